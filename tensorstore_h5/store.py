"""Reading files: :class:`Store` (lazy, read-only) and :class:`TensorHandle`."""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Union

import h5py
import numpy as np
import torch

from . import codecs, compression, io, transfer, tree
from .display import Progress, human_bytes
from .dtypes import bits_view
from .errors import FormatError, KeyNotFoundError, MismatchError
from .format import ArrayEntry, Container, ForeignEntry, Layout, TensorEntry, ValueEntry, contiguous_stride, read_layout
from .select import Selector, closest, resolve
from .slicing import Selection, select as select_index, whole
from .tree import Leaf

__all__ = ["Store", "TensorHandle", "open_store", "Device"]

PathLike = Union[str, "os.PathLike[str]"]
Device = Union[None, str, torch.device, Mapping[str, Any], Callable[[str], Any]]

HTML_RATIO_DATASETS = 2000
"""The HTML view shows compression ratios for at most this many datasets (each needs an open)."""

_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


class TensorHandle:
    """A lazy view of one stored tensor: metadata now, bytes when indexed or read.

    ``h[10:20]``, ``h[:, 3:7]``, ``h[...]`` read only the selected elements and return a new
    contiguous CPU tensor. :meth:`read` restores the saved memory layout (stride) and can
    fill a preallocated ``out`` tensor.
    """

    __slots__ = ("_store", "_entry")

    def __init__(self, store: Store, entry: TensorEntry) -> None:
        self._store = store
        self._entry = entry

    @property
    def key(self) -> str:
        """The key path."""
        return self._entry.path

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._entry.dtype.torch_dtype

    @property
    def stride(self) -> tuple[int, ...]:
        """The stride (elements) the tensor had when saved; row-major when it was contiguous."""
        return self._entry.stride or contiguous_stride(self._entry.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self._entry.nbytes

    @property
    def ndim(self) -> int:
        return len(self._entry.shape)

    def numel(self) -> int:
        return self._entry.numel

    def __len__(self) -> int:
        if not self._entry.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._entry.shape[0]

    @property
    def compression(self) -> dict[str, Any] | None:
        """Filters and chunk shape of the dataset, or None when it is stored uncompressed."""
        return self._store._compression(self._entry)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index=index)

    def read(self, out: torch.Tensor | None = None, *, index: Any = None, mmap: bool = False) -> torch.Tensor:
        """Read the tensor, or the part selected by ``index``, into ``out`` or a new tensor.

        Args:
            out: a tensor of the selection's shape and of this dtype to fill in place
                (checked before any I/O). Without it a new CPU tensor is returned; a full
                read restores the saved stride.
            index: what ``h[index]`` would take: integers, slices (positive step), ``...``.
            mmap: return a tensor backed by the file's pages (copy-on-write) when the dataset
                is contiguous, uncompressed and row-major; otherwise read as usual.

        Returns:
            ``out``, or the new tensor.

        Raises:
            MismatchError: ``out`` has another shape or dtype.
            IndexError: for an unsupported or out-of-range index.
            FormatError: the dataset cannot be read (damaged or truncated file).
        """
        sel = select_index(() if index is None else index, self._entry.shape)
        if mmap:
            if out is not None or index is not None:
                raise ValueError("read(mmap=True) maps the whole tensor; it takes no out or index")
            mapped = self._store._mapped(self._entry, io.FileMap(self._store._rawfile(), whole=False))
            if mapped is not None:
                return mapped
        return self._store._read_tensor(self._entry, sel, out, restore_layout=index is None)

    def _repr_html_(self) -> str:
        from .display import tree_html

        e = self._entry
        layout = "row-major" if e.stride is None else f"stride {list(e.stride)}"
        where = f"packed in {e.dataset}" if e.packed is not None else ("same as " + e.same_as if e.same_as else "own dataset")
        return tree_html(repr(self), [(e.path or "(root)", f"{e.dtype.name} {list(e.shape)} {layout}, {where}", human_bytes(e.nbytes))])

    def __repr__(self) -> str:
        e = self._entry
        dtype = str(self.dtype).removeprefix("torch.")
        return f"<TensorHandle {e.path!r} shape={list(e.shape)} dtype={dtype} {human_bytes(e.nbytes)}>"


