"""Host memory for tensors: fresh outputs in mappings of their own (freed for real when
dropped; transparent huge pages on request, see :data:`HUGEPAGES`), byte views of tensor
memory, the heap handed back while streaming, and saved strides restored. ``gc_paused`` (the
garbage collector paused for bulk work) is the storage package's, found here as well.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..format.dtypes import bits_view
from ..format.slicing import has_gaps, stride_span
from . import gc_paused  # (lives with the package, which imports no torch: the command line's listings pause it too)

__all__ = [
    "MAP_MIN_BYTES", "HUGEPAGES", "HUGEPAGE_MIN_BYTES", "TRIM_BYTES", "TRIM_CHECK_BYTES", "empty", "streamed",
    "gc_paused", "tensor_bytes", "tensor_buffer", "restore_layout",
]


MAP_MIN_BYTES = 256 * 2**10
"""Fresh outputs of at least this many bytes get a memory mapping of their own (see :func:`empty`)."""

HUGEPAGES = False
"""Advise fresh outputs of at least :data:`HUGEPAGE_MIN_BYTES` to use transparent huge pages.

Off by default. On a VM that reports free memory to its hypervisor (this project's machine),
a 2 MiB fault lands on a block the host has taken back unless the memory was freed in the
last ~2 s, and costs more than 4 KiB faults (touch times in bench/README.md). In two 2 GB
bench runs, load with huge pages ran 0.38x and 0.69x the default. Huge pages may pay on bare
metal: not measured here, so they stay opt-in."""

HUGEPAGE_MIN_BYTES = 4 * 2**20
"""With :data:`HUGEPAGES`, fresh outputs of at least this many bytes are advised to use
transparent huge pages."""

_HUGE = 2 * 2**20

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", None)

_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)  # None where mmap takes no flags (Windows)


def empty(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A new uninitialised CPU tensor; large ones live in an anonymous mapping of their own.

    ``populate``: a mapping gets its pages at once (``MAP_POPULATE``, in the calling thread,
    without the GIL), not by a fault at each first touch: for memory that another thread
    fills while holding the GIL (a remote load's event loop).

    Tensors of at least :data:`MAP_MIN_BYTES` are backed by a private anonymous ``mmap``,
    unmapped when the tensor is freed (with :data:`HUGEPAGES`, from :data:`HUGEPAGE_MIN_BYTES`
    on it is 2 MiB aligned and its whole 2 MiB blocks are advised ``MADV_HUGEPAGE``), so
    memory really drops when a streamed tensor is dropped. Through ``malloc`` it does not:
    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
    later tensors come from the heap, which keeps freed memory (measured streaming a 1 GB
    checkpoint: peak RSS growth 436 MiB through ``torch.empty``, 15 MiB this way).
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < MAP_MIN_BYTES or _ANONYMOUS is None:
        return torch.empty(shape, dtype=dtype, device="cpu")  # whatever torch's default device is
    huge = HUGEPAGES and nbytes >= HUGEPAGE_MIN_BYTES and _MADV_HUGEPAGE is not None
    flags = mmap.MAP_PRIVATE | _ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    area = mmap.mmap(-1, nbytes + (_HUGE if huge else 0), flags=flags)
    skip = 0
    if huge:
        skip = -torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr() % _HUGE
        body = nbytes - nbytes % _HUGE  # whole huge pages only: a partial last one would hold
        try:                            # up to 2 MiB of memory the tensor does not use
            area.madvise(_MADV_HUGEPAGE, skip, body)
            if _MADV_NOHUGEPAGE is not None:  # where the kernel makes huge pages unasked
                area.madvise(_MADV_NOHUGEPAGE, skip + body, len(area) - skip - body)
        except OSError:
            pass
    return torch.frombuffer(area, dtype=dtype, count=numel, offset=skip).view(shape)


TRIM_BYTES = 128 * 2**20
"""Streaming (``Store.items``, ``Writer.write``) hands the heap's free memory back to the system
when it holds at least this many free bytes (glibc only; None: never, for speed over memory)."""

TRIM_CHECK_BYTES = 16 * 2**20
"""How many streamed bytes pass between two looks at the heap's free bytes."""


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> tuple[Callable[[int], int], Callable[[], _Mallinfo2] | None] | None:
    """glibc's ``malloc_trim`` and ``mallinfo2`` (None where the C library is another), from
    the process's own symbols (``find_library`` runs ``ldconfig -p``: milliseconds at import)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info = getattr(libc, "mallinfo2", None)  # glibc 2.33+
    if info is not None:
        info.argtypes, info.restype = [], _Mallinfo2
    return trim, info


_GLIBC: Any = False  # looked up on first use (None: not glibc)

_streamed = 0


def streamed(nbytes: int) -> None:
    """Note ``nbytes`` streamed (read for or written from the caller, tensor by tensor) and, now
    and then, give the heap's free memory back to the system.

    Freed tensors of the caller's code (``0.5 * x + y`` over ``items()``) come from glibc's
    heap once glibc has raised its mmap threshold (it raises it to the size of each large
    block freed, up to 32 MiB), and the heap keeps what is freed in it: a key-by-key merge of
    three 640 MiB checkpoints grew RSS by 1,072 MiB that way, by 245 MiB with this. Every
    :data:`TRIM_CHECK_BYTES` streamed, when the heap holds :data:`TRIM_BYTES` free,
    ``malloc_trim(0)`` returns its free pages. The price is faulting that memory in again: the
    merge took 1.45x as long on this project's VM, where fresh memory is slow."""
    global _streamed, _GLIBC
    if _GLIBC is False:
        _GLIBC = _glibc() if os.name == "posix" else None
    if _GLIBC is None or TRIM_BYTES is None:
        return
    _streamed += nbytes
    if _streamed < TRIM_CHECK_BYTES:
        return
    _streamed = 0
    trim, info = _GLIBC
    if info is not None and info().fordblks < TRIM_BYTES:
        return
    trim(0)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of the bytes of a contiguous CPU tensor (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1:  # a contiguous single element may still carry any stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory of a contiguous CPU tensor, made without numpy
    (about a third of :func:`tensor_bytes`'s cost: it counts per small tensor). The view
    keeps ``t`` alive. Raises ValueError for a tensor that is not contiguous (its bytes are
    not one range)."""
    if not t.is_contiguous():
        raise ValueError(f"tensor_buffer needs a contiguous tensor, got stride {t.stride()} for shape {tuple(t.shape)}")
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    raw._tensor = t  # type: ignore[attr-defined]  # the memory lives as long as the view
    return memoryview(raw).cast("B")


def restore_layout(values: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A tensor with ``values``' logical contents (contiguous, any device) laid out with
    ``stride``, on the same device.

    Dense permutations (transposed, channels_last) are one copy. Layouts that map several
    elements to one storage element (stride 0: expanded) keep one copy of each; their values
    must agree, else ValueError (the data contradict the layout). Layouts with gaps (steps)
    are refused with ValueError: no memory is handed out that no value filled.
    """
    shape = tuple(values.shape)
    if has_gaps(shape, stride):
        raise ValueError(f"stride {list(stride)} leaves gaps in storage for shape {list(shape)}")
    out = torch.empty_strided(shape, stride, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return out
    if stride_span(shape, stride) == values.numel():  # a permutation: every element has its own place
        bits_view(out).copy_(bits_view(values))
        return out
    storage = bits_view(out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,), 0))
    offsets = torch.zeros((), dtype=torch.int64, device=values.device)
    for dim, (n, st) in enumerate(zip(shape, stride)):
        view = [1] * len(shape)
        view[dim] = n
        offsets = offsets + (torch.arange(n, dtype=torch.int64, device=values.device) * st).reshape(view)
    flat, src = offsets.reshape(-1), bits_view(values).reshape(-1)
    storage[flat] = src
    if not torch.equal(storage[flat], src):
        raise ValueError(f"elements that stride {list(stride)} stores once hold different values")
    return out
