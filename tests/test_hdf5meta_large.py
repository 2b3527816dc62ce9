"""Groups of very many links in files whose HDF5 metadata tensorstore_h5 encodes itself (issue
#32 item 5): their name index is a version-2 B-tree of as many levels as libhdf5 would give it,
their link heap a table of blocks as libhdf5 grows one, and libhdf5 (h5py, the HDF5 tools)
reads them, finds every name and changes them as its own files."""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.errors import FormatError
from tensorstore_h5.format import hdf5meta
from tensorstore_h5.format import layout as fmt
from tensorstore_h5.format import hdf5links
from tensorstore_h5.storage.files import RawFile

from helpers import assert_same

CHANGED = "was changed by another HDF5 tool after tensorstore_h5 saved it"
_HEAP = struct.Struct("<4sBHHBIQQQQQQQQQQQQHQQHHQH")
_BTREE = struct.Struct("<4sBBIHHBBQHQ")


def _key(i: int) -> str:
    return f"layers.{i}.weight"


def _flat(n: int) -> dict[str, torch.Tensor]:
    return {_key(i): torch.full((1,), float(i)) for i in range(n)}


def _dense(path: Path, group: str = "/") -> tuple[dict[str, int], tuple[Any, ...]]:
    """The fractal heap header (some fields, by name) and the name index's B-tree header of
    ``group``, read from the file's bytes."""
    with h5py.File(path, "r") as f:
        addr = h5py.h5o.get_info(f[group].id).addr
    image = path.read_bytes()
    (body,) = [b for kind, _, b in hdf5meta.parse_object_header(image, fmt.USERBLOCK + addr) if kind == 0x02]
    heap_at, index_at = struct.unpack("<QQ", body[2:18])
    assert heap_at != 2**64 - 1, "the group keeps its links in its header"
    h = _HEAP.unpack_from(image, fmt.USERBLOCK + heap_at)
    heap = dict(zip(("fsm", "objects", "start", "max_direct", "root_rows"), (h[9], h[13], h[19], h[20], h[24])))
    return heap, _BTREE.unpack_from(image, fmt.USERBLOCK + index_at)


def _limit(n: int) -> int:
    return (max(n, 1).bit_length() - 1) // 8 + 1


