"""Index expressions -> hyperslab selections."""

from __future__ import annotations

import pytest

from tensorstore_h5.format.slicing import rows, select, whole


@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (4, 5, 6)])
def test_whole_is_the_selection_of_every_full_index(shape: tuple[int, ...]) -> None:
    general = select((slice(None),) * len(shape), shape)
    assert whole(shape) == general == select((), shape) == select(..., shape)
    assert whole(shape).full and whole(shape).contiguous_rows


def test_row_ranges_and_integers() -> None:
    s = select((1, slice(2, 4)), (3, 5, 6))
    assert (s.start, s.count, s.step, s.shape) == ((1, 2, 0), (1, 2, 6), (1, 1, 1), (2, 6))
    assert s.contiguous_rows and not s.full
    assert not select((slice(None), 1), (3, 5)).contiguous_rows
    assert rows((10, 4), 3, 7) == select(slice(3, 7), (10, 4))
    with pytest.raises(IndexError, match="out of range"):
        select(5, (5,))
    with pytest.raises(IndexError, match="negative or zero step"):
        select(slice(None, None, -1), (5,))


def test_a_lone_slice_selects_what_the_general_walk_selects() -> None:
    """``h[a:b:c]`` takes a shortcut past the general walk of index tuples; both agree, and
    agree with what torch selects, for bounds in and out of range, empty ranges and steps."""
    import torch

    bounds = [None, -12, -5, -1, 0, 1, 3, 7, 12]
    for shape in [(7,), (7, 3), (0, 2), (7, 0, 2)]:
        base = torch.empty(shape)
        for a in bounds:
            for b in bounds:
                for step in (None, 1, 2, 5):
                    sl = slice(a, b, step)
                    fast, general = select(sl, shape), select((sl,), shape)
                    assert fast == general, (shape, sl)
                    assert fast.shape == tuple(base[sl].shape), (shape, sl)
                    if fast.count[0] and base.stride(0):  # the first selected row is where torch's view starts
                        assert fast.start[0] * base.stride(0) == base[sl].storage_offset(), (shape, sl)
                    elif not fast.count[0]:
                        assert fast.start[0] == 0, (shape, sl)
    with pytest.raises(IndexError, match="too many indices"):
        select(slice(1, 2), ())
    with pytest.raises(IndexError, match="negative or zero step"):
        select(slice(3, 1, -1), (5, 2))
