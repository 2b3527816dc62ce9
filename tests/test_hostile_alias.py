"""Entries that share stored bytes without a declared tie (issue #30, item 2).

An "alias bomb" is a small format-2 file whose layout names the same byte range from many
tensor entries, each with valid XXH3 checksums: every range is inside the file, yet loading
it allocated the range once per entry (2.8 GiB from 2.3 MB). Readers now refuse any two
entries (contiguous data or compressed chunks, of different entries or of one) whose stored
byte ranges overlap, with a FormatError naming the file and both keys; only ``same_as``
entries, which have no data of their own, share bytes, and they still load aliased. The
bomb itself runs in a worker process with an address-space limit and a time limit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.errors import FormatError
from tensorstore_h5.format import checksum
from tensorstore_h5.format import layout as fmt

from helpers import assert_same
from hostile.hostile_files import craft_layout, entry, flat, read_layout, save_v2

CALL_SECONDS = float(os.environ.get("TH5_HOSTILE_CALL_SECONDS", "30"))
"""Wall time one public call may take in the worker (its alarm ends it after that)."""
STARTUP_SECONDS = 60.0
"""Extra wall time for the worker to import torch before its first call."""
BOMB_ENTRIES = 20_000
BOMB_ELEMENTS = 32_768
"""The bomb: 20,000 entries naming one 128 KiB range (2.5 GiB if each were allocated)."""


def _hashes(path: Path, at: int, nbytes: int, block: int) -> list[str]:
    """The valid ``xxh3`` list of ``nbytes`` stored at ``at`` (as a writer would record it)."""
    with open(path, "rb") as f:
        f.seek(at)
        data = f.read(nbytes)
    return [checksum.to_hex(h) for h in checksum.block_hashes(data, block)]


def _add(head: dict[str, Any], entries: list[dict[str, Any]], path: str, kind: str, item: dict[str, Any]) -> None:
    head["paths"].append(path)
    head["types"].append(kind)
    entries.append(item)


def _refused(path: Path, call: Any, *keys: str) -> FormatError:
    """``call()`` raises a FormatError naming ``path``, "overlap" and every key of ``keys``."""
    with pytest.raises(FormatError) as info:
        call()
    text = str(info.value)
    assert str(path) in text and "overlap" in text, text
    for k in keys:
        assert repr(k) in text, (k, text)
    return info.value


def _refused_by_loads(path: Path, *keys: str) -> None:
    """Every whole-file read that allocates the entries' tensors refuses the file."""
    _refused(path, lambda: th5.load(path), *keys)
    _refused(path, lambda: th5.load(path, verify=True), *keys)
    _refused(path, lambda: th5.load(path, mmap=True), *keys)
    with th5.open(path) as s:
        _refused(path, lambda: dict(s.items()), *keys)
        _refused(path, lambda: list(s.walk()), *keys)
    out = path.with_name(path.stem + ".converted.h5")
    _refused(path, lambda: th5.convert(path, out), *keys)


# ---------------------------------------------------------------------------- the bomb


def make_bomb(path: Path, entries: int = BOMB_ENTRIES) -> None:
    """A file of one 128 KiB tensor ``a`` and ``entries`` more entries naming its bytes, each
    with ``a``'s valid checksums (no ``same_as``)."""
    th5.save({"a": torch.randn(BOMB_ELEMENTS, generator=torch.Generator().manual_seed(3))}, path)

    def edit(head: dict[str, Any], items: list[dict[str, Any]]) -> None:
        a = entry(head, items, "a")
        for i in range(entries):
            _add(head, items, f"k{i}", "tensor", {"dtype": "float32", "shape": [BOMB_ELEMENTS], "at": a["at"],
                                                   "xxh3": a["xxh3"]})
    craft_layout(path, edit)


