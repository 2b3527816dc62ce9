"""Device transfer: where each loaded tensor goes (``device=`` as given to a load, checked per
key), and staged copies into device tensors: a few reusable (pinned, on CUDA) host buffers,
the read of block i+1 overlapping the host-to-device copy of block i on a side stream;
GPUDirect Storage through kvikio where it is available.

The same pipeline runs against CPU targets (plain buffers, synchronous copies), which is how
the CPU test suite covers its block boundaries, ordering and buffer reuse.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fnmatch
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Union

import torch

from .errors import TensorStoreError
from .format import checksum
from .storage import memory, parallel

__all__ = [
    "STAGING_BUFFERS", "STAGING_BYTES", "PIN_BY_REGISTER", "GDS", "Device", "Fill", "FileFill", "RUN_GAP", "Stager",
    "Stagers", "asked_once",
    "device_for", "target_device", "check_available", "staged", "gds_device", "batched", "device_empty", "gds_read",
]

Device = Union[None, str, int, torch.device, Mapping[str, Any], Callable[[str], Any]]
"""What ``device=`` of a load takes: None (the CPU), a device, or a mapping (exact keys or
globs) / callable from key path to device."""

STAGING_BUFFERS = 2
"""Number of host staging buffers (made on first use). With many tensors packed per buffer,
all of them are being read at once but the one whose copy to the device goes out
(:meth:`Stager.copy_many`). On an H200 host, repeated 2 GB loads in one process took 82 ms
with 2 x 64 MiB, 82 ms with 4 x 64 MiB, 101 ms with 4 x 32 MiB and 131-147 ms with 8 x 16 MiB
(bench/results-gpu.txt): fewer, larger buffers cost less per byte."""

STAGING_BYTES = 64 * 2**20
"""Size in bytes of each staging buffer."""

PIN_BY_REGISTER = True
"""How CUDA staging buffers are page-locked. True (default): anonymous memory (transparent huge
pages asked for) is touched, then registered with ``cudaHostRegister``: 2 x 64 MiB took ~7 ms
each the first time in a process on an H200 host, against ~23 ms each through torch's
``pin_memory`` (``cudaHostAlloc``), which set the first load's time (bench/results-gpu.txt,
run 7 "pinways"). When registering fails, and with False, torch's pinned memory is used."""

GDS: bool | None = None
"""GPUDirect Storage through ``kvikio``: None (default) uses it for contiguous uncompressed
datasets going to CUDA when kvikio is installed and reports GDS (not its POSIX compatibility
mode); False never; True also in compatibility mode. Any failure falls back to staging."""

Fill = Callable[[int, torch.Tensor], None]  # fill(byte offset in the tensor, uint8 buffer view)


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error state after a failed ``cudaHostRegister``, so the failure does
    not come out of a later, unrelated kernel launch (best effort: libcudart loaded globally)."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):  # pragma: no cover - depends on how torch loaded libcudart
        pass


