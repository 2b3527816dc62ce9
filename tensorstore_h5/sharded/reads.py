"""Where a piece's bytes are and how they are read: the directory's format-2 files, opened on
first use and checked against the index before any byte is read, and hyperslab reads, run by
run or in windows of whole rows, straight into the destination where it is contiguous."""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import FormatError, TensorStoreError
from ..format import checksum
from ..format import layout as fmt
from ..format.dtypes import DtypeSpec, bits_view
from ..format.layout import ArrayEntry, Chunked, Contiguous, TensorEntry
from ..format.slicing import Selection, contiguous_stride
from ..reading.tensors import why
from ..storage import files, memory, parallel
from .index import DirectoryIndex, Piece, ShardedArrayEntry, ShardedTensorEntry

__all__ = [
    "RUN_EXACT_BYTES", "RUN_SPARSE_BYTES", "WINDOW_WASTE", "WINDOW_BYTES", "Loc", "Th5Files", "Reads",
    "piece_overlap", "block_selection",
]

RUN_EXACT_BYTES = 16 << 10
"""A hyperslab whose contiguous runs (the bytes of one row of the selection) are at least this
long is read run by run: exactly its bytes, one ``pread`` per run, straight into the
destination; so are runs of at least :data:`RUN_SPARSE_BYTES` that are less than
1/:data:`WINDOW_WASTE` of their rows. Other runs are read in windows of :data:`WINDOW_BYTES` of
whole rows and copied out of them: from the page cache, one system call per window of 2 MiB
beats one per run (measured on 2 cores, 64 MiB of float32, half of every row: 5.5 against
1.8 GB/s for runs of 2 KiB, 4.6 against 3.3 for 8 KiB, 4.7 against 4.4 for 16 KiB, where
reading only the hyperslab wins for data not in the page cache; an eighth of every row: 1.8
against 1.4 for 2 KiB, 1.6 against 2.5 for 4 KiB)."""
RUN_SPARSE_BYTES = 2 << 10
WINDOW_WASTE = 8
WINDOW_BYTES = 2 << 20

# ---------------------------------------------------------------------------- where a piece's bytes are


class Loc(NamedTuple):
    """A located piece: raw row-major bytes at ``offset`` of ``raw`` (uncompressed data), or
    ``handle`` (a TensorHandle of a compressed dataset), or neither (no elements). Raw bytes of a
    format-2 file come with their checksums: ``hashes``, one per ``block`` bytes (None: none
    stored, as in safetensors files)."""

    path: str
    key: str
    raw: files.RawFile | None = None
    offset: int = 0
    handle: Any = None
    hashes: tuple[int, ...] | None = None
    block: int = 0