WORKER = r'''
import json, os, resource, signal, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import tensorstore_h5 as th5
from tensorstore_h5.errors import TensorStoreError

with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))  # 1 GiB for the reads
path, seconds = sys.argv[1], float(sys.argv[2])


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


signal.signal(signal.SIGALRM, _alarm)


def items(p):
    with th5.open(p) as s:
        return dict(s.items())


def walk(p):
    with th5.open(p) as s:
        return list(s.walk())


CALLS = {
    "load": lambda: th5.load(path),
    "load(verify)": lambda: th5.load(path, verify=True),
    "load(mmap)": lambda: th5.load(path, mmap=True),
    "items": lambda: items(path),
    "walk": lambda: walk(path),
    "convert": lambda: th5.convert(path, path + ".converted.h5"),
}
results = []
for name, call in CALLS.items():
    r = {"call": name}
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        value = call()
        r["outcome"] = "ok"
        del value
    except Hang:
        r["outcome"] = "hang"
    except BaseException as e:  # noqa: BLE001 - reported
        r.update(outcome="error", type=type(e).__name__, message=str(e)[:2000],
                 library=isinstance(e, TensorStoreError))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    r["seconds"] = time.monotonic() - start
    results.append(r)
sys.stdout.write(json.dumps(results) + "\n")
sys.stdout.flush()
os._exit(0)
'''


def test_alias_bomb_is_refused_quickly_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "bomb.h5"
    make_bomb(path)
    assert path.stat().st_size < 3 * 2**20  # a 2.5 GiB load from under 3 MB
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), str(CALL_SECONDS)], capture_output=True, text=True,
                          env=env, timeout=STARTUP_SECONDS + CALL_SECONDS * 6)
    assert done.returncode == 0 and done.stdout.strip(), f"the worker died ({done.returncode}): {done.stderr[-2000:]}"
    problems = []
    for r in json.loads(done.stdout.strip().splitlines()[-1]):
        where = r["call"]
        if r["outcome"] == "hang" or r["seconds"] >= CALL_SECONDS:
            problems.append(f"{where}: still running after {r['seconds']:.1f} s")
        elif r["outcome"] == "ok":
            problems.append(f"{where}: loaded the bomb")
        elif r["type"] != "FormatError":
            problems.append(f"{where}: {r['type']} instead of a FormatError: {r['message'][:300]}")
        else:
            text = r["message"]
            named = re.findall(r"'(a|k\d+)'", text)
            if str(path) not in text or "overlap" not in text or len(set(named)) < 2:
                problems.append(f"{where}: the message does not name the file, the overlap and two keys: {text[:300]}")
    assert not problems, "\n".join(problems)


def test_alias_bomb_is_refused_before_its_entries_are_read(tmp_path: Path) -> None:
    """In-process, with a smaller bomb: the refusal comes from the layout, before any tensor
    is allocated (no read is attempted), and opening and listing keys still work."""
    path = tmp_path / "bomb.h5"
    make_bomb(path, 200)
    with th5.open(path) as s:
        assert len(s.keys()) == 201
        assert torch.equal(s["k7"].read(), s["a"].read())  # one tensor at a time is bounded by the file
    _refused_by_loads(path)


# ---------------------------------------------------------------------------- overlapping ranges


def test_two_entries_partially_overlapping_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "partial.h5"
    save_v2(path)
    head, items = read_layout(path)
    w = entry(head, items, "model/w")  # 64 x 32 float32: 8 KiB
    at = w["at"] + 4096
    hashes = _hashes(path, at, 4096, head["hash_block"])
    craft_layout(path, lambda h, e: _add(h, e, "x", "tensor", {"dtype": "float32", "shape": [1024], "at": at,
                                                                "xxh3": hashes}))
    _refused_by_loads(path, "model/w", "x")
    with th5.open(path) as s:  # one entry at a time is bounded by the file: still readable
        assert torch.equal(s["x"].read(), s["model/w"].read().reshape(-1)[1024:])


def test_compressed_chunks_of_two_entries_overlapping_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "chunks.h5"
    save_v2(path)

    def edit(head: dict[str, Any], items: list[dict[str, Any]]) -> None:
        lz4 = entry(head, items, "lz4")  # 256 x 64 float32 in chunks of 32 rows
        assert lz4["chunks"]["shape"] == [32, 64] and len(lz4["chunks"]["at"]) == 8
        chunks = {"shape": [32, 64], "filter": lz4["chunks"]["filter"], "at": lz4["chunks"]["at"][2:4]}
        _add(head, items, "lz4b", "tensor", {"dtype": "float32", "shape": [64, 64], "chunks": chunks,
                                              "xxh3": lz4["xxh3"][2:4]})
    craft_layout(path, edit)
    _refused_by_loads(path, "lz4", "lz4b")


