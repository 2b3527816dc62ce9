"""Index expressions (``h[3]``, ``h[10:20]``, ``h[:, 3:7]``, ``h[..., ::2]``) -> HDF5 hyperslabs,
and the arithmetic of strides (row-major strides, storage spans, gaps).

Every read path turns its index into a :class:`Selection` here, once.
(Key selection, ``select=``, lives in ``reading/select.py``.)
"""

from __future__ import annotations

import operator
from typing import Any

from .record import record

__all__ = ["Selection", "select", "whole", "rows", "contiguous_stride", "stride_span", "has_gaps"]


@record
class Selection:
    """A regular hyperslab of a dataset of shape ``source`` and the shape of the result.

    ``start``, ``count`` and ``step`` have one value per dataset dimension (elements);
    ``shape`` drops the dimensions that were indexed by an integer.
    """

    source: tuple[int, ...]
    start: tuple[int, ...]
    count: tuple[int, ...]
    step: tuple[int, ...]
    shape: tuple[int, ...]

    def __init__(self, source: tuple[int, ...], start: tuple[int, ...], count: tuple[int, ...],
                 step: tuple[int, ...], shape: tuple[int, ...]) -> None:
        # One update, not the record's generic keyword handling: a selection is made per read.
        self.__dict__.update(source=source, start=start, count=count, step=step, shape=shape)

    @property
    def full(self) -> bool:
        """True when the selection is the whole dataset in order."""
        return self.count == self.source and all(s == 1 for s in self.step)

    @property
    def empty(self) -> bool:
        return 0 in self.count

    @property
    def contiguous_rows(self) -> bool:
        """True when the selected elements form one contiguous byte range of a row-major dataset."""
        if self.empty:
            return True
        dims = len(self.source)
        # Leading dims may be single elements, one dim may be a unit-step range, the rest must be full.
        i = 0
        while i < dims and self.count[i] == 1:
            i += 1
        if i == dims:
            return True
        if self.step[i] != 1:
            return False
        return all(self.count[j] == self.source[j] and self.step[j] == 1 for j in range(i + 1, dims))


def select(index: Any, shape: tuple[int, ...]) -> Selection:
    """The selection of ``index`` on a dataset of ``shape``.

    Supports integers (negative counts from the end), slices with a positive step, one
    Ellipsis, and empty index lists (``[]``: none of that dimension). Raises IndexError for
    anything else (lists of indices among them) or out-of-range integers.
    """
    if index is Ellipsis or (type(index) is tuple and not index):
        return whole(shape)
    if type(index) is slice and shape:  # h[a:b], the commonest index, without the general walk below
        shape = tuple(shape)
        a, c, s = _slice_range(index, shape[0])
        rest, more = shape[1:], len(shape) - 1
        return Selection(shape, (a,) + (0,) * more, (c, *rest), (s,) + (1,) * more, (c, *rest))
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_real = sum(1 for it in items if it is not Ellipsis)
    if n_real > len(shape):
        raise IndexError(f"too many indices: {n_real} for a tensor of {len(shape)} dimensions")
    expanded: list[Any] = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - n_real))
        else:
            expanded.append(it)
    expanded.extend([slice(None)] * (len(shape) - len(expanded)))
    start, count, step, out = [], [], [], []
    for dim, (it, n) in enumerate(zip(expanded, shape)):
        if isinstance(it, slice):
            a, c, s = _slice_range(it, n)
            start.append(a)
            count.append(c)
            step.append(s)
            out.append(c)
        elif _empty_indices(it):  # h[[]]: no index of this dimension, as torch and numpy read it
            start.append(0)
            count.append(0)
            step.append(1)
            out.append(0)
        else:
            try:
                i = operator.index(it)
            except TypeError:
                raise IndexError(
                    f"unsupported index {it!r} of type {type(it).__name__}: use integers, slices and '...'"
                ) from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for dimension {dim} of size {n}")
            start.append(i % n)
            count.append(1)
            step.append(1)
    return Selection(tuple(shape), tuple(start), tuple(count), tuple(step), tuple(out))


def _slice_range(it: slice, n: int) -> tuple[int, int, int]:
    """``(start, count, step)`` of slice ``it`` on a dimension of ``n`` elements (start 0 when
    it selects none). Raises IndexError for a negative or zero step."""
    a, b, s = it.indices(n)
    if s <= 0:
        raise IndexError("slices with a negative or zero step are not supported; flip the result instead")
    c = max(0, (b - a + s - 1) // s)
    return (a if c else 0), c, s


def _empty_indices(it: Any) -> bool:
    """True for an empty list of indices: ``[]``, or an empty 1-d integer or bool numpy array
    or tensor (duck-typed: no import of either here)."""
    if type(it) is list:
        return not it
    shape = getattr(it, "shape", None)
    dtype = str(getattr(it, "dtype", ""))
    return shape is not None and tuple(shape) == (0,) and ("int" in dtype or "bool" in dtype)


def whole(shape: tuple[int, ...]) -> Selection:
    """The selection of all of a dataset of ``shape``."""
    shape = tuple(shape)
    return Selection(shape, (0,) * len(shape), shape, (1,) * len(shape), shape)


def rows(shape: tuple[int, ...], first: int, stop: int) -> Selection:
    """The selection of rows ``first:stop`` of dimension 0 (all of the other dimensions)."""
    return select(slice(first, stop), shape)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major (C) stride of ``shape``, in elements."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def stride_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage that a tensor of ``shape`` and ``stride`` spans (0 when empty)."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def has_gaps(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when the layout leaves storage elements that no logical element uses (a view
    sliced with a step): then the span exceeds what a dense or expanded layout needs."""
    if 0 in shape:
        return False
    covered = 1  # storage elements [0, covered) are all used by the dimensions taken so far
    for s, n in sorted((s, n) for n, s in zip(shape, stride) if n != 1 and s != 0):
        if s > covered:
            return True
        covered += (n - 1) * s
    return False
