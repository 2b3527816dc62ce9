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