def test_compressed_chunks_of_one_entry_overlapping_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "one.h5"
    save_v2(path)

    def edit(head: dict[str, Any], items: list[dict[str, Any]]) -> None:
        lz4 = entry(head, items, "lz4")
        lz4["chunks"]["at"][1] = lz4["chunks"]["at"][0]
        lz4["xxh3"][1] = lz4["xxh3"][0]
    craft_layout(path, edit)
    _refused_by_loads(path, "lz4")
    with th5.open(path) as s:  # a read of the entry alone is refused too (its own chunks are checked when parsed)
        _refused(path, lambda: s["lz4"].read(), "lz4")


def test_a_chunk_overlapping_another_entrys_contiguous_data_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mixed.h5"
    save_v2(path)
    head, items = read_layout(path)
    off, size = entry(head, items, "lz4")["chunks"]["at"][0][:2]
    at = off // fmt.ALIGNMENT * fmt.ALIGNMENT
    nbytes = off + size - at
    hashes = _hashes(path, at, nbytes, head["hash_block"])
    craft_layout(path, lambda h, e: _add(h, e, "y", "tensor", {"dtype": "uint8", "shape": [nbytes], "at": at,
                                                                "xxh3": hashes}))
    _refused_by_loads(path, "lz4", "y")


def test_an_array_overlapping_a_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "array.h5"
    save_v2(path)
    head, items = read_layout(path)
    w = entry(head, items, "model/w")
    hashes = _hashes(path, w["at"], 256, head["hash_block"])
    craft_layout(path, lambda h, e: _add(h, e, "arr", "ndarray", {"dtype": "<f4", "shape": [64], "at": w["at"],
                                                                   "xxh3": hashes}))
    _refused_by_loads(path, "model/w", "arr")


def test_a_range_overlapping_the_layout_text_is_refused() -> None:
    """When the caller says where the layout lies (``layout_at``), data inside it is refused."""
    line = {"dtype": "uint8", "shape": [128], "at": 8192, "xxh3": ["0" * 16]}
    head = {"format": "tensorstore_h5", "version": 2, "metadata": {}, "hash_block": checksum.HASH_BLOCK,
            "paths": ["", "x"], "types": ["dict", "tensor"]}
    text = "\n".join(json.dumps(x) for x in [head, {}, line]).encode()
    ok = fmt.parse_layout_v2(text, "f.h5", 8192 + 4096, layout_at=8192 + 128)
    assert [e.path for e in ok.entries] == ["", "x"]
    bad = fmt.parse_layout_v2(text, "f.h5", 8192 + 4096, layout_at=8192 + 64)
    with pytest.raises(FormatError, match=r"f\.h5: .*'x'.*layout.*overlap"):
        bad.entries


def test_disjoint_ranges_in_any_order_are_accepted(tmp_path: Path) -> None:
    """Ranges need not be stored in the order of their entries (nor chunks in grid order): only
    overlaps are refused. Here the lz4 chunks are listed backwards (each with its own hash),
    so the rows come back in reversed chunk order, checksums valid."""
    path = tmp_path / "reversed.h5"
    obj = save_v2(path)

    def edit(head: dict[str, Any], items: list[dict[str, Any]]) -> None:
        lz4 = entry(head, items, "lz4")
        lz4["chunks"]["at"].reverse()
        lz4["xxh3"].reverse()
        w = entry(head, items, "model/w")
        _add(head, items, "early", "tensor", {"dtype": "uint8", "shape": [64], "at": 4096,
                                               "xxh3": _hashes(path, 4096, 64, head["hash_block"])})
        assert w["at"] >= 4096 + 64
    craft_layout(path, edit)
    got = th5.load(path, verify=True)
    assert torch.equal(got["lz4"], torch.cat(list(obj["lz4"].split(32))[::-1]))
    assert torch.equal(got["model"]["w"], obj["model"]["w"])
    line = {"dtype": "uint8", "shape": [128], "xxh3": ["0" * 16]}
    head = {"format": "tensorstore_h5", "version": 2, "metadata": {}, "hash_block": checksum.HASH_BLOCK,
            "paths": ["", "x", "y"], "types": ["dict", "tensor", "tensor"]}
    text = "\n".join(json.dumps(x) for x in [head, {}, {**line, "at": 8192 + 1024}, {**line, "at": 4096}]).encode()
    layout = fmt.parse_layout_v2(text, "f.h5", 16384, layout_at=8192)  # the layout between the two
    assert [e.path for e in layout.entries] == ["", "x", "y"]


