"""Local files: positional reads of one open file straight into tensor memory (``os.preadv``),
its page-cache probes and readahead advice, copy-on-write mappings of its pages, and whole
writes, buffered or ``O_DIRECT`` through a page-aligned bounce buffer.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "WRITE_CALL_BYTES", "READAHEAD_BYTES", "coalesce", "Source", "RawFile", "FileMap", "pwrite_all", "DIRECT_ALIGN",
    "DIRECT_MIN_BYTES", "DIRECT_BUFFER_BYTES", "DirectWrites",
]


WRITE_CALL_BYTES = 1 << 30
"""Largest single ``pwrite`` a writer issues (Linux writes at most 0x7ffff000 bytes a call)."""

READAHEAD_BYTES = 64 * 2**20
"""``Store.items`` over a local file asks the kernel to read this many bytes of the next tensors
ahead of the one being read, and ``Store.load`` all it will read (see :meth:`RawFile.willneed`),
so that from a cold page cache the disk works ahead of the reads (0: never)."""


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


class Source:
    """What every byte source gives a reader (docs/ARCHITECTURE.md, "A storage backend"):
    ``path`` (for messages), ``size`` (bytes) and :meth:`pread`; :meth:`read` and :meth:`head`
    follow from those. Sources read where the bytes lie, so :meth:`prefetch` and
    :meth:`release` do nothing; a source that fetches ahead (``remote.RemoteSource``) has its own."""

    path: str
    size: int

    def pread(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset``. Raises EOFError past the end."""
        raise NotImplementedError

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes at ``offset`` (EOFError past the end of the file)."""
        buf = bytearray(nbytes)
        self.pread(offset, memoryview(buf))
        return bytes(buf)

    def head(self, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes (fewer in a shorter file)."""
        return self.read(0, min(self.size, nbytes))

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to do: the bytes are read where they lie (remote sources fetch here)."""

    def release(self) -> None:
        """Nothing to do (see :meth:`prefetch`)."""


class RawFile(Source):
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