def _register_pinned(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of anonymous memory, faulted in and page-locked with ``cudaHostRegister``;
    None when CUDA refuses (the caller falls back to torch's pinned memory). The memory is
    never unregistered: it lives in :data:`_PINNED` for the process's life."""
    try:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    with contextlib.suppress(AttributeError, OSError):  # no transparent huge pages: 4 KiB pages
        mem.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mem, dtype=torch.uint8)  # keeps ``mem`` mapped while it lives
    buf.fill_(0)  # fault the pages in before they are locked (locking absent pages is slower)
    try:
        ok = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
    except (AttributeError, RuntimeError, TypeError):  # a torch build without these bindings
        ok = False
    if not ok:
        _clear_cuda_error()
        return None
    return buf


class _PinnedPool:
    """Page-locked host buffers kept once made, as torch keeps its pinned blocks: a CUDA
    :class:`Stager` takes the smallest free buffer of at least the bytes it needs and gives its
    buffers back when it is dropped, so a later load (a new Store) does not pin again. A new
    buffer is a power of two of bytes; making one releases the free buffers smaller than it,
    so the pool holds a few sizes, not one buffer per size ever asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._registered: set[int] = set()  # data_ptr of the buffers made by _register_pinned
        self.made = 0  # buffers made (for tests and stats)

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` bytes, or a new one (``nbytes`` rounded up to a
        power of two)."""
        size = 1 << max(0, nbytes - 1).bit_length()
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            smaller = [b for b in self._free if b.numel() < size]
            self._free = [b for b in self._free if b.numel() >= size]
            self.made += 1
        for b in smaller:
            self._release(b)
        buf = _register_pinned(size) if PIN_BY_REGISTER else None
        if buf is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            self._registered.add(buf.data_ptr())
        return buf

    def give(self, bufs: Iterable[torch.Tensor | None]) -> None:
        """Return buffers no copy reads any more."""
        with self._lock:
            self._free.extend(b for b in bufs if b is not None)

    def _release(self, buf: torch.Tensor) -> None:
        """Unlock a buffer this pool registered (torch's own pinned blocks go back to torch)."""
        with self._lock:
            registered = buf.data_ptr() in self._registered
            self._registered.discard(buf.data_ptr())
        if registered:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


_PINNED = _PinnedPool()


def _new_pinned_pool_after_fork() -> None:
    """In a forked child the parent's page-locked buffers belong to a CUDA context the child
    cannot use, and the pool's lock may have been held: the child starts an empty pool."""
    global _PINNED
    _PINNED = _PinnedPool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pinned_pool_after_fork)


def _give_back(pool: _PinnedPool, bufs: list[torch.Tensor | None], events: list[Any]) -> None:
    """A dropped stager's buffers go back to the pool once the copies out of them are done."""
    for e in events:
        if e is not None:
            e.synchronize()
    pool.give(bufs)


RUN_GAP = 4096
"""Bytes between two tensors of one file (alignment padding: under 64 in files this library
writes) that :meth:`Stager.copy_many` stages as they lie, so that one read takes both."""


