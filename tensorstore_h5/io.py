"""Byte movement between HDF5 datasets and tensor memory.

Reads land straight in the caller's (or a freshly allocated) tensor: no intermediate numpy
array, no second copy. Contiguous, unfiltered datasets skip HDF5 altogether: their byte
range (``DatasetID.get_offset()``) is read with ``os.preadv`` by a small thread pool, which
releases the GIL, and large fresh outputs get anonymous mappings of their own (freed for real
when dropped; transparent huge pages on request, see :data:`HUGEPAGES`). Everything else goes
through HDF5's own read. Writes go straight from the tensor's memory; non-contiguous or
non-CPU tensors are written in row blocks of at most ``BLOCK_BYTES`` extra memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import gc
import math
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np
import torch

from . import checksum
from .dtypes import bits_view
from .slicing import Selection, has_gaps, rows, stride_span

__all__ = [
    "BLOCK_BYTES", "WRITE_CALL_BYTES", "IO_THREADS", "COLD_IO_THREADS", "PIECE_BYTES", "MAP_MIN_BYTES", "HUGEPAGES",
    "HUGEPAGE_MIN_BYTES", "GATHER_WINDOW", "tensor_bytes", "tensor_buffer", "pwrite_all", "empty", "read_hdf5",
    "write_hdf5", "write_tensor", "row_blocks", "restore_layout", "gather", "RawFile", "FileMap", "ReadPlan", "run_jobs",
    "submit_jobs", "wait_all", "DIRECT_ALIGN", "DIRECT_MIN_BYTES", "DIRECT_BUFFER_BYTES", "DirectWrites",
    "SPLIT_MIN_BYTES", "pread_split", "gc_paused",
]

BLOCK_BYTES = 64 * 2**20
"""Largest extra buffer (bytes) a write of a non-contiguous or device tensor holds at once."""

WRITE_CALL_BYTES = 1 << 30
"""Largest single ``pwrite`` a writer issues (Linux writes at most 0x7ffff000 bytes a call)."""

IO_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that read byte ranges in parallel."""

COLD_IO_THREADS = max(IO_THREADS, 4)
"""Threads of a load whose file is not in the page cache (:meth:`RawFile.cached`): more reads
in flight keep the disk busy. On this project's 2-core VM (2 GB, fresh processes, 4 rounds):
cold 1.42 / 1.11 GB/s (best / median) with 4 threads against 1.08 / 0.70 with 2, but warm
2.51 / 1.88 against 2.69 / 2.15, hence only for a cold file."""

PIECE_BYTES = 8 * 2**20
"""Byte ranges are split into pieces of this size so that the threads share large tensors."""

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


READAHEAD_BYTES = 64 * 2**20
"""``Store.items`` over a local file asks the kernel to read this many bytes of the next tensors
ahead of the one being read, and ``Store.load`` all it will read (see :meth:`RawFile.willneed`),
so that from a cold page cache the disk works ahead of the reads (0: never)."""

TRIM_BYTES = 128 * 2**20
"""Streaming (``Store.items``, ``Writer.write``) hands the heap's free memory back to the system
when it holds at least this many free bytes (glibc only; None: never, for speed over memory)."""

TRIM_CHECK_BYTES = 16 * 2**20
"""How many streamed bytes pass between two looks at the heap's free bytes."""


