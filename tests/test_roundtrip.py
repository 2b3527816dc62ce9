"""Property tests: random nested structures, dtypes, shapes and layouts round-trip exactly."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import tensorstore_h5 as th5

from helpers import ALL_DTYPES, assert_same, random_tensor

SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(SHAPES)
    base = random_tensor(tuple(n * 2 for n in shape) or (), dtype, seed=draw(st.integers(0, 2**16)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "step", "expand"]))
    if layout == "transposed" and base.dim() >= 2:
        return base.transpose(0, -1)
    if layout == "step" and base.dim() >= 1:
        return base[tuple(slice(None, None, 2) for _ in range(base.dim()))]
    if layout == "expand" and base.dim() >= 1:
        return base[:1].expand(3, *base.shape[1:]) if base.shape[0] else base
    return base


LEAVES = (
    tensors() | st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.complex_numbers() | st.sampled_from([torch.float32, torch.bfloat16, torch.Size([2, 3])])
    | st.builds(lambda n: np.arange(n, dtype=np.float32), st.integers(0, 5)) | st.sampled_from([np.int16(-3), np.float64(2.5)])
)
TREES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    | st.dictionaries(st.integers(-3, 3), inner, max_size=3).map(OrderedDict),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=6), TREES, max_size=4))
def test_random_trees_round_trip(tmp_path_factory, obj: dict) -> None:
    path = tmp_path_factory.mktemp("rt") / "f.h5"
    th5.save(obj, path)
    assert_same(th5.load(path), obj)
    with th5.open(path) as store:
        for key, value in store.items():
            assert key in store
            ref = obj
            for part in key.split("/"):
                ref = ref[_child_key(ref, part)]
            assert_same(value, ref)


def _child_key(container: object, name: str) -> object:
    if isinstance(container, (list, tuple)):
        return int(name)
    for k in container:  # type: ignore[union-attr]
        if (th5.escape(k) if isinstance(k, str) else str(k)) == name:
            return k
    raise KeyError(name)


@given(TREES)
def test_any_root_object_round_trips(tmp_path_factory, obj: object) -> None:
    path = tmp_path_factory.mktemp("root") / "f.h5"
    th5.save(obj, path)
    assert_same(th5.load(path), obj)
