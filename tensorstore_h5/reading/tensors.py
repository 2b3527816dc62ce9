"""Reading one tensor, or a slice of it, of an open file: where its bytes are (checked), and
every way they reach a tensor: positional reads (queued on a read plan or read here),
decoded chunks, strided gathers, copy-on-write mappings, staging to a device, GPUDirect
Storage, libhdf5's own reads (format 1 and foreign files); checksums checked on request.

:class:`TensorReader` is what a :class:`~tensorstore_h5.reading.store.Store` reads through;
:class:`~tensorstore_h5.reading.many.Reader` adds reads of many tensors at once.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import DecodeError, FormatError, MismatchError, RemoteError, TensorStoreError, few
from ..format import checksum
from ..format import layout as fmt
from ..format.dtypes import bits_view
from ..format.layout import ArrayEntry, Chunked, Contiguous, ForeignEntry, TensorEntry, ValueEntry
from ..format.slicing import Selection, contiguous_stride, select as select_index, whole
from ..storage import Deferred, files, memory, parallel

if TYPE_CHECKING:
    from ..storage.libhdf5 import HDF5Read
    from ..transfer import Device

# imported where they are needed: chunks to decode, files only libhdf5 reads, tensors bound for
# a device (a read into CPU memory never imports the device wing: ~0.3 ms of a fresh process)
decoders: Any = Deferred(f"{__package__.rpartition('.')[0]}.codecs.decoders", globals(), "decoders")
libhdf5: Any = Deferred(f"{__package__.rpartition('.')[0]}.storage.libhdf5", globals(), "libhdf5")
transfer: Any = Deferred(f"{__package__.rpartition('.')[0]}.transfer", globals(), "transfer")
from .listing import data_bytes

__all__ = ["TensorReader", "READ_ERRORS", "checking", "data_bytes"]  # (data_bytes: .listing's)

def _by_hdf5(where: Any) -> bool:
    """True for the location of a dataset that only libhdf5 reads (an ``HDF5Read``), told
    apart without importing libhdf5: every other location is an extent (or None)."""
    return where is not None and not isinstance(where, (Contiguous, Chunked))


READ_ERRORS = (OSError, EOFError, DecodeError, checksum.ChecksumError, ValueError)
"""What a read of stored bytes raises for a damaged or changed file (re-raised as FormatError)."""


class TensorReader:
    """Reads of single tensors of one open source (``raw``: a :class:`~..storage.files.RawFile`,
    :class:`~..storage.remote.RemoteSource` or :class:`~..storage.remote.FileObjSource`; ``file``:
    the h5py file of a format-1 or foreign file, else None), named ``path`` in errors.
    Owns both and closes them (:meth:`close`)."""

    def __init__(self, path: str, raw: Any, file: Any = None) -> None:
        self.path = path
        self._raw = raw
        self._file = file
        self.local = isinstance(raw, files.RawFile)
        self._located: dict[tuple[str, int | None], fmt.Extent | HDF5Read] = {}  # format 1 / foreign: checked locations
        self._pack_len: dict[str, int] = {}
        self._staging: Any = None  # transfer.Stagers, made by the first read to a device

    @property
    def closed(self) -> bool:
        return self._raw is None

    def close(self) -> None:
        """Close the file (idempotent); device staging buffers go back to the process's pool."""
        self._located.clear()
        if self._staging is not None:
            self._staging.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    @property
    def _stagers(self) -> Any:
        """The staging buffers of each device this reader has filled tensors of (``transfer.Stagers``)."""
        if self._staging is None:
            self._staging = transfer.Stagers()
        return self._staging

    @staticmethod
    def staged(device: torch.device) -> bool:
        """True for a target on a device that reads fill through the staging buffers
        (:func:`~..transfer.staged`); never for the CPU's memory, whose reads so import no device
        wing (~0.3 ms of the first read in a fresh process)."""
        return device.type != "cpu" and transfer.staged(device)

    def rawfile(self) -> Any:
        if self._raw is None:
            raise ValueError(f"{self.path}: the store is closed")
        return self._raw

    def run(self, plan: parallel.ReadPlan) -> None:
        try:
            plan.run()
        except TensorStoreError:
            raise
        except READ_ERRORS as e:
            raise FormatError(f"{self.path}: cannot read tensor data: {why(e)}") from e

    def where(self, entry: TensorEntry | ArrayEntry) -> fmt.Extent | HDF5Read | None:
        """Where ``entry``'s bytes are: its checked extent, an HDF5Read (format 1 and foreign
        files only), or None when it has no bytes. Raises FormatError for anything the
        format does not allow."""
        if self._file is None:
            self.rawfile()
            return entry.extent
        packed = entry.packed if isinstance(entry, TensorEntry) else None
        key = (entry.dataset, packed)
        where = self._located.get(key)
        if where is None:
            if self._raw is None:
                raise ValueError(f"{self.path}: the store is closed")
            where = self._located[key] = libhdf5.locate(self._file, entry, self.path, self._raw.size, self._pack_len)
        if isinstance(where, Contiguous) and where.nbytes == 0:
            return None
        return where

    def chunked(self, entry: TensorEntry) -> Chunked | None:
        """The checked chunk list of a compressed tensor, or None for other storage."""
        where = self.where(entry)
        return where if isinstance(where, Chunked) else None

    def stored_bytes(self, entry: TensorEntry) -> int:
        where = self.where(entry)
        if where is None:
            return 0
        if isinstance(where, Contiguous):
            return where.nbytes
        if isinstance(where, Chunked):
            return where.stored_bytes
        return int(where.dsid.get_storage_size())

    def compression(self, entry: TensorEntry) -> dict[str, Any] | None:
        where = self.where(entry)
        if isinstance(where, Chunked):
            return {"filters": [{"id": where.filter_id, "name": fmt.FILTER_NAMES.get(where.filter_id, str(where.filter_id)),
                                 "options": list(where.filter_values)}], "chunks": list(where.chunk_shape)}
        if _by_hdf5(where):
            from ..codecs.presets import describe

            return describe(where.dsid.get_create_plist())
        return None

    def keyed(self, job: Callable[[], None], entry: TensorEntry | ArrayEntry) -> Callable[[], None]:
        """``job`` with read errors turned into a FormatError naming the file and key (a
        failed request stays a RemoteError and gains the key)."""
        def run() -> None:
            try:
                if self.local:
                    job()
                else:
                    with self.fetching([entry.path]):
                        job()
            except TensorStoreError:
                raise
            except READ_ERRORS as e:
                raise FormatError(f"{self.path}: key {entry.path!r}: {why(e)}") from e
        return run

    @contextmanager
    def fetching(self, keys: list[str]) -> Iterator[None]:
        """Remote errors raised inside name ``keys``, the keys whose bytes are fetched (an
        error that already names a key is left as it is)."""
        try:
            yield
        except RemoteError as e:
            message, prefix = str(e), f"{self.path}: "
            if not keys or message.startswith(prefix + "key"):
                raise
            rest = message[len(prefix):] if message.startswith(prefix) else message
            names = few([repr(k) for k in keys])
            raise RemoteError(f"{prefix}{'key' if len(keys) == 1 else 'keys'} {names}: {rest}") from e

    def target(self, device: Device, key: str) -> torch.device | None:
        """The device a leaf goes to: None for the CPU (any spelling), else a device that
        exists here. Raises TensorStoreError naming the key and the device otherwise."""
        return None if device is None else transfer.target_device(device, key, self.path)

    def ranges(self, entry: Any, sel: Selection | None = None) -> list[tuple[int, int]]:
        """The ``(offset, nbytes)`` ranges of the file that reading ``sel`` (all by default) of a
        leaf touches (none for plain values, aliases and data only HDF5 reads)."""
        if not isinstance(entry, (TensorEntry, ArrayEntry)) or getattr(entry, "same_as", None):
            return []
        where = self.where(entry)
        if where is None or _by_hdf5(where):
            return []
        lo, hi = touched(entry, sel) if sel is not None and not sel.empty else (0, where.nbytes)
        if isinstance(where, Contiguous):
            return [(where.offset + lo, hi - lo)]
        out = []
        for k in range(where.locate(lo), len(where.chunks)):
            start, _ = where.span(k)
            if start >= hi:
                break
            out.append(where.chunks[k][:2])
        return out

    def read_leaf(self, entry: Any, cache: Any, device: Device, fmap: files.FileMap | None, plan: parallel.ReadPlan | None,
                   verify: bool | None, filled: torch.Tensor | None = None) -> Any:
        """A leaf's value. ``verify``: check the stored checksums (None: of what is read, not of
        what ``fmap`` maps, see :func:`checking`). ``filled``: a tensor already holding the
        entry's stored bytes (:meth:`Reader._fetched` of a remote source), checked and laid
        out here."""
        mapped_check, verify = verify is True, verify is not False
        if isinstance(entry, ValueEntry):
            return entry.value
        if isinstance(entry, ForeignEntry):
            raise FormatError(f"{self.path}: key {entry.path!r} cannot be loaded as a tensor: {entry.reason}")
        if isinstance(entry, ArrayEntry):
            return self.read_array(entry, verify)
        origin = entry.same_as or entry.path
        t = cache.get(origin)
        if t is not None and (isinstance(t, torch.nn.Parameter), t.requires_grad) != (entry.parameter, entry.requires_grad):
            t = flagged(t.detach(), entry)  # the same memory as another key, saved as another kind of tensor
        elif t is None:
            target = self.target(device, entry.path)
            t = self.mapped(entry, fmap, mapped_check) if fmap is not None and target is None else None
            if filled is not None:
                if verify and filled.device.type == "cpu":
                    self.check_hashes(entry, filled)
                elif verify:  # device memory: the stored bytes are read once more on the host
                    self.verify_stored(entry)
                t = self.restore(filled, entry) if entry.stride is not None else filled
            elif t is None and target is not None:  # allocated on the device, filled through the staging buffers
                t = transfer.device_empty(entry.shape, entry.dtype.torch_dtype, target, entry.path)
                self.read_tensor(entry, whole(entry.shape), t, restore_layout=False, verify=verify)
                if entry.stride is not None:
                    t = self.restore(t, entry)  # on the device
            elif t is None:  # queued when nothing is done to it after the read
                where = self.where(entry) if plan is not None and entry.stride is None else None
                if type(where) is Contiguous and 0 < where.nbytes <= parallel.SMALL_READ_BYTES and \
                        (not where.hashes or len(where.hashes) == 1):  # read with its neighbours
                    assert plan is not None
                    t = self.empty(entry, entry.shape)
                    plan.add_small(where.offset, t, lambda job, e=entry: self.keyed(job, e),
                                   where.hashes[0] if verify and where.hashes else None)
                else:
                    t = self.read_tensor(entry, whole(entry.shape), None, restore_layout=True, plan=plan,
                                          verify=verify)
            t = flagged(t, entry)
            cache[origin] = t
        return t

    def read_array(self, entry: ArrayEntry, verify: bool) -> np.ndarray:
        out = np.empty(entry.shape, dtype=entry.dtype)
        where = self.where(entry)
        if where is None:
            return out
        raw = self.rawfile()
        try:
            view = memoryview(out.reshape(-1).view(np.uint8))
            if isinstance(where, Contiguous):
                raw.pread(where.offset, view)
                if verify and where.hashes is not None and checksum.block_hashes(view, where.block) != list(where.hashes):
                    raise checksum.ChecksumError("its data")
            elif isinstance(where, Chunked):
                decoders.ChunkReader(where, raw.pread, verify).read(0, view)
            else:
                where.dsid.read(libhdf5.h5py.h5s.ALL, libhdf5.h5py.h5s.ALL, out)
        except (*READ_ERRORS, *libhdf5.H5_ERRORS) as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: {why(e)}") from e
        return out

    def empty(self, entry: TensorEntry, shape: tuple[int, ...], populate: bool = False) -> torch.Tensor:
        """A new CPU tensor for (part of) ``entry`` (``populate``: see :func:`memory.empty`);
        TensorStoreError naming the key when the memory cannot be had."""
        try:
            return memory.empty(shape, entry.dtype.torch_dtype, populate)
        except (OSError, MemoryError, RuntimeError) as e:
            from ..display import human_bytes

            nbytes = math.prod(shape) * entry.dtype.itemsize
            raise TensorStoreError(f"{self.path}: key {entry.path!r}: cannot allocate {human_bytes(nbytes)} for "
                                   f"{list(shape)} {entry.dtype.name} ({e})") from e

    def restore(self, values: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        assert entry.stride is not None
        try:
            return memory.restore_layout(values, entry.stride)
        except ValueError as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: {e}") from e

    def _hdf5_read(self, entry: TensorEntry, where: HDF5Read, sel: Selection, dest: torch.Tensor) -> None:
        """HDF5's own read of ``sel`` into ``dest`` (compact data, HDF5's filters, conversion;
        a version-1 packed tensor is the range of its pack at its offset)."""
        try:
            if entry.packed is None:
                libhdf5.read_hdf5(where.dsid, entry.dtype.h5_type, dest, sel)
                return
            full = self.empty(entry, entry.shape)
            span = select_index(slice(entry.packed, entry.packed + entry.numel), (self._pack_len[entry.dataset],))
            libhdf5.read_hdf5(where.dsid, entry.dtype.h5_type, full, span)
        except libhdf5.H5_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot read the data ({libhdf5._short(e)})") from e
        picked = bits_view(full)[tuple(slice(a, a + (c - 1) * st + 1, st) for a, c, st in zip(sel.start, sel.count, sel.step))]
        bits_view(dest).copy_(picked.reshape(sel.shape))

    def _hdf5_rows(self, entry: TensorEntry, where: HDF5Read, sel: Selection, limit: int) -> tuple[Any, int]:
        """For staging a row range that only HDF5 can read: ``(fill, align)`` reading whole
        rows into each staging buffer of ``limit`` bytes, or ``(None, 1)`` when the selection
        is not a row range or one row does not fit a buffer."""
        shape = entry.shape
        if not shape or any(st != 1 for st in sel.step) or sel.count[1:] != shape[1:]:
            return None, 1
        row = entry.dtype.itemsize * math.prod(shape[1:])
        if row == 0 or row > limit:
            return None, 1
        align = row
        try:
            dcpl = where.dsid.get_create_plist()
            if dcpl.get_layout() == libhdf5.h5py.h5d.CHUNKED and tuple(dcpl.get_chunk()[1:]) == tuple(shape[1:]) \
                    and dcpl.get_chunk()[0] * row <= limit:
                align = dcpl.get_chunk()[0] * row  # whole chunks per block: none is decoded twice
        except libhdf5.H5_ERRORS:
            pass
        first = sel.start[0]

        def fill(off: int, buf: torch.Tensor) -> None:
            a = first + off // row
            self._hdf5_read(entry, where, select_index(slice(a, a + buf.numel() // row), shape), buf)
        return fill, align

    def mapped(self, entry: TensorEntry, fmap: files.FileMap, verify: bool = False) -> torch.Tensor | None:
        """A tensor of ``fmap`` for a row-major, contiguous, unfiltered dataset whose data
        start at a multiple of the element size, else None (then it is read)."""
        where = self.where(entry)
        if not self.local or not isinstance(where, Contiguous) or entry.stride is not None or \
                where.offset % entry.dtype.itemsize:
            return None
        try:
            t = fmap.tensor(where.offset, entry.nbytes, entry.dtype.torch_dtype, entry.shape)
        except READ_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot map the data ({why(e)})") from e
        if verify:
            self.check_hashes(entry, t)
        return t

    def read_tensor(self, entry: TensorEntry, sel: Selection, out: torch.Tensor | None, restore_layout: bool,
                     plan: parallel.ReadPlan | None = None, verify: bool = False, fetch: bool = False) -> torch.Tensor:
        """Read ``sel`` of ``entry`` into ``out`` (checked first) or a new tensor.

        With ``plan``, raw reads are only queued: the caller runs the plan before using the
        result (only for results that need no copy afterwards). ``verify`` checks
        the stored checksums: all of them for a whole read, else those of the checksum blocks
        or chunks the selection touches. ``fetch``: a remote source first fetches the ranges the
        selection touches (callers that read many tensors fetch for all of them at once).
        """
        dtype = entry.dtype.torch_dtype
        if out is not None and (tuple(out.shape) != sel.shape or out.dtype != dtype):
            raise MismatchError(
                f"{self.path}: key {entry.path!r}: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                f"the selection needs {sel.shape} and {dtype}"
            )
        where = self.where(entry)
        raw = self.rawfile()
        whole_check = verify and sel.full
        partial_check = verify and not sel.full and isinstance(where, Contiguous) and not sel.empty
        if partial_check and not self.local:  # the slice is read from the very bytes that are checked
            assert isinstance(where, Contiguous)
            lo, hi = touched(entry, sel)
            b = where.block
            lo, hi = lo // b * b, min(where.nbytes, -(-hi // b) * b)
            with self.fetching([entry.path]):
                raw.prefetch([(where.offset + lo, hi - lo)])
            fetch = False
        if partial_check:
            self.verify_stored(entry, touched(entry, sel))  # the checksum blocks the selection touches
        if fetch and not self.local and not sel.empty:
            with self.fetching([entry.path]):
                raw.prefetch(self.ranges(entry, sel))  # the chunks or rows it touches, in few requests
        ranged = isinstance(where, (Contiguous, Chunked)) and sel.contiguous_rows
        skip = sum(a * st for a, st in zip(sel.start, contiguous_stride(entry.shape))) * entry.dtype.itemsize \
            if any(sel.start) else 0  # bytes before the selection's first element
        reader = decoders.ChunkReader(where, raw.pread, verify) if isinstance(where, Chunked) else None

        def fetch(off: int, buf: memoryview) -> None:  # logical bytes [off, off + len(buf)) of the dataset
            if reader is not None:
                reader.read(off, buf)
            else:
                assert isinstance(where, Contiguous)
                raw.pread(where.offset + off, buf)

        if out is not None and self.staged(out.device) and out.is_contiguous() and not sel.empty:
            stager = self._stagers[out.device]
            # A compressed tensor's chunks are checked as they decode; contiguous data in the
            # staging buffers, block by block, where whole checksum blocks fit a buffer.
            in_flight = whole_check and isinstance(where, Contiguous) and where.hashes is not None and \
                ranged and where.block <= stager.block_bytes
            gds = self.local and isinstance(where, Contiguous) and ranged and transfer.gds_device(out.device)
            if whole_check and isinstance(where, Contiguous) and (gds or not in_flight):
                self.verify_stored(entry)
            if gds and transfer.gds_read(_fd_path(raw, self.path), where.offset + skip, out):
                return out
            stage, align = None, 1
            if ranged and reader is None and self.local:  # the block read by all the I/O threads at once
                assert isinstance(where, Contiguous)
                at = where.offset + skip
                stage = lambda off, buf: parallel.pread_split(raw.pread, at + off, memory.tensor_buffer(buf))  # noqa: E731
            elif ranged:  # chunks decode on the I/O threads (ChunkReader.read); a remote source's bytes are fetched
                align = reader.chunk_bytes if reader is not None else 1
                stage = lambda off, buf: fetch(skip + off, memory.tensor_buffer(buf))  # noqa: E731
            elif _by_hdf5(where):
                stage, align = self._hdf5_rows(entry, where, sel, stager.block_bytes)
            if stage is not None and in_flight and not (gds and whole_check):
                assert isinstance(where, Contiguous) and where.hashes is not None
                stage, align = _hashing(stage, where.hashes, where.block), where.block
            if stage is not None:
                self.keyed(lambda: self._stagers[out.device].copy(out, stage, entry.path, align=align), entry)()
                return out
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct else self.empty(entry, sel.shape)
        post = (out is not None and not direct) or (out is None and restore_layout and entry.stride is not None)
        if not sel.empty and where is not None:
            queue = plan if plan is not None and not post else None
            if queue is None and (reader is not None or dest.numel() * dest.element_size() > parallel.PIECE_BYTES):
                queue = parallel.ReadPlan(raw)
            if _by_hdf5(where):
                self._hdf5_read(entry, where, sel, dest)
            elif not ranged:
                bits = bits_view(dest).view(sel.count) if dest.element_size() <= 8 else dest.view(sel.count)
                self.keyed(lambda: parallel.gather(fetch, entry.shape, entry.dtype.itemsize, sel, bits), entry)()
            elif reader is not None:
                for job in reader.tasks(skip, memory.tensor_bytes(dest)):
                    assert queue is not None
                    queue.add_job(self.keyed(job, entry), job.n * decoders.DECODE_COST)
            elif queue is None:  # one range under a piece: read here, by the I/O threads at once where it is large
                if self.local and reader is None:
                    assert isinstance(where, Contiguous)
                    at = where.offset + skip
                    self.keyed(lambda: parallel.pread_split(raw.pread, at, memory.tensor_buffer(dest)), entry)()
                else:
                    self.keyed(lambda: fetch(skip, memory.tensor_buffer(dest)), entry)()
                if whole_check:
                    self.check_hashes(entry, dest)
            else:
                assert isinstance(where, Contiguous)
                queue.add(where.offset + skip, dest, lambda job: self.keyed(job, entry),
                          where.hashes if whole_check else None, where.block)
            if queue is not None and queue is not plan:
                self.run(queue)
        if out is None:
            if restore_layout and entry.stride is not None:
                return self.restore(dest, entry)
            return dest
        if not direct:
            with torch.no_grad():
                bits_view(out).copy_(bits_view(dest))
        return out

    def check_hashes(self, entry: TensorEntry, values: torch.Tensor) -> None:
        """Check the contiguous tensor ``values``, all of ``entry``'s stored bytes, against
        its checksums (none in format 1). Raises FormatError naming the key."""
        where = self.where(entry)
        if isinstance(where, Contiguous) and where.hashes is not None and \
                checksum.block_hashes(memory.tensor_buffer(values), where.block) != list(where.hashes):
            raise FormatError(f"{self.path}: key {entry.path!r}: {why(checksum.ChecksumError('its data'))}")

    def verify_stored(self, entry: TensorEntry | ArrayEntry, span: tuple[int, int] | None = None) -> None:
        """Check ``entry``'s stored checksums by reading its bytes once (nothing kept): all of
        them, or (``span``: logical bytes ``[lo, hi)``) those of the checksum blocks or chunks
        that the span touches. Raises FormatError naming the file and key."""
        self.verify_many([entry], {id(entry): span} if span is not None else None)

    def verify_many(self, entries: Sequence[Any], spans: dict[int, tuple[int, int]] | None = None) -> None:
        """Check the stored checksums of every tensor and array entry of ``entries`` (others,
        aliases and data without checksums are skipped) in one pass over their stored bytes
        on the I/O threads: neighbouring small ranges by one ``pread``, each checksum block or
        compressed chunk a job, nothing kept (per-thread scratch of :data:`parallel.PIECE_BYTES`).
        ``spans``: by ``id(entry)``, the logical bytes ``[lo, hi)`` to check (see
        :meth:`verify_stored`). Raises FormatError naming the file and the first bad key."""
        raw = self.rawfile()
        ranges: list[tuple[int, int, int | None, Any]] = []  # file offset, bytes, hash, entry
        jobs: list[Callable[[], None]] = []
        for e in entries:
            if not isinstance(e, (TensorEntry, ArrayEntry)) or getattr(e, "same_as", None) is not None:
                continue
            where = self.where(e)
            if where is None or _by_hdf5(where) or where.hashes is None:
                continue
            lo, hi = spans[id(e)] if spans and id(e) in spans else (0, where.nbytes)
            if hi <= lo:
                continue
            if isinstance(where, Contiguous):
                b = where.block
                for i in range(lo // b, (hi - 1) // b + 1):
                    ranges.append((where.offset + i * b, min(b, where.nbytes - i * b), where.hashes[i], e))
            else:
                reader = decoders.ChunkReader(where, raw.pread, verify=True)
                for k in range(where.locate(lo), len(where.chunks)):
                    start, valid = where.span(k)
                    if start >= hi:
                        break
                    jobs.append(self.keyed(lambda r=reader, s=start, v=valid: r.read(s, _scratch(v)), e))
        ranges.sort(key=lambda r: r[0])
        window: list[tuple[int, int, int | None, Any]] = []
        for r in ranges:
            if window and (r[0] - (window[-1][0] + window[-1][1]) > parallel.SMALL_GAP or
                           r[0] + r[1] - window[0][0] > parallel.PIECE_BYTES):
                jobs.append(self._hash_job(window))
                window = []
            window.append(r)
        if window:
            jobs.append(self._hash_job(window))
        parallel.run_jobs(jobs)  # (a remote source reads what it has not fetched by a request per window)

    def _hash_job(self, window: list[tuple[int, int, int | None, Any]]) -> Callable[[], None]:
        """A job reading the ranges of ``window`` (sorted, close together) by one ``pread`` (or,
        for one range longer than the scratch, piece by piece) and checking each one's hash."""
        raw = self.rawfile()
        first = window[0][0]
        span = window[-1][0] + window[-1][1] - first

        def job() -> None:
            if span > parallel.PIECE_BYTES:  # one block larger than a piece: hashed as a stream
                (offset, n, expected, entry), = window
                h = checksum.stream()
                for at in range(0, n, parallel.PIECE_BYTES):
                    view = _scratch(min(parallel.PIECE_BYTES, n - at))
                    raw.pread(offset + at, view)
                    h.update(view)
                if h.intdigest() != expected:
                    raise checksum.ChecksumError(f"the block at byte {offset} of the file")
                return
            view = _scratch(span)
            raw.pread(first, view)
            for offset, n, expected, entry in window:
                if checksum.digest(view[offset - first:offset - first + n]) != expected:
                    raise FormatError(f"{self.path}: key {entry.path!r}: "
                                      f"{why(checksum.ChecksumError(f'bytes {offset}..{offset + n} of the file'))}")

        return self.keyed(job, window[0][3])


def _hashing(stage: Callable[[int, torch.Tensor], None], hashes: Sequence[int], block: int
             ) -> Callable[[int, torch.Tensor], None]:
    """``stage`` (filling a staging buffer with the bytes at a multiple of ``block``) that then
    checks each checksum block in the buffer on the I/O threads (ChecksumError)."""
    def fill(off: int, buf: torch.Tensor) -> None:
        stage(off, buf)
        view = memory.tensor_buffer(buf)

        def check(i: int) -> None:
            if checksum.digest(view[i:i + block]) != hashes[(off + i) // block]:
                raise checksum.ChecksumError(f"block {(off + i) // block}, bytes {off + i}..{off + i + block} of its data")
        parallel.run_jobs([lambda i=i: check(i) for i in range(0, len(view), block)])
    return fill


_scratch_bufs = threading.local()


def _scratch(n: int) -> memoryview:
    """A per-thread scratch buffer of ``n`` bytes (reused; grown as needed)."""
    buf = getattr(_scratch_bufs, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch_bufs.buf = bytearray(max(n, 2**16))
    return memoryview(buf)[:n]


def flagged(t: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``t`` as the ``nn.Parameter`` or grad-requiring tensor that ``entry`` was saved as."""
    if entry.parameter:
        return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
    if entry.requires_grad:
        t.requires_grad_(True)
    return t


def why(e: BaseException) -> str:
    """The reason of a read failure, for a message that already names the file and key."""
    if isinstance(e, checksum.ChecksumError):
        return (f"stored bytes do not match their checksum ({e}); the file is damaged, or another tool wrote "
                "to it in place (h5py): if so, `tensorstore-h5 reindex FILE` adopts the values")
    if isinstance(e, DecodeError):
        return f"a compressed chunk does not decode ({e}): the file is damaged"
    return f"cannot read the data ({e})"


def _fd_path(raw: files.RawFile, path: str) -> str:
    """A path that opens the very file ``raw`` has open (Linux), else ``path``."""
    proc = f"/proc/self/fd/{raw._fileno()}"
    return proc if os.path.exists(proc) else path


def checking(verify: bool | None, whole: bool = True) -> bool:
    """Whether a read checks the stored checksums: ``verify`` when given; by default (None) a
    read that covers whole checksum blocks (a whole tensor) does, a slice or a mapping not."""
    return whole if verify is None else verify


def touched(entry: TensorEntry, sel: Selection) -> tuple[int, int]:
    """The logical bytes ``[lo, hi)`` of ``entry`` in the rows that ``sel`` (not empty) touches."""
    if not entry.shape:
        return 0, entry.dtype.itemsize
    row = entry.dtype.itemsize * math.prod(entry.shape[1:])
    first = sel.start[0]
    last = first + (sel.count[0] - 1) * sel.step[0] + 1
    return first * row, last * row
