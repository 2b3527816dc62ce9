"""Checkpoint directories as one store (tensorstore_h5.sharded): the view over directories of
tensorstore_h5 files with an index and over Hugging Face sharded safetensors checkpoints,
hyperslab reads of only the overlapping pieces, conversions, verification, hostile indexes."""

from __future__ import annotations

import gc
import json
import os
import weakref

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from helpers import assert_same
from tensorstore_h5 import sharded, transfer
from tensorstore_h5.format import tree
from tensorstore_h5.sharded import ShardedStore

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torch.distributed.checkpoint")

from tensorstore_h5.bench.simulate import save_as_ranks, shard_bounds  # noqa: E402

NO_DIST = "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(100, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64, generator=g).to(torch.float16),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(64),
        "lm_head.weight": torch.randint(-128, 127, (100, 64), dtype=torch.int8, generator=g),
        "odd/name%": torch.arange(5, dtype=torch.int64),
    }


def _write_hf(path, tensors: dict[str, torch.Tensor], shards: int = 2) -> str:
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    weight_map = {n: weight_map[n] for n in names}
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return str(path)


@pytest.fixture
def hf_dir(tmp_path) -> str:
    return _write_hf(tmp_path / "hf", _hf_tensors())


# ---------------------------------------------------------------------------- the Hugging Face view


def test_hugging_face_directory_as_one_store(hf_dir) -> None:
    tensors = _hf_tensors()
    with ShardedStore(hf_dir) as s:
        assert s.kind == "safetensors" and s.format_version is None
        assert s.keys() == [th5.escape(k) for k in tensors]
        assert len(s) == len(tensors) and "model.norm.weight" in s and "nope" not in s
        assert s.metadata == {"total_size": sum(t.nbytes for t in tensors.values())}
        assert s.nbytes == s.metadata["total_size"]
        for name, t in tensors.items():
            h = s[th5.escape(name)]
            assert (h.shape, h.dtype, h.nbytes, h.ndim, h.numel(), len(h)) == (t.shape, t.dtype, t.nbytes, t.ndim,
                                                                              t.numel(), t.shape[0])
            assert torch.equal(h[...], t)
            assert torch.equal(h[3:5], t[3:5])
            assert torch.equal(h[-1], t[-1])
            if t.ndim == 2:
                assert torch.equal(h[:, 7:40], t[:, 7:40])
                assert torch.equal(h[1::3, ::5], t[1::3, ::5])
        out = torch.empty(2, 64, dtype=torch.bfloat16)
        assert s["model.layers.0.self_attn.q_proj.weight"].read(out=out, index=slice(10, 12)) is out
        assert torch.equal(out, tensors["model.layers.0.self_attn.q_proj.weight"][10:12])
        with pytest.raises(th5.MismatchError):
            s["model.norm.weight"].read(out=torch.empty(3))
        part = s.load(select="model.layers.0.*")
        assert list(part) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
        streamed = dict(s.items(select=["lm_head.weight", "odd%2Fname%25"]))
        assert_same(streamed, {"lm_head.weight": tensors["lm_head.weight"], "odd%2Fname%25": tensors["odd/name%"]})
        with pytest.raises(th5.KeyNotFoundError, match="lm_head.weight"):
            s["lm_head.weigth"]
        info = s.info()
        assert info["files"] == 2 and info["keys"] == len(tensors)
        assert info["tensors"]["lm_head.weight"] == {"dtype": "int8", "shape": [100, 64], "nbytes": 6400, "pieces": 1}
        assert "norm.weight" in s._repr_html_() and "1 piece(s)" in s._repr_html_() and "2 files" in repr(s)
        assert s.leaf_info("model.norm.weight") == {"key": "model.norm.weight", "kind": "tensor", "shape": [64],
                                                   "dtype": "float32", "nbytes": 256, "pieces": 1}
        h = s["model.norm.weight"]
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        h[...]


def test_lone_model_safetensors(tmp_path) -> None:
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2, dtype=torch.bool)}
    safetensors_torch.save_file(t, tmp_path / "model.safetensors", metadata={"k": "v"})
    with ShardedStore(tmp_path) as s:
        assert s.keys() == ["a", "b"] and s.metadata == {"k": "v"}
        assert_same(s.load(), t)


def test_open_the_index_file_itself(hf_dir) -> None:
    with ShardedStore(os.path.join(hf_dir, "model.safetensors.index.json")) as s:
        assert len(s) == len(_hf_tensors())


# ---------------------------------------------------------------------------- reading only what overlaps


def _recording_pread(monkeypatch) -> list[tuple[str, int]]:
    """Record (file name, bytes) of every positional read (all of them go through os.preadv)."""
    calls: list[tuple[str, int]] = []
    orig = os.preadv

    def preadv(fd, buffers, offset, *args):
        n = orig(fd, buffers, offset, *args)
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), n))
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _four_rank_dir(tmp_path) -> tuple[str, torch.Tensor]:
    e = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5))
    path = str(tmp_path / "ckpt")
    save_as_ranks({"model.e": e, "model.b": torch.arange(8.0)}, path, ranks=4,
                  mappings={"model.e": ("model", "e"), "model.b": ("model", "b")})
    return path, e


