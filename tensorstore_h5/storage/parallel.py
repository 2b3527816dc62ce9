"""The I/O threads and the plans they run: byte ranges read by ``os.preadv`` on a small
thread pool (which releases the GIL) straight into tensor memory, small reads joined into
windows, large ranges split so that the threads share them, strided selections gathered in
windows, and other jobs (chunk decodes) run beside the reads.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..format import checksum
from ..format.slicing import Selection
from .files import RawFile
from .memory import tensor_buffer

__all__ = [
    "IO_THREADS", "COLD_IO_THREADS", "PIECE_BYTES", "SMALL_READ_BYTES", "SPLIT_MIN_BYTES", "GATHER_WINDOW", "ReadPlan",
    "run_jobs", "submit_jobs", "wait_all", "pread_split", "gather",
]


IO_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that read byte ranges in parallel."""

COLD_IO_THREADS = max(IO_THREADS, 4)
"""Threads of a load whose file is not in the page cache (:meth:`RawFile.cached`): more reads
in flight keep the disk busy. On this project's 2-core VM (2 GB, fresh processes, 4 rounds):
cold 1.42 / 1.11 GB/s (best / median) with 4 threads against 1.08 / 0.70 with 2, but warm
2.51 / 1.88 against 2.69 / 2.15, hence only for a cold file."""

PIECE_BYTES = 8 * 2**20
"""Byte ranges are split into pieces of this size so that the threads share large tensors."""

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


def _forget_pools_after_fork() -> None:
    """In a forked child (a DataLoader worker, a multiprocessing pool): the parent's I/O
    threads do not exist there, and a pool that believes they do waits forever for them; the
    child makes its own pools, and its own lock (the parent's may have been held)."""
    global _pool_lock
    _pools.clear()
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


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
