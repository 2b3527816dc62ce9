"""Format-2 files changed by other HDF5 tools (h5py, h5repack) after tensorstore_h5 saved them
(docs/FORMAT.md, "Files changed by other HDF5 tools"): every such change is refused with a
message that says what was seen and how to adopt it, a deleted tensor never loads, and
``th5.reindex`` / ``tensorstore-h5 reindex`` rebuild the file so that loads return what h5py
reads, bit for bit. Ordinary files, compressed or not, raise no false alarm, and opening a
file and listing its keys read no HDF5 metadata."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import cli
from tensorstore_h5.errors import FormatError
from tensorstore_h5.format import layout as fmt
from tensorstore_h5.reading import listing as listing_module
from tensorstore_h5.format import hdf5links

from helpers import assert_same, bits

CHANGED = "was changed by another HDF5 tool after tensorstore_h5 saved it"


def _object() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(16, 8, generator=g)
    return {
        "model": {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g),
                  "e": torch.randn(4, 4, generator=g).bfloat16(), "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(8, 8)}},
                  "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "tied": {"enc": emb, "dec": emb},
        "t": torch.randn(5, 3, generator=g).t(),
        "epoch": 3,
    }


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.h5"
    th5.save(_object(), path, metadata={"run": "baseline"})
    return path


def _edit(path: Path, change: Callable[[h5py.File], None]) -> None:
    with h5py.File(path, "r+") as f:
        change(f)


def _hdf5_bits(path: Path) -> dict[str, bytes]:
    """Every dataset's stored bits as h5py reads them (the file's own type: no conversion), by
    path; every path of a dataset linked at several."""
    out: dict[str, bytes] = {}
    with h5py.File(path, "r") as f:
        stack: list[tuple[str, Any]] = [("", f)]
        while stack:
            prefix, group = stack.pop()
            for name in group:
                obj = group[name]
                if isinstance(obj, h5py.Group):
                    stack.append((f"{prefix}{name}/", obj))
                elif f"{prefix}{name}" != fmt.LAYOUT_DATASET:
                    ftype = obj.id.get_type()
                    buf = np.empty(obj.size * ftype.get_size(), dtype=np.uint8)
                    if obj.size:
                        obj.id.read(h5py.h5s.ALL, h5py.h5s.ALL, buf, mtype=ftype)
                    out[f"{prefix}{name}"] = buf.tobytes()
    return out


def _assert_loads_what_h5py_reads(path: Path) -> None:
    """``th5`` returns, for every dataset h5py sees, its bits (in row-major order), and no tensor
    that h5py does not see."""
    expected = _hdf5_bits(path)
    with th5.open(path) as s:
        tensors = {k: s[k].read().contiguous() for k in s.keys() if isinstance(s[k], th5.TensorHandle)}
    assert set(tensors) == set(expected), (sorted(tensors), sorted(expected))
    for k, t in tensors.items():
        assert bytes(bits(t).numpy()) == expected[k], k
    assert th5.load(path) is not None  # and a whole load, checksums checked, passes


def _refused(path: Path, call: Callable[[], Any]) -> str:
    with pytest.raises(FormatError) as info:
        call()
    text = str(info.value)
    assert str(path) in text and CHANGED in text and f"tensorstore-h5 reindex {path}" in text, text
    assert "th5.reindex" in text and "h5py" in text
    return text


def _every_read_refuses(path: Path, key: str) -> str:
    text = _refused(path, lambda: th5.load(path))
    _refused(path, lambda: th5.load(path, mmap=True))
    _refused(path, lambda: th5.load(path, select=[key]))
    _refused(path, lambda: _slice(path, key))
    return text


def _slice(path: Path, key: str) -> torch.Tensor:
    with th5.open(path) as s:
        return s[key][:1]


# ---------------------------------------------------------------------------- each edit


def test_a_value_written_in_place_is_caught_by_checksums_and_adopted_by_reindex(saved: Path) -> None:
    _edit(saved, lambda f: f["model/w"].__setitem__((0, 0), 42.0))
    with th5.open(saved) as s:
        with pytest.raises(FormatError, match="checksum"):
            s["model/w"].read(index=slice(0, 1), verify=True)
        with pytest.raises(FormatError, match="checksum"):
            s["model/w"].read()
    with pytest.raises(FormatError, match="checksum"):
        th5.load(saved, mmap=True, verify=True)
    done = th5.reindex(saved)
    assert done.added == [] and done.removed == []
    assert th5.load(saved, verify=True)["model"]["w"][0, 0].item() == 42.0
    assert th5.load(saved, mmap=True, verify=True)["model"]["w"][0, 0].item() == 42.0
    _assert_loads_what_h5py_reads(saved)


def test_a_rename_is_refused_and_adopted(saved: Path) -> None:
    _edit(saved, lambda f: f.move("model/w", "model/w2"))
    text = _every_read_refuses(saved, "model/w")
    assert "'model/w2'" in text
    done = th5.reindex(saved)
    assert done.added == ["model/w2"] and done.removed == ["model/w"]
    got = th5.load(saved)
    assert "w" not in got["model"] and torch.equal(got["model"]["w2"], _object()["model"]["w"])
    _assert_loads_what_h5py_reads(saved)


def test_an_added_dataset_is_refused_and_adopted(saved: Path) -> None:
    size = saved.stat().st_size
    _edit(saved, lambda f: f.create_dataset("model/x", data=np.arange(5, dtype=np.float32)))
    text = _every_read_refuses(saved, "model/w")
    assert f"its length went from {size} to {saved.stat().st_size} bytes" in text
    assert "bytes appended" not in text
    done = th5.reindex(saved)
    assert done.added == ["model/x"] and done.removed == []
    assert torch.equal(th5.load(saved)["model"]["x"], torch.arange(5, dtype=torch.float32))
    _assert_loads_what_h5py_reads(saved)


def test_a_dataset_deleted_and_created_again_is_refused_and_adopted(saved: Path) -> None:
    def change(f: h5py.File) -> None:
        del f["model/b"]
        f["model/b"] = np.full(8, 7.0, dtype=np.float32)
    _edit(saved, change)
    _every_read_refuses(saved, "model/b")
    th5.reindex(saved)
    assert torch.equal(th5.load(saved)["model"]["b"], torch.full((8,), 7.0))
    _assert_loads_what_h5py_reads(saved)


def test_a_dataset_deleted_from_a_small_group_never_loads(saved: Path) -> None:
    size = saved.stat().st_size
    _edit(saved, lambda f: f.__delitem__("model/b"))
    assert saved.stat().st_size == size  # libhdf5 changes the group in place: the length says nothing
    text = _every_read_refuses(saved, "model/b")
    assert "1 of the" in text and "is gone" in text
    with th5.open(saved) as s:
        _refused(saved, lambda: s["model/w"].read())  # any key: the layout no longer describes the file
        _refused(saved, lambda: s.info())
    done = th5.reindex(saved)
    assert done.removed == ["model/b"]
    got = th5.load(saved)
    assert "b" not in got["model"]
    _assert_loads_what_h5py_reads(saved)


def test_a_deleted_group_and_a_move_across_groups_are_refused(tmp_path: Path) -> None:
    for name, change in [("group", lambda f: f.__delitem__("optim/state/0")),
                         ("move", lambda f: f.move("optim/state/0/step", "model/step"))]:
        path = tmp_path / f"{name}.h5"
        th5.save(_object(), path)
        _edit(path, change)
        _refused(path, lambda: th5.load(path))
        th5.reindex(path)
        _assert_loads_what_h5py_reads(path)


@pytest.mark.skipif(shutil.which("h5repack") is None, reason="h5repack (Debian: hdf5-tools) is not installed")
def test_h5repack_output_is_refused_and_adopted(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "repacked.h5"
    subprocess.run(["h5repack", str(saved), str(out)], check=True, capture_output=True)
    assert out.read_bytes()[:64] == saved.read_bytes()[:64]  # the header, HDF5's user block, copied as it was
    text = _every_read_refuses(out, "model/w")
    assert "HDF5 superblock" in text and "bytes appended" not in text and "truncated" not in text
    done = th5.reindex(out)
    assert done.added == [] and done.removed == []  # the layout is found again in the %layout dataset
    assert_same(th5.load(out), th5.load(saved))
    assert th5.open(out).metadata == {"run": "baseline"}
    _assert_loads_what_h5py_reads(out)


def test_a_compressed_file_edited_in_place_is_refused_and_keeps_its_compression(tmp_path: Path) -> None:
    path = tmp_path / "z.h5"
    obj = {"model": {f"w{i}": torch.randn(64, 128) for i in range(3)}, "small": {"a": torch.ones(3), "b": torch.ones(2)}}
    th5.save(obj, path, compression="zstd")
    size = path.stat().st_size
    _edit(path, lambda f: f.__delitem__("small/a"))
    assert path.stat().st_size == size
    _every_read_refuses(path, "small/a")
    th5.reindex(path)
    with th5.open(path) as s:
        assert s["model/w0"].compression["filters"][0]["name"] == "blosc2"
        assert "small/a" not in s.keys()
    _assert_loads_what_h5py_reads(path)


# ---------------------------------------------------------------------------- reindex keeps


def test_reindex_without_a_change_gives_back_what_was_saved(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "optim": opt.state_dict(), "p": torch.nn.Parameter(torch.randn(3)),
           "arr": np.arange(6, dtype=">i4").reshape(2, 3), "seq": [torch.ones(2), 5, "x"], "pair": (torch.zeros(1), 1.5),
           "od": OrderedDict(b=torch.ones(1), a=torch.zeros(1)), "empty": torch.empty(0, 3),
           "expanded": torch.randn(3, 1).expand(3, 4), "tied": _object()["tied"], "bf": torch.randn(3).bfloat16(),
           "keys": {None: torch.ones(1), 1.5: torch.zeros(1), True: 3, 7: {0: torch.ones(2)}}}
    for compression in (None, "lz4"):
        path = tmp_path / f"same-{compression}.h5"
        th5.save(obj, path, compression=compression, metadata={"step": 7})
        before = th5.load(path)
        done = th5.reindex(path)
        assert done.added == [] and done.removed == []
        after = th5.load(path)
        assert_same(before, after)
        assert after["tied"]["enc"] is after["tied"]["dec"]
        assert isinstance(after["p"], torch.nn.Parameter)
        assert after["model"]._metadata == before["model"]._metadata
        assert th5.open(path).metadata == {"step": 7}
        model.load_state_dict(after["model"])
        opt.load_state_dict(after["optim"])


def test_reindex_drops_values_with_their_group_and_keeps_the_others(saved: Path) -> None:
    _edit(saved, lambda f: f.__delitem__("optim"))
    th5.reindex(saved)
    got = th5.load(saved)
    assert "optim" not in got and got["epoch"] == 3
    assert got["model"]["e"].dtype == torch.bfloat16 and got["model"]["f8"].dtype == torch.float8_e4m3fn
    assert got["t"].stride() == (1, 3)


def test_a_list_that_lost_an_item_becomes_a_dict_of_what_is_left(tmp_path: Path) -> None:
    path = tmp_path / "seq.h5"
    th5.save({"seq": [torch.ones(2), torch.zeros(2), 5], "pair": (torch.ones(1), torch.zeros(1))}, path)
    _edit(path, lambda f: f.__delitem__("seq/0"))
    th5.reindex(path)
    got = th5.load(path)
    assert list(got["seq"]) == ["1", "2"] and got["seq"]["2"] == 5 and torch.equal(got["seq"]["1"], torch.zeros(2))
    assert isinstance(got["pair"], tuple)
    _assert_loads_what_h5py_reads(path)


def test_reindex_refuses_what_it_cannot_store_and_changes_nothing(saved: Path) -> None:
    _edit(saved, lambda f: f.create_dataset("names", data=np.array([b"a", b"b"])))
    before = saved.read_bytes()
    with pytest.raises(FormatError, match="'names'.*no torch dtype"):
        th5.reindex(saved)
    assert saved.read_bytes() == before
    _edit(saved, lambda f: (f.__delitem__("names"), f.__setitem__("link", h5py.SoftLink("/model/w"))))
    with pytest.raises(FormatError, match="'link' is a soft link"):
        th5.reindex(saved)
    plain = saved.with_name("plain.h5")
    with h5py.File(plain, "w") as f:
        f["x"] = np.ones(3)
    with pytest.raises(FormatError, match="not a tensorstore_h5 format-2 file"):
        th5.reindex(plain)


def test_the_reindex_command(saved: Path) -> None:
    _edit(saved, lambda f: f.move("model/w", "model/v"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["verify", str(saved)]) == 1
    assert CHANGED in err.getvalue() and "tensorstore-h5 reindex" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["reindex", str(saved)]) == 0, err.getvalue()
    assert "reindexed" in out.getvalue() and "'model/v'" in out.getvalue() and "'model/w'" in out.getvalue()
    _assert_loads_what_h5py_reads(saved)


# ---------------------------------------------------------------------------- no false alarm


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_saved_files_raise_no_false_alarm(tmp_path: Path, compression: str | None) -> None:
    many = {"model": {f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(200)},  # a dense group
            "optim": {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn(64, 80)} for i in range(70)}},
            "obj": _object()}
    path = tmp_path / "ok.h5"
    th5.save(many, path, compression=compression)
    for call in (lambda: th5.load(path), lambda: th5.load(path, mmap=True, verify=True),
                 lambda: th5.load(path, select="optim/*"), lambda: th5.open(path)["obj/model/w"][2:4],
                 lambda: th5.open(path).info()):
        hdf5links._CHECKED.clear()
        call()
    hdf5links._CHECKED.clear()
    raw = files_of(path)
    with th5.open(path) as s:
        assert hdf5links.link_changes(raw, s._layout) is None
    raw.close()


@pytest.mark.parametrize("obj", [torch.arange(3.0), np.arange(4), {}, {"a": 1, "b": [1, 2]},
                                 {"a": torch.empty(0), "b": {"c": {}}}], ids=["tensor", "array", "empty", "values", "no-data"])
def test_files_without_groups_of_tensors_raise_no_false_alarm(tmp_path: Path, obj: Any) -> None:
    path = tmp_path / "small.h5"
    th5.save(obj, path)
    assert_same(th5.load(path), obj)
    th5.reindex(path)
    assert_same(th5.load(path), obj)


def test_groups_libhdf5_keeps_in_deep_name_indexes_are_read_exactly(tmp_path: Path) -> None:
    """A compressed file's HDF5 metadata is libhdf5's: groups of many links keep them in a heap
    of several blocks, indexed by a B-tree of several levels. No false alarm, and an edit of
    such a group is seen."""
    path = tmp_path / "deep.h5"
    obj = {"g": {f"a.longer.key.name.{i:05d}": torch.full((2,), float(i)) for i in range(1500)},
           "sub": {f"s{i}": {"x": torch.ones(1)} for i in range(120)}}
    th5.save(obj, path, compression="lz4")
    assert_same(th5.load(path), obj)
    for change in (lambda f: f.__delitem__("g/a.longer.key.name.00077"), lambda f: f.move("sub/s5", "sub/t5")):
        edited = tmp_path / "edited.h5"
        shutil.copy(path, edited)
        _edit(edited, change)
        _refused(edited, lambda: th5.load(edited))
        th5.reindex(edited)
        _assert_loads_what_h5py_reads(edited)


def files_of(path: Path) -> Any:
    from tensorstore_h5.storage.files import RawFile

    return RawFile(str(path))


def test_damage_that_is_not_an_hdf5_edit_keeps_its_message(saved: Path) -> None:
    data = saved.read_bytes()
    saved.write_bytes(data + b"\0" * 10)
    with pytest.raises(FormatError, match="bytes appended"):
        th5.open(saved)
    saved.write_bytes(data[:-100])
    with pytest.raises(FormatError, match="truncated"):
        th5.open(saved)


# ---------------------------------------------------------------------------- cost


def test_opening_and_listing_keys_read_no_hdf5_metadata_and_the_first_read_is_cheap(tmp_path: Path, monkeypatch) -> None:
    """The open + keys of 10,000 keys (the first-call benchmark's file) walks no HDF5 group; the
    first read walks them once (four small reads for one flat group). Figures are printed, not
    asserted (a shared machine's timings vary)."""
    path = tmp_path / "many.h5"
    th5.save({f"blocks.{i // 10}.param{i % 10}": torch.full((4,), float(i)) for i in range(10_000)}, path)
    calls = []
    real = hdf5links.link_changes
    monkeypatch.setattr(hdf5links, "link_changes", lambda raw, layout: calls.append(1) or real(raw, layout))

    def best(fn: Callable[[], Any], n: int = 15) -> float:
        times = []
        for _ in range(n):
            hdf5links._CHECKED.clear()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    def keys() -> None:
        with th5.open(path) as s:
            s.keys()

    def first_read() -> None:
        with th5.open(path) as s:
            s["blocks.500.param3"][:1]

    opened = best(keys)
    assert calls == []
    read = best(first_read)
    assert calls
    raw, layout = files_of(path), th5.open(path)._layout
    walk = best(lambda: real(raw, layout))
    raw.close()
    monkeypatch.setattr(listing_module, "check_links_first", lambda layout, raw: None)
    read_unchecked = best(first_read)
    print(f"\n10,000 keys: open + keys {opened:.2f} ms; open + first slice {read:.2f} ms "
          f"({read_unchecked:.2f} ms without the link check); the walk alone {walk:.3f} ms")