class FileFill:
    """A :data:`Fill` of a tensor stored contiguously at byte ``offset`` of the file ``raw``
    (``raw.pread(file offset, memoryview)``); ``run(job)`` runs a read of it and names its key
    when the read fails. :meth:`Stager.copy_many` stages neighbouring ones of one file as they
    lie in the file (gaps of at most :data:`RUN_GAP` included) and reads each run with one
    ``pread``: a buffer of thousands of small tensors costs a few reads, not one a tensor.

    ``hashes``, ``block``: the tensor's stored checksums, one per ``block`` bytes (at most a
    staging buffer). Then :meth:`Stager.copy_many` cuts the tensor only at multiples of
    ``block`` and checks each block in the staging buffer on the I/O thread that read it,
    before it goes to the device (``ChecksumError`` through ``run``): a load checks its bytes
    without reading them a second time."""

    __slots__ = ("raw", "offset", "run", "hashes", "block")

    def __init__(self, raw: Any, offset: int, run: Callable[[Callable[[], None]], None],
                 hashes: Sequence[int] | None = None, block: int = 0) -> None:
        if hashes is not None and block <= 0:
            raise ValueError("FileFill: hashes need a block size")
        self.raw, self.offset, self.run, self.hashes, self.block = raw, offset, run, hashes, block

    def __call__(self, off: int, buf: torch.Tensor) -> None:
        def read() -> None:
            self.raw.pread(self.offset + off, memory.tensor_buffer(buf))
            if self.hashes is not None:
                self.check(off, buf)
        self.run(read)

    def check(self, off: int, buf: torch.Tensor) -> None:
        """Check the checksum blocks that ``buf``, the tensor's bytes from ``off`` (a multiple
        of ``block``) on, holds: whole blocks, the last one ending at the tensor's end or at
        the buffer's. Raises ChecksumError for one that differs."""
        assert self.hashes is not None and off % self.block == 0
        view = memory.tensor_buffer(buf)
        for at in range(0, len(view), self.block):
            if checksum.digest(view[at:at + self.block]) != self.hashes[(off + at) // self.block]:
                first = self.offset + off + at
                raise checksum.ChecksumError(f"bytes {first}..{first + min(len(view) - at, self.block)} of the file")


def _fill_all(parts: list[tuple[Fill, int, int, int]], buf: torch.Tensor) -> None:
    """One I/O job of :meth:`Stager.copy_many`: ``fill(offset, buf[at:at + n])`` for each part
    in order. Consecutive parts share a job while together they hold at most a read piece, so
    a buffer of thousands of small tensors costs about one job a thread, not one a tensor
    (measured with the CPU standing in as the device: 6,000 tensors of a few bytes cost ~20 us
    a tensor in futures and hand-offs between threads holding the GIL); a part that would take
    a job past a piece (a large tensor's) starts the next one, so large tensors are read with
    as many threads as before. Parts of :class:`FileFill` staged as they lie in one file are
    read together, with one ``pread``; where that read fails each is read alone, so that the
    error names its key."""
    i = 0
    while i < len(parts):
        fill, offset, at, n = parts[i]
        j, end = i + 1, at + n
        if type(fill) is FileFill:
            base = fill.offset + offset - at  # the file byte at buffer byte 0, for this run
            while j < len(parts):
                f, o, a, k = parts[j]
                if type(f) is not FileFill or f.raw is not fill.raw or f.offset + o - a != base or a < end:
                    break
                end = a + k
                j += 1
        if j == i + 1:
            fill(offset, buf[at:at + n])
        else:
            try:
                fill.raw.pread(base + at, memory.tensor_buffer(buf[at:end]))  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - read each alone: the one that fails says which key
                for f, o, a, k in parts[i:j]:
                    f(o, buf[a:a + k])
            else:
                for f, o, a, k in parts[i:j]:
                    if f.hashes is not None:  # type: ignore[union-attr]
                        f.run(functools.partial(f.check, o, buf[a:a + k]))  # type: ignore[union-attr]
        i = j


class Stager:
    """Copies bytes produced block by block on the host into contiguous device tensors.

    Args:
        device: the target device. CUDA targets get pinned buffers, a side stream and
            events that guard buffer reuse; the caller's current stream waits for the
            copies at the end of each :meth:`copy`.
        buffers, buffer_bytes: how many staging buffers, and their size in bytes
            (default :data:`STAGING_BUFFERS` x :data:`STAGING_BYTES`).
    """

    def __init__(self, device: torch.device | str, buffers: int | None = None, buffer_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        buffers = STAGING_BUFFERS if buffers is None else buffers
        buffer_bytes = STAGING_BYTES if buffer_bytes is None else buffer_bytes
        cuda = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * max(1, buffers)  # made by _acquire, on first use
        self._events: list[Any] = [None] * len(self._bufs)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self.block_bytes = buffer_bytes
        self.uses = [0] * len(self._bufs)  # blocks staged through each buffer (for tests and stats)
        self._pool: _PinnedPool | None = _PINNED if cuda else None  # CUDA: page-locked buffers, kept when dropped
        self._returns: weakref.finalize | None = None  # gives the buffers back to the pool when dropped

    def copy(self, dest: torch.Tensor, fill: Fill, key: str = "", align: int = 1) -> None:
        """Fill the contiguous tensor ``dest`` (any device) by blocks: ``fill(offset, buf)``
        must write ``len(buf)`` bytes of the tensor starting at byte ``offset`` into ``buf``.

        ``align``: blocks start at multiples of it where a buffer holds at least one such
        unit (compressed data passes its chunk size, so no chunk is decoded twice).
        Raises TensorStoreError naming ``key`` when the device runs out of memory.
        """
        flat = dest.reshape(-1).view(torch.uint8) if dest.numel() else None
        if flat is None:
            return
        with self._oom(f"key {key!r}"), self._joined():
            for i, (start, n) in enumerate(self.iter_blocks(flat.numel(), align)):
                buf = self._acquire(i % len(self._bufs), n)[:n]
                fill(start, buf)
                self._send(i % len(self._bufs), [(flat[start:start + n], buf)])

    def copy_many(self, parts: Iterable[tuple[torch.Tensor, Fill]], done: Callable[[torch.Tensor], None] | None = None
                  ) -> None:
        """Fill many contiguous tensors (``(dest, fill)`` pairs, ``fill`` as in :meth:`copy`)
        by packing their bytes into the staging buffers in order: a buffer holds the next
        bytes of one or more tensors, read on the I/O thread pool (each tensor's part in
        pieces of at most max(:data:`parallel.SPLIT_MIN_BYTES`, buffer size / :data:`parallel.IO_THREADS`);
        consecutive small parts share a job up to that size, see :func:`_fill_all`).

        The reads of every buffer but one are in flight at once: when all buffers are busy,
        the oldest one's reads are waited for, its copies to the device go out, and once
        those are done it takes the next bytes. So the threads never wait at a per-buffer
        barrier, and a checkpoint of many small tensors fills whole buffers with all threads
        reading. ``done(dest)``: called when the last copy into ``dest`` has been issued (not
        finished). A :class:`FileFill` with ``hashes`` is cut only at its checksum blocks' ends
        (a buffer it would straddle is sent part-full) and checked in the buffer as it is read.
        Raises what a ``fill`` raises (once every read in flight has ended), ValueError for
        checksum blocks larger than a buffer, or TensorStoreError when the device runs out of
        memory."""
        piece = max(parallel.SPLIT_MIN_BYTES, self.block_bytes // max(1, parallel.IO_THREADS))
        size = self.block_bytes
        # dest, its bytes (flat), fill, start in them, at in the buffer, n bytes, the dest's total bytes
        queued: list[tuple[torch.Tensor, torch.Tensor, Fill, int, int, int, int]] = []
        inflight: collections.deque[tuple[int, torch.Tensor, list[Future[None]], list[Any]]] = collections.deque()
        used = 0
        blocks = 0

        def complete_oldest() -> None:
            slot, buf, futures, filled = inflight.popleft()
            parallel.wait_all(futures)
            self._send(slot, [(flat if n == total else flat[start:start + n], buf[at:at + n])
                              for _, flat, _, start, at, n, total in filled])  # (a whole small tensor: no slice)
            if done is not None:
                for dest, _, _, start, _, n, total in filled:
                    if start + n == total:
                        done(dest)

        def flush() -> None:
            nonlocal queued, used, blocks
            if not queued:
                return
            slot = blocks % len(self._bufs)
            if len(inflight) == len(self._bufs):
                complete_oldest()  # the reads into this slot's previous bytes
            buf = self._acquire(slot, used)
            jobs: list[Callable[[], None]] = []
            group: list[tuple[Fill, int, int, int]] = []  # consecutive parts of at most a piece, in order
            grouped = 0
            for _, _, fill, start, at, n, _ in queued:
                step = piece
                if type(fill) is FileFill and fill.hashes is not None:  # a job holds whole checksum blocks
                    step = max(fill.block, piece - piece % fill.block)
                for a in range(0, n, step):
                    k = min(n - a, step)
                    if group and grouped + k > piece:
                        jobs.append(functools.partial(_fill_all, group, buf))
                        group, grouped = [], 0
                    group.append((fill, start + a, at + a, k))
                    grouped += k
            if group:
                jobs.append(functools.partial(_fill_all, group, buf))
            inflight.append((slot, buf, parallel.submit_jobs(jobs), queued))
            queued, used, blocks = [], 0, blocks + 1

        with self._oom("a batch of keys"), self._joined():
            try:
                for dest, fill in parts:
                    flat = (dest if dest.dim() == 1 else dest.reshape(-1)).view(torch.uint8) if dest.numel() else None
                    if flat is None:
                        continue
                    start, total = 0, flat.numel()
                    block = fill.block if type(fill) is FileFill and fill.hashes is not None else 0
                    if block > size:
                        raise ValueError(f"checksum blocks of {block} bytes do not fit staging buffers of {size}")
                    if queued and type(fill) is FileFill:  # staged as it lies after the last one: one read takes both
                        last, lstart, lused, ln = queued[-1][2], queued[-1][3], queued[-1][4], queued[-1][5]
                        if type(last) is FileFill and last.raw is fill.raw:
                            gap = fill.offset - (last.offset + lstart + ln)
                            if 0 < gap <= RUN_GAP and lused + ln == used and used + gap < size:
                                used += gap
                    while start < total:
                        n = min(total - start, size - used)
                        if block and n < total - start:  # cut at the end of a checksum block, or in the next buffer
                            n -= n % block
                            if not n:
                                flush()
                                continue
                        queued.append((dest, flat, fill, start, used, n, total))
                        start += n
                        used += n
                        if used == size:
                            flush()
                flush()
                while inflight:
                    complete_oldest()
            except BaseException:
                for _, _, futures, _ in inflight:  # no read into a staging buffer outlives the call
                    for f in futures:
                        f.cancel()
                    for f in futures:
                        if not f.cancelled():
                            f.exception()
                raise

    def _acquire(self, slot: int, nbytes: int) -> torch.Tensor:
        """Staging buffer ``slot``, holding at least ``nbytes`` (at most the buffer size), once
        the copies out of its previous use are done. Buffers are made on first use and only as
        large as asked (in MiB steps; CUDA buffers come from a process-wide pool of page-locked
        buffers, see :data:`PIN_BY_REGISTER`), grown when a later use asks for more: pinning
        costs 0.1-0.5 ms per MiB the first time on an H200 host, which a load of a few small
        tensors to the GPU should not pay for 128 MiB."""
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            size = min(self.block_bytes, -(-max(1, nbytes) // 2**20) * 2**20)
            if self._pool is None:
                buf = torch.empty(size, dtype=torch.uint8)
            else:
                if buf is not None:
                    self._pool.give([buf])  # its copies are done (synchronized above)
                elif self._returns is None:
                    self._returns = weakref.finalize(self, _give_back, self._pool, self._bufs, self._events)
                    self._returns.atexit = False
                buf = self._pool.take(size)
            self._bufs[slot] = buf
        self.uses[slot] += 1
        return buf

    def _send(self, slot: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Issue the ``(destination, staged bytes)`` copies out of buffer ``slot``: on the side
        stream, with an event guarding the buffer's reuse (CUDA), or at once (CPU)."""
        if self._stream is None:
            for dst, src in copies:
                dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[slot] = event

    @contextlib.contextmanager
    def _joined(self) -> Iterator[None]:
        """At the end of the block, also when it raises, the caller's current stream waits for
        every copy issued on the side stream: memory the caller frees afterwards (a failed
        load's tensors) is not reused while a copy into it is still running."""
        try:
            yield
        finally:
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)

    @contextlib.contextmanager
    def _oom(self, what: str) -> Iterator[None]:
        try:
            yield
        except torch.cuda.OutOfMemoryError as e:  # pragma: no cover - needs a GPU
            raise TensorStoreError(f"out of device memory while loading {what} to {self.device}") from e

    def block_size(self, align: int = 1) -> int:
        """Bytes per block: the largest multiple of ``align`` that fits a buffer (the buffer
        size when ``align`` is larger than a buffer)."""
        if 1 < align <= self.block_bytes:
            return self.block_bytes // align * align
        return self.block_bytes

    def iter_blocks(self, nbytes: int, align: int = 1) -> Iterable[tuple[int, int]]:
        """The (offset, size) blocks that :meth:`copy` uses for a tensor of ``nbytes`` bytes."""
        block = self.block_size(align)
        return [(s, min(block, nbytes - s)) for s in range(0, nbytes, block)]


def asked_once(device: Device) -> Device:
    """``device``, a callable called at most once per key path (a load looks a key's device up
    twice); any other ``device`` as it is."""
    if not callable(device) or isinstance(device, (str, torch.device)):
        return device
    chosen: dict[str, Any] = {}

    def ask(path: str) -> Any:
        if path not in chosen:
            chosen[path] = device(path)
        return chosen[path]
    return ask


def device_for(device: Device, path: str) -> Any:
    """What ``device`` names for the key ``path``, unchecked (None: nothing, the CPU)."""
    if device is None or isinstance(device, (str, torch.device, int)):
        return device
    if callable(device):
        return device(path)
    for pattern, dev in device.items():
        if path == pattern or fnmatch.fnmatchcase(path, pattern):
            return dev
    return None


def target_device(device: Device, key: str, file: str, available: bool = True) -> torch.device | None:
    """The device the leaf ``key`` of ``file`` goes to: None for the CPU (any spelling), else a
    device. Raises TensorStoreError naming the file, the key and the device for an invalid
    device, the meta device, and (``available``) a CUDA device this torch cannot use."""
    dev = device_for(device, key)
    if dev is None:
        return None
    try:
        d = torch.device(dev)
    except (RuntimeError, TypeError, ValueError) as e:
        raise TensorStoreError(f"{file}: key {key!r}: invalid device {dev!r} ({e})") from e
    if d.type == "cpu":
        return None
    if d.type == "meta":
        raise TensorStoreError(f"{file}: key {key!r}: cannot load data onto the meta device")
    if available:
        check_available(d, key, file)
    return d


def check_available(device: torch.device, key: str, file: str) -> None:
    """Raise TensorStoreError naming the file, the key and ``device`` when it is a CUDA device
    that this torch cannot use."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TensorStoreError(f"{file}: key {key!r}: device {str(device)!r} is not available (this torch has no "
                               "usable CUDA device)")


def staged(device: torch.device) -> bool:
    """True for devices whose tensors a load fills through staging buffers (not the CPU)."""
    return device.type != "cpu"


def gds_device(device: torch.device) -> bool:
    """True for devices that GPUDirect Storage can fill (CUDA)."""
    return device.type == "cuda"


class Stagers(dict):  # type: ignore[type-arg]  # torch.device -> Stager
    """The staging buffers of each device a store loads to, made on first use: ``stagers[dev]``."""

    def __missing__(self, device: torch.device) -> Stager:
        stager = self[device] = Stager(device)
        return stager


def device_empty(shape: tuple[int, ...], dtype: torch.dtype, device: Any, key: str) -> torch.Tensor:
    """``torch.empty`` on ``device``. Raises TensorStoreError naming ``key`` and the device when
    it is out of memory or cannot be used (no such device index, a backend not built in)."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError as e:
        raise TensorStoreError(f"out of device memory allocating key {key!r} ({list(shape)} {dtype}) on {device}") from e
    except (RuntimeError, AssertionError, ValueError) as e:
        raise TensorStoreError(f"cannot allocate key {key!r} ({list(shape)} {dtype}) on device {str(device)!r} ({e})") from e


def batched() -> bool:
    """True when loads to a device pack many tensors into each staging buffer
    (:meth:`Stager.copy_many`): whenever GPUDirect Storage is not used (see :data:`GDS`)."""
    return _kvikio() is None


_kvikio_module: Any = False  # not looked up yet


def _kvikio() -> Any | None:
    """The kvikio module when GPUDirect Storage should be used (see :data:`GDS`), else None."""
    global _kvikio_module
    if GDS is False:
        return None
    if _kvikio_module is False:
        try:
            import kvikio
            import kvikio.defaults
        except Exception:  # ImportError, or a broken CUDA install
            kvikio = None
        _kvikio_module = kvikio
    kvikio = _kvikio_module
    if kvikio is None or GDS is True:
        return kvikio
    prefers = getattr(kvikio.defaults, "is_compat_mode_preferred", None)
    try:
        compat = prefers() if prefers is not None else bool(kvikio.defaults.compat_mode())
    except Exception:
        return None
    return None if compat else kvikio


def gds_read(path: str, offset: int, dest: torch.Tensor) -> bool:
    """Read ``dest.nbytes`` bytes at file ``offset`` straight into the contiguous CUDA tensor
    ``dest`` with kvikio. Returns False (having changed nothing that a staged read will not
    overwrite) when GDS is unavailable or the read fails."""
    kvikio = _kvikio()
    if kvikio is None or dest.numel() == 0:
        return False
    nbytes = dest.numel() * dest.element_size()
    try:
        with kvikio.CuFile(path, "r") as f:
            got = f.pread(dest.reshape(-1).view(torch.uint8), nbytes, offset).get()
    except Exception:
        return False
    return got == nbytes
