"""Byte movement between HDF5 datasets and tensor memory.

Reads land straight in the caller's (or a freshly allocated) tensor: no intermediate numpy
array, no second copy. Writes go straight from the tensor's memory; non-contiguous or
non-CPU tensors are written in row blocks of at most ``BLOCK_BYTES`` extra memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import h5py
import numpy as np
import torch

from .dtypes import bits_view
from .slicing import Selection, rows

__all__ = ["BLOCK_BYTES", "tensor_bytes", "read_hdf5", "write_hdf5", "write_tensor", "row_blocks", "restore_layout"]

BLOCK_BYTES = 64 * 2**20
"""Largest extra buffer (bytes) a write of a non-contiguous or device tensor holds at once."""


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of the bytes of a contiguous CPU tensor (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1:  # a contiguous single element may still carry any stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


def _spaces(sel: Selection | None, dsid: h5py.h5d.DatasetID) -> tuple[h5py.h5s.SpaceID, h5py.h5s.SpaceID]:
    if sel is None or sel.full:
        return h5py.h5s.ALL, h5py.h5s.ALL
    fspace = dsid.get_space()
    fspace.select_hyperslab(sel.start, sel.count, sel.step)
    return h5py.h5s.create_simple(sel.count), fspace


def read_hdf5(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, out: torch.Tensor, sel: Selection | None = None) -> None:
    """Read the selection (all of it by default) into ``out``, a contiguous CPU tensor with the
    selection's number of elements. ``mtype`` is the memory type: the file's own type makes
    HDF5 copy raw bytes, another type makes it convert."""
    if out.numel() == 0:
        return
    mspace, fspace = _spaces(sel, dsid)
    dsid.read(mspace, fspace, tensor_bytes(out), mtype=mtype)


def write_hdf5(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, src: torch.Tensor, sel: Selection | None = None) -> None:
    """Write ``src`` (contiguous, CPU) into the selection (all of the dataset by default)."""
    if src.numel() == 0:
        return
    mspace, fspace = _spaces(sel, dsid)
    dsid.write(mspace, fspace, tensor_bytes(src), mtype=mtype)


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` row ranges of dimension 0 holding at most ``block_bytes`` each
    (at least one row)."""
    if not shape:
        yield 0, 1
        return
    row = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, block_bytes // row)
    for first in range(0, shape[0], step):
        yield first, min(shape[0], first + step)


def write_tensor(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, t: torch.Tensor, block_bytes: int | None = None) -> None:
    """Write the logical (row-major) values of any strided tensor ``t`` to the whole dataset.

    A contiguous CPU tensor is written from its own memory; otherwise row blocks of at most
    ``block_bytes`` (default :data:`BLOCK_BYTES`) are made contiguous (and moved to the CPU) one at a time.
    """
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        write_hdf5(dsid, mtype, t)
        return
    bits = bits_view(t)
    shape = tuple(t.shape)
    for first, stop in row_blocks(shape, t.element_size(), block_bytes or BLOCK_BYTES):
        block = bits[first:stop] if shape else bits
        block = block.contiguous().cpu()
        write_hdf5(dsid, mtype, block, rows(shape, first, stop) if shape else None)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when ``stride`` is a permutation of a row-major layout (no gaps, no overlap)."""
    expected = 1
    for size, st in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= size
    return True


def restore_layout(values: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A tensor with ``values``' logical contents (contiguous CPU) laid out with ``stride``.

    Dense permutations (transposed, channels_last) are one copy; layouts with gaps or
    overlaps (steps, expand) scatter each element to its storage offset.
    """
    shape = tuple(values.shape)
    out = torch.empty_strided(shape, stride, dtype=values.dtype)
    if values.numel() == 0:
        return out
    if _dense(shape, stride):
        bits_view(out).copy_(bits_view(values))
        return out
    storage = bits_view(out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,), 0))
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (n, st) in enumerate(zip(shape, stride)):
        view = [1] * len(shape)
        view[dim] = n
        offsets = offsets + (torch.arange(n, dtype=torch.int64) * st).reshape(view)
    storage[offsets.reshape(-1)] = bits_view(values).reshape(-1)
    return out