def coalesce(ranges: Sequence[tuple[int, int]], max_gap: int) -> list[list[int]]:
    """``(offset, nbytes)`` ranges as sorted ``[start, end)`` spans, joining those less than
    ``max_gap`` bytes apart (empty ranges dropped)."""
    joined: list[list[int]] = []
    for a, b in sorted((o, o + n) for o, n in ranges if n > 0):
        if joined and a <= joined[-1][1] + max_gap:
            joined[-1][1] = max(joined[-1][1], b)
        else:
            joined.append([a, b])
    return joined


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> tuple[Callable[[int], int], Callable[[], _Mallinfo2] | None] | None:
    """glibc's ``malloc_trim`` and ``mallinfo2`` (None where the C library is another)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info = getattr(libc, "mallinfo2", None)  # glibc 2.33+
    if info is not None:
        info.argtypes, info.restype = [], _Mallinfo2
    return trim, info


_GLIBC = _glibc() if os.name == "posix" else None
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
    global _streamed
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


_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _executor(threads: int | None = None) -> ThreadPoolExecutor:
    """The I/O thread pool of ``threads`` workers (:data:`IO_THREADS` by default), made once."""
    n = IO_THREADS if threads is None else threads
    with _pool_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tensorstore_h5-io")
        return pool


class RawFile:
    """Positional reads of one open file's bytes straight into tensor memory, and its mapping.

    The file is opened once (or adopted from ``fd``); every read goes to that open file, so
    a file renamed over the path later (a save replacing it) is never mixed in. ``size`` is
    its length when opened. Raises FileNotFoundError, IsADirectoryError, or PermissionError.
    """

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if fd is None else fd
        st = os.fstat(self._fd)
        if stat.S_ISDIR(st.st_mode):
            self.close()
            raise IsADirectoryError(f"{path} is a directory, not a checkpoint file")
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino)

    def pread(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset``. Raises EOFError past the end of the file."""
        fd = self._fileno()
        done, n = 0, len(view)
        while done < n:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise EOFError(f"{self.path}: file ends at byte {offset + done}, {n - done} bytes short (truncated?)")
            done += got

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes at ``offset`` (EOFError past the end of the file)."""
        buf = bytearray(nbytes)
        self.pread(offset, memoryview(buf))
        return bytes(buf)

    def head(self, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes (fewer in a shorter file)."""
        return self.read(0, min(self.size, nbytes))

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to do: a local file is read where it lies (remote sources fetch here)."""

    def release(self) -> None:
        """Nothing to do (see :meth:`prefetch`)."""

    def cached(self, ranges: Sequence[tuple[int, int]], probes: int = 8) -> bool:
        """Whether the page cache holds the first and last byte of up to ``probes`` of the
        ``(offset, nbytes)`` ranges, spread over the list (one-byte reads with ``RWF_NOWAIT``,
        which fail rather than wait for the disk). True where the probe does not exist (then
        nothing is assumed cold)."""
        nowait = getattr(os, "RWF_NOWAIT", None)
        ranges = [r for r in ranges if r[1] > 0]
        if nowait is None or self._fd is None or not ranges:
            return True
        step = max(1, len(ranges) // probes)
        picked = ranges[::step][:probes - 1] + [ranges[-1]]
        byte = bytearray(1)
        for offset, nbytes in picked:
            for at in (offset, offset + nbytes - 1):
                try:
                    os.preadv(self._fd, [byte], at, nowait)
                except BlockingIOError:
                    return False
                except OSError:  # RWF_NOWAIT refused by this file system: nothing to learn
                    return True
        return True

    def willneed(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to start reading ``(offset, nbytes)`` ranges into the page cache
        (``POSIX_FADV_WILLNEED``: returns at once), so that a cold read of them later waits
        less; ranges less than 1 MiB apart go as one. Nothing happens where the call does
        not exist."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None or self._fd is None:
            return
        for start, end in coalesce(ranges, 1 << 20):
            try:
                advise(self._fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def prime(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Read the first byte of each ``(offset, nbytes)`` range, so that the kernel starts its
        readahead there and marks where to read further: page faults on a mapping of the ranges
        then read ahead in growing windows instead of around each fault. Measured on the 2-core
        VM (5 fresh processes each, interleaved), a cold ``load(mmap=True)`` + touch of 2 GB in
        296 tensors: 0.60 GB/s median (0.86 best) without, 0.89 (1.44) with; one read at the
        start of the first range only did not help; ``torch.load(mmap=True)`` + touch ran 1.24
        (1.31) in the same run. The reads go through a second open file of the same inode
        (``/proc/self/fd``), leaving this one's readahead state, which the mapping's faults use,
        as it was. Nothing happens where that cannot be opened."""
        if self._fd is None:
            return
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            if os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
                return
            byte = bytearray(1)
            for offset, nbytes in ranges:
                if nbytes > 0:
                    os.preadv(fd, [byte], offset)
        except OSError:
            pass
        finally:
            os.close(fd)

    def mapped(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor backed by the file's pages through its own private mapping: copy-on-write,
        so writes stay in this tensor's memory and reach neither the file nor other tensors."""
        if offset + nbytes > self.size:
            raise EOFError(f"{self.path}: file ends before byte {offset + nbytes} (truncated?)")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fileno(), nbytes + offset - start, offset=start, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset - start)
        return flat.view(dtype).reshape(shape)

    def _fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: closed")
        return self._fd

    def close(self) -> None:
        """Close the descriptor. Mapped tensors stay valid (the mapping lives while they do)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileMap:
    """Tensors backed by one private (copy-on-write) mapping of the whole file, made on first use.

    One ``mmap`` per load instead of one per tensor: each tensor is a view of it, so a
    mapped load of hundreds of tensors costs one system call. Writes to a tensor stay in the
    mapping's private pages, inside that tensor's own bytes: they reach neither the file nor
    the other tensors (which never share bytes, only pages). The mapping lives while any of
    its tensors does. With ``whole=False`` (streaming, where memory should fall as each
    tensor is dropped) each tensor gets a mapping of its own (:meth:`RawFile.mapped`).
    Callers map only offsets that are multiples of the element size.
    """

    def __init__(self, raw: RawFile, whole: bool = True) -> None:
        self._raw = raw
        self._one = whole
        self._whole: torch.Tensor | None = None

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` as a tensor of ``dtype`` and ``shape``. Raises EOFError
        past the end of the file, ValueError for an offset that is not a multiple of the
        element size (the tensor would be misaligned)."""
        raw = self._raw
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} is not a multiple of the element size {dtype.itemsize}")
        if not self._one:
            return raw.mapped(offset, nbytes, dtype, shape)
        if offset + nbytes > raw.size:
            raise EOFError(f"{raw.path}: file ends before byte {offset + nbytes} (truncated?)")
        if self._whole is None:
            mapping = mmap.mmap(raw._fileno(), raw.size, access=mmap.ACCESS_COPY)
            self._whole = torch.frombuffer(mapping, dtype=torch.uint8)
        return self._whole[offset:offset + nbytes].view(dtype).view(shape)


