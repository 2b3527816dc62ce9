"""``th5.diff`` and ``th5.stats`` (reading/compare.py): every status, the numbers against float64
references computed with torch, blocks and chunks, directories and safetensors files, bounded
memory, the command line's exit statuses, and the Jupyter views."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.reading import compare


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorstore_h5", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 KiB and chunks of 100 elements: every tensor of a few KiB is read in blocks of
    rows and summed in chunks, on the threads, as a large one is."""
    monkeypatch.setattr(compare, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(compare, "AHEAD_BYTES", 4096)
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 100)


def reference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float, float]:
    """(elements that differ, max |b - a|, ||b - a|| / ||a||) computed plainly with torch in float64."""
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    d = y - x
    return int((a != b).sum()), float(d.abs().max()), float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(x))


def row_of(result: compare.Diff, key: str) -> dict:
    found = [r for r in result if r["key"] == key]
    assert len(found) == 1, key
    return found[0]


# -- statuses and numbers ---------------------------------------------------------------------


def test_every_status(tmp_path) -> None:
    w = torch.randn(8, 4)
    a = {"same": w, "moved": w.clone(), "cast": w.clone(), "grown": w.clone(), "gone": torch.ones(2), "epoch": 3,
         "name": "run", "lr": [1e-3, float("nan")], "kind": torch.zeros(2)}
    b = {"same": w.clone(), "moved": w + 1e-3, "cast": w.to(torch.bfloat16), "grown": torch.zeros(9, 4), "new": 1.5,
         "epoch": 4, "name": "run", "lr": [1e-3, float("nan")], "kind": "not a tensor"}
    th5.save(a, tmp_path / "a.h5")
    th5.save(b, tmp_path / "b.h5")
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    status = {r["key"]: r["status"] for r in result}
    assert status == {"same": "equal", "moved": "changed", "cast": "dtype", "grown": "shape", "gone": "only_a",
                      "epoch": "changed", "name": "equal", "lr/0": "equal", "lr/1": "equal", "kind": "dtype",
                      "new": "only_b"}
    assert [r["key"] for r in result][-1] == "new"  # keys only in b come after a's, in b's order
    assert set(compare.STATUSES) == set(status.values())
    assert not result.equal and result.counts() == {"equal": 4, "changed": 2, "dtype": 2, "shape": 1, "only_a": 1,
                                                    "only_b": 1}
    same, moved, grown = row_of(result, "same"), row_of(result, "moved"), row_of(result, "grown")
    assert (same["changed"], same["max_abs"], same["rel_l2"]) == (0, 0.0, 0.0)
    assert moved["changed"] == 32 and moved["a"] == moved["b"] == "float32 [8, 4]"
    assert grown["max_abs"] is grown["rel_l2"] is grown["changed"] is None and grown["b"] == "float32 [9, 4]"
    cast = row_of(result, "cast")  # two numeric dtypes of one shape: compared in float64 all the same
    count, max_abs, rel = reference(w, w.to(torch.bfloat16))
    assert cast["changed"] == count and cast["max_abs"] == max_abs and cast["rel_l2"] == pytest.approx(rel, rel=1e-12)
    assert row_of(result, "epoch")["a"] == "int = 3" and row_of(result, "gone")["b"] is None
    assert th5.diff(tmp_path / "a.h5", tmp_path / "a.h5").equal


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOATS + [torch.complex64], ids=str)
@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
def test_floats_against_a_float64_reference(tmp_path, dtype, blocks, request) -> None:
    if blocks:
        request.getfixturevalue("small_blocks")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50, 37, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32)
    step = torch.randn(50, 37, generator=g, dtype=base.dtype) * 0.05
    a, b = base.to(dtype), (base + step).to(dtype)
    b[3] = a[3]  # some rows unchanged
    th5.save({"w": a}, tmp_path / "a.h5")
    th5.save({"w": b}, tmp_path / "b.h5")
    row = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")[0]
    count, max_abs, rel = reference(a, b)
    assert row["status"] == "changed" and row["changed"] == count
    assert row["max_abs"] == max_abs  # one element's difference, exact in float64
    assert row["rel_l2"] == pytest.approx(rel, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16,
                                   torch.uint32], ids=str)
