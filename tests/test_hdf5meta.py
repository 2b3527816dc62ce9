"""The HDF5 metadata that tensorstore_h5 encodes itself for uncompressed files (hdf5meta):
libhdf5 reads it as it reads its own, message for message."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format import hdf5meta
from tensorstore_h5.format import layout as fmt
from tensorstore_h5.format.dtypes import spec_for_torch
from tensorstore_h5.writing import writer

from helpers import assert_same, random_tensor

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
          torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bfloat16,
          torch.float8_e5m2, torch.complex32, torch.float8_e4m3fn, torch.float8_e8m0fnu]


@pytest.mark.parametrize("n", [0, 1, 11, 12, 13, 24, 25, 100, 4099])
def test_lookup3_matches_libhdf5(n) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert hdf5meta._lookup3_py(data) == hdf5meta.lookup3(data)
    assert hdf5meta._lookup3_py(data, 7) == hdf5meta.lookup3(data, 7)
    assert hdf5meta._lookup3_c() is not None  # h5py's libhdf5 exports it: the fast path is the one tested


def _sample() -> dict:
    w = random_tensor((4, 3), torch.float32, seed=1)
    state = {f"{dt}".removeprefix("torch."): random_tensor((5, 2), dt, seed=i) for i, dt in enumerate(DTYPES)}
    return {"model": {"w": w, "tied": w, "wt": w.t(), "empty": torch.ones(0, 3), "scalar": torch.tensor(2.5),
                      "ü/x": torch.arange(3)}, "dtypes": state, "list": [torch.ones(2), 3], "n": 7}


def _headers(path) -> dict[str, list[tuple[int, int, bytes]]]:
    """Every dataset's object header messages, by HDF5 path."""
    with open(path, "rb") as fh:
        raw = fh.read()
    out = {}
    with h5py.File(path) as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = hdf5meta.parse_object_header(raw, h5py.h5o.get_info(obj.id).addr + fmt.USERBLOCK)
        f.visititems(visit)
    return out


def test_files_read_by_libhdf5_as_its_own(tmp_path, monkeypatch) -> None:
    """The same state saved with encoded metadata and through libhdf5: h5py sees the same
    objects, types, attributes, values and hard links, and every dataset's dataspace, datatype
    and fill-value messages are byte for byte libhdf5's (the layout differs in its address only)."""
    sd = _sample()
    th5.save(sd, tmp_path / "own.h5")
    monkeypatch.setattr(writer, "ENCODE_METADATA", False)
    th5.save(sd, tmp_path / "lib.h5")
    assert_same(th5.load(tmp_path / "own.h5"), sd)

    def describe(path):
        seen = {}
        with h5py.File(path) as f:
            def visit(name, obj):
                kind = "group" if isinstance(obj, h5py.Group) else (obj.dtype, obj.shape, obj[()].tobytes())
                seen[name] = (kind, sorted((k, np.asarray(v).tobytes()) for k, v in obj.attrs.items()),
                              h5py.h5o.get_info(obj.id).rc)
            f.visititems(visit)
            seen["/"] = sorted((k, np.asarray(v).tobytes()) for k, v in f.attrs.items())
            assert f["model/tied"].id == f["model/w"].id
        return seen

    own, lib = describe(tmp_path / "own.h5"), describe(tmp_path / "lib.h5")
    assert own.keys() == lib.keys() and own == {k: v for k, v in lib.items()} | {"%layout": own["%layout"]}
    own_h, lib_h = _headers(tmp_path / "own.h5"), _headers(tmp_path / "lib.h5")
    for name in lib_h:
        mine = {kind: body for kind, _, body in own_h[name]}
        theirs = {kind: body for kind, _, body in lib_h[name]}
        for kind in (0x01, 0x03, 0x05):
            assert mine[kind] == theirs[kind], (name, kind)
        assert mine[0x08][:2] == theirs[0x08][:2] and mine[0x08][10:] == theirs[0x08][10:]  # version, class, size
        assert {k for k in theirs if k} - {0x10} <= set(mine)  # libhdf5's messages, but for continuations


