from __future__ import annotations

import os

import h5py
import pytest
import torch

import tensorstore_h5 as th5

from helpers import assert_same


def _files(d) -> list[str]:
    return sorted(os.listdir(d))


def test_failed_save_leaves_earlier_file_intact(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    th5.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(th5.UnsupportedTypeError, match="ckpt.h5: .*builtins.object.*'b/c'"):
        th5.save({"a": torch.zeros(3), "b": {"c": object()}}, path)
    assert path.read_bytes() == before and _files(tmp_path) == ["ckpt.h5"]


def test_exception_inside_writer_discards_partial_file(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    th5.save({"old": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="boom"):
        with th5.Writer(path) as w:
            w["new"] = torch.zeros(1000)
            assert len(_files(tmp_path)) == 2  # the partial file sits beside the target
            raise RuntimeError("boom")
    assert _files(tmp_path) == ["ckpt.h5"]
    assert list(th5.load(path)) == ["old"]


def test_bad_value_in_writer_writes_nothing_of_it(tmp_path) -> None:
    path = tmp_path / "w.h5"
    with th5.Writer(path) as w:
        w["a"] = torch.ones(2)
        with pytest.raises(th5.UnsupportedTypeError, match="'b/x'"):
            w["b"] = {"t": torch.ones(2), "x": {1, 2}}
        w["c"] = 3
    with th5.open(path) as s:
        assert s.keys() == ["a", "c"]


def test_writer_streams_nested_keys_and_values(tmp_path) -> None:
    path = tmp_path / "w.h5"
    t = torch.randn(4, 4)
    with th5.Writer(path, metadata={"step": 10}) as w:
        w["model/enc.weight"] = t
        w["model/enc.bias"] = torch.zeros(4)
        w["optim"] = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
        w["epoch"] = 3
        w["tied"] = t
    out = th5.load(path)
    assert list(out) == ["model", "optim", "epoch", "tied"]
    assert out["tied"] is out["model"]["enc.weight"]
    assert_same(out["optim"]["param_groups"], [{"lr": 0.1, "betas": (0.9, 0.99)}])
    with th5.open(path) as s:
        assert s.metadata == {"step": 10}


def test_writer_rejects_repeated_and_malformed_keys(tmp_path) -> None:
    with th5.Writer(tmp_path / "w.h5") as w:
        w["a"] = 1
        with pytest.raises(ValueError, match="already written"):
            w["a"] = 2
        with pytest.raises(ValueError, match="invalid key path"):
            w["bad%zz"] = 1
        with pytest.raises(ValueError, match="not a dict"):
            w["a/b"] = 1
        with pytest.raises(ValueError, match="must not be empty"):
            w[""] = 1


def test_closed_writer_refuses_writes(tmp_path) -> None:
    w = th5.Writer(tmp_path / "w.h5")
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w["a"] = 1


def test_abandoned_writer_removes_its_partial_file(tmp_path) -> None:
    w = th5.Writer(tmp_path / "w.h5")
    w["a"] = torch.ones(3)
    del w
    import gc

    gc.collect()
    assert _files(tmp_path) == []


def test_shared_storage_is_written_once_as_a_hard_link(tmp_path) -> None:
    emb = torch.randn(100, 8)
    sd = {"embed": emb, "head": emb, "view": emb[10:20], "other": emb.clone()}
    path = tmp_path / "tied.h5"
    th5.save(sd, path)
    with h5py.File(path) as f:
        assert f["embed"].id == f["head"].id  # the same object
        assert f["embed"].id != f["view"].id
    out = th5.load(path)
    assert out["embed"].data_ptr() == out["head"].data_ptr()
    assert out["view"].data_ptr() != out["embed"].data_ptr()  # partial overlaps are separate data
    assert torch.equal(out["view"], emb[10:20])
    only_head = th5.load(path, select="head")
    assert torch.equal(only_head["head"], emb)


def test_non_contiguous_and_device_tensors_are_written_in_blocks(tmp_path, device, monkeypatch) -> None:
    from tensorstore_h5 import io

    calls = []
    real = io.write_hdf5
    monkeypatch.setattr(io, "write_hdf5", lambda *a, **k: (calls.append(a[2].shape), real(*a, **k))[1])
    t = torch.randn(64, 33, device=device).t()  # 33 x 64, non-contiguous
    monkeypatch.setattr(io, "BLOCK_BYTES", 10 * 64 * 4)
    th5.save({"t": t}, tmp_path / "b.h5")
    # 33 rows of 256 bytes in blocks of 10 rows: 4 writes, the last one partial
    assert calls == [torch.Size([10, 64])] * 3 + [torch.Size([3, 64])]
    out = th5.load(tmp_path / "b.h5")["t"]
    assert torch.equal(out, t.cpu()) and out.stride() == t.stride()


def test_parameters_keep_requires_grad(tmp_path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    th5.save({"p": p, "q": q, "t": torch.ones(1)}, tmp_path / "p.h5")
    out = th5.load(tmp_path / "p.h5")
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert isinstance(out["q"], torch.nn.Parameter) and not out["q"].requires_grad
    assert type(out["t"]) is torch.Tensor
