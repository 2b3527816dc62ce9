"""Shared test helpers: random tensors of any dtype and bitwise comparison."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tensorstore_h5.format.dtypes import REGISTRY, bits_view
from tensorstore_h5.format.slicing import has_gaps
from tensorstore_h5.storage.memory import tensor_bytes

ALL_DTYPES = sorted(REGISTRY, key=str)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of random bits (NaN payloads, denormals and all)."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(tensor_bytes(bits_view(t.detach().cpu()).contiguous()))


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, layout: bool = True) -> None:
    assert isinstance(b, torch.Tensor), type(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if layout:  # views with gaps (steps) come back contiguous: no memory that no value fills
        gaps = any(has_gaps(tuple(x.shape), tuple(x.stride())) and y.is_contiguous() for x, y in ((a, b), (b, a)))
        assert a.stride() == b.stride() or a.is_contiguous() and b.is_contiguous() or gaps, (a.stride(), b.stride())
    assert torch.equal(bits(a), bits(b))


def assert_same(a: Any, b: Any) -> None:
    """Deep equality with bitwise tensors, exact types and NaN-aware floats."""
    assert type(a) is type(b) or isinstance(a, torch.Tensor), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, complex):
        assert repr(a) == repr(b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    else:
        assert a == b and repr(a) == repr(b)
