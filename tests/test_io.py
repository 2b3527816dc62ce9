"""The fast paths return exactly the bytes of HDF5's own read."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import io
from tensorstore_h5.dtypes import REGISTRY

from helpers import ALL_DTYPES, assert_same_tensor, random_tensor


@pytest.fixture()
def small_pieces(monkeypatch):
    """Odd piece size: many pieces per tensor, and a partial last piece."""
    monkeypatch.setattr(io, "PIECE_BYTES", 1000)
    monkeypatch.setattr(io, "IO_THREADS", 2)


def _hdf5_read(path, key: str, dtype: torch.dtype, index=()) -> torch.Tensor:
    with h5py.File(path) as f:
        ds = f[key]
        from tensorstore_h5.slicing import select

        sel = select(index, ds.shape)
        out = torch.empty(sel.shape, dtype=dtype)
        io.read_hdf5(ds.id, REGISTRY[dtype].h5_type, out, sel)
        return out


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_fast_full_read_matches_hdf5(tmp_path, small_pieces, dtype) -> None:
    tensors = {f"t{i}": random_tensor(shape, dtype, seed=i) for i, shape in enumerate([(0,), (), (1,), (37, 11), (5000,)])}
    th5.save(tensors, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        assert s._offsets == {}
        loaded = s.load()
        for k, t in tensors.items():
            assert_same_tensor(loaded[k], t)
            assert_same_tensor(loaded[k], _hdf5_read(tmp_path / "f.h5", k, dtype))
        assert all(s._offsets[k] is not None for k in tensors if tensors[k].numel())  # the fast path was taken


def test_fast_row_slices_at_odd_offsets(tmp_path, small_pieces) -> None:
    t = random_tensor((101, 7, 3), torch.float16, seed=3)
    th5.save({"t": t}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        h = s["t"]
        for index in [slice(0, 1), slice(13, 77), slice(100, 101), (5,), (5, 2), (5, slice(1, 4)), (slice(3, 9), 1),
                      slice(50, 50), (slice(None), slice(None), 1)]:
            got = h[index]
            assert torch.equal(got.view(torch.int16), t[index].contiguous().view(torch.int16)), index
            assert torch.equal(got.view(torch.int16), _hdf5_read(tmp_path / "f.h5", "t", torch.float16, index).view(torch.int16))


def test_batched_load_into_targets(tmp_path, small_pieces) -> None:
    src = {f"w{i}": torch.randn(i * 13 + 1, 5) for i in range(12)}
    th5.save(src, tmp_path / "f.h5")
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    th5.load_into(dst, tmp_path / "f.h5")
    assert all(torch.equal(dst[k], src[k]) and dst[k].data_ptr() == ptrs[k] for k in src)


def test_truncated_data_is_refused_before_any_target_changes(tmp_path) -> None:
    src = {"a": torch.ones(1000), "b": torch.ones(300, 1000)}
    path = tmp_path / "f.h5"
    th5.save(src, path)
    with h5py.File(path) as f:
        end_b = f["b"].id.get_offset() + 300 * 1000 * 4
    data = path.read_bytes()
    path.write_bytes(data[: end_b - 10] + data[end_b:])  # drop 10 bytes inside b's data
    dst = {"a": torch.zeros(1000), "b": torch.zeros(300, 1000)}
    with pytest.raises(th5.FormatError, match="f.h5.*"):
        th5.load_into(dst, path)
    assert dst["a"].eq(0).all() and dst["b"].eq(0).all()


def test_mmap_tensors_are_file_backed_and_copy_on_write(tmp_path) -> None:
    src = {"w": torch.randn(64, 32), "t": torch.randn(8, 4).t(), "n": torch.tensor(3), "e": torch.empty(0, 3)}
    path = tmp_path / "f.h5"
    th5.save(src, path)
    before = path.read_bytes()
    out = th5.load(path, mmap=True)
    for k in src:
        assert_same_tensor(out[k], src[k])
    with th5.open(path) as s:
        m = s["w"].read(mmap=True)
        assert torch.equal(m, src["w"])
        m.add_(1)  # private pages: the file is not touched
        with pytest.raises(ValueError, match="mmap"):
            s["w"].read(mmap=True, index=0)
        streamed = dict(s.items(mmap=True))
    assert torch.equal(streamed["w"], src["w"])
    out["w"].mul_(0)
    assert path.read_bytes() == before
    assert torch.equal(th5.load(path)["w"], src["w"])


def test_empty_gives_a_usable_tensor_of_any_size() -> None:
    for shape in [(0,), (3,), (io.HUGEPAGE_MIN_BYTES // 4 + 7,)]:
        t = io.empty(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
        t.fill_(1.5)
        assert t.sum().item() == 1.5 * shape[0]


def test_raw_offset_only_for_contiguous_unfiltered(tmp_path) -> None:
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("c", data=np.arange(10, dtype="<f4"))
        f.create_dataset("k", data=np.arange(10, dtype="<f4"), chunks=(5,))
        f.create_dataset("b", data=np.arange(10, dtype=">f4"))
        f.create_dataset("z", shape=(10,), dtype="<f4")  # never written: no storage
        ft = REGISTRY[torch.float32].h5_type
        assert io.raw_offset(f["c"].id, ft) is not None
        assert io.raw_offset(f["k"].id, ft) is None and io.raw_offset(f["b"].id, ft) is None
        assert io.raw_offset(f["z"].id, ft) is None
