"""The lazy view of a file: :class:`Store` (read-only, a mapping of key paths) and
:class:`TensorHandle` (one tensor: metadata now, bytes when indexed or read).

A store opens its file once and reads every byte through that open file, so a save that
renames a new file over the path meanwhile is never mixed in. Format-2 files are read from
their header and layout alone (byte ranges checked against the file before any read);
format-1 and foreign HDF5 files through :mod:`tensorstore_h5.storage.libhdf5`, whose checks run
before any byte of a dataset is read. How bytes are read is the read planner's
(:class:`~tensorstore_h5.reading.many.Reader`); the store resolves keys and ``select=``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FormatError, KeyNotFoundError
from ..format import tree
from ..format import layout as fmt
from ..format.layout import ArrayEntry, Chunked, Container, Layout, TensorEntry, ValueEntry
from ..format.slicing import contiguous_stride, select as select_index
from ..format.tree import Leaf
from ..storage import Deferred, files, memory
from .listing import Listing, layout_v2
from .select import Selector

if TYPE_CHECKING:
    from ..transfer import Device
    from .many import Reader

# a local format-2 file is opened and read without either (their imports are most of a fresh open)
libhdf5: Any = Deferred(f"{__package__.rpartition('.')[0]}.storage.libhdf5", globals(), "libhdf5")
remote: Any = Deferred(f"{__package__.rpartition('.')[0]}.storage.remote", globals(), "remote")
# what reads need, imported on the first read: opening a file and listing its keys need none of it
tensors: Any = Deferred(f"{__package__}.tensors", globals(), "tensors")

__all__ = ["Store", "TensorHandle", "EntryView", "Device"]


def __getattr__(name: str) -> Any:
    if name == "Device":  # (named here before; the device wing's)
        from ..transfer import Device

        return Device
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class EntryView:
    """What a lazy tensor handle knows before reading a byte: the key path, shape, dtype and
    sizes of ``entry`` (a tensor entry of a file or of a checkpoint directory's index)."""

    __slots__ = ("_store", "_entry")

    def __init__(self, store: Any, entry: Any) -> None:
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

    # -- conversions: one read of the whole tensor (never row by row through __getitem__) ----

    def _whole(self) -> torch.Tensor:
        return self.read().detach()  # type: ignore[attr-defined]  # the subclasses' read

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """``np.asarray(h)``, ``np.array(h)``: the whole tensor, read once (``h.read().numpy()``).

        Every call reads the file into new memory, which the array owns, so ``copy`` changes
        nothing. A dtype numpy has none for (bfloat16, float8, complex32, sub-byte types) is a
        TypeError naming the key, as ``Tensor.numpy()`` refuses it, unless ``dtype`` asks
        for one: ``np.asarray(h, dtype=np.float32)`` converts as ``h[:].float().numpy()``."""
        import numpy as np

        t = self._whole()
        try:
            a = t.numpy()
        except TypeError:
            name = str(t.dtype).removeprefix("torch.")
            if dtype is None:
                raise TypeError(f"{self._store.path}: key {self.key!r} has dtype {name}, which numpy has no dtype for; "
                                "read it as a tensor and convert it: h[:].float().numpy(), or np.asarray(h, "
                                "dtype=np.float32)") from None
            try:
                a = t.to(torch.from_numpy(np.empty(0, dtype=dtype)).dtype).numpy()
            except (TypeError, RuntimeError) as e:
                raise TypeError(f"{self._store.path}: key {self.key!r} of dtype {name} cannot be converted to numpy "
                                f"{np.dtype(dtype)} ({e})") from None
        return a if dtype is None else a.astype(dtype, copy=False)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        """The DLPack capsule of the whole tensor, read once onto the CPU: what
        ``torch.as_tensor(h)``, ``torch.tensor(h)``, ``torch.asarray(h)`` and
        ``torch.from_dlpack(h)`` (and ``np.from_dlpack(h)``) use."""
        given = {"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy}
        return self._whole().__dlpack__(**{k: v for k, v in given.items() if v is not None})

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCPU, 0)``: handles read into CPU memory."""
        return (1, 0)


class TensorHandle(EntryView):
    """A lazy view of one stored tensor: metadata now, bytes when indexed or read.

    ``h[10:20]``, ``h[:, 3:7]``, ``h[...]`` read only the selected elements and return a new
    contiguous CPU tensor. :meth:`read` restores the saved memory layout (stride) and can
    fill a preallocated ``out`` tensor.
    """

    __slots__ = ()
    _store: Store
    _entry: TensorEntry

    @property
    def stride(self) -> tuple[int, ...]:
        """The stride (elements) the tensor had when saved; row-major when it was contiguous."""
        return self._entry.stride or contiguous_stride(self._entry.shape)

    @property
    def compression(self) -> dict[str, Any] | None:
        """Filter and chunk shape of the dataset, or None when it is stored uncompressed."""
        return self._store._reader.compression(self._entry)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index=index)

    def read(self, out: torch.Tensor | None = None, *, index: Any = None, mmap: bool = False,
             verify: bool | None = None) -> torch.Tensor:
        """Read the tensor, or the part selected by ``index``, into ``out`` or a new tensor.

        Args:
            out: a tensor of the selection's shape and of this dtype to fill in place
                (checked before any I/O). Without it a new CPU tensor is returned; a full
                read restores the saved stride.
            index: what ``h[index]`` would take: integers, slices (positive step), ``...``.
            mmap: return a tensor backed by the file's pages (copy-on-write) when the dataset
                is contiguous, uncompressed, row-major and aligned; otherwise read as usual.
            verify: check the stored checksums. By default (None) a read of the whole tensor
                is checked, a slice or a mapping is not; True checks the checksum blocks (8 MiB)
                or compressed chunks a slice touches, and the mapped bytes; False checks nothing.
                With ``out``, the bytes are checked before ``out`` changes (one more read).

        Returns:
            ``out``, or the new tensor.

        Raises:
            MismatchError: ``out`` has another shape or dtype.
            IndexError: for an unsupported or out-of-range index.
            FormatError: the dataset cannot be read (damaged or truncated file, or, with
                ``verify``, a checksum that does not match).
        """
        sel = select_index(() if index is None else index, self._entry.shape)
        reader = self._store._reader
        if mmap:
            if out is not None or index is not None:
                raise ValueError("read(mmap=True) maps the whole tensor; it takes no out or index")
            mapped = reader.mapped(self._entry, files.FileMap(reader.rawfile(), whole=False), verify is True)
            if mapped is not None:
                return mapped
        check = tensors.checking(verify, sel.full)
        try:
            if out is not None and check and not sel.empty:  # out changes only once the bytes are known good
                reader.verify_stored(self._entry, None if sel.full else tensors.touched(self._entry, sel))
                check = False
            return reader.read_tensor(self._entry, sel, out, restore_layout=index is None, verify=check, fetch=True)
        finally:
            reader.rawfile().release()

    def _repr_html_(self) -> str:
        from ..display.views import TreeRow, tree_html

        e = self._entry
        layout = "row-major" if e.stride is None else f"stride {list(e.stride)}"
        where = "same as " + e.same_as if e.same_as else ("compressed" if isinstance(e.extent, Chunked) else "contiguous")
        row = TreeRow(e.path or "(root)", f"{e.dtype.name} {list(e.shape)} {layout}, {where}", e.nbytes)
        return tree_html(repr(self), [row], nest=False)

    def __repr__(self) -> str:
        from ..display import human_bytes

        e = self._entry
        dtype = str(self.dtype).removeprefix("torch.")
        return f"<TensorHandle {e.path!r} shape={list(e.shape)} dtype={dtype} {human_bytes(e.nbytes)}>"


class Store(Listing):
    """A tensorstore_h5 (or plain HDF5) file opened read-only. Nothing is read until asked for.

    Example::

        with th5.open("ckpt.h5") as store:
            print(store.keys())
            w = store["model/enc.weight"][:, :16]      # reads 16 columns only
            for key, t in store.items(select="model/*"):
                ...                                    # one tensor at a time

    Raises:
        MissingFileError: no such file (a FileNotFoundError).
        NotRegularFileError: a directory, FIFO, device or socket (a FormatError), refused
            before it is read.
        FormatError: not a tensorstore_h5 or HDF5 file, an unknown format version, or a
            damaged header or layout.
    """

    def __init__(self, path: Any, *, storage_options: dict[str, Any] | None = None) -> None:
        local = files.local_path(path)
        self.path = local if local is not None else path if isinstance(path, str) else remote.FileObjSource.name_of(path)
        for _ in range(3 if local is not None else 1):  # a save may rename a new file over the path while we open it
            # files.RawFile, remote.RemoteSource or FileObjSource
            raw = files.RawFile(local) if local is not None else remote.open_source(path, storage_options)
            try:
                with memory.gc_paused():  # a layout of many keys is many new objects, none in a cycle
                    self._layout, file = self._open(raw)  # file: the h5py.File of a format-1 or foreign file
                break
            except FileExistsError:
                raw.close()
            except BaseException:
                raw.close()
                raise
        else:
            raise FormatError(f"{self.path}: the file kept being replaced while it was opened")
        self._source: tuple[Any, Any] = (raw, file)  # for the reader, made on the first read

    @functools.cached_property
    def _reader(self) -> Reader:
        """The reads of this store's file (:class:`~.many.Reader`), made on first use: the read
        planner's modules are ~1.5 ms of a fresh process's first open, which a listing of the
        keys does not need. Threads that read first together get the one reader."""
        from .many import Reader

        return self.__dict__.setdefault("_reader", Reader(self.path, *self._source))

    def _open(self, raw: Any) -> tuple[Layout, Any]:
        """The layout of the file ``raw`` reads, and its h5py file (None for format 2)."""
        head = raw.head(fmt.HEADER_SIZE)
        if head[:8] == fmt.MAGIC:
            return layout_v2(raw, self.path, head), None
        other = _other_format(head)
        if other:
            what, suffix = other
            stem = os.path.splitext(self.path)[0]
            src = self.path if self.path.endswith(suffix) else f"{stem}{suffix}"
            rename = "" if src == self.path else f" (named {suffix} first)"
            raise FormatError(f"{self.path}: not a tensorstore_h5 file: it looks like {what}; convert it with "
                              f"`tensorstore-h5 convert {src} {stem}.h5`{rename}")
        file = libhdf5.open_file(self.path, raw.identity, None if isinstance(raw, files.RawFile) else raw)
        try:
            return libhdf5.read_layout(file, self.path), file
        except BaseException:
            file.close()
            raise

    # -- reading (the mapping-like view is the Listing's) ----------------------------------

    def __getitem__(self, key: str) -> Any:
        """A :class:`TensorHandle` for a tensor leaf; the value for other leaves (numpy arrays are read).

        Raises KeyNotFoundError (a KeyError) naming the closest keys.
        """
        entry = self._entry(key)
        if isinstance(entry, TensorEntry):
            return TensorHandle(self, entry)
        return self._reader.read_leaf(entry, {}, None, None, None, False)

    def info(self) -> dict[str, Any]:
        """Totals and, per tensor with data of its own, dtype, shape, bytes, bytes on disk,
        ratio (stored/original) and compression (filter and chunk shape, or None)."""
        tensors = {}
        for e in self._layout.leaves:
            if isinstance(e, TensorEntry) and e.same_as is None and e.packed is None:
                stored = self._reader.stored_bytes(e)
                tensors[e.path] = {"dtype": e.dtype.name, "shape": list(e.shape), "nbytes": e.nbytes, "stored_bytes": stored,
                                   "ratio": stored / e.nbytes if e.nbytes else 1.0, "compression": self._reader.compression(e)}
        data = sum(t["nbytes"] for t in tensors.values())
        stored = sum(t["stored_bytes"] for t in tensors.values())
        return {"file": self.path, "format_version": self.format_version, "file_bytes": self._reader.rawfile().size,
                "keys": len(self), "data_bytes": self.nbytes, "ratio": stored / data if data else 1.0,
                "metadata": self.metadata, "tensors": tensors}

    # -- loading ------------------------------------------------------------------------

    def items(self, select: Selector = None, device: Device = None, *, mmap: bool = False,
              verify: bool | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, value)`` for the selected leaves, one at a time, in saved order.

        The store keeps no reference to what it yields, so memory falls as the caller drops
        each tensor. Aliased tensors come back as the same object while it is alive.
        ``device``, ``mmap`` and ``verify`` are as for :meth:`load`. Over a URL the next
        tensors download while the caller uses this one: up to :data:`remote.FETCH_AHEAD` + 1
        batches of :data:`remote.BATCH_BYTES` are held ahead of the caller.
        """
        included = self._included(select)
        entries = [e for e in self._layout.select(included) if not isinstance(e, Container)]
        yield from self._reader.items(entries, device, mmap, verify)

    def read_many(self, selections: Mapping[str, Any], *, verify: bool | None = None) -> dict[str, torch.Tensor]:
        """A part of each of several tensors: ``{key path: index}`` (what ``h[index]`` takes;
        ``...`` for all of it) to ``{key path: new CPU tensor}``. Over a URL, every range they
        touch is fetched at once (neighbours in one request, the rest concurrently) instead
        of one round trip per tensor. ``verify`` as for :meth:`TensorHandle.read`.

        Raises KeyNotFoundError, IndexError, FormatError as :meth:`TensorHandle.read` does.
        """
        self._layout.check_disjoint(set(selections))  # one tensor each: together bounded by the file
        parts = []
        for key, index in selections.items():
            entry = self._entry(key)
            if not isinstance(entry, TensorEntry):
                raise KeyNotFoundError(f"{self.path}: {key!r} is not a tensor")
            parts.append((key, entry, select_index(index, entry.shape)))
        return self._reader.read_many(parts, verify)

    def walk(self, select: Selector = None, *, verify: bool | None = None) -> Iterator[Container | Leaf]:
        """The selected part of the file as ``tree.flatten`` gives an object: containers and
        leaves in pre-order, each leaf read when it is reached (tied tensors come back as one
        while alive). What :meth:`Writer.write_tree` takes, to copy a file key by key."""
        included = self._included(select)
        yield from self._reader.walk(self._layout.select(included), verify)

    def stats(self, select: Selector = None, **options: Any) -> Any:
        """Per-tensor ``mean``, ``std``, ``min``, ``max``, ``nan``, ``inf``, ``zeros``, streaming
        (:func:`tensorstore_h5.reading.compare.stats`)."""
        from .compare import stats

        return stats(self, select, **options)

    def load(self, select: Selector = None, device: Device = None, progress: bool | None = None, *,
             mmap: bool = False, verify: bool | None = None) -> Any:
        """Load the selected leaves into the saved nesting (pruned to what was selected).

        Args:
            select: a glob, a list of exact keys or globs, or a callable on the key path.
            device: where tensors go: None (CPU), a device, or a mapping / callable from key
                path to device. Any spelling of the CPU (``"cpu:0"``) is the CPU.
            progress: progress bar by bytes (see :func:`tensorstore_h5.save`).
            mmap: return tensors backed by the file's pages (zero-copy, copy-on-write: writes
                to them never reach the file or another tensor) for contiguous uncompressed
                datasets saved row-major, all views of one mapping of the file that lives
                while any of them does; other tensors are read as usual.
            verify: check the stored checksums (format 2; a format-1 file has none). By
                default (None) every tensor read is checked as it is read, on the I/O threads
                (bench: a few per cent); tensors that ``mmap`` maps are not (that would read
                them all), unless True. False checks nothing.

        Raises:
            KeyNotFoundError: an exact key in ``select`` is not in the file.
            FormatError: data cannot be read, or a checked checksum does not match.
            TensorStoreError: a device that does not exist here.
        """
        with memory.gc_paused():  # many new objects, none in a cycle
            included = self._included(select)
            return tree.inflate(self._reader.load(self._layout.select(included), device, progress, mmap, verify))

    def _read_into(self, pairs: list[tuple[TensorEntry, torch.Tensor]], progress: bool | None, verify: bool | None
                   ) -> None:
        """Fill existing targets from their entries, every entry checked first (what ``load_into``
        calls, as on a ``ShardedStore``; see :meth:`Reader.read_into`)."""
        self._layout.check_disjoint({e.path for e, _ in pairs})
        self._reader.read_into(pairs, progress, verify)

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent). Handles of a closed store cannot read."""
        if "_reader" in self.__dict__:
            self._reader.close()
            return
        raw, file = self._source
        self._source = (None, None)  # a reader made later finds the store closed
        if file is not None:
            file.close()
        if raw is not None:
            raw.close()

    @property
    def closed(self) -> bool:
        return self._reader.closed if "_reader" in self.__dict__ else self._source[0] is None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """A collapsible tree of the keys with dtype, shape, layout and size (Jupyter)."""
        from ..display.views import TreeRow, tree_html

        rows = []
        for e in self._layout.leaves:
            if isinstance(e, TensorEntry):
                desc = f"{e.dtype.name} {list(e.shape)}" + ("" if e.stride is None else f" stride {list(e.stride)}")
                desc += f" (same as {e.same_as})" if e.same_as else ""
                if isinstance(e.extent, Chunked) and e.nbytes:
                    desc += f", compressed to {e.extent.stored_bytes / e.nbytes:.2f}"
                rows.append(TreeRow(e.path, desc, e.nbytes, e.same_as is None))
            elif isinstance(e, ArrayEntry):
                rows.append(TreeRow(e.path, f"ndarray {e.dtype} {list(e.shape)}", e.nbytes))
            elif isinstance(e, ValueEntry):
                rows.append(TreeRow(e.path, f"{type(e.value).__name__} = {repr(e.value)[:40]}"))
            else:
                rows.append(TreeRow(e.path, f"unsupported: {e.reason}"))
        return tree_html(repr(self), rows)

def _other_format(head: bytes) -> tuple[str, str] | None:
    """``(what, suffix)`` for a file that is neither tensorstore_h5 nor HDF5 but looks like a
    format ``convert`` reads, from its first bytes."""
    if head[:4] == b"PK\x03\x04":
        return "a torch.save (zip) file", ".pt"
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        return "a pickle (legacy torch.save) file", ".pt"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 2**32:
        return "a safetensors file", ".safetensors"
    return None