class Store:
    """A tensorstore_h5 (or plain HDF5) file opened read-only. Nothing is read until asked for.

    Example::

        with th5.open("ckpt.h5") as store:
            print(store.keys())
            w = store["model/enc.weight"][:, :16]      # reads 16 columns only
            for key, t in store.items(select="model/*"):
                ...                                    # one tensor at a time

    Raises:
        FileNotFoundError: no such file.
        FormatError: not an HDF5 file, a newer format version, or a damaged layout.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no such file: {self.path!r}")
        try:
            self._file: h5py.File | None = h5py.File(self.path, "r")
        except OSError as e:
            raise FormatError(f"{self.path}: not a readable HDF5 file ({e})") from e
        try:
            self._layout: Layout = read_layout(self._file, self.path)
        except BaseException:
            self._file.close()
            raise
        self._leaf_paths = self._layout.leaf_paths
        self._container_paths = self._layout.container_paths
        self._offsets: dict[str, int | None] = {}  # dataset -> raw byte offset, once checked
        self._pack_len: dict[str, int] = {}  # pack dataset -> elements
        self._chunks: dict[str, codecs.RowChunks | None] = {}  # filtered dataset -> chunk index (None: HDF5 decodes)
        self._raw: io.RawFile | None = None
        self._stagers: dict[torch.device, Any] = {}  # device -> transfer.Stager, made on first use

    # -- mapping-like view ---------------------------------------------------------------

    def keys(self) -> list[str]:
        """Key paths of every leaf, in saved order."""
        return list(self._leaf_paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaf_paths)

    def __len__(self) -> int:
        return len(self._leaf_paths)

    def __contains__(self, key: object) -> bool:
        e = self._layout.entry(key) if isinstance(key, str) else None
        return e is not None and not isinstance(e, Container)

    def __getitem__(self, key: str) -> Any:
        """A :class:`TensorHandle` for a tensor leaf; the value for other leaves (numpy arrays are read).

        Raises KeyNotFoundError (a KeyError) naming the closest keys.
        """
        entry = self._entry(key)
        if isinstance(entry, TensorEntry):
            return TensorHandle(self, entry)
        return self._read_leaf(entry, {}, None, None, None)

    def _entry(self, key: str) -> Any:
        entry = self._layout.entry(key)
        if entry is None or isinstance(entry, Container):
            if entry is not None:
                raise KeyNotFoundError(f"{self.path}: {key!r} is a container, not a leaf; use store.load(select={key!r})")
            near = closest(key, self._leaf_paths)
            hint = f"; closest keys: {', '.join(map(repr, near))}" if near else ""
            raise KeyNotFoundError(f"{self.path}: no key {key!r}{hint}")
        return entry

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata given to save (a copy)."""
        return dict(self._layout.metadata)

    @property
    def format_version(self) -> int | None:
        """The tensorstore_h5 format version, or None for a foreign HDF5 file."""
        return self._layout.version

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor and array data (aliased tensors counted once)."""
        return sum(_data_bytes(e) for e in self._layout.leaves)

    def info(self) -> dict[str, Any]:
        """Totals and, per tensor with a dataset of its own, dtype, shape, bytes, bytes on disk,
        ratio (stored/original) and compression (filters and chunk shape, or None)."""
        tensors = {}
        for e in self._layout.leaves:
            if isinstance(e, TensorEntry) and e.same_as is None and e.packed is None:
                dsid = self._dataset(e)
                stored = dsid.get_storage_size()
                tensors[e.path] = {"dtype": e.dtype.name, "shape": list(e.shape), "nbytes": e.nbytes, "stored_bytes": stored,
                                   "ratio": stored / e.nbytes if e.nbytes else 1.0,
                                   "compression": compression.describe(dsid.get_create_plist())}
        data = sum(t["nbytes"] for t in tensors.values())
        stored = sum(t["stored_bytes"] for t in tensors.values())
        return {"file": self.path, "format_version": self.format_version, "file_bytes": os.path.getsize(self.path),
                "keys": len(self), "data_bytes": self.nbytes, "ratio": stored / data if data else 1.0,
                "metadata": self.metadata, "tensors": tensors}

    # -- loading ------------------------------------------------------------------------

    def items(self, select: Selector = None, device: Device = None, *, mmap: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, value)`` for the selected leaves, one at a time, in saved order.

        The store keeps no reference to what it yields, so memory falls as the caller drops
        each tensor. Aliased tensors come back as the same object while it is alive.
        ``device`` and ``mmap`` are as for :meth:`load`.
        """
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        alive: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        fmap = io.FileMap(self._rawfile(), whole=False) if mmap else None  # each tensor unmapped when dropped
        for entry in self._layout.leaves:
            if entry.path in included:
                yield entry.path, self._read_leaf(entry, alive, device, fmap, None)

    def selected_keys(self, select: Selector = None) -> list[str]:
        """The leaf key paths that ``select`` picks, in saved order (see :meth:`load`)."""
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        return [p for p in self._leaf_paths if p in included]

    def load(self, select: Selector = None, device: Device = None, progress: bool | None = None, *,
             mmap: bool = False) -> Any:
        """Load the selected leaves into the saved nesting (pruned to what was selected).

        Args:
            select: a glob, a list of exact keys or globs, or a callable on the key path.
            device: where tensors go: None (CPU), a device, or a mapping / callable from key
                path to device.
            progress: progress bar by bytes (see :func:`tensorstore_h5.save`).
            mmap: return tensors backed by the file's pages (zero-copy, copy-on-write: writes
                to them never reach the file or another tensor) for contiguous uncompressed
                datasets saved row-major, all views of one mapping of the file that lives
                while any of them does; other tensors are read as usual.

        Raises:
            KeyNotFoundError: an exact key in ``select`` is not in the file.
            FormatError: data cannot be read.
        """
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        cache: dict[str, torch.Tensor] = {}
        items: list[Container | Leaf] = []
        fmap = io.FileMap(self._rawfile()) if mmap else None
        with self._batched(progress, sum(_data_bytes(e) for e in self._layout.leaves if e.path in included)) as (bar, plan):
            for entry in self._layout.entries:
                if entry.path not in included:
                    continue
                if isinstance(entry, Container):
                    items.append(entry)
                else:
                    items.append(Leaf(entry.path, entry.key, self._read_leaf(entry, cache, device, fmap, plan)))
                    bar.update(_data_bytes(entry))
        return tree.inflate(items)

    def _read_into(self, pairs: list[tuple[TensorHandle, torch.Tensor]], progress: bool | None) -> None:
        """Fill each target from its handle (shapes and dtypes already checked).

        Every dataset is checked first (type, shape, byte range inside the file), so a
        damaged or truncated file is refused before any target changes.
        """
        for handle, _ in pairs:
            self._base(handle._entry)
        with self._batched(progress, sum(h.nbytes for h, _ in pairs)) as (bar, plan):
            for handle, target in pairs:
                sel = whole(handle._entry.shape)
                self._read_tensor(handle._entry, sel, target, restore_layout=False, plan=plan)
                bar.update(handle.nbytes)

    @contextmanager
    def _batched(self, progress: bool | None, nbytes: int) -> Iterator[tuple[Progress, io.ReadPlan | None]]:
        """``(bar, plan)`` for a multi-tensor read: a progress bar over ``nbytes``, and one read
        plan for both cores when no bar is shown (reads then finish at the end of the block;
        with a bar each tensor is read as it comes, so the bar moves). An error inside the
        block abandons the plan's queued reads; the bar is closed either way."""
        bar = Progress(progress, desc=f"loading {os.path.basename(self.path)}")
        bar.total(nbytes)
        plan = io.ReadPlan(self._rawfile()) if bar.silent else None
        try:
            yield bar, plan
            if plan is not None:
                self._run(plan)
        except BaseException:
            if plan is not None:
                plan.abandon()
            raise
        finally:
            bar.close()

    # -- internals ----------------------------------------------------------------------

    def _h5(self) -> h5py.File:
        if self._file is None:
            raise ValueError(f"{self.path}: the store is closed")
        return self._file

    def _rawfile(self) -> io.RawFile:
        self._h5()
        if self._raw is None:
            self._raw = io.RawFile(self.path)
        return self._raw

    def _run(self, plan: io.ReadPlan) -> None:
        try:
            plan.run()
        except (OSError, EOFError) as e:
            raise FormatError(f"{self.path}: cannot read tensor data: {e}") from e

    def _dataset(self, entry: TensorEntry | ArrayEntry | ForeignEntry) -> h5py.h5d.DatasetID:
        """The open dataset of ``entry``, checked against the layout on first use."""
        try:
            dsid = h5py.h5d.open(self._h5().id, entry.dataset.encode("utf-8"))
        except _H5_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: dataset {entry.dataset!r} is missing or not a dataset ({e})") from e
        if entry.dataset not in self._offsets and isinstance(entry, (TensorEntry, ArrayEntry)):
            self._offsets[entry.dataset] = self._check_dataset(entry, dsid)
        return dsid

    def _base(self, entry: TensorEntry) -> int | None:
        """File offset of ``entry``'s first byte when it can be read raw, else None. Checks
        the dataset on first use (without opening it again later) and a packed entry's range."""
        if entry.dataset not in self._offsets:
            self._dataset(entry)
        offset = self._offsets[entry.dataset]
        if entry.packed is None:
            return offset
        if entry.packed + entry.numel > self._pack_len[entry.dataset]:
            raise FormatError(f"{self.path}: key {entry.path!r}: packed range ends past its dataset {entry.dataset!r}")
        return None if offset is None else offset + entry.packed * entry.dtype.itemsize

    def _check_dataset(self, entry: TensorEntry | ArrayEntry, dsid: h5py.h5d.DatasetID) -> int | None:
        """Check a dataset against its entry once; return its raw byte offset (or None)."""
        packed = isinstance(entry, TensorEntry) and entry.packed is not None
        try:
            # an offset only for contiguous data stored in this file (not compact, external,
            # chunked or unallocated): then the creation properties need no look
            offset = dsid.get_offset()
            shape = dsid.shape
            same_type = isinstance(entry, TensorEntry) and dsid.get_type() == entry.dtype.h5_type
            filtered = False
            if offset is None or not same_type:
                offset = None
                dcpl = dsid.get_create_plist()
                filtered = dcpl.get_layout() == h5py.h5d.CHUNKED and dcpl.get_nfilters() > 0
        except _H5_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: unreadable dataset header ({e})") from e
        if packed:
            if len(shape) != 1:
                raise FormatError(f"{self.path}: key {entry.path!r}: pack dataset {entry.dataset!r} is not 1-D")
            self._pack_len[entry.dataset] = shape[0]
            nbytes = shape[0] * entry.dtype.itemsize
        elif shape != entry.shape:
            raise FormatError(f"{self.path}: key {entry.path!r}: dataset shape {shape} does not match the layout's {entry.shape}")
        else:
            nbytes = entry.nbytes
        if isinstance(entry, TensorEntry) and not entry.foreign and not same_type:
            raise FormatError(f"{self.path}: key {entry.path!r}: dataset type does not match torch dtype {entry.dtype.name}")
        if offset is not None and offset + nbytes > self._rawfile().size:
            raise FormatError(
                f"{self.path}: key {entry.path!r}: data ends at byte {offset + nbytes}, past the end of the "
                f"file ({self._rawfile().size} bytes): truncated file"
            )
        if filtered:
            compression.ensure_plugins()
            if same_type and not packed:
                try:
                    self._chunks[entry.dataset] = codecs.row_chunks(dsid, entry.dtype.itemsize, dcpl)
                except _H5_ERRORS as e:
                    raise FormatError(f"{self.path}: key {entry.path!r}: unreadable chunk index ({e})") from e
        return offset

    def _row_chunks(self, entry: TensorEntry) -> codecs.RowChunks | None:
        """The chunk index of a filtered dataset that codecs can decode in parallel, else None."""
        if entry.dataset not in self._offsets:
            self._dataset(entry)  # the first check indexes the chunks
        return self._chunks.get(entry.dataset)

    def _keyed(self, job: Callable[[], None], entry: TensorEntry) -> Callable[[], None]:
        """``job`` with read errors turned into a FormatError naming the file and key."""
        def run() -> None:
            try:
                job()
            except (OSError, EOFError) as e:  # h5py reports read failures as OSError
                raise FormatError(f"{self.path}: key {entry.path!r}: cannot read the data ({e})") from e
        return run

    def _compression(self, entry: TensorEntry) -> dict[str, Any] | None:
        return compression.describe(self._dataset(entry).get_create_plist())

    def _read_leaf(self, entry: Any, cache: Any, device: Device, fmap: io.FileMap | None, plan: io.ReadPlan | None) -> Any:
        if isinstance(entry, ValueEntry):
            return entry.value
        if isinstance(entry, ForeignEntry):
            raise FormatError(f"{self.path}: key {entry.path!r} cannot be loaded as a tensor: {entry.reason}")
        if isinstance(entry, ArrayEntry):
            ds = h5py.Dataset(self._dataset(entry))
            try:
                return np.asarray(ds[()], dtype=entry.dtype)
            except _H5_ERRORS as e:
                raise FormatError(f"{self.path}: key {entry.path!r}: cannot read the dataset ({e})") from e
        origin = entry.same_as or entry.path
        t = cache.get(origin)
        if t is None:
            target = _device_for(device, entry.path)
            on_cpu = _host(target)
            t = self._mapped(entry, fmap) if fmap is not None and on_cpu else None
            sel = whole(entry.shape)
            if t is None and not on_cpu:  # allocated on the device, filled through the staging buffers
                t = transfer.device_empty(entry.shape, entry.dtype.torch_dtype, target, entry.path)
                self._read_tensor(entry, sel, t, restore_layout=False)
                if entry.stride is not None:
                    t = io.restore_layout(t, entry.stride)  # on the device
            elif t is None:
                t = self._read_tensor(entry, sel, None, restore_layout=True, plan=plan if on_cpu else None)
            if t.device != torch.device(target or "cpu"):
                t = t.to(target)
            if entry.requires_grad is not None:
                t = torch.nn.Parameter(t, requires_grad=entry.requires_grad)
            cache[origin] = t
        return t

    def _read_hdf5(self, entry: TensorEntry, sel: Selection, dest: torch.Tensor) -> None:
        """HDF5's own read of ``sel`` into ``dest`` (chunked, filtered or converted data)."""
        dsid = self._dataset(entry)
        try:
            if entry.packed is None:
                io.read_hdf5(dsid, entry.dtype.h5_type, dest, sel)
                return
            full = io.empty(entry.shape, entry.dtype.torch_dtype)
            span = select_index(slice(entry.packed, entry.packed + entry.numel), (self._pack_len[entry.dataset],))
            io.read_hdf5(dsid, entry.dtype.h5_type, full, span)
        except _H5_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot read the data ({e})") from e
        picked = bits_view(full)[tuple(slice(a, a + (c - 1) * st + 1, st) for a, c, st in zip(sel.start, sel.count, sel.step))]
        bits_view(dest).copy_(picked.reshape(sel.shape))

    def _stager(self, device: torch.device) -> Any:
        stager = self._stagers.get(device)
        if stager is None:
            stager = self._stagers[device] = transfer.Stager(device)
        return stager

    def _hdf5_rows(self, entry: TensorEntry, sel: Selection, limit: int) -> tuple[Any, int]:
        """For staging a row range that only HDF5 can read (other filters, type conversion):
        ``(fill, align)`` reading whole rows (whole chunks where chunks are row blocks) into
        each staging buffer of ``limit`` bytes, or ``(None, 1)`` when the selection is not a
        row range or one row does not fit a buffer."""
        shape = entry.shape
        if entry.packed is not None or not shape or any(st != 1 for st in sel.step) or sel.count[1:] != shape[1:]:
            return None, 1
        row = entry.dtype.itemsize * math.prod(shape[1:])
        if row == 0 or row > limit:
            return None, 1
        align = row
        dcpl = self._dataset(entry).get_create_plist()
        if dcpl.get_layout() == h5py.h5d.CHUNKED and tuple(dcpl.get_chunk()[1:]) == tuple(shape[1:]):
            if dcpl.get_chunk()[0] * row <= limit:
                align = dcpl.get_chunk()[0] * row
        first = sel.start[0]

        def fill(off: int, buf: torch.Tensor) -> None:
            a = first + off // row
            self._read_hdf5(entry, select_index(slice(a, a + buf.numel() // row), shape), buf)
        return fill, align

    def _mapped(self, entry: TensorEntry, fmap: io.FileMap) -> torch.Tensor | None:
        """A tensor of ``fmap`` for a row-major, contiguous, unfiltered dataset, else None."""
        offset = self._base(entry)
        if offset is None or entry.stride is not None or entry.numel == 0 or entry.packed is not None:
            return None
        try:
            return fmap.tensor(offset, entry.nbytes, entry.dtype.torch_dtype, entry.shape)
        except (OSError, EOFError, ValueError) as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot map the data ({e})") from e

    def _read_tensor(self, entry: TensorEntry, sel: Selection, out: torch.Tensor | None, restore_layout: bool,
                     plan: io.ReadPlan | None = None) -> torch.Tensor:
        """Read ``sel`` of ``entry`` into ``out`` (checked first) or a new tensor.

        With ``plan``, raw reads are only queued: the caller runs the plan before using the
        result (only for results that need no copy afterwards).
        """
        dtype = entry.dtype.torch_dtype
        if out is not None and (tuple(out.shape) != sel.shape or out.dtype != dtype):
            raise MismatchError(
                f"{self.path}: key {entry.path!r}: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                f"the selection needs {sel.shape} and {dtype}"
            )
        base = self._base(entry)
        raw = self._rawfile()
        start = chunks = None  # the selection as one byte range: in the file, or in decoded chunks
        if sel.contiguous_rows:
            skip = sum(a * st for a, st in zip(sel.start, contiguous_stride(entry.shape))) * entry.dtype.itemsize
            if base is not None:
                start = base + skip
            else:
                chunks = self._row_chunks(entry)

        def fetch(off: int, buf: np.ndarray) -> None:  # bytes [off, off + len(buf)) of the selection
            if chunks is not None:
                chunks.read(raw.pread, skip + off, buf)
            else:
                raw.pread(start + off, memoryview(buf))

        ranged = start is not None or chunks is not None
        if out is not None and _staged(out) and out.is_contiguous() and not sel.empty:
            if start is not None and _gds(out) and transfer.gds_read(self.path, start, out):
                return out
            stage = None
            if ranged:
                align = chunks.chunk_bytes if chunks is not None else 1
                stage = lambda off, buf: fetch(off, buf.numpy())  # noqa: E731
            else:
                stage, align = self._hdf5_rows(entry, sel, self._stager(out.device).block_bytes)
            if stage is not None:
                self._keyed(lambda: self._stager(out.device).copy(out, stage, entry.path, align=align), entry)()
                return out
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct else io.empty(sel.shape, dtype)
        post = (out is not None and not direct) or (out is None and restore_layout and entry.stride is not None)
        if not sel.empty:
            queue = plan if plan is not None and not post else None
            if queue is None and (chunks is not None or dest.numel() * dest.element_size() > io.PIECE_BYTES):
                queue = io.ReadPlan(raw)
            if not ranged:
                self._read_hdf5(entry, sel, dest)
            elif queue is None:  # one small range: read it here
                self._keyed(lambda: raw.pread(start, memoryview(io.tensor_bytes(dest))), entry)()
            elif chunks is None:
                queue.add(start, dest, lambda job: self._keyed(job, entry))
            else:
                for job in chunks.tasks(raw.pread, skip, io.tensor_bytes(dest)):
                    queue.add_job(self._keyed(job, entry), job.n * codecs.DECODE_COST)
            if queue is not None and queue is not plan:
                self._run(queue)
        if out is None:
            if restore_layout and entry.stride is not None:
                return io.restore_layout(dest, entry.stride)
            return dest
        if not direct:
            with torch.no_grad():
                bits_view(out).copy_(bits_view(dest))
        return out

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent). Handles of a closed store cannot read."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """A collapsible tree of the keys with dtype, shape, layout and size (Jupyter)."""
        from .display import tree_html

        rows = []
        budget = HTML_RATIO_DATASETS
        for e in self._layout.leaves:
            if isinstance(e, TensorEntry):
                desc = f"{e.dtype.name} {list(e.shape)}" + ("" if e.stride is None else f" stride {list(e.stride)}")
                desc += f" (same as {e.same_as})" if e.same_as else ""
                if e.packed is None and e.same_as is None and e.nbytes and budget > 0:
                    budget -= 1
                    dsid = self._dataset(e)
                    if compression.describe(dsid.get_create_plist()) is not None:
                        desc += f", compressed to {dsid.get_storage_size() / e.nbytes:.2f}"
                rows.append((e.path, desc, human_bytes(e.nbytes)))
            elif isinstance(e, ArrayEntry):
                rows.append((e.path, f"ndarray {e.dtype} {list(e.shape)}", human_bytes(e.nbytes)))
            elif isinstance(e, ValueEntry):
                rows.append((e.path, f"{type(e.value).__name__} = {repr(e.value)[:40]}", ""))
            else:
                rows.append((e.path, f"unsupported: {e.reason}", ""))
        return tree_html(repr(self), rows)

    def __repr__(self) -> str:
        n_t = sum(1 for e in self._layout.leaves if isinstance(e, TensorEntry))
        version = f"v{self._layout.version}" if self._layout.version else "foreign HDF5"
        state = ", closed" if self._file is None else ""
        return f"<tensorstore_h5.Store {self.path!r} ({version}, {len(self)} keys, {n_t} tensors, {human_bytes(self.nbytes)}{state})>"


def _staged(t: torch.Tensor) -> bool:
    """True for targets filled through staging buffers (device memory, not the CPU's)."""
    return t.device.type != "cpu"


def _host(device: Any) -> bool:
    """True when a leaf for ``device`` is read into host memory (None or a CPU device)."""
    return device is None or torch.device(device).type == "cpu"


def _gds(t: torch.Tensor) -> bool:
    """True for targets that GPUDirect Storage can fill (CUDA memory)."""
    return t.device.type == "cuda"


def _data_bytes(entry: Any) -> int:
    """Bytes a leaf reads from the file (0 for plain values and aliases)."""
    if isinstance(entry, ArrayEntry) or (isinstance(entry, TensorEntry) and entry.same_as is None):
        return entry.nbytes
    return 0


def _device_for(device: Device, path: str) -> Any:
    if device is None or isinstance(device, (str, torch.device)):
        return device
    if callable(device):
        return device(path)
    import fnmatch

    for pattern, dev in device.items():
        if path == pattern or fnmatch.fnmatchcase(path, pattern):
            return dev
    return None


def open_store(path: PathLike) -> Store:
    """Open ``path`` read-only as a :class:`Store` (use it as a context manager)."""
    return Store(path)