def _walk_index(path: Path, group: str = "/") -> tuple[int, list[int]]:
    """Walk the name index of ``group`` from the file's bytes, as the specification (III.A.2)
    lays out a version-2 B-tree: every node's signature, type and checksum, its record count
    against its parent's pointer, its subtree's against the parent's total, the hashes in order
    across the tree, and every node but the root at least as full as libhdf5's merge threshold
    (40 %). Returns ``(depth, the hashes in tree order)``."""
    heap, (sig, version, btype, node, rsize, depth, split, merge, root, nroot, total) = _dense(path, group)
    assert (sig, version, btype, rsize, split, merge) == (b"BTHD", 0, 5, 11, 100, 40)
    image = path.read_bytes()
    leaf_max = (node - 10) // rsize
    nrec_size = _limit(leaf_max)
    node_max, cum = [leaf_max], [leaf_max]  # per level, as libhdf5's H5B2__hdr_init
    for d in range(1, depth + 1):
        ptr = 8 + nrec_size + (_limit(cum[d - 1]) if d > 1 else 0)
        node_max.append((node - 10 - ptr) // (rsize + ptr))
        cum.append((node_max[d] + 1) * cum[d - 1] + node_max[d])
    assert total <= cum[depth] and (depth == 0 or total > cum[depth - 1])  # no deeper than needed
    hashes: list[int] = []

    def walk(at: int, nrec: int, d: int, is_root: bool) -> int:
        raw = image[fmt.USERBLOCK + at:fmt.USERBLOCK + at + node]
        assert raw[:6] == (b"BTIN" if d else b"BTLF") + bytes([0, 5])
        assert nrec <= node_max[d] and (is_root or nrec >= node_max[d] * merge // 100), (d, nrec, node_max[d])
        ptr = (8 + nrec_size + (_limit(cum[d - 1]) if d > 1 else 0)) if d else 0
        end = 6 + nrec * rsize + (nrec + 1) * ptr
        assert hdf5meta.lookup3(raw[:end]) == int.from_bytes(raw[end:end + 4], "little")
        records = [int.from_bytes(raw[p:p + 4], "little") for p in range(6, 6 + nrec * rsize, rsize)]
        if not d:
            hashes.extend(records)
            return nrec
        count = nrec
        p = 6 + nrec * rsize
        for i in range(nrec + 1):
            child = int.from_bytes(raw[p:p + 8], "little")
            child_nrec = int.from_bytes(raw[p + 8:p + 8 + nrec_size], "little")
            below = walk(child, child_nrec, d - 1, False)
            if d > 1:
                assert int.from_bytes(raw[p + 8 + nrec_size:p + ptr], "little") == below
            count += below
            if i < nrec:
                hashes.append(records[i])
            p += ptr
        return count

    assert walk(root, nroot, depth, True) == total == heap["objects"]
    assert hashes == sorted(hashes)
    return depth, hashes


def _h5_tools(path: Path) -> None:
    """HDF5's own tools read the whole file without a word on stderr (where installed)."""
    for tool, args in (("h5dump", ["-H"]), ("h5ls", []), ("h5stat", [])):
        exe = shutil.which(tool)
        if exe is None:
            continue
        r = subprocess.run([exe, *args, str(path)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and not r.stderr, (tool, r.stderr[-2000:])


def _check_with_h5py(path: Path, expected: dict[str, float], group: str = "/", sample: int = 2000) -> None:
    """h5py lists exactly ``expected``'s names, finds a random sample of them (and not names
    that are not there) and reads their values."""
    rng = random.Random(len(expected))
    names = list(expected)
    with h5py.File(path, "r") as f:
        g = f[group]
        assert set(g) - {fmt.LAYOUT_DATASET} == set(names)
        for name in rng.sample(names, min(sample, len(names))):
            assert g[name][0] == expected[name], name
        for i in rng.sample(range(len(names)), min(200, len(names))):
            assert f"{names[i]}x" not in g and f"x{names[i]}" not in g


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """50,000 keys in one group, written by th5.save (which no longer leaves such a group to libhdf5)."""
    path = tmp_path_factory.mktemp("big") / "50k.h5"
    th5.save(_flat(50_000), path)
    return path


@pytest.fixture(scope="module")
def bigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120,000 keys in one group, written key by key by th5.Writer."""
    path = tmp_path_factory.mktemp("bigger") / "120k.h5"
    with th5.Writer(path) as w:
        for i in range(120_000):
            w[_key(i)] = torch.full((1,), float(i))
    return path


def _encoded(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(4096 + 20)
        return f.read(8) == b"\xff" * 8  # no superblock extension: hdf5meta wrote the metadata


@pytest.mark.parametrize("which, n", [("big", 50_000), ("bigger", 120_000)])
def test_a_group_of_very_many_links_is_dense_and_read_by_h5py(which: str, n: int, request: pytest.FixtureRequest) -> None:
    """The group is dense (no longer its links in its header, where libhdf5 scans them): a heap
    as libhdf5 lays one out (a root indirect block, blocks of 512 bytes to 64 KiB), a name index
    of 512-byte nodes three levels deep; h5py lists every name and finds every one it is asked."""
    path = request.getfixturevalue(which)
    assert _encoded(path)
    heap, index = _dense(path)
    assert heap["fsm"] == 2**64 - 1 and heap["root_rows"] > 0 and (heap["start"], heap["max_direct"]) == (512, 65536)
    assert index[3] == hdf5meta.NAME_NODE == 512 and index[5] == 3 and index[10] == n + 1
    assert _walk_index(path)[0] == 3
    _check_with_h5py(path, {_key(i): float(i) for i in range(n)})


def test_a_very_large_group_loads_verified(big: Path) -> None:
    sd = th5.load(big, verify=True)
    assert len(sd) == 50_000 and sd[_key(49_999)].item() == 49_999.0 and sd[_key(7)].item() == 7.0


def test_hdf5_tools_read_very_large_groups(big: Path) -> None:
    """h5dump -H, h5ls and h5stat (libhdf5's tools, which walk the heap and index themselves)."""
    if not any(shutil.which(t) for t in ("h5dump", "h5ls", "h5stat")):
        pytest.skip("the HDF5 tools are not installed (Debian: hdf5-tools)")
    _h5_tools(big)
    h5ls = shutil.which("h5ls")
    if h5ls:
        out = subprocess.run([h5ls, str(big)], capture_output=True, text=True, timeout=300).stdout
        assert len(out.splitlines()) == 50_001 and f"{_key(31_337)} Dataset {{1}}" in " ".join(out.split())


def test_libhdf5_inserts_into_and_removes_from_a_deep_name_index(big: Path, tmp_path: Path) -> None:
    """h5py adds 3,000 links (leaf splits, new heap blocks after the last one written), removes
    every third of the 50,000 (redistributions and merges of nodes, a free-space manager for
    the heap) and renames one: the file reads as it should through h5py and the HDF5 tools, and
    tensorstore_h5 refuses it as changed."""
    path = tmp_path / "edited.h5"
    shutil.copy(big, path)
    with h5py.File(path, "a") as f:
        for i in range(3000):
            f.create_dataset(f"new.{i}", data=np.full((1,), -i, dtype=np.float32))
        for i in range(0, 50_000, 3):
            del f[_key(i)]
        f.move(_key(1), "renamed")
    expected = {_key(i): float(i) for i in range(2, 50_000) if i % 3} | {f"new.{i}": -i for i in range(3000)}
    _check_with_h5py(path, expected | {"renamed": 1.0})
    heap, index = _dense(path)
    assert heap["fsm"] != 2**64 - 1 and index[10] == len(expected) + 2
    _h5_tools(path)
    with pytest.raises(FormatError, match=CHANGED):
        th5.load(path)


@pytest.mark.parametrize("n, depth", [(92, 0), (93, 1), (1149, 1), (1150, 2), (3000, 2)])
def test_every_depth_of_name_index_is_read_and_changed_by_libhdf5(tmp_path: Path, monkeypatch, n: int, depth: int) -> None:
    """With one-block heaps and one-leaf indexes kept under 1 KiB, small groups get trees of
    each depth at its bounds (a leaf of 512 bytes holds 45 records, an internal node 24 over a
    level below: 1,149 records in two levels) and heaps of several rows; h5py finds every name
    in each, and adds and removes links (splits, merges, the root split and merged away)."""
    monkeypatch.setattr(hdf5meta, "ONE_BLOCK", 1024)
    path = tmp_path / "f.h5"
    th5.save({"g": _flat(n), "x": torch.ones(1)}, path)
    heap, _ = _dense(path, "g")
    assert heap["root_rows"] > 0
    assert _walk_index(path, "g")[0] == depth
    expected = {_key(i): float(i) for i in range(n)}
    _check_with_h5py(path, expected, "g")
    with h5py.File(path, "a") as f:
        for i in range(n, n + 300):
            f["g"].create_dataset(_key(i), data=np.full((1,), i, dtype=np.float32))
        for i in range(0, n, 2):
            del f["g"][_key(i)]
    _check_with_h5py(path, {_key(i): float(i) for i in range(n + 300) if i >= n or i % 2}, "g")
    _h5_tools(path)


def test_names_whose_hashes_collide_are_found_in_a_deep_index(tmp_path: Path) -> None:
    """Records of equal hashes ordered by name (as libhdf5's strcmp), in a tree of three levels."""
    from test_hdf5meta import _colliding_names

    a, b = _colliding_names()
    sd = _flat(30_000)
    sd[b], sd[a] = torch.full((1,), -2.0), torch.full((1,), -1.0)
    th5.save(sd, tmp_path / "f.h5")
    depth, hashes = _walk_index(tmp_path / "f.h5")
    assert depth == 3 and len(set(hashes)) < len(hashes)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f[a][0] == -1.0 and f[b][0] == -2.0 and len(f) == 30_003


def test_reindex_adopts_an_edit_of_a_deep_group(tmp_path: Path) -> None:
    """A group of 4,000 links (a heap of several rows, a name index of three levels) edited by
    h5py is refused, then adopted by th5.reindex; loads then return what h5py reads. Walking
    such a group's links (a group that holds a group is read, not counted) raises no false
    alarm before the edit."""
    path = tmp_path / "f.h5"
    sd: dict[str, Any] = {"g": _flat(4000) | {"sub": {"x": torch.ones(2)}}}
    th5.save(sd, path)
    assert _walk_index(path, "g")[0] == 2
    raw = RawFile(str(path))
    with th5.open(path) as s:
        hdf5links._CHECKED.clear()
        assert hdf5links.link_changes(raw, s._layout) is None
    raw.close()
    assert_same(th5.load(path), sd)
    with h5py.File(path, "a") as f:
        del f["g"][_key(17)]
        f["g"].create_dataset("added", data=np.arange(3, dtype=np.int64))
    with pytest.raises(FormatError, match=CHANGED):
        th5.load(path)
    th5.reindex(path)
    out = th5.load(path)
    assert _key(17) not in out["g"] and out["g"]["added"].tolist() == [0, 1, 2] and len(out["g"]) == 4000 + 1
    assert out["g"][_key(3999)].item() == 3999.0 and out["g"]["sub"]["x"].tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_reindex_adopts_an_edit_of_a_very_large_group(big: Path, tmp_path: Path) -> None:
    """The same for 50,000 keys (~30 s: reindex's own cost for a group this large)."""
    path = tmp_path / "edited.h5"
    shutil.copy(big, path)
    with h5py.File(path, "a") as f:
        del f[_key(123)]
        f.create_dataset("added", data=np.float32(5.0))
    with pytest.raises(FormatError, match=CHANGED):
        th5.load(path)
    th5.reindex(path)
    out = th5.load(path)
    assert len(out) == 50_000 and _key(123) not in out and out["added"].item() == 5.0
    assert out[_key(49_999)].item() == 49_999.0


def test_the_first_read_of_a_very_large_group_counts_its_links(big: Path) -> None:
    """link_changes counts a dense group of datasets that libhdf5 never changed, whatever the
    shape of its heap and index: no walk of 50,000 links before a first read."""
    raw = RawFile(str(big))
    with th5.open(big) as s:
        hdf5links._CHECKED.clear()
        reads = []
        real = hdf5links._records
        hdf5links._records = lambda *a: reads.append(1) or real(*a)  # type: ignore[assignment]
        try:
            assert hdf5links.link_changes(raw, s._layout) is None
        finally:
            hdf5links._records = real  # type: ignore[assignment]
        assert reads == []
        assert s[_key(12_345)][:].item() == 12_345.0
    raw.close()


def test_libhdf5_grows_a_heap_of_one_block_past_its_rows_of_direct_blocks(tmp_path: Path) -> None:
    """A heap whose root is one direct block (the largest kept so, 32 KiB) is one libhdf5 can
    grow: h5py adding 5,000 links of long names fills a root indirect block's rows of direct
    blocks and goes on into indirect ones. (A root block of 64 KiB, as this module once wrote,
    gave libhdf5 indirect rows of no rows: h5py crashed adding such links.)"""
    path = tmp_path / "f.h5"
    long = "x" * 100
    th5.save({f"{long}.{i}": torch.full((1,), float(i)) for i in range(250)}, path)
    heap, _ = _dense(path)
    assert heap["root_rows"] == 0 and heap["start"] == hdf5meta.ONE_BLOCK and heap["max_direct"] == 65536
    with h5py.File(path, "a") as f:
        for i in range(250, 5250):
            f.create_dataset(f"{long}.{i}", data=np.full((1,), i, dtype=np.float32))
    heap, _ = _dense(path)
    assert heap["root_rows"] > 3  # past rows 0-2, the direct ones (32, 32 and 64 KiB)
    _check_with_h5py(path, {f"{long}.{i}": float(i) for i in range(5250)})
