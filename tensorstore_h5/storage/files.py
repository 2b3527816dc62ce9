"""Local files: positional reads of one open file straight into tensor memory (``os.preadv``),
its page-cache probes and readahead advice, copy-on-write mappings of its pages, and whole
writes, buffered or ``O_DIRECT`` through a page-aligned bounce buffer.

Every file opened for reading (checkpoint files, shards, indexes) goes through
:func:`open_regular`: only regular files are read (symlinks to them too), anything else
(FIFO, directory, device, socket) is refused before a byte is read, and a FIFO never blocks
the open. Small files read whole (indexes, JSON) go through :func:`read_small`, whose size
cap is checked before reading. Every refusal is a :class:`PathError` naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import (
    FileAccessError, FormatError, InvalidPathError, MissingFileError, NotRegularFileError, PathError,
)

if TYPE_CHECKING:
    import torch  # imported by the mapped reads only: a layout is listed without torch

__all__ = [
    "MAX_JSON_BYTES", "path_error", "check_path", "open_regular", "read_small",
    "WRITE_CALL_BYTES", "READAHEAD_BYTES", "coalesce", "Source", "RawFile", "FileMap", "pwrite_all", "DIRECT_ALIGN",
    "DIRECT_MIN_BYTES", "DIRECT_BUFFER_BYTES", "DirectWrites", "is_url", "is_fileobj", "local_path",
]


# ---------------------------------------------------------------------------- what a target names


def is_url(target: Any) -> bool:
    """True for a string with a scheme other than a Windows drive letter (``s3://``, ``https://``)."""
    return isinstance(target, str) and "://" in target and len(target.split("://", 1)[0]) > 1


def is_fileobj(target: Any) -> bool:
    """True for a readable, seekable object that is not a path."""
    return hasattr(target, "read") and hasattr(target, "seek") and not isinstance(target, (str, bytes, os.PathLike))


def local_path(target: Any) -> str | None:
    """The local path of a path or a ``file://`` URL, else None (a URL or a file object:
    ``storage.remote`` reads those)."""
    if isinstance(target, os.PathLike):
        return os.fspath(target)
    if isinstance(target, str):
        if target.startswith("file://"):
            return target[len("file://"):]
        return None if is_url(target) else target
    return None


# ---------------------------------------------------------------------------- regular files only


MAX_JSON_BYTES = 256 * 2**20
"""Largest JSON file read whole that is not a directory index (a Hugging Face
``*.safetensors.index.json``, ~100 KiB for the largest models; 256 MiB): larger ones are
refused from their size, before any byte is read. Directory indexes have their own cap
(``sharded.index.MAX_INDEX_BYTES``)."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _shown(path: str | bytes) -> str:
    """``path`` for a message: decoded, and a NUL written as ``\\0``."""
    return os.fsdecode(path).replace("\0", "\\0")


def _symlink_note(path: str | bytes) -> str:
    """`` (a symlink to <target>)`` where ``path`` is a symlink, else ``""``."""
    try:
        return f" (a symlink to {os.fsdecode(os.readlink(path))})" if os.path.islink(path) else ""
    except (OSError, ValueError):
        return ""


def _not_regular(path: str | bytes, mode: int, what: str) -> NotRegularFileError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    err = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    return NotRegularFileError(f"{_shown(path)}{_symlink_note(path)}: the {what} is {kind}, not a regular file; "
                               "refused without reading it", _shown(path), err)


def path_error(err: OSError, path: str | bytes, what: str = "file") -> PathError:
    """The library's error for ``err``, raised opening or reading ``path`` (named in the message,
    as ``the <what>``): MissingFileError, FileAccessError, NotRegularFileError (a directory) or
    PathError; ``err`` itself where it is a PathError already."""
    if isinstance(err, PathError):
        return err
    shown, note = _shown(path), _symlink_note(path)
    if isinstance(err, FileNotFoundError):
        return MissingFileError(f"{shown}{note}: {err.strerror or 'No such file or directory'} (the {what})", shown,
                                errno.ENOENT)
    if isinstance(err, PermissionError):
        return FileAccessError(f"{shown}{note}: {err.strerror or 'Permission denied'} (cannot read the {what})", shown,
                               err.errno)
    if isinstance(err, IsADirectoryError):
        return NotRegularFileError(f"{shown}{note}: the {what} is a directory, not a regular file; refused without "
                                   "reading it", shown, errno.EISDIR)
    return PathError(f"{shown}{note}: cannot read the {what} ({err.strerror or err})", shown, err.errno)


def _check_regular(fd: int, path: str | bytes, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode, what)
    return st


def check_path(path: str | bytes) -> None:
    """Raise InvalidPathError (naming the path, a NUL shown as ``\\0``) where ``path`` holds a
    NUL character, which no file name can (the OS calls would raise a bare ValueError)."""
    if ("\0" if isinstance(path, str) else b"\0") in path:
        raise InvalidPathError(f"{_shown(path)}: the path holds a NUL character, which no file name can; refused",
                               _shown(path), errno.EINVAL)


def open_regular(path: str | os.PathLike[str], what: str = "file") -> int:
    """A read-only, blocking, close-on-exec descriptor of ``path``, which must be a regular file
    (a symlink to one is followed). ``what`` names the file in messages ("directory index").

    The path is ``stat``-ed first, so that a FIFO, socket or device is never opened; the open
    itself uses ``O_RDONLY | O_NONBLOCK | O_NOCTTY`` (a FIFO swapped in meanwhile cannot block
    it) and is checked again with ``fstat`` before ``O_NONBLOCK`` is cleared.

    Raises InvalidPathError (a NUL in the path), MissingFileError (a FileNotFoundError),
    FileAccessError (a PermissionError), NotRegularFileError (a FormatError: directory, FIFO,
    device, socket) or PathError (another OSError); each names the path.
    """
    p = os.fspath(path)
    check_path(p)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(p, st.st_mode, what)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise path_error(e, p, what) from e
    try:
        _check_regular(fd, p, what)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES, what: str = "file") -> bytearray:
    """The whole content of the regular file ``path`` (opened by :func:`open_regular`), at most
    ``limit`` bytes: a larger file is refused from its ``fstat`` size before any byte is read,
    and one that grows past ``limit`` while it is read is refused too.

    Raises what :func:`open_regular` raises, FormatError (naming the path) for a file larger
    than ``limit`` bytes, and PathError for a failed read.
    """
    fd = open_regular(path, what)
    shown = _shown(os.fspath(path))

    def too_big(size: int | str) -> FormatError:
        from ..display import human_bytes

        return FormatError(f"{shown}: the {what} is {size} bytes, more than the {human_bytes(limit)} a {what} may "
                           "hold; refused without reading it")

    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise too_big(size)
        buf = bytearray(size + 1)  # one byte more: a file that grew since fstat is seen
        done = 0
        with memoryview(buf) as view:
            while done < len(buf):
                n = os.readv(fd, [view[done:]])
                if n == 0:
                    break
                done += n
        while done == len(buf):  # it grew: read on, up to the cap
            more = os.read(fd, min(1 << 24, limit + 1 - done))
            if not more:
                break
            buf += more
            done += len(more)
            if done > limit:
                raise too_big(f"more than {done - 1}")
        del buf[done:]
        return buf
    except OSError as e:
        raise path_error(e, os.fspath(path), what) from e
    finally:
        os.close(fd)


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
    remote = False
    """True for a source that fetches over a network (``remote.RemoteSource``)."""

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

    The file is opened once (or adopted from ``fd``) by :func:`open_regular`: only a regular
    file (or a symlink to one) is read. Every read goes to that open file, so a file renamed
    over the path later (a save replacing it) is never mixed in. ``size`` is its length when
    opened. ``what`` names the file in messages. Raises what :func:`open_regular` raises
    (PathError subclasses naming the path: MissingFileError is a FileNotFoundError,
    FileAccessError a PermissionError, NotRegularFileError a FormatError); an adopted ``fd``
    that is not a regular file is closed.
    """

    def __init__(self, path: str, fd: int | None = None, what: str = "checkpoint file") -> None:
        self.path = path
        self._fd: int | None = open_regular(path, what) if fd is None else fd
        try:
            st = _check_regular(self._fd, path, what)
        except BaseException:
            self.close()
            raise
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
        import torch

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
            import torch

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