def test_a_selection_is_checked_against_itself(tmp_path: Path) -> None:
    """A load of some keys is refused when two of them overlap; keys whose bytes do not
    overlap any other selected key still load."""
    path = tmp_path / "partial.h5"
    obj = save_v2(path)
    head, items = read_layout(path)
    w = entry(head, items, "model/w")
    hashes = _hashes(path, w["at"], 4096, head["hash_block"])
    craft_layout(path, lambda h, e: _add(h, e, "x", "tensor", {"dtype": "float32", "shape": [1024], "at": w["at"],
                                                                "xxh3": hashes}))
    _refused(path, lambda: th5.load(path, select=["model/w", "x"]), "model/w", "x")
    got = th5.load(path, select=["model/*", "lz4", "zstd"], verify=True)
    assert_same(got, {k: v for k, v in obj.items() if k != "n"})


# ---------------------------------------------------------------------------- what still loads


def test_declared_ties_still_load_aliased(tmp_path: Path) -> None:
    t = torch.randn(64, 64)
    path = tmp_path / "tied.h5"
    th5.save({"enc": {"w": t}, "dec": {"w": t}, "v": t[0], "big": torch.randn(32, 32)}, path)
    head, items = read_layout(path)
    assert entry(head, items, "dec/w").get("same_as") == "enc/w"
    for kwargs in ({}, {"verify": True}, {"mmap": True}):
        got = th5.load(path, **kwargs)
        assert got["enc"]["w"].data_ptr() == got["dec"]["w"].data_ptr()
        assert torch.equal(got["dec"]["w"], t) and torch.equal(got["v"], t[0])
    with th5.open(path) as s:
        got = dict(s.items())
        assert got["enc/w"].data_ptr() == got["dec/w"].data_ptr()
    sub = th5.load(path, select=["dec/w"])  # a tie whose original is not selected reads the original's bytes
    assert torch.equal(sub["dec"]["w"], t)


@pytest.mark.parametrize("compression", [None, "lz4", "zstd", "best"])
def test_ordinary_files_still_load(tmp_path: Path, compression: str | None) -> None:
    g = torch.Generator().manual_seed(9)
    obj = {
        "small": {f"t{i}": torch.randn(3, generator=g) for i in range(3000)},
        "empty": {"f": torch.zeros(0), "i": torch.zeros(0, 5, dtype=torch.int64), "b": torch.zeros(4, 0)},
        "scalar": torch.tensor(2.5),
        "big": torch.randn(512, 300, generator=g),
        "bf16": torch.randn(300, 129, generator=g).to(torch.bfloat16),
        "t": torch.randn(200, 100, generator=g).t(),
        "arr": np.arange(5000, dtype=np.int32),
        "arr0": np.zeros((0,), dtype=np.float64),
        "tied": None,
        "n": 5,
    }
    obj["tied"] = obj["big"]
    path = tmp_path / f"ordinary-{compression}.h5"
    th5.save(obj, path, compression=compression, chunk_bytes=16384)
    for kwargs in ({}, {"verify": True}, {"mmap": True}):
        got = th5.load(path, **kwargs)
        assert_same(got, obj)
        assert got["tied"].data_ptr() == got["big"].data_ptr()
    with th5.open(path) as s:
        assert_same(dict(s.items()), flat(obj))
        assert torch.equal(s["big"][10:20], obj["big"][10:20])
