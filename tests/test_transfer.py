"""The staging pipeline, run against CPU targets (and CUDA ones where present)."""

from __future__ import annotations

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import store as store_mod
from tensorstore_h5.transfer import Stager

from helpers import random_tensor


@pytest.mark.parametrize("nbytes", [1, 999, 1000, 1001, 4567])
def test_blocks_cover_the_tensor_in_order_and_reuse_two_buffers(nbytes) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    stager = Stager("cpu", buffers=2, buffer_bytes=1000)
    seen = []

    def fill(offset: int, buf: torch.Tensor) -> None:
        seen.append((offset, buf.numel(), buf.data_ptr()))
        buf.copy_(src[offset:offset + buf.numel()])

    stager.copy(dest, fill)
    assert torch.equal(dest, src)
    assert [(o, n) for o, n, _ in seen] == stager.iter_blocks(nbytes)
    ptrs = [p for _, _, p in seen]
    assert len(set(ptrs)) == min(2, len(ptrs)) and all(ptrs[i] == ptrs[i % 2] for i in range(len(ptrs)))
    assert sum(stager.uses) == len(seen)


@pytest.fixture()
def staged_cpu(monkeypatch):
    """Send CPU targets through the staging path, as device targets go."""
    monkeypatch.setattr(store_mod, "_staged", lambda t: True)
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", 1000)


def test_store_reads_through_staging_buffers(tmp_path, staged_cpu) -> None:
    t = random_tensor((300, 7), torch.bfloat16, seed=2)
    th5.save({"t": t, "small": torch.arange(5)}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        out = torch.empty(300, 7, dtype=torch.bfloat16)
        s["t"].read(out=out)
        assert torch.equal(out.view(torch.int16), t.view(torch.int16))
        part = torch.empty(50, 7, dtype=torch.bfloat16)
        s["t"].read(out=part, index=slice(123, 173))
        assert torch.equal(part.view(torch.int16), t[123:173].view(torch.int16))
        small = torch.empty(5, dtype=torch.int64)
        assert s["small"].read(out=small).tolist() == [0, 1, 2, 3, 4]  # packed tensors stage too
        stager = s._stagers[torch.device("cpu")]
        assert stager.block_bytes == 1000 and sum(stager.uses) == 5 + 1 + 1  # 4200 B in 5 blocks, 700 B, 40 B
        with pytest.raises(th5.MismatchError):
            s["t"].read(out=torch.empty(300, 7))  # wrong dtype: refused before any copy


@pytest.mark.cuda
def test_cuda_targets(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    sd = {"w": torch.randn(1000, 300), "b": torch.randn(300), "t": torch.randn(30, 40).t()}
    th5.save(sd, tmp_path / "g.h5")
    out = th5.load(tmp_path / "g.h5", device="cuda")
    assert all(out[k].is_cuda and torch.equal(out[k].cpu(), sd[k]) for k in sd)
    target = {k: torch.empty_like(v, device="cuda") for k, v in sd.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    th5.load_into(target, tmp_path / "g.h5")
    assert all(torch.equal(target[k].cpu(), sd[k]) and target[k].data_ptr() == ptrs[k] for k in sd)