class Th5Files:
    """The format-2 files named by an index, opened once each and checked against it (length
    and layout hash) before any byte is read; every error names the file and the key."""

    def __init__(self, index: DirectoryIndex) -> None:
        self.index = index
        self._stores: dict[str, Any] = {}

    def store(self, name: str, key: str) -> Any:
        s = self._stores.get(name)
        if s is None:
            s = self._stores[name] = self._open(name, key)
        return s

    def _open(self, name: str, key: str) -> Any:
        from ..reading.store import Store

        full = os.path.join(self.index.directory, name)
        size, layout_hash = self.index.files[name]
        where = f"{full}: key {key!r}"
        try:
            raw = files.RawFile(full)
        except FileNotFoundError:
            raise FormatError(f"{where}: the file is missing; the index {self.index.path} names it "
                              "(a rank that did not finish, or a file removed by hand)") from None
        except OSError as e:
            raise FormatError(f"{where}: cannot open the file ({e})") from e
        try:
            if raw.size != size:
                what = "truncated" if raw.size < size else "longer than recorded"
                raise FormatError(f"{where}: the file is {what}: {raw.size} bytes, the index {self.index.path} records {size}")
            head = raw.read(0, fmt.HEADER_SIZE)
            if head[:8] != fmt.MAGIC:
                raise FormatError(f"{where}: not a tensorstore_h5 format-2 file (a foreign file where the index "
                                  f"{self.index.path} names one)")
            header = fmt.parse_header(head, full, raw.size)
            if layout_hash is not None and header.layout_hash != layout_hash:
                raise FormatError(f"{where}: the file's layout checksum differs from the one the index {self.index.path} "
                                  "records: it is not the file this checkpoint wrote (a file of another save or checkpoint)")
        except FormatError as e:
            if key in str(e):
                raise
            raise FormatError(f"{e} (key {key!r})") from e
        except (OSError, EOFError) as e:
            raise FormatError(f"{where}: cannot read the file ({e})") from e
        finally:
            raw.close()
        try:
            store = Store(full)
        except FormatError as e:
            raise FormatError(f"{e} (key {key!r})") from e
        except OSError as e:
            raise FormatError(f"{where}: cannot read the file ({e})") from e
        if store.format_version not in (2, 3):
            store.close()
            raise FormatError(f"{where}: not a tensorstore_h5 format-2 file")
        try:
            store._layout.check_disjoint()  # pieces of many keys are read from it: no two may share bytes
        except FormatError:
            store.close()
            raise
        return store

    def entry(self, piece: Piece, owner: str, kind: type = TensorEntry) -> tuple[Any, Any]:
        """The store and checked file entry of ``piece`` of the tensor at ``owner``."""
        store = self.store(piece.file, piece.key)
        e = store._layout.entry(piece.key)
        full = os.path.join(self.index.directory, piece.file)
        if not isinstance(e, kind):
            what = "no such key" if e is None else f"a {type(e).__name__}, not a {' or '.join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))}"
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {owner!r}): {what} in the file the index "
                              f"{self.index.path} names")
        if tuple(e.shape) != tuple(piece.shape):
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {owner!r}): the dataset has shape {list(e.shape)}, "
                              f"the index {self.index.path} records {list(piece.shape)}")
        return store, e

    def locate(self, piece: Piece, entry: ShardedTensorEntry) -> Loc:
        store, e = self.entry(piece, entry.path)
        full = os.path.join(self.index.directory, piece.file)
        if e.dtype != entry.dtype:
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {entry.path!r}): dtype {e.dtype.name}, the index "
                              f"{self.index.path} records {entry.dtype.name}")
        where = e.extent
        if isinstance(where, Contiguous):
            return Loc(full, piece.key, raw=store._reader.rawfile(), offset=where.offset, hashes=where.hashes,
                       block=where.block)
        if isinstance(where, Chunked):
            from ..reading.store import TensorHandle

            return Loc(full, piece.key, handle=TensorHandle(store, e))
        return Loc(full, piece.key)

    def read_array(self, entry: ShardedArrayEntry) -> np.ndarray:
        if len(entry.pieces) != 1 or any(entry.pieces[0].offsets):
            raise FormatError(f"{self.index.path}: key {entry.path!r}: an array is stored as one piece")
        store, e = self.entry(entry.pieces[0], entry.path, ArrayEntry)
        if e.dtype != entry.dtype:
            raise FormatError(f"{os.path.join(self.index.directory, entry.pieces[0].file)}: key {entry.pieces[0].key!r}: "
                              f"dtype {e.dtype}, the index records {entry.dtype}")
        return store._reader.read_array(e, verify=False)

    def close(self) -> None:
        for s in self._stores.values():
            s.close()
        self._stores.clear()


# ---------------------------------------------------------------------------- reading hyperslabs