def test_integers_have_an_exact_max_abs(tmp_path, dtype, small_blocks) -> None:
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(1)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    a = torch.randint(lo, hi, (40, 30), generator=g, dtype=torch.int64)
    b = a.clone()
    b[5, 7], b[20, 1] = hi, lo  # the largest difference somewhere in the middle of a block
    th5.save({"i": a.to(dtype)}, tmp_path / "a.h5")
    th5.save({"i": b.to(dtype)}, tmp_path / "b.h5")
    row = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")[0]
    d = (b - a).double()
    assert row["changed"] == int((a != b).sum())
    assert type(row["max_abs"]) is int and row["max_abs"] == int((b - a).abs().max())
    assert row["rel_l2"] == pytest.approx(float(d.norm() / a.double().norm()), rel=1e-12)


def test_int64_extremes_are_exact(tmp_path) -> None:
    big = 2**62 + 12345
    a = torch.tensor([0, -big, 7], dtype=torch.int64)
    b = torch.tensor([0, big, 7], dtype=torch.int64)  # 2**63 + 24690 does not fit an int64
    th5.save({"i": a, "u": torch.tensor([1, 2], dtype=torch.uint64)}, tmp_path / "a.h5")
    th5.save({"i": b, "u": torch.tensor([1, 2**64 - 1], dtype=torch.uint64)}, tmp_path / "b.h5")
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    assert row_of(result, "i")["max_abs"] == 2 * big
    assert row_of(result, "u")["max_abs"] == 2**64 - 3