def _flip_data_byte(directory: str, name: str, key: str, at: int, mask: int) -> None:
    """XOR ``mask`` into byte ``at`` of the data of ``key`` in the rank file ``name``."""
    with th5.open(os.path.join(directory, name)) as f:
        offset = f._layout.entry(key).extent.offset + at
    with open(os.path.join(directory, name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def test_a_slice_reads_only_the_pieces_it_overlaps(tmp_path, monkeypatch) -> None:
    path, e = _four_rank_dir(tmp_path)
    with ShardedStore(path) as s:
        h = s["model/e"]
        assert [(p.offsets, p.shape) for p in h.pieces] == [((16 * r, 0), (16, 1024)) for r in range(4)]
        files = [p.file for p in h.pieces]
        calls = _recording_pread(monkeypatch)
        assert torch.equal(h[0:1], e[0:1])  # the first read of a file compares its HDF5 links with its layout once
        assert {f for f, _ in calls if f in files} == {files[0]}
        calls.clear()
        assert torch.equal(h[2:10], e[2:10])
        assert {f for f, _ in calls if f in files} == {files[0]}
        assert sum(n for f, n in calls if f == files[0]) == 8 * 4096  # 8 rows, nothing else
        calls.clear()
        assert torch.equal(h[14:35], e[14:35])
        assert {f for f, _ in calls} == set(files[:3])
        calls.clear()
        assert torch.equal(h[60:], e[60:])
        assert {f for f, _ in calls} == {files[3]}
        calls.clear()
        assert torch.equal(h[5, 1000:], e[5, 1000:])
        assert sum(n for _, n in calls) == 24 * 4


def test_column_slices_read_the_hyperslab(tmp_path, monkeypatch) -> None:
    """Runs of 16 KiB and more are read exactly; narrower ones in windows of whole rows of the
    piece (never more than the overlapping pieces' bytes); steps through parallel.gather."""
    wide = torch.randn(32, 16384, generator=torch.Generator().manual_seed(6))
    save_as_ranks({"wide": wide}, tmp_path / "c", ranks=2)
    with ShardedStore(tmp_path / "c") as s:
        h = s["wide"]
        assert torch.equal(h[:, 0], wide[:, 0])  # opens both files (their header and layout are read once)
        calls = _recording_pread(monkeypatch)
        assert torch.equal(h[:, 4096:12288], wide[:, 4096:12288])  # runs of 32 KiB: exactly the hyperslab
        assert sum(n for _, n in calls) == 32 * 8192 * 4
        calls.clear()
        assert torch.equal(h[3:30, 100:700], wide[3:30, 100:700])  # runs of 2400 B, 1/27 of the rows: exact too
        assert sum(n for _, n in calls) == 27 * 600 * 4
        calls.clear()
        assert torch.equal(h[:, 0:4096], wide[:, 0:4096])  # 16 KiB of 64 KiB rows: exact
        assert sum(n for _, n in calls) == 32 * 4096 * 4
        calls.clear()
        assert torch.equal(h[:, 0:3000], wide[:, 0:3000])  # 12 KiB runs of 64 KiB rows: windows of rows
        assert 32 * 3000 * 4 < sum(n for _, n in calls) <= wide.nbytes
        calls.clear()
        assert torch.equal(h[1:31:3, ::7], wide[1:31:3, ::7])
        assert sum(n for _, n in calls) <= wide.nbytes


def test_reads_go_straight_into_a_contiguous_destination(tmp_path) -> None:
    path, e = _four_rank_dir(tmp_path)
    with ShardedStore(path) as s:
        out = torch.empty(64, 1024)
        ptr = out.data_ptr()
        assert s["model/e"].read(out=out) is out and out.data_ptr() == ptr
        assert torch.equal(out, e)
        strided = torch.zeros(1024, 64).t()  # not contiguous: filled through a temporary
        s["model/e"].read(out=strided)
        assert torch.equal(strided, e)


def test_shard_bounds_split_like_dtensor() -> None:
    assert shard_bounds(7, 2) == [(0, 4), (4, 3)]
    assert shard_bounds(7, 4) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert [len(c) for c in torch.arange(7).chunk(4)] == [n for _, n in shard_bounds(7, 4)]


def test_empty_pieces_and_uneven_ranks(tmp_path) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    save_as_ranks({"t": t, "s": torch.tensor(1.5)}, tmp_path / "c", ranks=4)
    with ShardedStore(tmp_path / "c") as s:
        assert [p.shape for p in s["t"].pieces] == [(1, 3), (1, 3), (0, 3), (0, 3)]
        assert torch.equal(s["t"][...], t) and torch.equal(s["s"][...], torch.tensor(1.5))


# ---------------------------------------------------------------------------- conversions


def test_convert_hugging_face_directory_to_one_file(hf_dir, tmp_path, monkeypatch) -> None:
    live: list[weakref.ref] = []
    orig = ShardedStore._read_leaf

    def read_leaf(self, entry, device, verify):
        gc.collect()  # key by key: of the tensors read before, only the one being written may be alive
        assert all(r() is None for r in live[:-1]), "tensors read before are still in memory"
        value = orig(self, entry, device, verify)
        live.append(weakref.ref(value))
        return value

    monkeypatch.setattr(ShardedStore, "_read_leaf", read_leaf)
    sharded.convert_dir(hf_dir, tmp_path / "one.h5", compression="lz4")
    monkeypatch.undo()
    got = th5.load(tmp_path / "one.h5")
    assert_same(got, _hf_tensors())  # the names as they were (escaped in key paths only)
    with th5.open(tmp_path / "one.h5") as f:
        assert f.metadata == {"total_size": sum(t.nbytes for t in _hf_tensors().values())}
        assert f["model.embed_tokens.weight"].compression is not None


@pytest.mark.filterwarnings(NO_DIST)
def test_convert_a_dcp_directory_to_one_file_keeps_the_nesting(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from tensorstore_h5.distributed import H5StorageWriter

    sd = {"model": {"w": torch.randn(5, 3), "layers": [torch.ones(2), torch.zeros(2)]}, "epoch": 3, "betas": (0.9, 0.99)}
    dcp.save(sd, storage_writer=H5StorageWriter(tmp_path / "dcp", sync_files=False))
    sharded.to_file(tmp_path / "dcp", tmp_path / "one.h5")
    assert_same(th5.load(tmp_path / "one.h5"), sd)
    sharded.to_file(tmp_path / "dcp", tmp_path / "part.h5", select="model/layers")
    assert_same(th5.load(tmp_path / "part.h5"), {"model": {"layers": sd["model"]["layers"]}})


def test_hugging_face_directory_to_tensorstore_shards(hf_dir, tmp_path) -> None:
    dst = tmp_path / "th5"
    written = sharded.from_safetensors_dir(hf_dir, dst, compression="zstd")
    assert sorted(n.split(".")[0] for n in written) == ["model-00001-of-00002", "model-00002-of-00002"]
    assert sorted(os.listdir(dst)) == sorted(written + [sharded.INDEX_NAME])
    tensors = _hf_tensors()
    with ShardedStore(dst) as s:
        assert s.kind == "tensorstore_h5" and s.keys() == [th5.escape(k) for k in tensors]
        for name, t in tensors.items():
            assert torch.equal(s[th5.escape(name)][...], t)
        assert s.verify()["problems"] == []
        first = s.save_id
    for name in written:  # ordinary files
        with th5.open(dst / name) as f:
            assert set(f.keys()) <= {th5.escape(k) for k in tensors}
    # converting again replaces it: the new index, then the old files go
    changed = dict(tensors, **{"model.norm.weight": torch.full((64,), 2.0)})
    again = sharded.from_safetensors_dir(_write_hf(tmp_path / "hf2", changed), dst)
    assert sorted(os.listdir(dst)) == sorted(again + [sharded.INDEX_NAME])
    with ShardedStore(dst) as s:
        assert s.save_id != first and torch.equal(s["model.norm.weight"][...], torch.full((64,), 2.0))


@pytest.mark.filterwarnings(NO_DIST)
def test_dcp_loads_hugging_face_and_converted_directories(hf_dir, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from tensorstore_h5.distributed import H5StorageReader

    tensors = _hf_tensors()
    sharded.from_safetensors_dir(hf_dir, tmp_path / "th5")
    for src in (hf_dir, tmp_path / "th5"):
        target = {k: torch.zeros_like(v) for k, v in tensors.items() if "/" not in k}
        dcp.load(target, storage_reader=H5StorageReader(src))
        for k, v in target.items():
            assert torch.equal(v, tensors[k]), (src, k)


# ---------------------------------------------------------------------------- checking


def test_verify_finds_a_damaged_byte(tmp_path) -> None:
    path, e = _four_rank_dir(tmp_path)
    with ShardedStore(path) as s:
        report = s.verify()
        assert report["problems"] == [] and report["files"] == 4 and report["tensor_bytes"] == e.nbytes + 32
        piece = s["model/e"].pieces[2]
    _flip_data_byte(path, piece.file, "model/e", 100, 1)
    with ShardedStore(path) as s:
        problems = s.verify()["problems"]
        assert len(problems) == 1 and piece.file in problems[0] and "'model/e'" in problems[0]
        assert "checksum" in problems[0]
        with pytest.raises(th5.FormatError, match="checksum"):
            s["model/e"].read(verify=True)
        assert s["model/e"][:16].shape == (16, 1024)  # reads without verify do not check


def test_read_a_directory_with_json_and_h5py_alone(tmp_path) -> None:
    """The directory reader printed in docs/FORMAT.md, executed as written, reads every dtype bitwise."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "FORMAT.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    namespace: dict = {}
    for code in [b for b in blocks if "def read_plain" in b] + [b for b in blocks if "def read_directory" in b]:
        exec(compile(code, "FORMAT.md", "exec"), namespace)
    g = torch.Generator().manual_seed(7)
    tensors = {"m.e": torch.randn(64, 24, generator=g), "m.h": torch.randn(10, 6, generator=g).to(torch.bfloat16),
               "m.f8": torch.randn(12, 4, generator=g).to(torch.float8_e5m2)}
    path = str(tmp_path / "ckpt")
    save_as_ranks(tensors, path, ranks=3, mappings={k: tuple(k.split(".")) for k in tensors})
    out = namespace["read_directory"](path)
    for key, t in tensors.items():
        got = out[key.replace(".", "/")]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), key


def test_directories_that_are_not_checkpoints(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        ShardedStore(tmp_path / "nope")
    with pytest.raises(th5.FormatError, match="not a checkpoint directory"):
        ShardedStore(tmp_path)
    (tmp_path / "f.h5").write_bytes(b"x")
    with pytest.raises(th5.FormatError, match="not a directory"):
        ShardedStore(tmp_path / "f.h5")
    assert not sharded.is_checkpoint_directory(tmp_path)


@pytest.mark.filterwarnings(NO_DIST)
def test_a_filesystem_writer_checkpoint_is_refused_not_unpickled(tmp_path, monkeypatch) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(th5.FormatError, match="pickled"):
        ShardedStore(tmp_path)


# ---------------------------------------------------------------------------- hostile indexes


def _index_of(path: str) -> dict:
    with open(os.path.join(path, sharded.INDEX_NAME)) as f:
        return json.load(f)


def _write_index(path: str, obj) -> None:
    with open(os.path.join(path, sharded.INDEX_NAME), "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))


@pytest.mark.parametrize("edit, why", [
    (lambda o: "{not json", "not valid JSON"),
    (lambda o: [], "not a JSON object"),
    (lambda o: dict(o, format="safetensors"), "not a tensorstore_h5 directory index"),
    (lambda o: dict(o, version=3), "upgrade tensorstore_h5"),
    (lambda o: dict(o, extra=1), "unknown fields"),
    (lambda o: {k: v for k, v in o.items() if k != "files"}, "missing fields"),
    (lambda o: dict(o, files={"../escape.0123456789abcdef.h5": {"bytes": 5000, "layout_xxh3": "0" * 16}}), "invalid file name"),
    (lambda o: dict(o, files={n: {"bytes": 10, "layout_xxh3": "0" * 16} for n in o["files"]}), "expected"),
    (lambda o: dict(o, save_id="x"), "invalid save_id"),
    (lambda o: dict(o, entries=o["entries"][:-1]), "one length"),
    (lambda o: dict(o, paths=["", "a/b", "a"], types=["dict", "tensor", "dict"], entries=[{}, {}, {}]), "parent"),
    (lambda o: dict(o, dcp={"version": None}), "dcp must be"),
])
def test_hostile_index_is_refused_when_opened(tmp_path, edit, why) -> None:
    path, _ = _four_rank_dir(tmp_path)
    _write_index(path, edit(_index_of(path)))
    with pytest.raises(th5.FormatError, match=why) as info:
        ShardedStore(path)
    assert sharded.INDEX_NAME in str(info.value)


@pytest.mark.parametrize("edit, why", [
    (lambda e: e.update(stride=[1, 64]), "unexpected fields"),
    (lambda e: e.update(dtype="float128"), "unknown torch dtype"),
    (lambda e: e.update(shape=[-1, 1024]), "invalid shape"),
    (lambda e: e.update(pieces="all"), "invalid 'pieces'"),
    (lambda e: e["pieces"][0].update(extra=True), "piece 0"),
    (lambda e: e["pieces"][0].update(key=5), "invalid key"),
    (lambda e: e["pieces"][0].update(offsets=[0]), "offsets"),
    (lambda e: e["pieces"][0].update(key="model/nothing"), "no such key"),
])
def test_hostile_entry_is_refused_when_used(tmp_path, edit, why) -> None:
    path, e = _four_rank_dir(tmp_path)
    obj = _index_of(path)
    edit(obj["entries"][obj["paths"].index("model/e")])
    _write_index(path, obj)
    with ShardedStore(path) as s:
        assert torch.equal(s["model/b"][...], torch.arange(8.0))
        with pytest.raises(th5.FormatError, match=why) as info:
            s["model/e"][...]
    assert "'model/e'" in str(info.value) or "'model/nothing'" in str(info.value)


def test_hostile_safetensors_directories(tmp_path) -> None:
    tensors = {"a": torch.ones(4), "b": torch.zeros(2, 2)}
    path = _write_hf(tmp_path / "hf", tensors, shards=2)
    index_file = os.path.join(path, "model.safetensors.index.json")
    with open(index_file) as f:
        obj = json.load(f)
    obj["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    with open(index_file, "w") as f:
        json.dump(obj, f)
    with pytest.raises(th5.FormatError, match="key 'c': not in the file") as info:
        ShardedStore(path)
    assert "model-00001-of-00002.safetensors" in str(info.value)
    obj["weight_map"] = {"a": "missing.safetensors"}
    with open(index_file, "w") as f:
        json.dump(obj, f)
    with pytest.raises(th5.FormatError, match="missing.safetensors: the file is missing"):
        ShardedStore(path)
    obj["weight_map"] = {"a": "../outside.safetensors"}
    with open(index_file, "w") as f:
        json.dump(obj, f)
    with pytest.raises(th5.FormatError, match="leaves the directory"):
        ShardedStore(path)
    # a header whose data range lies outside the file
    bad = tmp_path / "bad"
    bad.mkdir()
    header = json.dumps({"x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(th5.FormatError, match="key 'x': data range"):
        ShardedStore(bad)
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(th5.FormatError, match="dtype 'F4' is not supported"):
        ShardedStore(bad)
    (bad / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(th5.FormatError, match="not a safetensors file"):
        ShardedStore(bad)


# ---------------------------------------------------------------------------- loading


@pytest.mark.filterwarnings(NO_DIST)
def test_load_keeps_parameters_grad_flags_and_devices(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from tensorstore_h5.distributed import H5StorageWriter

    p = torch.nn.Parameter(torch.randn(3, 2))
    dcp.save({"p": p, "buf": torch.ones(2)}, storage_writer=H5StorageWriter(tmp_path, sync_files=False))
    with ShardedStore(tmp_path) as s:
        got = s.load(device={"p": "cpu:0", "*": None})
        assert got["p"].requires_grad and not got["buf"].requires_grad
        assert torch.equal(got["p"].detach(), p.detach())
        with pytest.raises(th5.TensorStoreError, match="meta"):
            s.load(device="meta")
        if not torch.cuda.is_available():
            with pytest.raises(th5.TensorStoreError, match="'p'.*not available"):
                s.load(device="cuda:0")


def test_check_cover() -> None:
    assert sharded.check_cover((4, 4), [((0, 0), (4, 2)), ((0, 2), (4, 2))]) is None
    assert "overlap" in sharded.check_cover((4, 4), [((0, 0), (4, 3)), ((0, 2), (4, 2))])
    assert "gap" in sharded.check_cover((4, 4), [((0, 0), (4, 2))])
    assert sharded.check_cover((4, 4), [((0, 0), (4, 2))], complete=False) is None
    assert "outside" in sharded.check_cover((4, 4), [((0, 3), (4, 2))])
    assert sharded.check_cover((), [((), ())]) is None
    assert "overlap" in sharded.check_cover((), [((), ()), ((), ())])
    assert sharded.check_cover((0, 3), [((0, 0), (0, 3)), ((0, 0), (0, 3))]) is None  # empty pieces cover nothing
    grid = [((r * 8, c * 8), (8, 8)) for r in range(64) for c in range(64)]  # 4096 pieces: the sweep stays fast
    assert sharded.check_cover((512, 512), grid) is None
    assert "overlap" in sharded.check_cover((512, 512), grid + [((100, 100), (1, 1))])


# ---------------------------------------------------------------------------- public API and command line


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tensorstore_h5", *args], capture_output=True, text=True, timeout=300)


def test_open_and_load_take_a_directory(tmp_path, hf_dir) -> None:
    path, e = _four_rank_dir(tmp_path)
    with th5.open(path) as s:
        assert isinstance(s, ShardedStore) and torch.equal(s["model/e"][3:40, 7], e[3:40, 7])
    got = th5.load(path, select="model/e")
    assert list(got) == ["model"] and torch.equal(got["model"]["e"], e)
    with pytest.raises(ValueError, match="mmap"):
        th5.load(path, mmap=True)
    flat = th5.load(hf_dir)
    assert_same(flat["model.norm.weight"], torch.ones(64))


def test_cli_ls_info_verify_convert_a_directory(tmp_path) -> None:
    path, e = _four_rank_dir(tmp_path)
    r = _cli("ls", path, "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["key"]: row for row in json.loads(r.stdout)}
    assert rows["model/e"]["shape"] == [64, 1024] and rows["model/e"]["pieces"] == 4
    r = _cli("ls", path)
    assert "(4 pieces)" in r.stdout
    r = _cli("info", path, "--json")
    info = json.loads(r.stdout)
    assert info["files"] == 4 and info["tensors"] == 2 and info["data_bytes"] == e.nbytes + 32
    r = _cli("info", path)
    assert r.returncode == 0 and "checkpoint directory" in r.stdout
    r = _cli("verify", path)
    assert r.returncode == 0 and "OK, 2 keys in 4 files" in r.stdout, r.stderr
    r = _cli("convert", path, str(tmp_path / "one.h5"))
    assert r.returncode == 0, r.stderr
    with th5.open(tmp_path / "one.h5") as f:
        assert torch.equal(f["model/e"].read(), e)
    with ShardedStore(path) as s:  # damage one byte of one piece: verify names the file and the key, exits 1
        piece = s["model/e"].pieces[1]
    with th5.open(os.path.join(path, piece.file)) as f:
        at = f._layout.entry("model/e").extent.offset
    with open(os.path.join(path, piece.file), "r+b") as f:
        f.seek(at + 8)
        b = f.read(1)
        f.seek(at + 8)
        f.write(bytes([b[0] ^ 0x40]))
    r = _cli("verify", path)
    assert r.returncode == 1 and piece.file in r.stderr and "model/e" in r.stderr and "FAILED" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_on_a_damaged_index_names_the_file(tmp_path) -> None:
    path, _ = _four_rank_dir(tmp_path)
    index = os.path.join(path, "tensorstore_h5.json")
    with open(index) as f:
        text = f.read()
    with open(index, "w") as f:
        f.write(text[: len(text) // 2])
    r = _cli("ls", path)
    assert r.returncode != 0 and "tensorstore_h5.json" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------- load_into a directory


class _Tiny(torch.nn.Module):
    """A module whose state dict keys are the Hugging Face fixture's, minus one and plus one."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        kw = {"device": device}
        self.embed = torch.nn.Parameter(torch.zeros(100, 64, **kw))
        self.q = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16, **kw))
        self.register_buffer("norm", torch.zeros(64, **kw))


def test_load_into_a_module_from_a_hugging_face_directory(hf_dir) -> None:
    """load_into takes a checkpoint directory: each target gets the global tensor (straight
    into it, or cast / laid out like copy_), keys are matched as for a file, strict refuses."""
    src = _hf_tensors()
    targets = {"model.embed_tokens.weight": torch.zeros(64, 100).t(),  # not contiguous
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64),  # float32 target, bfloat16 stored
               "model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64, dtype=torch.float16),
               "lm_head.weight": torch.zeros(100, 64, dtype=torch.int8)}
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    with pytest.raises(th5.MismatchError, match="unexpected keys"):
        th5.load_into(targets, hf_dir)
    assert all(not t.any() for t in targets.values())  # refused before anything changed
    result = th5.load_into(targets, hf_dir, strict=False)
    assert sorted(result.unexpected_keys) == sorted(tree.escape(k) for k in set(src) - set(targets))  # key paths
    assert result.missing_keys == []
    for k, t in targets.items():
        assert t.data_ptr() == ptrs[k]
        assert torch.equal(t, src[k].to(t.dtype)), k
    assert targets["model.embed_tokens.weight"].stride() == (1, 100)  # its own layout kept


def test_load_into_a_directory_refuses_before_any_target_changes(tmp_path, monkeypatch) -> None:
    """A shape mismatch, and (with verify) a damaged byte in one rank's file, are refused
    naming the key, with every target as it was, including those read before the bad one
    ('model/e' comes first; reads run a tensor at a time here)."""
    monkeypatch.setattr(sharded.store, "INTO_BATCH_BYTES", 1)
    path, e = _four_rank_dir(tmp_path)
    targets = {"model": {"b": torch.zeros(8), "e": torch.zeros(64, 1000)}}
    with pytest.raises(th5.MismatchError, match="'model/e'.*stored \\[64, 1024\\]"):
        th5.load_into(targets, path)
    targets["model"]["e"] = torch.zeros(64, 1024)
    assert th5.load_into(targets, path) == ([], [])
    assert torch.equal(targets["model"]["e"], e) and torch.equal(targets["model"]["b"], torch.arange(8.0))
    with ShardedStore(path) as s:
        assert s.keys() == ["model/e", "model/b"]
        piece = s["model/b"].pieces[3]
    _flip_data_byte(path, piece.file, "model/b", 1, 0x40)
    fresh = {"model": {"b": torch.full((8,), -1.0), "e": torch.full((64, 1024), -1.0)}}
    with pytest.raises(th5.FormatError, match=f"{piece.file}.*'model/b'.*checksum"):
        th5.load_into(fresh, path, verify=True)
    assert bool((fresh["model"]["b"] == -1).all()) and bool((fresh["model"]["e"] == -1).all())
    os.remove(os.path.join(path, piece.file))
    with pytest.raises(th5.FormatError, match=piece.file):
        th5.load_into(fresh, path)
    assert bool((fresh["model"]["b"] == -1).all()) and bool((fresh["model"]["e"] == -1).all())


def test_load_into_assign_materialises_a_meta_module_from_a_directory(hf_dir, tmp_path) -> None:
    """assign=True replaces meta parameters and buffers by tensors read from the directory,
    keeping nn.Parameter and requires_grad, as load_state_dict(assign=True) does."""
    src = _hf_tensors()
    renamed = {"embed": src["model.embed_tokens.weight"], "q": src["model.layers.0.self_attn.q_proj.weight"],
               "norm": src["model.norm.weight"]}
    d = _write_hf(tmp_path / "tiny", renamed, shards=2)
    m = _Tiny(device="meta")
    with pytest.raises(th5.MismatchError, match="meta device"):
        th5.load_into(m, d)
    assert th5.load_into(m, d, assign=True) == ([], [])
    assert isinstance(m.embed, torch.nn.Parameter) and m.embed.requires_grad and m.embed.device.type == "cpu"
    for k, v in renamed.items():
        assert torch.equal(m.state_dict()[k], v), k


@pytest.fixture
def staged_cpu(monkeypatch):
    """Treat the CPU as a device: ShardedStore.load(device="cpu") takes the staged device
    branch (what CUDA destinations take), and the stagers made are recorded."""
    real = ShardedStore._device
    monkeypatch.setattr(ShardedStore, "_device", lambda self, device, key: torch.device("cpu") if device == "cpu"
                        else real(self, device, key))
    monkeypatch.setattr(transfer, "staged", lambda dev: True)
    made = []

    class Recorded(transfer.Stager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(transfer, "Stager", Recorded)  # what transfer.Stagers makes
    return made


def test_device_loads_of_whole_row_pieces_go_through_the_staging_buffers(tmp_path, hf_dir, staged_cpu) -> None:
    """Tensors whose pieces hold whole rows (Hugging Face shards, Shard(0) ranks) go to a
    device through the staging buffers, straight from the files; pieces narrower than the
    rows are read on the host and copied; every value is exact either way."""
    with ShardedStore(hf_dir) as s:
        got = s.load(device="cpu")
    assert_same(got, _hf_tensors())
    assert len(staged_cpu) == 1 and sum(staged_cpu[0].uses) == 1  # 56 kB: one buffer, one fill of it
    path, e = _four_rank_dir(tmp_path)
    with ShardedStore(path) as s:
        got = s.load(device="cpu")
    assert torch.equal(got["model"]["e"], e) and torch.equal(got["model"]["b"], torch.arange(8.0))
    cols = str(tmp_path / "cols")
    save_as_ranks({"model.w": e}, cols, ranks=2, dim=1, mappings={"model.w": ("model", "w")})
    staged_cpu.clear()
    with ShardedStore(cols) as s:
        assert [p.offsets for p in s["model/w"].pieces] == [(0, 0), (0, 512)]
        got = s.load(device="cpu")
    assert torch.equal(got["model"]["w"], e) and staged_cpu == []  # column pieces: read on the host
    with ShardedStore(path) as s:
        s.load(device="cpu")
        assert s._stagers
    assert not s._stagers  # closing drops the stagers: their pinned buffers go back to the pool


def test_device_loads_of_a_directory_check_whole_row_pieces_as_they_are_read(tmp_path, staged_cpu, monkeypatch) -> None:
    """Whole-row pieces staged to a device are checked in the staging buffers, so each stored
    byte is read once; a damaged one is refused naming the rank file and its key; pieces whose
    checksum blocks do not fit a buffer are still checked, by a second read."""
    from tensorstore_h5.storage import files

    path, e = _four_rank_dir(tmp_path)
    data = e.nbytes + 8 * 4
    reads: list[int] = []
    real = files.RawFile.pread
    monkeypatch.setattr(files.RawFile, "pread", lambda self, o, v: reads.append(len(v)) or real(self, o, v))

    def load() -> dict:
        with ShardedStore(path) as s:
            for k in s.keys():
                s._located(s._layout.entry(k), sharded.store.select_index((), s[k].shape))  # files opened, checked
            reads.clear()
            return s.load(device="cpu")

    got = load()
    assert torch.equal(got["model"]["e"], e) and torch.equal(got["model"]["b"], torch.arange(8.0))
    assert data <= sum(reads) < data + 4 * 4096  # once (and the padding between pieces)
    with ShardedStore(path) as s:
        piece = s["model/e"].pieces[2]
    _flip_data_byte(path, piece.file, "model/e", 100, 0x10)
    with pytest.raises(th5.FormatError, match=f"{piece.file}.*'model/e'.*checksum"):
        load()
    monkeypatch.setattr(transfer, "STAGING_BYTES", 4096)  # a piece's checksum block (its 64 KiB) over a buffer
    with pytest.raises(th5.FormatError, match=f"{piece.file}.*'model/e'.*checksum"):
        load()
    _flip_data_byte(path, piece.file, "model/e", 100, 0x10)  # mended
    got = load()
    assert torch.equal(got["model"]["e"], e) and sum(reads) >= data + e.nbytes  # checked by a second read


@pytest.mark.parametrize("when", ["opening", "reading data"])
def test_an_io_error_in_a_rank_file_names_the_file_and_the_key(tmp_path, staged_cpu, monkeypatch, when) -> None:
    """An I/O error while a rank file is opened and checked, or while a staged piece is read,
    is a FormatError naming the file and the key, not a bare OSError."""
    path, _ = _four_rank_dir(tmp_path)
    with ShardedStore(path) as s:
        bad = s["model/e"].pieces[2].file
    with th5.open(os.path.join(path, bad)) as f:
        extent = f._layout.entry("model/e").extent
    real = th5.io.RawFile.pread

    def pread(self, offset, view):
        in_data = extent.offset <= offset < extent.offset + extent.nbytes
        if os.path.basename(self.path) == bad and (in_data if when == "reading data" else offset == 0):
            raise OSError(5, "Input/output error")
        return real(self, offset, view)

    monkeypatch.setattr(th5.io.RawFile, "pread", pread)
    with ShardedStore(path) as s, pytest.raises(th5.FormatError, match=f"{bad}.*'model/e'.*Input/output error"):
        s.load(device="cpu")


def test_load_into_device_targets_from_a_directory_go_through_the_staging_buffers(tmp_path, staged_cpu) -> None:
    """Contiguous device targets of the stored dtype are filled through the staging buffers
    (the CPU stands in for a device here); others are read on the host and cast; all exact."""
    path, e = _four_rank_dir(tmp_path)
    targets = {"model": {"e": torch.zeros(64, 1024), "b": torch.zeros(8, dtype=torch.float64)}}
    ptr = targets["model"]["e"].data_ptr()
    assert th5.load_into(targets, path) == ([], [])
    assert targets["model"]["e"].data_ptr() == ptr and torch.equal(targets["model"]["e"], e)
    assert torch.equal(targets["model"]["b"], torch.arange(8.0, dtype=torch.float64))
    assert len(staged_cpu) == 1 and sum(staged_cpu[0].uses) == 1  # 256 kB of 'e' in one buffer; 'b' cast on the host


@pytest.mark.parametrize("cached", [True, False])
def test_reads_of_a_cold_file_run_on_more_threads(tmp_path, monkeypatch, cached) -> None:
    """A directory read whose first large region is not in the page cache runs on
    parallel.COLD_IO_THREADS threads (more reads in flight for the disk), a cached one on
    parallel.IO_THREADS; small reads are not probed. The bytes are right either way."""
    from tensorstore_h5.storage import files, parallel
    from tensorstore_h5.format.dtypes import spec_for_torch
    from tensorstore_h5.sharded.reads import Loc, Reads
    from tensorstore_h5.format.slicing import whole

    monkeypatch.setattr(parallel, "COLD_IO_THREADS", parallel.IO_THREADS + 2)
    src = torch.randn(5 * 2**20 + 3, generator=torch.Generator().manual_seed(2))  # ~20 MiB
    (tmp_path / "raw.bin").write_bytes(bytes(4096) + src.numpy().tobytes())
    probed = []
    monkeypatch.setattr(files.RawFile, "cached", lambda self, ranges, probes=8: probed.append(ranges) or cached)
    raw = files.RawFile(str(tmp_path / "raw.bin"))
    try:
        loc = Loc(str(tmp_path / "raw.bin"), "x", raw=raw, offset=4096)
        small = Reads()
        out = torch.empty(1000)
        small.region(loc, (1000,), spec_for_torch(torch.float32), whole((1000,)), out)
        small.run()
        assert probed == [] and torch.equal(out, src[:1000])
        reads = Reads()
        out = torch.empty_like(src)
        reads.region(loc, tuple(src.shape), spec_for_torch(torch.float32), whole(tuple(src.shape)), out)
        assert reads.plan._threads == (parallel.IO_THREADS if cached else parallel.COLD_IO_THREADS)
        reads.run()
        assert probed == [[(4096, src.nbytes)]] and torch.equal(out, src)
    finally:
        raw.close()


def test_a_device_callable_is_asked_once_per_key(tmp_path) -> None:
    """load and items of a directory ask a callable device= once per key, as a file's do."""
    path, _ = _four_rank_dir(tmp_path)
    for read in (lambda s, d: s.load(device=d), lambda s, d: dict(s.items(device=d))):
        asked: list[str] = []
        with ShardedStore(path) as s:
            read(s, lambda key: asked.append(key) or "cpu")
        assert sorted(asked) == ["model/b", "model/e"]