class ReadPlan:
    """Byte ranges to read into tensors (and other jobs, such as chunk decodes), run by the
    thread pool while the plan is still being built.

    Jobs are grouped into batches of about :data:`PIECE_BYTES` (large ranges are split into
    pieces of that size); each full batch starts on the pool at once, so the caller's work of
    finding the next tensors overlaps the reads of the previous ones. :meth:`run` runs the
    last batch on the calling thread and waits for all of them. ``threads``: how many batches
    run at once (:data:`IO_THREADS` by default).
    """

    def __init__(self, raw: RawFile, threads: int | None = None) -> None:
        self._raw = raw
        self._threads = IO_THREADS if threads is None else threads
        self._batch: list[Callable[[], None]] = []
        self._window: list[tuple[int, int, torch.Tensor, Any, int | None]] = []  # small reads to be read together
        self._window_end = 0
        self._pending = 0
        self._futures: list[Future[None]] = []
        self.nbytes = 0

    def add(self, offset: int, out: torch.Tensor, wrap: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
            hashes: Sequence[int] | None = None, block: int = PIECE_BYTES) -> None:
        """Read ``out.nbytes`` bytes at ``offset`` into the contiguous CPU tensor ``out`` in pieces
        of ``block`` bytes; with ``hashes``, each piece is checked against its hash right after
        its read (ChecksumError). Each piece's job runs as ``wrap(job)()`` when given (to name
        the tensor in its errors)."""
        view = tensor_buffer(out)
        for i, start in enumerate(range(0, len(view), block)):
            piece = view[start:start + block]
            job = _read_job(self._raw, offset + start, piece, None if hashes is None else hashes[i], i, start)
            self.add_job(job if wrap is None else wrap(job), len(piece))

    def add_small(self, offset: int, out: torch.Tensor,
                  wrap: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                  expected: int | None = None) -> None:
        """Read the ``out.nbytes`` bytes (at most :data:`SMALL_READ_BYTES`) at ``offset`` into
        the contiguous CPU tensor ``out`` together with the small reads added just before it
        that lie close by: one ``pread`` of their whole window (:data:`SMALL_WINDOW_BYTES` at
        most), then a copy into each tensor. With ``expected``, the bytes' XXH3 is checked
        (ChecksumError). Errors come out of ``wrap(job)()``, as for :meth:`add`: a window whose
        read fails is read again tensor by tensor, so that the error names its tensor."""
        n = out.numel() * out.element_size()
        window = self._window
        if window and not (self._window_end <= offset <= self._window_end + SMALL_GAP
                           and offset + n - window[0][0] <= SMALL_WINDOW_BYTES):
            self._flush_small()
        self._window.append((offset, n, out, wrap, expected))
        self._window_end = offset + n

    def _flush_small(self) -> None:
        window, self._window = self._window, []
        if window:
            self.add_job(functools.partial(_read_window, self._raw, window), self._window_end - window[0][0])

    def add_job(self, job: Callable[[], None], cost: int) -> None:
        """Run ``job()``, which costs about as much as reading ``cost`` bytes, with the others."""
        self._batch.append(job)
        self._pending += cost
        self.nbytes += cost
        if self._pending >= PIECE_BYTES and self._threads > 1:
            self._futures.append(_executor(self._threads).submit(_run_all, self._batch))
            self._batch, self._pending = [], 0

    def run(self) -> None:
        """Finish every job; raises the first error (EOFError, OSError, ...) once all are done."""
        self._flush_small()
        batch, futures = self._batch, self._futures
        self._batch, self._pending, self._futures = [], 0, []
        _finish(functools.partial(_run_all, batch), futures)

    def abandon(self) -> None:
        """Drop the jobs not started yet and wait for the running ones (after an error)."""
        futures, self._futures, self._batch, self._window = self._futures, [], [], []
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                f.exception()