def test_bool_and_bit_types_count_the_elements_that_differ(tmp_path) -> None:
    a = torch.zeros(100, dtype=torch.bool)
    b = a.clone()
    b[[3, 50, 99]] = True
    packed = torch.arange(64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # no arithmetic in torch
    other = packed.view(torch.uint8).clone()
    other[:5] += 1
    th5.save({"m": a, "f4": packed}, tmp_path / "a.h5")
    th5.save({"m": b, "f4": other.view(torch.float4_e2m1fn_x2)}, tmp_path / "b.h5")
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    for key, n in (("m", 3), ("f4", 5)):
        row = row_of(result, key)
        assert (row["status"], row["changed"], row["max_abs"], row["rel_l2"]) == ("changed", n, None, None)


def test_nan_and_inf(tmp_path) -> None:
    a = torch.tensor([1.0, float("nan"), float("inf"), 2.0, 0.0])
    same_specials = a.clone()
    same_specials[3] = 2.5  # nan and inf where a has them: no difference there
    new_nan = a.clone()
    new_nan[0] = float("nan")
    th5.save({"x": a, "y": a, "z": torch.zeros(3)}, tmp_path / "a.h5")
    th5.save({"x": same_specials, "y": new_nan, "z": torch.tensor([0.0, 1.0, 0.0])}, tmp_path / "b.h5")
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    x, y, z = (row_of(result, k) for k in "xyz")
    assert x["changed"] == 1 and x["max_abs"] == 0.5
    assert x["rel_l2"] == pytest.approx(0.5 / math.sqrt(1 + 4))  # ||a|| over a's finite elements
    assert math.isnan(y["max_abs"]) and math.isnan(y["rel_l2"]) and y["changed"] == 1
    assert z["rel_l2"] == math.inf and z["max_abs"] == 1.0  # a is all zeros
    assert th5.diff(tmp_path / "a.h5", tmp_path / "a.h5").equal  # nan is bitwise equal to itself


def test_huge_float64_values_do_not_overflow_the_norm(tmp_path) -> None:
    a = torch.tensor([1e300, -1e300, 3e299], dtype=torch.float64)
    b = a * (1 + 1e-6)
    th5.save({"x": a}, tmp_path / "a.h5")
    th5.save({"x": b}, tmp_path / "b.h5")
    row = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")[0]
    assert row["rel_l2"] == pytest.approx(1e-6, rel=1e-6)


def test_select_applies_to_both_and_an_exact_key_may_be_in_one(tmp_path) -> None:
    th5.save({"model": {"w": torch.ones(2), "old": torch.ones(1)}, "step": 1}, tmp_path / "a.h5")
    th5.save({"model": {"w": torch.ones(2) * 2, "new": torch.ones(1)}, "step": 2}, tmp_path / "b.h5")
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5", select="model/*")
    assert [(r["key"], r["status"]) for r in result] == [("model/w", "changed"), ("model/old", "only_a"),
                                                          ("model/new", "only_b")]
    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5", select=["model/new"])
    assert [(r["key"], r["status"]) for r in result] == [("model/new", "only_b")]
    with pytest.raises(th5.KeyNotFoundError, match="model/nowhere"):
        th5.diff(tmp_path / "a.h5", tmp_path / "b.h5", select=["model/nowhere"])


def test_big_tensors_go_in_blocks_and_give_the_same_numbers(tmp_path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(2)
    a = {"w": torch.randn(300, 200, generator=g), "row": torch.randn(3, 5000, generator=g),
         "scalar": torch.tensor(1.5), "b": torch.randn(7, 3, 2, 300, generator=g).bfloat16()}
    b = {k: v + 0.01 for k, v in a.items()}
    th5.save(a, tmp_path / "a.h5")
    th5.save(b, tmp_path / "b.h5")
    whole = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    whole_stats = th5.stats(tmp_path / "a.h5")
    reads: list = []
    original = compare._read
    monkeypatch.setattr(compare, "_read", lambda h, index, verify: reads.append(index) or original(h, index, verify))
    monkeypatch.setattr(compare, "BLOCK_BYTES", 4000)  # smaller than one row of "row": integers, then slices
    blocked = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    assert any(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], int) for i in reads)
    assert len(reads) > 100
    for r1, r2 in zip(whole, blocked):
        assert r1["changed"] == r2["changed"] and r1["max_abs"] == r2["max_abs"]
        assert r1["rel_l2"] == pytest.approx(r2["rel_l2"], rel=1e-12)
    for r1, r2 in zip(whole_stats, th5.stats(tmp_path / "a.h5")):
        assert r1["min"] == r2["min"] and r1["max"] == r2["max"] and r1["nan"] == r2["nan"]
        assert r1["mean"] == pytest.approx(r2["mean"], rel=1e-9, abs=1e-15)
        assert r1["std"] == pytest.approx(r2["std"], rel=1e-9)


def test_blocks_cover_every_element_once() -> None:
    for shape, itemsize, limit in [((10, 7), 4, 30), ((3, 5, 1000), 2, 300), ((1000,), 8, 64), ((), 4, 1),
                                   ((4, 0, 3), 4, 1), ((2, 3), 4, 1000)]:
        t = torch.arange(math.prod(shape)).reshape(shape)
        seen = torch.cat([t[i].reshape(-1) for i in compare._blocks(shape, itemsize, limit)]) if t.numel() else t.reshape(-1)
        assert torch.equal(seen, t.reshape(-1)), shape
        for i in compare._blocks(shape, itemsize, limit):
            assert i is Ellipsis or math.prod(compare._block_shape(shape, i)) * itemsize <= max(limit, itemsize)


# -- inputs ------------------------------------------------------------------------------------


def test_directories_safetensors_and_open_stores(tmp_path) -> None:
    from safetensors.torch import save_file

    from tensorstore_h5.bench.simulate import save_as_ranks

    g = torch.Generator().manual_seed(3)
    sd = {f"layers.{i}.weight": torch.randn(16, 8, generator=g) for i in range(4)}
    tuned = {k: v + (0.01 if k.startswith("layers.2") else 0.0) for k, v in sd.items()}
    th5.save(sd, tmp_path / "base.h5")
    save_file(tuned, tmp_path / "tuned.safetensors")
    save_as_ranks(tuned, tmp_path / "ranks", ranks=2)  # a DCP directory of two rank files
    hf = tmp_path / "hf"
    hf.mkdir()
    names = list(tuned)
    for i in range(2):
        save_file({k: tuned[k] for k in names[i::2]}, hf / f"model-0000{i + 1}-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, k in enumerate(names)}}))
    expected = {k: "changed" if k.startswith("layers.2") else "equal" for k in sd}
    for other in (tmp_path / "tuned.safetensors", tmp_path / "ranks", hf, str(hf)):
        result = th5.diff(tmp_path / "base.h5", other)
        assert {r["key"]: r["status"] for r in result} == expected, other
        assert row_of(result, "layers.2.weight")["max_abs"] == pytest.approx(0.01, rel=1e-3)
    assert th5.diff(tmp_path / "tuned.safetensors", tmp_path / "ranks").equal
    nested = {"model": {"w.0": torch.ones(3)}, "optim": {"m": torch.zeros(2)}}  # key paths that convert marks
    th5.save(nested, tmp_path / "nested.h5")
    th5.convert(tmp_path / "nested.h5", tmp_path / "nested.safetensors")
    result = th5.diff(tmp_path / "nested.h5", tmp_path / "nested.safetensors", select="model/*")
    assert [(r["key"], r["status"]) for r in result] == [("model/w.0", "equal")]
    with th5.open(tmp_path / "base.h5") as a, th5.open(hf) as b:  # open stores are used, not closed
        assert th5.diff(a, b).counts() == {"equal": 3, "changed": 1}
        assert th5.diff(a, a).equal  # one store on both sides: read by one thread
        assert compare.stats(a)[0]["key"] == "layers.0.weight"  # what Store.stats() calls
        assert [r["mean"] for r in compare.stats(b)] == [r["mean"] for r in th5.stats(tmp_path / "ranks")]  # and ShardedStore's
        assert not a.closed
    with pytest.raises(TypeError, match="not an open store"):
        compare.diff(str(tmp_path / "base.h5"), str(tmp_path / "base.h5"))  # without th5's opener


def test_a_damaged_file_is_an_error_not_a_difference(tmp_path) -> None:
    th5.save({"w": torch.full((1000,), 1.2345)}, tmp_path / "a.h5")
    shutil.copy(tmp_path / "a.h5", tmp_path / "b.h5")
    data = bytearray((tmp_path / "b.h5").read_bytes())
    at = data.find(torch.full((4,), 1.2345).numpy().tobytes())
    data[at + 100] ^= 1
    (tmp_path / "b.h5").write_bytes(bytes(data))
    with pytest.raises(th5.FormatError, match="checksum"):
        th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    assert th5.diff(tmp_path / "a.h5", tmp_path / "b.h5", verify=False)[0]["changed"] == 1
    r = cli("diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert r.returncode == 2 and "checksum" in r.stderr and "Traceback" not in r.stderr


# -- stats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_stats_against_torch_with_nan_and_inf(tmp_path, dtype, small_blocks) -> None:
    g = torch.Generator().manual_seed(4)
    t = (torch.randn(40, 30, generator=g) * 3 + 1).to(dtype)
    t[0, 0], t[5, 5], t[7, 1], t[9, 9] = float("nan"), float("inf"), float("-inf"), float("nan")
    t[11, :4] = 0
    th5.save({"t": t, "plain": 3, "ints": torch.tensor([[3, -7], [0, 12]], dtype=torch.int32)}, tmp_path / "s.h5")
    rows = {r["key"]: r for r in th5.stats(tmp_path / "s.h5")}
    assert list(rows) == ["t", "ints"]  # plain values have no statistics
    row = rows["t"]
    finite = t[torch.isfinite(t)].double()
    not_nan = t[~torch.isnan(t)]
    assert (row["nan"], row["inf"], row["zeros"]) == (2, 2, int((t == 0).sum()))
    assert row["mean"] == pytest.approx(float(finite.mean()), rel=1e-12)
    assert row["std"] == pytest.approx(float(finite.std()), rel=1e-12)  # Bessel-corrected, as torch.std
    assert (row["min"], row["max"]) == (float(not_nan.min()), float(not_nan.max())) == (-math.inf, math.inf)
    assert (row["dtype"], row["shape"], row["numel"]) == (str(dtype)[6:], [40, 30], 1200)
    ints = rows["ints"]
    assert (ints["min"], ints["max"], ints["zeros"], ints["nan"]) == (-7, 12, 1, 0) and type(ints["max"]) is int
    assert ints["mean"] == 2.0 and ints["std"] == pytest.approx(float(torch.tensor([3.0, -7, 0, 12]).std()))


def test_stats_of_other_dtypes(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental in torch
        values = {"b": torch.tensor([True, False, True, True]), "f8": torch.tensor([0.5, -2.0, 0.0]).to(torch.float8_e4m3fn),
                  "u32": torch.tensor([1, 2**32 - 1], dtype=torch.uint32), "c": torch.tensor([1 + 2j, float("nan")]),
                  "f4": torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "one": torch.tensor([2.0]),
                  "empty": torch.zeros(0, 3)}
    th5.save(values, tmp_path / "s.h5")
    rows = {r["key"]: r for r in th5.stats(tmp_path / "s.h5")}
    assert (rows["b"]["mean"], rows["b"]["min"], rows["b"]["max"], rows["b"]["zeros"]) == (0.75, False, True, 1)
    assert (rows["f8"]["min"], rows["f8"]["max"], rows["f8"]["zeros"]) == (-2.0, 0.5, 1)
    assert (rows["u32"]["min"], rows["u32"]["max"]) == (1, 2**32 - 1)
    assert (rows["c"]["mean"], rows["c"]["nan"], rows["c"]["zeros"]) == (None, 1, 0)
    assert rows["f4"]["mean"] is None and rows["f4"]["numel"] == 4 and rows["f4"]["nan"] is None
    assert (rows["one"]["mean"], rows["one"]["std"]) == (2.0, None)
    assert rows["empty"]["mean"] is rows["empty"]["min"] is None and rows["empty"]["zeros"] == 0


# -- memory ------------------------------------------------------------------------------------


_PEAK = """
import json, sys, tensorstore_h5 as th5
from tensorstore_h5.bench.measure import reset_peak, status
th5.diff(sys.argv[1], sys.argv[2])  # imports, thread pools, first reads: not what is measured
th5.stats(sys.argv[1])
rss0 = status("VmRSS")
reset_peak()
result = th5.diff(sys.argv[1], sys.argv[2]) if sys.argv[3] == "diff" else th5.stats(sys.argv[1])
print(json.dumps({"growth": status("VmHWM") - rss0, "rows": len(result)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is reset through /proc (Linux)")
def test_memory_stays_bounded_on_a_large_pair(tmp_path) -> None:
    """Two 400 MB files (one 200 MB tensor, two 100 MB ones): the diff's peak RSS grows by a few
    blocks, a small part of what reading both would hold."""
    g = torch.Generator().manual_seed(5)
    block = torch.randn(1 << 20, generator=g)
    sd = {"big": block.repeat(50).view(-1, 4096), "mid": block.repeat(25).view(-1, 1024),
          "mid2": block.repeat(25).view(-1, 1024).clone()}
    th5.save(sd, tmp_path / "a.h5")
    sd["big"][::7] += 1e-3
    sd["mid2"] = sd["mid2"].bfloat16().float()
    th5.save(sd, tmp_path / "b.h5")
    del sd
    size = os.path.getsize(tmp_path / "a.h5")
    assert size > 400e6
    for what in ("diff", "stats"):
        r = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), what],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["rows"] == 3
        # per store: the block being compared and one read ahead (32 MiB each), plus the chunks' arithmetic
        assert out["growth"] < 0.4 * size, (what, out["growth"] / 2**20)


# -- the command line --------------------------------------------------------------------------


def test_cli_exit_statuses_and_json(tmp_path) -> None:
    th5.save({"w": torch.ones(3), "n": 1}, tmp_path / "a.h5")
    th5.save({"w": torch.ones(3), "n": 1}, tmp_path / "same.h5")
    th5.save({"w": torch.tensor([1.0, 2.0, 1.0]), "n": 1, "extra": torch.zeros(1)}, tmp_path / "b.h5")
    r = cli("diff", str(tmp_path / "a.h5"), str(tmp_path / "same.h5"))
    assert r.returncode == 0 and r.stdout.strip().endswith("2 keys: 2 equal"), r.stdout + r.stderr
    r = cli("diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["key", "status", "max", "|b-a|"]
    assert re.match(r"w\s+changed\s+1\s+0.577\s+1\s+float32 \[3\]", lines[1]) and lines[2].startswith("extra")
    assert "n " not in r.stdout  # equal keys are listed with --all only
    assert "n  " in cli("diff", "--all", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")).stdout
    r = cli("diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json", "--select", "w", "--select", "extra")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["equal"] is False and out["counts"] == {"changed": 1, "only_b": 1}
    assert [(x["key"], x["status"], x["max_abs"]) for x in out["rows"]] == [("w", "changed", 1.0), ("extra", "only_b", None)]
    for args in (("diff", str(tmp_path / "a.h5"), str(tmp_path / "missing.h5")),  # an error: 2, as cmp and diff
                 ("diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--select", "nowhere"),
                 ("diff", str(tmp_path / "a.h5"))):  # a usage error: 2 as well
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
    assert "Exit status: 0" in cli("diff", "--help").stdout


def test_cli_json_holds_nan_and_inf_as_strings(tmp_path) -> None:
    th5.save({"z": torch.zeros(2), "n": torch.tensor([1.0, 2.0])}, tmp_path / "a.h5")
    th5.save({"z": torch.ones(2), "n": torch.tensor([float("nan"), 2.0])}, tmp_path / "b.h5")
    r = cli("diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json")
    rows = {x["key"]: x for x in json.loads(r.stdout)["rows"]}
    assert rows["z"]["rel_l2"] == "inf" and rows["n"]["max_abs"] == "nan"
    r = cli("stats", str(tmp_path / "b.h5"), "--json")
    assert r.returncode == 0, r.stderr
    stats = {x["key"]: x for x in json.loads(r.stdout)["rows"]}
    assert stats["n"]["nan"] == 1 and stats["n"]["mean"] == 2.0 and stats["z"]["std"] == 0.0
    r = cli("stats", str(tmp_path / "b.h5"), "--select", "n")
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[:4] == ["n", "float32", "[2]", "2"]
    assert cli("stats", str(tmp_path / "missing.h5")).returncode == 1  # other commands: 1 on an error


# -- the Jupyter views -------------------------------------------------------------------------


def test_html_views_hold_the_rows_and_a_figure(tmp_path) -> None:
    from tensorstore_h5.bench.synthetic import transformer_state_dict

    sd = transformer_state_dict(3, 16)
    th5.save({"model": sd, "step": 1}, tmp_path / "a.h5")
    moved = {k: v + 0.01 if k.startswith("layers.1.") and v.is_floating_point() else v for k, v in sd.items()}
    moved["layers.2.norm1.weight"] = moved["layers.2.norm1.weight"].clone()
    moved["layers.2.norm1.weight"][0] = float("nan")
    th5.save({"model": moved, "step": 2}, tmp_path / "b.h5")
    from test_display import outline  # the store view's reader: what a person clicking through it can reach

    result = th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")
    html = result._repr_html_()
    assert html.count("<svg") >= len(result) + 1 and "<table" in html  # the figure, and a bar per row
    title, root = outline(html)
    assert title == repr(result)
    heading, *rows = root.all_rows()  # the heading row, then the rows of each level (not in key order)
    assert heading[1][:6] == ["key", "status", "a → b", "max |b−a|", "rel L2", "changed"]
    shown = dict(rows)
    assert sorted(shown) == sorted(r["key"] for r in result)
    for r in result:
        assert shown[r["key"]][1] == r["status"] and shown[r["key"]][4] == compare._fmt(r["rel_l2"])
    layers = root.group("model/").group("layers.")
    assert [(g.name, g.open) for g in layers.groups] == [("0.", False), ("1.", True), ("2.", True)]  # what moved opens
    assert layers.group("1.").summary == "1. (8 keys: 1 equal, 7 changed; rel. change up to inf)"
    assert "layers.N" in html and "#e45756" in html  # bands of the numbered layers; nan and inf in red
    stats = th5.stats(tmp_path / "b.h5")
    title, root = outline(stats._repr_html_())
    assert title == repr(stats) and "<svg" in stats._repr_html_()
    assert sorted(path for path, _ in root.all_rows()[1:]) == sorted(r["key"] for r in stats)
    assert "Diff" in repr(result) and "changed" in str(result)


def test_the_library_does_not_import_matplotlib(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import sys, torch, tensorstore_h5 as th5
        th5.save({{"w": torch.ones(3)}}, {str(tmp_path / 'a.h5')!r})
        d = th5.diff({str(tmp_path / 'a.h5')!r}, {str(tmp_path / 'a.h5')!r})
        d._repr_html_(); th5.stats({str(tmp_path / 'a.h5')!r})._repr_html_()
        print("matplotlib" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "False", r.stderr


_PROBE = """<script>
window.addEventListener('load', () => {
  const rows = [...document.querySelectorAll('.th5 table.t:not(.hd) tr')].filter((tr) => tr.offsetParent);
  const out = rows.map((tr) => [...tr.cells].slice(1).map((td) => Math.round(td.getBoundingClientRect().left)));
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="needs Chromium")
def test_columns_line_up_across_nesting_levels_in_a_browser(tmp_path) -> None:
    """#33 item 9: dtype, shape and size (and a diff's figures) start at the same x at every depth."""
    import html as html_module

    from tensorstore_h5.bench.synthetic import checkpoint

    ckpt = checkpoint(layers=2, width=32)
    th5.save(ckpt, tmp_path / "a.h5")
    ckpt["model"]["layers.1.mlp.up.weight"] += 1
    th5.save(ckpt, tmp_path / "b.h5")
    with th5.open(tmp_path / "a.h5") as store:
        views = {"store": store._repr_html_(), "diff": th5.diff(tmp_path / "a.h5", tmp_path / "b.h5")._repr_html_()}
    exe = next(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b))
    for name, view in views.items():
        page = tmp_path / f"{name}.html"
        page.write_text(f"<!doctype html><meta charset='utf-8'><body>{view}{_PROBE}</body>", encoding="utf-8")
        dom = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'p'}",
                              "--dump-dom", "--virtual-time-budget=2000", page.as_uri()],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        lefts = json.loads(html_module.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))
        assert len(lefts) > 10, name
        for column in range(len(lefts[0])):
            assert len({row[column] for row in lefts}) == 1, (name, column, sorted({row[column] for row in lefts}))