class Reads:
    """Hyperslab reads of many pieces into their destinations, run on the I/O thread pool.

    Raw reads are queued as jobs of about :data:`parallel.PIECE_BYTES` each; destinations that are not
    contiguous CPU tensors of the stored dtype are read into a temporary and copied after
    :meth:`run` (cast like ``copy_``). When the first raw region of at least two pieces is not
    in the page cache (:meth:`files.RawFile.cached`), the reads run on :data:`parallel.COLD_IO_THREADS`
    threads, as a cold load of one file does: more reads in flight keep the disk busy."""

    def __init__(self) -> None:
        self.plan = parallel.ReadPlan(None)  # type: ignore[arg-type]  # jobs only: each names its own file
        self.posts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._probed = False

    def region(self, loc: Loc, shape: tuple[int, ...], spec: DtypeSpec, sel: Selection, dest: torch.Tensor) -> None:
        """Read ``sel`` (a box or strided selection, ``sel.shape == sel.count``) of the stored
        piece of ``shape`` into ``dest`` (any tensor of shape ``sel.count``)."""
        if sel.empty:
            return
        dtype = spec.torch_dtype
        direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
        buf = dest if direct else memory.empty(sel.count, dtype)
        if not direct:
            self.posts.append((dest, buf))
        if loc.raw is not None:
            self._raw(loc, shape, spec.itemsize, sel, buf)
        elif loc.handle is not None:
            index = tuple(slice(a, a + (c - 1) * s + 1, s) for a, c, s in zip(sel.start, sel.count, sel.step))
            loc.handle.read(out=buf, index=index)
        else:
            raise FormatError(f"{loc.path}: key {loc.key!r}: the dataset holds no data")

    def _raw(self, loc: Loc, shape: tuple[int, ...], itemsize: int, sel: Selection, buf: torch.Tensor) -> None:
        raw, base = loc.raw, loc.offset
        assert raw is not None
        strides = contiguous_stride(shape)
        wrap = functools.partial(_keyed, loc)
        if not self._probed and buf.numel() * itemsize >= 2 * parallel.PIECE_BYTES:  # reads that several threads share
            self._probed = True
            if not raw.cached([(base, math.prod(shape) * itemsize)]) and not self.plan.nbytes:
                self.plan = parallel.ReadPlan(None, parallel.COLD_IO_THREADS)  # type: ignore[arg-type]
        if sel.contiguous_rows:
            first = base + sum(a * s for a, s in zip(sel.start, strides)) * itemsize
            view = memory.tensor_buffer(buf)
            for i in range(0, len(view), parallel.PIECE_BYTES):
                piece = view[i:i + parallel.PIECE_BYTES]
                self.plan.add_job(wrap(functools.partial(raw.pread, first + i, piece)), len(piece))
            return
        if all(s == 1 for s in sel.step):
            self._box_jobs(raw, base, shape, itemsize, sel, buf, wrap)
            return
        bits = bits_view(buf)
        fetch = functools.partial(_fetch, raw, base)
        self.plan.add_job(wrap(functools.partial(parallel.gather, fetch, shape, itemsize, sel, bits)),
                          buf.numel() * itemsize)

    def _box_jobs(self, raw: files.RawFile, base: int, shape: tuple[int, ...], itemsize: int, sel: Selection,
                  buf: torch.Tensor, wrap: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
        """A box that is not one byte range: runs of ``count[d]`` elements of the last partial
        dimension ``d`` (with the whole dimensions after it), one per index of the dimensions
        before. Each run is read on its own (:data:`RUN_EXACT_BYTES`), or windows of whole rows
        are read and the runs copied out of them."""
        strides = contiguous_stride(shape)
        d = max(k for k in range(len(shape)) if sel.count[k] != shape[k])  # >= 1: not one byte range
        run = sel.count[d] * strides[d] * itemsize
        pitch = strides[d - 1] * itemsize
        rows = sel.count[d - 1]
        exact = run >= RUN_EXACT_BYTES or (run >= RUN_SPARSE_BYTES and run * WINDOW_WASTE <= pitch)
        flat = buf.reshape(-1).view(torch.uint8)
        view = memory.tensor_buffer(buf)
        first = base + (sel.start[d - 1] * strides[d - 1] + sel.start[d] * strides[d]) * itemsize
        outer = [range(a, a + c) for a, c in zip(sel.start[:d - 1], sel.count[:d - 1])]
        per = max(1, (parallel.PIECE_BYTES if exact else WINDOW_BYTES) // (run if exact else pitch))
        for k, idx in enumerate(itertools.product(*outer)):
            o = first + sum(i * s for i, s in zip(idx, strides)) * itemsize
            at = k * rows * run
            for r0 in range(0, rows, per):
                n = min(per, rows - r0)
                dest = (at + r0 * run, at + (r0 + n) * run)
                if exact:
                    job = functools.partial(_read_runs, raw, [o + (r0 + r) * pitch for r in range(n)],
                                            view[dest[0]:dest[1]], run)
                else:
                    job = functools.partial(_read_window, raw, o + r0 * pitch, pitch, run, n, flat[dest[0]:dest[1]])
                self.plan.add_job(wrap(job), n * (run if exact else pitch))

    def run(self) -> None:
        try:
            self.plan.run()
        except BaseException:
            self.plan.abandon()
            raise
        with torch.no_grad():
            for dest, buf in self.posts:
                if dest.dtype == buf.dtype:
                    bits_view(dest).copy_(bits_view(buf))
                else:
                    dest.copy_(buf)
        self.posts.clear()


def _read_runs(raw: files.RawFile, offsets: list[int], view: memoryview, run: int) -> None:
    """Fill consecutive ``run``-byte slices of ``view`` from the file offsets, one system call
    each (a short read is finished by :meth:`files.RawFile.pread`, which raises at the end of
    the file)."""
    if not hasattr(raw, "_fileno"):  # not a local file: its own reads
        for i, off in enumerate(offsets):
            raw.pread(off, view[i * run:(i + 1) * run])
        return
    fd, preadv = raw._fileno(), os.preadv
    for i, off in enumerate(offsets):
        piece = view[i * run:(i + 1) * run]
        got = preadv(fd, [piece], off)
        if got != run:
            raw.pread(off + got, piece[got:])


_windows = threading.local()


def _window(nbytes: int) -> torch.Tensor:
    """This thread's window buffer of at least ``nbytes`` (kept: memory touched once, not
    faulted in again for every window)."""
    buf = getattr(_windows, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _windows.buf = torch.empty(max(nbytes, WINDOW_BYTES), dtype=torch.uint8, device="cpu")
    return buf[:nbytes]


def _read_window(raw: files.RawFile, offset: int, pitch: int, run: int, n: int, dest: torch.Tensor) -> None:
    """Read ``n`` rows of ``pitch`` bytes from ``offset`` in one system call and copy the first
    ``run`` bytes of each into ``dest`` (contiguous uint8, ``n * run`` bytes)."""
    window = _window((n - 1) * pitch + run)
    raw.pread(offset, memoryview(window.numpy()))
    dest.view(n, run).copy_(window.as_strided((n, run), (pitch, 1)))


def _fetch(raw: files.RawFile, base: int, off: int, view: memoryview) -> None:
    raw.pread(base + off, view)


def _keyed(loc: Loc, job: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            job()
        except TensorStoreError:
            raise
        except (OSError, EOFError, ValueError, checksum.ChecksumError) as e:  # (checked in a staging buffer)
            raise FormatError(f"{loc.path}: key {loc.key!r}: {why(e)}") from e
    return run


def piece_overlap(sel: Selection, piece: Piece) -> tuple[Selection, tuple[slice, ...]] | None:
    """The part of ``sel`` (of the global tensor) inside ``piece``: the selection of the piece's
    own elements, and the slices of the result (shaped ``sel.count``) it fills; None if none."""
    start, count, dest = [], [], []
    for a, c, st, o, s in zip(sel.start, sel.count, sel.step, piece.offsets, piece.shape):
        lo = max(0, -((a - o) // st))
        hi = min(c, -((a - o - s) // st))
        if lo >= hi:
            return None
        start.append(a + lo * st - o)
        count.append(hi - lo)
        dest.append(slice(lo, hi))
    cnt = tuple(count)
    return Selection(piece.shape, tuple(start), cnt, sel.step, cnt), tuple(dest)


def block_selection(shape: tuple[int, ...], start: Sequence[int], count: Sequence[int]) -> Selection:
    cnt = tuple(int(c) for c in count)
    return Selection(tuple(shape), tuple(int(a) for a in start), cnt, (1,) * len(shape), cnt)