def _read_window(raw: Any, items: list[tuple[int, int, torch.Tensor, Any, int | None]]) -> None:
    """One job of :meth:`ReadPlan.add_small`: ``items`` are ``(offset, nbytes, tensor, wrap,
    expected hash)``, in file order."""
    start = items[0][0]
    buf = bytearray(items[-1][0] + items[-1][1] - start)
    try:
        raw.pread(start, memoryview(buf))
    except (EOFError, OSError):
        for offset, _, out, wrap, expected in items:  # again one by one: the error names its tensor
            job = _read_job(raw, offset, tensor_buffer(out), expected)
            (job if wrap is None else wrap(job))()
        return
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    view = memoryview(buf)
    for offset, n, out, wrap, expected in items:
        at = offset - start
        ctypes.memmove(out.data_ptr(), base + at, n)
        if expected is not None and checksum.digest(view[at:at + n]) != expected:
            failed = functools.partial(_checked, lambda: None, view[at:at + n], expected, 0, 0)  # raises, naming it
            (failed if wrap is None else wrap(failed))()


def _read_job(raw: Any, offset: int, view: memoryview, expected: int | None = None, index: int = 0,
              start: int = 0) -> Callable[[], None]:
    """A job reading the bytes at ``offset`` into ``view``; with ``expected``, then checking
    their XXH3 (ChecksumError naming hash block ``index``, which starts ``start`` bytes in)."""
    job: Callable[[], None] = functools.partial(raw.pread, offset, view)
    return job if expected is None else functools.partial(_checked, job, view, expected, index, start)


def _checked(read: Callable[[], None], piece: memoryview, expected: int, index: int, start: int) -> None:
    read()
    if checksum.digest(piece) != expected:
        raise checksum.ChecksumError(f"block {index}, bytes {start}..{start + len(piece)} of its data")


