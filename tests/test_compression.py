from __future__ import annotations

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.codecs.presets import chunk_shape

from helpers import ALL_DTYPES, assert_same_tensor, random_tensor

PRESETS = sorted(th5.PRESETS)


def _smooth(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Compressible data: a smooth ramp (for any dtype via its bits)."""
    n = int(np.prod(shape))
    base = (torch.arange(n) % 97).to(torch.uint8)
    return base.repeat_interleave(dtype.itemsize)[: n * dtype.itemsize].view(dtype).reshape(shape) if dtype.itemsize > 1 \
        else base.view(dtype).reshape(shape)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_preset_and_dtype_round_trips_bitwise(tmp_path, preset, dtype) -> None:
    t = random_tensor((40, 300), dtype, seed=1)
    s = _smooth((64, 512), dtype)
    th5.save({"random": t, "smooth": s, "strided": s.t()}, tmp_path / "c.h5", compression=preset)
    out = th5.load(tmp_path / "c.h5")
    assert_same_tensor(out["random"], t)
    assert_same_tensor(out["smooth"], s)
    assert_same_tensor(out["strided"], s.t())
    with th5.open(tmp_path / "c.h5") as store:
        info = store["smooth"].compression
        assert info is not None and info["chunks"][1:] == [512]


@pytest.mark.parametrize("preset", PRESETS)
def test_chunk_boundary_slices(tmp_path, preset) -> None:
    t = torch.randn(1000, 37)
    th5.save({"t": t}, tmp_path / "c.h5", compression=preset, chunk_bytes=37 * 4 * 64)  # 64-row chunks
    with th5.open(tmp_path / "c.h5") as s:
        h = s["t"]
        assert h.compression["chunks"] == [64, 37]
        for index in [slice(0, 64), slice(63, 65), slice(64, 128), slice(999, 1000), slice(10, 900, 7), (500, slice(3, 9)),
                      (slice(None), 5)]:
            assert torch.equal(h[index], t[index]), index
        out = torch.empty(1000, 37)
        assert torch.equal(h.read(out=out), t)


def test_compressed_file_reads_with_plain_h5py_and_hdf5plugin(tmp_path) -> None:
    t = _smooth((256, 256), torch.float32)
    th5.save({"w": t}, tmp_path / "c.h5", compression="zstd")
    assert hdf5plugin  # registered: plain h5py can decode
    with h5py.File(tmp_path / "c.h5") as f:
        np.testing.assert_array_equal(f["w"][()], t.numpy())
        _filter_mask, raw = f["w"].id.read_direct_chunk((0, 0))
        assert len(raw) < 0.5 * f["w"].chunks[0] * 256 * 4  # really compressed


def test_per_key_choice_and_tiny_tensors(tmp_path) -> None:
    sd = {"big.weight": _smooth((512, 64), torch.float32), "big.idx": torch.arange(8192), "small": torch.ones(100)}
    seen = []

    def policy(key: str, t: torch.Tensor):
        seen.append(key)
        return None if not t.is_floating_point() else "lz4"

    th5.save(sd, tmp_path / "c.h5", compression=policy)
    with th5.open(tmp_path / "c.h5") as s:
        assert s["big.weight"].compression["filters"][0]["name"] == "bitshuffle"
        assert s["big.idx"].compression is None and s["small"].compression is None
        info = s.info()
        assert info["tensors"]["big.weight"]["ratio"] < 0.5 and info["tensors"]["big.idx"]["ratio"] == 1.0
    assert "big.weight" in seen and "big.idx" in seen
    assert all(torch.equal(v, th5.load(tmp_path / "c.h5")[k]) for k, v in sd.items())


def test_filter_object_and_unknown_preset(tmp_path) -> None:
    t = _smooth((128, 128), torch.float32)
    th5.save({"w": t}, tmp_path / "c.h5", compression=hdf5plugin.Bitshuffle(cname="zstd", clevel=1))
    with th5.open(tmp_path / "c.h5") as s:
        assert s["w"].compression["filters"][0]["id"] == hdf5plugin.BSHUF_ID
    for refused in (hdf5plugin.Zstd(clevel=1), hdf5plugin.LZ4(), hdf5plugin.Bitshuffle(cname="none")):
        with pytest.raises(ValueError, match="hdf5plugin.Bitshuffle|cname='lz4'"):
            th5.save({"w": t}, tmp_path / "x.h5", compression=refused)
    with pytest.raises(ValueError, match="unknown compression preset 'lzma'.*'best', 'gzip', 'lz4', 'zstd'"):
        th5.save({"w": t}, tmp_path / "x.h5", compression="lzma")
    with pytest.raises(TypeError, match="compression must be"):
        th5.save({"w": t}, tmp_path / "x.h5", compression=3)
    assert not (tmp_path / "x.h5").exists()


def test_compressed_datasets_are_not_mapped(tmp_path) -> None:
    t = _smooth((128, 128), torch.float32)
    th5.save({"w": t}, tmp_path / "c.h5", compression="lz4")
    out = th5.load(tmp_path / "c.h5", mmap=True)
    assert torch.equal(out["w"], t)


@pytest.mark.parametrize("shape, itemsize, budget, expected", [
    ((1000, 256), 4, 2**20, (1000, 256)),
    ((4096, 1024), 4, 2**20, (256, 1024)),
    ((10, 1 << 20), 4, 2**20, (1, 262144)),
    ((3, 4, 5), 2, 40, (1, 4, 5)),
])
def test_chunk_shape(shape, itemsize, budget, expected) -> None:
    assert chunk_shape(shape, itemsize, budget) == expected