def test_encoded_file_layout(tmp_path) -> None:
    """Superblock version 3 at the end of the user block, data on 64-byte boundaries, the file
    exactly as long as its metadata says, and `verify` (libhdf5's view against the layout) agrees."""
    th5.save(_sample(), tmp_path / "f.h5")
    raw = (tmp_path / "f.h5").read_bytes()
    assert raw[4096:4104] == fmt.HDF5_SIGNATURE and raw[4104] == 3
    assert int.from_bytes(raw[4096 + 28:4096 + 36], "little") == len(raw)  # end-of-file address
    with th5.open(tmp_path / "f.h5") as s:
        for k in s.keys():
            h = s[k]
            if isinstance(h, th5.TensorHandle) and h.nbytes:
                assert s._reader.where(h._entry).offset % 64 == 0
    r = subprocess.run([sys.executable, "-m", "tensorstore_h5", "verify", str(tmp_path / "f.h5")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_many_links_long_names_and_deep_groups(tmp_path) -> None:
    """A group of 3,000 datasets keeps its links in its header; names over 255 bytes get a
    two-byte length; h5py can still add to the file afterwards (then tensorstore_h5 refuses
    it as appended to, as for any file changed after it was written)."""
    long = "k" * 300
    sd = {"many": {str(i): torch.full((2,), float(i)) for i in range(3000)}, long: torch.ones(1),
          "a": {"b": {"c": {"d": torch.zeros(1)}}}}
    th5.save(sd, tmp_path / "f.h5")
    with h5py.File(tmp_path / "f.h5") as f:
        assert len(f["many"]) == 3000 and f["many/2999"][1] == 2999.0 and f[long].shape == (1,)
        assert f["a/b/c/d"].shape == (1,)
    assert_same(th5.load(tmp_path / "f.h5"), sd)
    with h5py.File(tmp_path / "f.h5", "r+") as f:
        f["extra"] = np.arange(3)
        f["many"]["3000"] = np.arange(2)
    with h5py.File(tmp_path / "f.h5") as f:
        assert len(f["many"]) == 3001 and f["extra"][2] == 2
    with pytest.raises(th5.FormatError, match="appended|length"):
        th5.load(tmp_path / "f.h5")


def test_corrupt_encoded_metadata_is_caught_by_libhdf5_checksums(tmp_path) -> None:
    """A flipped byte in an object header written here fails libhdf5's checksum check, as it
    would in one libhdf5 wrote: the checksums are real."""
    th5.save({"w": torch.ones(3)}, tmp_path / "f.h5")
    raw = bytearray((tmp_path / "f.h5").read_bytes())
    with h5py.File(tmp_path / "f.h5") as f:
        addr = h5py.h5o.get_info(f["w"].id).addr + fmt.USERBLOCK
    raw[addr + 12] ^= 0x01
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    with pytest.raises(Exception), h5py.File(tmp_path / "bad.h5") as f:  # noqa: B017 - libhdf5's own error
        f["w"][()]


def test_a_failed_save_with_encoded_metadata_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    th5.save({"w": torch.ones(3)}, tmp_path / "f.h5")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hdf5meta.Builder, "encode", fail)
    with pytest.raises(th5.WriteError, match="f.h5"):
        th5.save({"w": torch.zeros(3)}, tmp_path / "f.h5")
    assert torch.equal(th5.load(tmp_path / "f.h5")["w"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["f.h5"]


def test_builder_refuses_a_dataset_under_a_dataset() -> None:
    b = hdf5meta.Builder(4096)
    b.dataset("a", spec_for_torch(torch.float32, "a").h5_type, (1,), 4160, 4)
    with pytest.raises(ValueError, match="'a' is a dataset"):
        b.dataset("a/b", spec_for_torch(torch.float32, "a").h5_type, (1,), 4224, 4)
    with pytest.raises(ValueError, match="already linked"):
        b.dataset("a", spec_for_torch(torch.float32, "a").h5_type, (1,), 4224, 4)


def test_small_tensors_are_gathered_into_few_writes(tmp_path, monkeypatch) -> None:
    """Small tensors' data goes out in gathered writes of about 1 MiB (with the alignment gaps
    as zeros); a large tensor between them is written on its own; every byte and checksum
    reads back (verify)."""
    from tensorstore_h5.storage import files

    sizes = []
    real = files.pwrite_all
    monkeypatch.setattr(files, "pwrite_all", lambda fd, data, at: (sizes.append(memoryview(data).nbytes), real(fd, data, at))[1])
    g = torch.Generator().manual_seed(4)
    sd = {f"s{i}": torch.randn(int(torch.randint(1, 300, (1,), generator=g)), generator=g) for i in range(3000)}
    sd["big"] = torch.randn(2**18, generator=g)  # 1 MiB: its own write
    sd |= {f"t{i}": torch.randint(0, 9, (i % 7 + 1,), generator=g) for i in range(500)}
    th5.save(sd, tmp_path / "f.h5")
    data_writes = sizes[:-3]  # then the layout, the metadata and the superblock
    assert 2**20 in data_writes and len(data_writes) < 10
    assert_same(th5.load(tmp_path / "f.h5", verify=True), sd)


def test_plain_tensor_lines_are_what_entry_json_gives(tmp_path) -> None:
    """The layout's directly formatted lines for plain tensors parse to entry_json's objects;
    other entries (non-str keys, strides, parameters, ties, empty) take the general path."""
    import json

    w = random_tensor((3, 4), torch.float32, seed=3)
    sd = {"a": {"w": w, "tied": w, 1: torch.ones(2), "t": w.t(), "p": torch.nn.Parameter(torch.ones(2)),
                "e": torch.ones(0), "b": torch.ones(5, dtype=torch.bfloat16)}, "l": [torch.arange(3)]}
    wr = th5.Writer(tmp_path / "f.h5")
    wr.write_root(sd)
    types, plain = {}, 0
    for e in wr._entries:
        parent = e.path.rpartition("/")[0] if e.path else None
        parent_type = types.get(parent) if parent is not None else None
        if type(e) is fmt.TensorEntry:
            line = fmt._plain_tensor_line(e, parent_type)
            expect_plain = e.path in ("a/w", "a/b", "l/0")
            assert (line is not None) == expect_plain, e.path
            if line is not None:
                assert json.loads(line) == fmt.entry_json(e, parent_type)
                plain += 1
        if isinstance(e, fmt.Container):
            types[e.path] = e.type
    wr.abort()
    assert plain == 3


def test_a_group_of_very_many_links_is_written_by_libhdf5(tmp_path, monkeypatch) -> None:
    """save() of a tree with a group over ENCODED_LINKS links lets libhdf5 write the metadata
    (indexed link storage, fast lookups for HDF5 tools); under it, hdf5meta does."""
    monkeypatch.setattr(writer, "ENCODED_LINKS", 50)
    made = []
    real = hdf5meta.Builder.__init__
    monkeypatch.setattr(hdf5meta.Builder, "__init__", lambda self, base: (made.append(1), real(self, base))[1])
    th5.save({"g": {str(i): torch.ones(1) for i in range(50)}}, tmp_path / "few.h5")
    assert made == [1]
    sd = {"g": {str(i): torch.ones(1) for i in range(51)}}
    th5.save(sd, tmp_path / "many.h5")
    assert made == [1]  # not used
    raw = (tmp_path / "many.h5").read_bytes()
    assert raw[4096 + 8] == 3 and int.from_bytes(raw[4096 + 20:4096 + 28], "little") != 2**64 - 1  # libhdf5's extension
    assert_same(th5.load(tmp_path / "many.h5"), sd)
    th5.save_async(sd, tmp_path / "async.h5").result()  # save_async decides the same way
    assert made == [1] and _encoded(tmp_path / "async.h5") is False
    th5.save_async({"g": {"0": torch.ones(1)}}, tmp_path / "async-few.h5").result()
    assert made == [1, 1] and _encoded(tmp_path / "async-few.h5") is True


def _encoded(path) -> bool:
    """Whether the file's HDF5 metadata was encoded by hdf5meta (no superblock extension)."""
    with open(path, "rb") as f:
        f.seek(4096 + 20)
        return f.read(8) == b"\xff" * 8


def test_conversions_let_libhdf5_write_files_with_a_group_of_very_many_keys(tmp_path, monkeypatch) -> None:
    """convert (safetensors, torch.save and h5 sources) decides as save() does, from the keys
    it will write."""
    from safetensors.torch import save_file

    monkeypatch.setattr(writer, "ENCODED_LINKS", 5)
    for n, encoded in ((5, True), (6, False)):
        sd = {f"w{i}": torch.full((2,), float(i)) for i in range(n)}
        save_file(sd, tmp_path / f"{n}.safetensors")
        torch.save(sd, tmp_path / f"{n}.pt")
        th5.convert(tmp_path / f"{n}.safetensors", tmp_path / f"{n}-st.h5")
        th5.convert(tmp_path / f"{n}.pt", tmp_path / f"{n}-pt.h5")
        th5.convert(tmp_path / f"{n}-st.h5", tmp_path / f"{n}-h5.h5")
        for kind in ("st", "pt", "h5"):
            assert _encoded(tmp_path / f"{n}-{kind}.h5") is encoded, (n, kind)
            assert_same(th5.load(tmp_path / f"{n}-{kind}.h5"), sd)


def test_every_layout_line_is_what_entry_json_gives(tmp_path) -> None:
    """Lines formatted directly (plain tensors, containers without fields) and lines through
    json parse alike, for containers under str, non-str and None keys, in lists and tuples,
    with _metadata, and the root."""
    import collections
    import json

    od = collections.OrderedDict(a=torch.ones(1))
    od._metadata = {"": {"version": 2}}
    sd = {"x": {1: {"y": torch.ones(1)}, None: [], "t": (torch.ones(1), {"q": 1})}, "od": od, "": {},
          "l": [{"a": torch.zeros(2)}, [torch.ones(2)]], "v": 2.5,
          "atoms": {2: 5, -3: None, 4: True, 5: False, "n": -(2**70), True: 1, 2.5: 0, "s": "x\"y", "f": 1.5},
          "ints": [1, -2, None, True, 2**65, {"z": [0]}]}
    w = th5.Writer(tmp_path / "f.h5")
    w.write_root(sd)
    lines = fmt.layout_text(w._entries, {}).split(b"\n")[1:]
    types, direct = {}, 0
    assert len(lines) == len(w._entries)
    for e, line in zip(w._entries, lines):
        parent = e.path.rpartition("/")[0] if e.path else None
        parent_type = types.get(parent) if parent is not None else None
        assert json.loads(line) == fmt.entry_json(e, parent_type), e.path
        if isinstance(e, fmt.Container):
            types[e.path] = e.type
        direct += fmt._simple_line(e, parent_type) is not None
    w.abort()
    assert direct >= 20  # the direct path was taken (containers, int keys, int/bool/None values)
    assert_same(th5.load(_saved(tmp_path / "g.h5", sd)), sd)


def _saved(path, sd):
    th5.save(sd, path)
    return path


def test_small_tensors_fast_path_writes_the_same_file(tmp_path, monkeypatch) -> None:
    """Writer._write_small (small contiguous plain CPU tensors, gathered) writes byte for byte
    the file that the general path writes: ties (hard links), views, dtypes with attributes,
    0-d and empty tensors, Parameters, requires_grad, conjugate views, int keys."""
    w = random_tensor((4, 3), torch.float32, seed=1)
    c = torch.randn(3, dtype=torch.complex64)
    p = torch.nn.Parameter(torch.ones(2))
    sd = {"tied": {"a": w, "b": w, "v": w[1], "t": w.t()}, "bf": torch.ones(5, dtype=torch.bfloat16),
          "f8": torch.ones(3, dtype=torch.float8_e4m3fn), "scalar": torch.tensor(2.5), "empty": torch.ones(0, 3),
          "p": p, "pd": p.detach(), "g": torch.ones(2, requires_grad=True), "conj": c.conj(), "c": c,
          "state": {i: {"step": torch.tensor(float(i)), "m": torch.full((4,), float(i))} for i in range(3)},
          "big": torch.arange(300_000, dtype=torch.int32)}
    th5.save(sd, tmp_path / "fast.h5")
    calls = []
    original = writer.Writer._write_small

    def counting(self, path, key, t):
        entry = original(self, path, key, t)
        calls.append((path, entry is not None))
        return entry

    monkeypatch.setattr(writer.Writer, "_write_small", counting)
    th5.save(sd, tmp_path / "counted.h5")
    taken = {p for p, hit in calls if hit}
    assert {"tied/a", "bf", "f8", "scalar", "state/0/step", "state/2/m", "c"} <= taken
    assert not taken & {"tied/b", "tied/t", "p", "pd", "g", "conj", "empty", "big"}  # pd: a tie of p
    monkeypatch.setattr(writer.Writer, "_write_small", lambda self, path, key, t: None)
    th5.save(sd, tmp_path / "general.h5")
    assert (tmp_path / "fast.h5").read_bytes() == (tmp_path / "general.h5").read_bytes()
    out = th5.load(tmp_path / "fast.h5", verify=True)
    assert_same(out, dict(sd, conj=c.conj().resolve_conj()))  # (bits() of a conjugate view are its base's)
    assert out["tied"]["a"] is out["tied"]["b"] or out["tied"]["a"].data_ptr() == out["tied"]["b"].data_ptr()
    with h5py.File(tmp_path / "fast.h5", "r") as f:
        assert f["tied/a"].id == f["tied/b"].id  # one dataset, two links
        assert f["state/1/m"][()].tolist() == [1.0] * 4


def test_a_small_tensor_changed_between_writes_is_written_again(tmp_path) -> None:
    """A tensor written, changed in place, then written under another key is stored twice
    (its version moved), not linked to its old bytes."""
    t = torch.zeros(4)
    with th5.Writer(tmp_path / "f.h5") as wr:
        wr["a"] = t
        t += 1
        wr["b"] = t
    out = th5.load(tmp_path / "f.h5", verify=True)
    assert out["a"].tolist() == [0.0] * 4 and out["b"].tolist() == [1.0] * 4


@pytest.mark.parametrize("length", [0, 1, 11, 12, 13, 24, 25, 101])
def test_lookup3_of_many_blobs_at_once_matches_one_by_one(length) -> None:
    rng = np.random.default_rng(length)
    blobs = [rng.integers(0, 256, length, dtype=np.uint8).tobytes() for _ in range(40)] + [b"x" * 7]
    assert hdf5meta.lookup3_many(blobs) == [hdf5meta.lookup3(b) for b in blobs]


def _link_info(path, group: str) -> tuple[int, int]:
    """The (fractal heap, name index) addresses in the Link Info message of ``group``'s object
    header (both undefined: its links are in the header)."""
    import struct

    with h5py.File(path, "r") as f:
        addr = h5py.h5o.get_info(f[group].id).addr
    with open(path, "rb") as f:
        image = f.read()
    (body,) = [b for kind, _, b in hdf5meta.parse_object_header(image, fmt.USERBLOCK + addr) if kind == 0x02]
    heap, index = struct.unpack("<QQ", body[2:18])
    return heap, index


def _colliding_names(n: int = 120_000) -> tuple[str, str]:
    """Two link names with the same lookup3 hash (found among ``n`` short names)."""
    names = [f"k{i:07d}" for i in range(n)]
    seen: dict[int, str] = {}
    for name, h in zip(names, hdf5meta.lookup3_many([s.encode() for s in names])):
        if h in seen:
            return seen[h], name
        seen[h] = name
    raise AssertionError("no collision found")


@pytest.mark.parametrize("n", [hdf5meta.DENSE_LINKS, hdf5meta.DENSE_LINKS + 1, 3000, 20_000])
def test_big_groups_get_dense_link_storage_that_libhdf5_reads(tmp_path, n) -> None:
    """A group of more than DENSE_LINKS links keeps them in a fractal heap indexed by a B-tree
    of name hashes (libhdf5's dense storage): h5py finds every name and iterates them all."""
    names = [f"w{i}" for i in range(n - 3)] + ["ü-ñ", "x" * 300, "%2E"]
    sd = {"g": {tree_name: torch.full((2,), float(i)) for i, tree_name in enumerate(names)}, "x": torch.ones(1)}
    th5.save(sd, tmp_path / "f.h5")
    assert _encoded(tmp_path / "f.h5")
    heap, index = _link_info(tmp_path / "f.h5", "g")
    assert (heap != 2**64 - 1) is (n > hdf5meta.DENSE_LINKS) and (index != 2**64 - 1) is (n > hdf5meta.DENSE_LINKS)
    assert _link_info(tmp_path / "f.h5", "/")[0] == 2**64 - 1  # the root's two links stay in its header
    with h5py.File(tmp_path / "f.h5", "r") as f:
        g = f["g"]
        assert len(g) == n and sorted(g) == sorted(th5.escape(k) for k in names)
        for i in list(range(0, n, max(1, n // 300))) + [n - 3, n - 2, n - 1]:
            assert g[th5.escape(names[i])][1] == float(i)
        assert "missing" not in g and "w" not in g
    assert_same(th5.load(tmp_path / "f.h5", verify=True), sd)


def test_dense_groups_find_names_whose_hashes_collide(tmp_path) -> None:
    """Records of equal hashes are ordered by name, as libhdf5 compares them: both names of a
    colliding pair are found."""
    a, b = _colliding_names()
    sd = {"g": {f"w{i}": torch.full((1,), float(i)) for i in range(100)}}
    sd["g"][b], sd["g"][a] = torch.full((1,), -2.0), torch.full((1,), -1.0)
    th5.save(sd, tmp_path / "f.h5")
    assert _link_info(tmp_path / "f.h5", "g")[1] != 2**64 - 1
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["g"][a][0] == -1.0 and f["g"][b][0] == -2.0 and len(f["g"]) == 102


def test_libhdf5_changes_a_dense_group_written_here(tmp_path) -> None:
    """h5py adds links to a dense group (new heap blocks, a split of the B-tree leaf), deletes
    some and renames one; the file then reads back with every change."""
    n = 600
    th5.save({"g": {f"w{i}": torch.full((2,), float(i)) for i in range(n)}}, tmp_path / "f.h5")
    with h5py.File(tmp_path / "f.h5", "a") as f:
        g = f["g"]
        for i in range(n, n + 400):
            g.create_dataset(f"w{i}", data=np.full(2, float(i), dtype=np.float32))
        for i in range(0, 100):
            del g[f"w{i}"]
        g.move("w500", "renamed")
    with h5py.File(tmp_path / "f.h5", "r") as f:
        g = f["g"]
        assert len(g) == n + 300
        assert all(g[f"w{i}"][0] == i for i in range(100, n + 400) if i != 500)
        assert g["renamed"][0] == 500 and "w500" not in g and "w5" not in g


def test_a_group_past_the_dense_limits_keeps_its_links_in_its_header(tmp_path, monkeypatch) -> None:
    """A group of more than MAX_DENSE_LINKS links (a guard: 16,777,216), or with a name too long
    for the heap, keeps compact links, which libhdf5 reads as well. (Groups of very many links
    in dense storage: tests/test_hdf5meta_large.py.)"""
    monkeypatch.setattr(hdf5meta, "MAX_DENSE_LINKS", 100)
    with th5.Writer(tmp_path / "f.h5") as w:
        for i in range(101):
            w[f"big/w{i}"] = torch.full((1,), float(i))
        for i in range(70):
            w[f"long/{'y' * (5000 if i == 3 else 1)}{i}"] = torch.full((1,), float(i))
    assert _link_info(tmp_path / "f.h5", "big")[0] == 2**64 - 1
    assert _link_info(tmp_path / "f.h5", "long")[0] == 2**64 - 1
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert len(f["big"]) == 101 and f["big/w100"][0] == 100 and f["long"]["y" * 5000 + "3"][0] == 3
    out = th5.load(tmp_path / "f.h5", verify=True)
    assert len(out["big"]) == 101 and len(out["long"]) == 70


def _without_layout(dump: str) -> list[str]:
    """``h5dump``'s text without its first line (the file name) and the ``%layout`` dataset
    (whose bytes name data offsets, which differ between the two writers)."""
    out, skip = [], None
    for line in dump.splitlines()[1:]:
        if skip is None and line.strip() == f'DATASET "{fmt.LAYOUT_DATASET}" {{':
            skip = line[:len(line) - len(line.lstrip())] + "}"
            continue
        if skip is not None:
            skip = None if line == skip else skip
            continue
        out.append(line)
    return out


def test_h5dump_prints_an_encoded_file_as_libhdf5s_own(tmp_path, monkeypatch) -> None:
    """The HDF5 tools' own reader (``h5dump``, not h5py) prints every group, dataset, type,
    attribute, storage property and value of an encoded file exactly as of the file libhdf5
    writes for the same state, but where each dataset's bytes lie (.ci/run installs hdf5-tools)."""
    import shutil

    h5dump = shutil.which("h5dump")
    if h5dump is None:
        pytest.skip("h5dump is not installed (Debian: hdf5-tools)")
    sd = _sample() | {"dense": {f"k{i}": torch.full((2,), float(i)) for i in range(70)}}  # > 64 links: dense storage
    th5.save(sd, tmp_path / "own.h5", metadata={"note": "x"})
    monkeypatch.setattr(writer, "ENCODE_METADATA", False)
    th5.save(sd, tmp_path / "lib.h5", metadata={"note": "x"})

    def dump(name: str) -> list[str]:
        r = subprocess.run([h5dump, "-p", str(tmp_path / name)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and not r.stderr, r.stderr
        return [line for line in _without_layout(r.stdout) if not line.strip().startswith("OFFSET ")]  # data placement

    own, lib = dump("own.h5"), dump("lib.h5")
    assert own == lib
    text = "\n".join(own)
    assert 'DATASET "k69"' in text and 'ATTRIBUTE "torch_dtype"' in text and "H5T_IEEE_F32LE" in text
    values = ", ".join(f"{v:g}" for v in sd["model"]["w"][0].tolist())
    assert f"(0,0): {values}" in text.replace("\n      ", " ")  # the values themselves, read by h5dump


def test_pyfive_sees_the_same_tree_in_an_encoded_file(tmp_path, monkeypatch) -> None:
    """pyfive, a pure-Python HDF5 reader that shares no code with libhdf5, reads the groups,
    names, shapes, types and attributes of an encoded file as of libhdf5's file. (pyfive 1.3
    reads dataset values at addresses not offset by the user block, in libhdf5's own files
    with one too, so the values are checked through h5py and h5dump only; it parses neither
    the 8-bit float type of float8_e5m2 nor the compound of two halves of complex32, which are
    left out.)"""
    pyfive = pytest.importorskip("pyfive")
    sd = _sample() | {"dense": {f"k{i}": torch.full((2,), float(i)) for i in range(70)}}
    sd["dtypes"] = {k: v for k, v in sd["dtypes"].items() if k not in ("float8_e5m2", "complex32")}
    th5.save(sd, tmp_path / "own.h5")
    monkeypatch.setattr(writer, "ENCODE_METADATA", False)
    th5.save(sd, tmp_path / "lib.h5")

    def tree(group, path=""):
        out = {}
        for name in group.keys():
            obj, key = group[name], f"{path}/{name}"
            attrs = {a: np.asarray(v).tolist() for a, v in obj.attrs.items()}
            if isinstance(obj, pyfive.Group):
                out[key] = ("group", attrs)
                out.update(tree(obj, key))
            elif name != fmt.LAYOUT_DATASET:
                out[key] = (tuple(obj.shape), str(obj.dtype), attrs)
        return out

    own, lib = tree(pyfive.File(str(tmp_path / "own.h5"))), tree(pyfive.File(str(tmp_path / "lib.h5")))
    assert own == lib
    assert own["/model/w"] == ((4, 3), "float32", {}) and len([k for k in own if k.startswith("/dense/")]) == 70
    assert own["/dtypes/bfloat16"][2] == {"torch_dtype": b"bfloat16"}
    assert {k: np.asarray(v).tolist() for k, v in pyfive.File(str(tmp_path / "own.h5")).attrs.items()} == \
        {"tensorstore_h5.format": b"tensorstore_h5", "tensorstore_h5.version": 2}