def _run_all(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def run_jobs(jobs: list[Callable[[], None]]) -> None:
    """Run independent jobs on the I/O thread pool, the last one on the calling thread; waits
    for all of them and raises the first error."""
    if len(jobs) <= 1 or IO_THREADS == 1:
        for job in jobs:
            job()
        return
    _finish(jobs[-1], [_executor().submit(job) for job in jobs[:-1]])


def submit_jobs(jobs: list[Callable[[], None]]) -> list[Future[None]]:
    """Start independent jobs on the I/O thread pool and return their futures (for
    :func:`wait_all`); with :data:`IO_THREADS` 1 they run here, now, and errors are kept in
    the futures as a pool would."""
    if IO_THREADS == 1:
        futures: list[Future[None]] = []
        for job in jobs:
            f: Future[None] = Future()
            try:
                job()
                f.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed over in the future, as the pool does
                f.set_exception(e)
            futures.append(f)
        return futures
    pool = _executor()
    return [pool.submit(job) for job in jobs]


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every future; raise the first error once all have ended."""
    _finish(lambda: None, futures)


SMALL_READ_BYTES = 64 * 2**10
"""Tensors of at most this many bytes are read by :meth:`ReadPlan.add_small`: with their
neighbours, one ``pread`` per window instead of one each, without the general read path's
per-tensor work (a load of 10,000 tensors of 16 bytes: 276 -> ~200 ms)."""

SMALL_WINDOW_BYTES = 2**20
"""The most bytes one window of small reads spans."""

SMALL_GAP = 4096
"""Small reads further apart than this start a new window."""


SPLIT_MIN_BYTES = 2**20
"""Smallest piece :func:`pread_split` gives one I/O thread."""


def pread_split(pread: Callable[[int, memoryview], None], offset: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes at ``offset`` through ``pread(offset, view)``, split into
    up to :data:`IO_THREADS` pieces (4 KiB multiples of at least :data:`SPLIT_MIN_BYTES`) read
    at once on the I/O thread pool: one thread copies about 5 GB/s out of the page cache, so a
    staging buffer filled by one thread holds a GPU load to that. Raises what ``pread`` raises
    (EOFError, OSError), once every piece has ended."""
    n = len(view)
    pieces = min(IO_THREADS, n // SPLIT_MIN_BYTES)
    if pieces <= 1:
        pread(offset, view)
        return
    step = -(-n // pieces)  # ceil(n / pieces), then up to a page multiple
    step = -(-step // 4096) * 4096
    run_jobs([functools.partial(pread, offset + s, view[s:s + step]) for s in range(0, n, step)])


def _finish(inline: Callable[[], None], futures: list[Future[None]]) -> None:
    """Run ``inline`` here, then wait for ``futures``; raise the first error once all have ended."""
    error: BaseException | None = None
    try:
        inline()
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the pool's jobs end
        error = e
    for f in futures:
        failed = f.exception()  # waits for it, also after an earlier error: no job outlives the call
        error = error or failed
    if error is not None:
        raise error


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (back as it was when the last of
    the blocks running in any thread ends). Building thousands of objects that form no cycle
    (tensors, entries, index pieces) otherwise runs it again and again over everything the
    process holds: half the time of loading 10,000 small tensors (560 -> 280 ms, as fast as
    safetensors' ``load_file``) and of a rank reading a 512-rank index."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


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


def write_hdf5(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, src: torch.Tensor, sel: Selection | None = None) -> np.ndarray:
    """Write ``src`` (contiguous, CPU) into the selection (all of the dataset by default);
    returns the bytes written (a uint8 view of ``src``)."""
    data = tensor_bytes(src)
    if src.numel():
        mspace, fspace = _spaces(sel, dsid)
        dsid.write(mspace, fspace, data, mtype=mtype)
    return data


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write the whole buffer ``data`` at file ``offset`` of ``fd`` (``os.pwrite`` writes at most
    about 2 GiB a call, and may write less). Raises OSError."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:done + WRITE_CALL_BYTES], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


DIRECT_ALIGN = 4096
"""Alignment in bytes of the offsets, lengths and memory of ``O_DIRECT`` writes."""

DIRECT_MIN_BYTES = 2**20
"""Smallest range :class:`DirectWrites` writes with ``O_DIRECT`` (smaller ones: buffered)."""

DIRECT_BUFFER_BYTES = 8 * 2**20
"""Size of the page-aligned bounce buffer of :class:`DirectWrites`."""


class DirectWrites:
    """Writes of large byte ranges of one file with ``O_DIRECT``, bypassing the page cache.

    The page-aligned middle of each range goes through a page-aligned bounce buffer of
    :data:`DIRECT_BUFFER_BYTES` to a second descriptor opened with ``O_DIRECT``; its unaligned
    head and tail, and ranges under :data:`DIRECT_MIN_BYTES`, go through the file's ordinary
    descriptor ``fd`` (their pages never overlap a direct range). Where the page cache is slow
    to hand out fresh memory (this project's VM: 0.10-0.26 GB/s buffered against 1.0-1.35 GB/s
    direct for 1 GiB), this is several times faster; where the disk is slower than memory it
    is slower, and the bytes written are not left in the page cache. A file system that refuses
    ``O_DIRECT`` (tmpfs) makes :meth:`open` return None; one that refuses a direct write
    (EINVAL) turns the rest into buffered writes. ``direct_bytes`` counts what went direct.
    """

    def __init__(self, path: str, fd: int, dfd: int) -> None:
        self.path = path
        self._fd = fd
        self._dfd: int | None = dfd
        self._buf = mmap.mmap(-1, DIRECT_BUFFER_BYTES)  # anonymous maps are page-aligned
        self.direct_bytes = 0
        self._finalizer = weakref.finalize(self, DirectWrites._release, dfd, self._buf)

    @classmethod
    def open(cls, path: str, fd: int) -> DirectWrites | None:
        """Direct writes to ``path`` (whose ordinary descriptor is ``fd``), or None where
        ``O_DIRECT`` is not available there."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            dfd = os.open(path, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        return cls(path, fd, dfd)

    def pwrite(self, data: Any, offset: int) -> None:
        """Write the whole buffer ``data`` at file ``offset``. Raises OSError."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        a = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN
        e = end // DIRECT_ALIGN * DIRECT_ALIGN
        if self._dfd is None or len(view) < DIRECT_MIN_BYTES or e - a < DIRECT_ALIGN:
            pwrite_all(self._fd, view, offset)
            return
        pwrite_all(self._fd, view[:a - offset], offset)
        buf = memoryview(self._buf)
        pos = a
        try:
            while pos < e:
                n = min(len(buf), e - pos)
                buf[:n] = view[pos - offset:pos - offset + n]
                done = 0
                while done < n:
                    w = os.pwrite(self._dfd, buf[done:n], pos + done)
                    if w <= 0 or w % DIRECT_ALIGN:
                        raise OSError(errno.EIO, f"short direct write ({w} of {n - done} bytes)")
                    done += w
                pos += n
                self.direct_bytes += n
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            buf.release()
            self.close()  # the file system refuses these writes after all: the rest goes buffered
            pwrite_all(self._fd, view[pos - offset:e - offset], pos)
        finally:
            buf.release()
        pwrite_all(self._fd, view[e - offset:], e)

    def close(self) -> None:
        """Close the direct descriptor and free the bounce buffer (idempotent)."""
        self._dfd = None
        self._finalizer()

    @staticmethod
    def _release(dfd: int, buf: mmap.mmap) -> None:
        with contextlib.suppress(OSError):
            os.close(dfd)
        with contextlib.suppress(BufferError):
            buf.close()


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


def write_tensor(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, t: torch.Tensor, block_bytes: int | None = None,
                 on_bytes: Callable[[np.ndarray], None] | None = None) -> None:
    """Write the logical (row-major) values of any strided tensor ``t`` to the whole dataset.

    A contiguous CPU tensor is written from its own memory; otherwise row blocks of at most
    ``block_bytes`` (default :data:`BLOCK_BYTES`) are made contiguous (and moved to the CPU)
    one at a time. ``on_bytes`` sees every byte written, in order (to hash them).
    """
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        data = write_hdf5(dsid, mtype, t)
        if on_bytes is not None:
            on_bytes(data)
        return
    bits = bits_view(t)
    shape = tuple(t.shape)
    for first, stop in row_blocks(shape, t.element_size(), block_bytes or BLOCK_BYTES):
        block = bits[first:stop] if shape else bits
        data = write_hdf5(dsid, mtype, block.contiguous().cpu(), rows(shape, first, stop) if shape else None)
        if on_bytes is not None:
            on_bytes(data)


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


GATHER_WINDOW = 64 * 2**20
"""Strided selections of raw data are read in windows of at most this many bytes."""


def gather(read: Callable[[int, memoryview], None], shape: tuple[int, ...], itemsize: int, sel: Selection,
           dest: torch.Tensor, window: int = GATHER_WINDOW) -> None:
    """Fill ``dest`` (contiguous, CPU, shaped like ``sel.count``, an integer dtype of
    ``itemsize`` bytes) with a strided selection of row-major data whose logical bytes
    ``read(offset, view)`` returns: rows of the first dimension are read in windows of at
    most ``window`` bytes and picked from in memory; rows larger than a window are split
    along the next dimension the same way."""
    _gather(read, 0, shape, itemsize, sel.start, sel.count, sel.step, dest, window)


def _gather(read: Callable[[int, memoryview], None], base: int, shape: tuple[int, ...], itemsize: int,
            start: tuple[int, ...], count: tuple[int, ...], step: tuple[int, ...], dest: torch.Tensor, window: int) -> None:
    if 0 in count:
        return
    row = itemsize * math.prod(shape[1:])
    inner = tuple(slice(a, a + (c - 1) * s + 1, s) for a, c, s in zip(start[1:], count[1:], step[1:]))
    if row > window and len(shape) > 1:
        for i in range(count[0]):
            r = start[0] + i * step[0]
            _gather(read, base + r * row, shape[1:], itemsize, start[1:], count[1:], step[1:], dest[i], window)
        return
    per = max(1, (window // max(row, 1) - 1) // step[0] + 1)  # selected rows per window
    for i0 in range(0, count[0], per):
        i1 = min(count[0], i0 + per)
        first, last = start[0] + i0 * step[0], start[0] + (i1 - 1) * step[0]
        buf = torch.empty((last - first + 1, *shape[1:]), dtype=dest.dtype, device="cpu")
        read(base + first * row, tensor_buffer(buf))
        dest[i0:i1].copy_(buf[::step[0]][(slice(None), *inner)])
