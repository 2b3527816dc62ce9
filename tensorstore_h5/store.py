"""Reading files: :class:`Store` (lazy, read-only) and :class:`TensorHandle`.

A store opens its file once and reads every byte through that open file, so a save that
renames a new file over the path meanwhile is never mixed in. Format-2 files are read from
their header and layout alone (byte ranges checked against the file before any read);
format-1 and foreign HDF5 files through :mod:`tensorstore_h5.hdf5source`, whose checks run
before any byte of a dataset is read.
"""

from __future__ import annotations

import math
import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Union

import numpy as np
import torch

from . import checksum, hdf5source, io, remote, transfer, tree
from . import format as fmt
from .codecs import DECODE_COST, ChunkReader, DecodeError
from .display import Progress, human_bytes
from .dtypes import bits_view
from .errors import FormatError, KeyNotFoundError, MismatchError, TensorStoreError, few
from .format import ArrayEntry, Chunked, Container, Contiguous, ForeignEntry, Layout, TensorEntry, ValueEntry
from .hdf5source import HDF5Read
from .select import Selector, closest, resolve
from .slicing import Selection, contiguous_stride, select as select_index, whole
from .tree import Leaf

__all__ = ["Store", "TensorHandle", "EntryView", "Device"]

PathLike = Union[str, "os.PathLike[str]"]
Device = Union[None, str, int, torch.device, Mapping[str, Any], Callable[[str], Any]]

_READ_ERRORS = (OSError, EOFError, DecodeError, checksum.ChecksumError, ValueError)
"""What a read of stored bytes raises for a damaged or changed file (re-raised as FormatError)."""


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
        return self._store._compression(self._entry)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index=index)

    def read(self, out: torch.Tensor | None = None, *, index: Any = None, mmap: bool = False,
             verify: bool = False) -> torch.Tensor:
        """Read the tensor, or the part selected by ``index``, into ``out`` or a new tensor.

        Args:
            out: a tensor of the selection's shape and of this dtype to fill in place
                (checked before any I/O). Without it a new CPU tensor is returned; a full
                read restores the saved stride.
            index: what ``h[index]`` would take: integers, slices (positive step), ``...``.
            mmap: return a tensor backed by the file's pages (copy-on-write) when the dataset
                is contiguous, uncompressed, row-major and aligned; otherwise read as usual.
            verify: check the stored checksums of the tensor (whole reads only).

        Returns:
            ``out``, or the new tensor.

        Raises:
            MismatchError: ``out`` has another shape or dtype.
            IndexError: for an unsupported or out-of-range index.
            FormatError: the dataset cannot be read (damaged or truncated file, or, with
                ``verify``, a checksum that does not match).
        """
        if verify and index is not None:
            raise ValueError("verify checks whole tensors; read without index, then slice")
        sel = select_index(() if index is None else index, self._entry.shape)
        if mmap:
            if out is not None or index is not None:
                raise ValueError("read(mmap=True) maps the whole tensor; it takes no out or index")
            mapped = self._store._mapped(self._entry, io.FileMap(self._store._rawfile(), whole=False), verify)
            if mapped is not None:
                return mapped
        try:
            return self._store._read_tensor(self._entry, sel, out, restore_layout=index is None, verify=verify, fetch=True)
        finally:
            self._store._rawfile().release()

    def _repr_html_(self) -> str:
        from .display import TreeRow, tree_html

        e = self._entry
        layout = "row-major" if e.stride is None else f"stride {list(e.stride)}"
        where = "same as " + e.same_as if e.same_as else ("compressed" if isinstance(e.extent, Chunked) else "contiguous")
        row = TreeRow(e.path or "(root)", f"{e.dtype.name} {list(e.shape)} {layout}, {where}", e.nbytes)
        return tree_html(repr(self), [row], nest=False)

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
        IsADirectoryError: a directory.
        FormatError: not a tensorstore_h5 or HDF5 file, an unknown format version, or a
            damaged header or layout.
    """

    def __init__(self, path: Any, *, storage_options: dict[str, Any] | None = None) -> None:
        local = remote.local_path(path)
        self.path = local if local is not None else path if isinstance(path, str) else remote.FileObjSource.name_of(path)
        self._file: Any = None  # the h5py.File of a format-1 or foreign file
        self._raw: Any = None  # io.RawFile, remote.RemoteSource or remote.FileObjSource
        for _ in range(3 if local is not None else 1):  # a save may rename a new file over the path while we open it
            raw = remote.open_source(path, storage_options)
            try:
                self._layout: Layout = self._open(raw)
                break
            except FileExistsError:
                raw.close()
            except BaseException:
                raw.close()
                raise
        else:
            raise FormatError(f"{self.path}: the file kept being replaced while it was opened")
        self._raw = raw
        self._local = isinstance(raw, io.RawFile)
        self._leaf_paths = self._layout.leaf_paths
        self._container_paths = self._layout.container_paths
        self._located: dict[tuple[str, int | None], fmt.Extent | HDF5Read] = {}  # format 1 / foreign: checked locations
        self._pack_len: dict[str, int] = {}
        self._stagers = transfer.Stagers()

    def _open(self, raw: Any) -> Layout:
        head = raw.head(fmt.HEADER_SIZE)
        if head[:8] == fmt.MAGIC:
            header = fmt.parse_header(head, self.path, raw.size)
            text = raw.read(header.layout_offset, header.layout_length)
            if checksum.digest(text) != header.layout_hash:
                raise FormatError(f"{self.path}: damaged layout (checksum mismatch)")
            return fmt.parse_layout_v2(text, self.path, raw.size)
        other = _other_format(head)
        if other:
            what, suffix = other
            stem = os.path.splitext(self.path)[0]
            src = self.path if self.path.endswith(suffix) else f"{stem}{suffix}"
            rename = "" if src == self.path else f" (named {suffix} first)"
            raise FormatError(f"{self.path}: not a tensorstore_h5 file: it looks like {what}; convert it with "
                              f"`tensorstore-h5 convert {src} {stem}.h5`{rename}")
        self._file = hdf5source.open_file(self.path, raw.identity, None if isinstance(raw, io.RawFile) else raw)
        try:
            return hdf5source.read_layout(self._file, self.path)
        except BaseException:
            self._file.close()
            self._file = None
            raise

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
        return self._read_leaf(entry, {}, None, None, None, False)

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
        """Totals and, per tensor with data of its own, dtype, shape, bytes, bytes on disk,
        ratio (stored/original) and compression (filter and chunk shape, or None)."""
        tensors = {}
        for e in self._layout.leaves:
            if isinstance(e, TensorEntry) and e.same_as is None and e.packed is None:
                stored = self._stored_bytes(e)
                tensors[e.path] = {"dtype": e.dtype.name, "shape": list(e.shape), "nbytes": e.nbytes, "stored_bytes": stored,
                                   "ratio": stored / e.nbytes if e.nbytes else 1.0, "compression": self._compression(e)}
        data = sum(t["nbytes"] for t in tensors.values())
        stored = sum(t["stored_bytes"] for t in tensors.values())
        return {"file": self.path, "format_version": self.format_version, "file_bytes": self._rawfile().size,
                "keys": len(self), "data_bytes": self.nbytes, "ratio": stored / data if data else 1.0,
                "metadata": self.metadata, "tensors": tensors}

    # -- loading ------------------------------------------------------------------------

    def items(self, select: Selector = None, device: Device = None, *, mmap: bool = False,
              verify: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, value)`` for the selected leaves, one at a time, in saved order.

        The store keeps no reference to what it yields, so memory falls as the caller drops
        each tensor. Aliased tensors come back as the same object while it is alive.
        ``device``, ``mmap`` and ``verify`` are as for :meth:`load`. Over a URL the next
        tensors download while the caller uses this one: up to :data:`remote.FETCH_AHEAD` + 1
        batches of :data:`remote.BATCH_BYTES` are held ahead of the caller.
        """
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        alive: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        fmap = io.FileMap(self._rawfile(), whole=False) if mmap else None  # each tensor unmapped when dropped
        entries = [e for e in self._layout.select(included) if not isinstance(e, Container)]
        if not self._local:  # batches fetched ahead, not one round trip per tensor
            device = _asked_once(device)
            for group, filled in self._fetched(entries, self._streamable(device)):
                for entry in group:
                    io.streamed(_data_bytes(entry))
                    value = self._read_leaf(entry, alive, device, fmap, None, verify, filled.pop(entry.path, None))
                    yield entry.path, value
                    del value  # not held while the next one is read
            return
        advised, ahead = 0, 0  # entries[:advised] were handed to the kernel's readahead; bytes beyond now
        sizes: dict[int, int] = {}  # bytes handed to the readahead, by entry, until the entry is read
        for i, entry in enumerate(entries):
            if fmap is None and io.READAHEAD_BYTES:  # the disk reads the next tensors while this one is used
                ahead -= sizes.pop(i, 0)
                advised = max(advised, i)
                while advised < len(entries) and ahead < io.READAHEAD_BYTES:
                    ranges = self._ranges(entries[advised])
                    if ranges:
                        self._rawfile().willneed(ranges)
                        sizes[advised] = n = sum(n for _, n in ranges)
                        ahead += n
                    advised += 1
            io.streamed(_data_bytes(entry))  # what the caller freed since the last one goes back
            yield entry.path, self._read_leaf(entry, alive, device, fmap, None, verify)

    def read_many(self, selections: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """A part of each of several tensors: ``{key path: index}`` (what ``h[index]`` takes;
        ``...`` for all of it) to ``{key path: new CPU tensor}``. Over a URL, every range they
        touch is fetched at once (neighbours in one request, the rest concurrently) instead
        of one round trip per tensor.

        Raises KeyNotFoundError, IndexError, FormatError as :meth:`TensorHandle.read` does.
        """
        parts = []
        for key, index in selections.items():
            entry = self._entry(key)
            if not isinstance(entry, TensorEntry):
                raise KeyNotFoundError(f"{self.path}: {key!r} is not a tensor")
            parts.append((key, entry, select_index(index, entry.shape)))
        raw = self._rawfile()
        try:
            if not self._local:
                with self._fetching([key for key, _, sel in parts if not sel.empty]):
                    raw.prefetch([r for _, entry, sel in parts if not sel.empty for r in self._ranges(entry, sel)])
            return {key: self._read_tensor(entry, sel, None, restore_layout=False) for key, entry, sel in parts}
        finally:
            raw.release()

    def walk(self, select: Selector = None, *, verify: bool = False) -> Iterator[Container | Leaf]:
        """The selected part of the file as ``tree.flatten`` gives an object: containers and
        leaves in pre-order, each leaf read when it is reached (tied tensors come back as one
        while alive). What :meth:`Writer.write_tree` takes, to copy a file key by key."""
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        entries = self._layout.select(included)
        tied = {e.same_as for e in entries if isinstance(e, TensorEntry) and e.same_as is not None}
        alive: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        kept: dict[str, torch.Tensor] = {}  # tensors that a later key is tied to: one object for both
        for group, filled in self._fetched(entries, self._streamable(None)):  # over a URL: batches ahead, as items()
            for entry in group:
                if isinstance(entry, Container):
                    yield entry
                else:
                    value = self._read_leaf(entry, alive, None, None, None, verify, filled.pop(entry.path, None))
                    if entry.path in tied:
                        kept[entry.path] = value
                    yield Leaf(entry.path, entry.key, value)
                    del value  # not held while the next leaf is read

    def nbytes_of(self, select: Selector = None) -> int:
        """Bytes of tensor and array data that ``select`` picks (tied tensors counted once)."""
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        return sum(_data_bytes(e) for e in self._layout.select(included) if not isinstance(e, Container))

    def selected_keys(self, select: Selector = None) -> list[str]:
        """The leaf key paths that ``select`` picks, in saved order (see :meth:`load`)."""
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        return [p for p in self._leaf_paths if p in included]

    def load(self, select: Selector = None, device: Device = None, progress: bool | None = None, *,
             mmap: bool = False, verify: bool = False) -> Any:
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
            verify: check every tensor's stored checksums (format 2; a format-1 file has
                none). About the cost of one more pass over the bytes, in the I/O threads.

        Raises:
            KeyNotFoundError: an exact key in ``select`` is not in the file.
            FormatError: data cannot be read, or (``verify``) a checksum does not match.
            TensorStoreError: a device that does not exist here.
        """
        with io.gc_paused():  # many new objects, none in a cycle
            return self._load(select, device, progress, mmap, verify)

    def _load(self, select: Selector, device: Device, progress: bool | None, mmap: bool, verify: bool) -> Any:
        included = resolve(select, self._leaf_paths, self._container_paths, self.path)
        cache: dict[str, torch.Tensor] = {}
        items: list[Container | Leaf] = []
        fmap = io.FileMap(self._rawfile()) if mmap else None
        entries = self._layout.select(included)
        cold = False
        if self._local:
            ranges = [r for e in entries for r in self._ranges(e)]
            cold = not self._rawfile().cached(ranges)  # then more reads in flight (io.COLD_IO_THREADS)
            if mmap:
                if cold:  # the caller's page faults will read the mapped tensors: let them read ahead
                    self._rawfile().prime(ranges)
            elif io.READAHEAD_BYTES:  # from a cold cache the kernel reads ahead of the I/O threads
                self._rawfile().willneed(ranges)
        staged: dict[str, torch.Tensor] = {}
        device = _asked_once(device)
        direct = self._streamable(device)
        with self._batched(progress, sum(_data_bytes(e) for e in entries), cold) as (bar, plan):
            if device is not None and self._local and transfer.batched():  # to devices: many tensors per buffer
                pairs = [(e, transfer.device_empty(e.shape, e.dtype.torch_dtype, d, e.path)) for e in entries
                         if (d := self._stageable(e, device)) is not None]
                self._stage_many(pairs, lambda e: bar.update(_data_bytes(e)))
                staged = {e.path: t for e, t in pairs}
            for group, filled in self._fetched(entries, direct):
                for entry in group:
                    if isinstance(entry, Container):
                        items.append(entry)
                    else:
                        leaf = self._read_leaf(entry, cache, device, fmap, plan, verify,
                                               staged.get(entry.path, filled.get(entry.path)))
                        items.append(Leaf(entry.path, entry.key, leaf))
                        if entry.path not in staged:
                            bar.update(_data_bytes(entry))
        return tree.inflate(items)

    def _streamable(self, device: Device) -> Callable[[Any], bool] | None:
        """For a remote source, which entries :meth:`_fetched` streams into new CPU tensors of
        their own (contiguous tensors of at least :data:`remote.DIRECT_BYTES` bound for the
        CPU); None for other sources."""
        if not isinstance(self._rawfile(), remote.RemoteSource):
            return None

        def direct(e: Any) -> bool:
            return isinstance(e, TensorEntry) and e.same_as is None and e.nbytes >= remote.DIRECT_BYTES and \
                isinstance(self._where(e), Contiguous) and self._target(device, e.path) is None
        return direct

    def _stageable(self, entry: Any, device: Device) -> torch.device | None:
        """The device that ``entry`` goes to through :meth:`_stage_many` (a contiguous dataset of
        a local file with bytes, not an alias, bound for memory that is not the CPU's), else None."""
        if not isinstance(entry, TensorEntry) or entry.same_as is not None or not entry.nbytes:
            return None
        target = self._target(device, entry.path)
        if target is None or not isinstance(self._where(entry), Contiguous):
            return None
        return target

    def _stage_many(self, pairs: list[tuple[TensorEntry, torch.Tensor]], done: Callable[[TensorEntry], None]
                    ) -> None:
        """Fill each contiguous device tensor with its entry's stored bytes (shapes and dtypes
        already match) through the staging buffers of its device, many tensors per buffer
        (:meth:`transfer.Stager.copy_many`). ``done(entry)`` as each one's copies are issued.
        Raises FormatError naming the key for a read that fails."""
        raw = self._rawfile()
        of = {id(t): e for e, t in pairs}  # dest -> entry, for done

        def filler(entry: TensorEntry) -> transfer.Fill:
            where = self._where(entry)
            assert isinstance(where, Contiguous)
            return lambda off, buf: self._keyed(lambda: raw.pread(where.offset + off, io.tensor_buffer(buf)), entry)()

        for dev in dict.fromkeys(t.device for _, t in pairs):
            mine = [(t, filler(e)) for e, t in pairs if t.device == dev]
            self._stagers[dev].copy_many(mine, lambda t: done(of[id(t)]))

    def _fetched(self, entries: list[Any], direct: Callable[[Any], bool] | None = None
                 ) -> Iterator[tuple[list[Any], dict[str, torch.Tensor]]]:
        """``entries`` in groups whose stored bytes a remote source has fetched (about
        :data:`remote.BATCH_BYTES` a group, neighbouring ranges in one request); the next
        groups' bytes (:data:`remote.FETCH_AHEAD` of them) download while the caller reads the
        current one. One group, nothing fetched, for a local file.

        Each group comes with ``{path: tensor}``: a new CPU tensor holding the whole stored
        bytes of each entry that ``direct(entry)`` chose (a contiguous dataset), filled by
        the fetch itself rather than copied from fetched bytes."""
        if self._local:
            yield entries, {}
            return
        raw = self._rawfile()
        groups: list[tuple[list[Any], list[tuple[int, int]], list[TensorEntry]]] = [([], [], [])]
        size = 0
        for entry in entries:
            streamed = direct is not None and direct(entry)
            more = self._ranges(entry)
            grow = sum(n for _, n in more)
            limit = min(remote.BATCH_BYTES, remote.FIRST_BATCH_BYTES << (len(groups) - 1))  # see FIRST_BATCH_BYTES
            if groups[-1][0] and size and size + grow > limit:
                groups.append(([], [], []))
                size = 0
            groups[-1][0].append(entry)
            (groups[-1][2].append(entry) if streamed else groups[-1][1].extend(more))
            size += grow

        populate = raw.populate  # no faults under the GIL where one event loop receives (fsspec's aiohttp)

        def alloc(streamed: list[TensorEntry]) -> dict[str, torch.Tensor]:
            return {e.path: self._empty(e, e.shape, populate=populate) for e in streamed}

        def fetch(ranges: list[tuple[int, int]], streamed: list[TensorEntry], filled: dict[str, torch.Tensor] | None
                  ) -> tuple[list[tuple[int, bytes]], dict[str, torch.Tensor]]:
            filled = alloc(streamed) if filled is None else filled
            into = []
            for e in streamed:
                where = self._where(e)
                assert isinstance(where, Contiguous)
                into.append((where.offset, io.tensor_buffer(filled[e.path])))
            return raw.fetch(ranges, into), filled

        ahead = max(1, remote.FETCH_AHEAD)
        pool = ThreadPoolExecutor(ahead, thread_name_prefix="th5-fetch")
        pending = deque(pool.submit(fetch, ranges, streamed, None) for _, ranges, streamed in groups[:ahead])
        try:
            for k, (group, _, _) in enumerate(groups):
                # The memory of the next group's streamed tensors (new tensors of the result, not
                # extra memory) is made here, while the earlier groups' requests are in flight:
                # made in the fetch thread, no request of that group was in flight for the ~40 ms
                # of faulting in 64 MiB (at 20 ms latency, a gap after every pair of batches).
                later = groups[k + ahead] if k + ahead < len(groups) else None
                made = alloc(later[2]) if later is not None else None
                with self._fetching([e.path for e in group if isinstance(e, (TensorEntry, ArrayEntry))]):
                    pieces, filled = pending.popleft().result()
                if later is not None:
                    pending.append(pool.submit(fetch, later[1], later[2], made))
                del made
                raw.use(pieces)
                del pieces
                yield group, filled
                del filled
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True)
            raw.release()

    def _ranges(self, entry: Any, sel: Selection | None = None) -> list[tuple[int, int]]:
        """The ``(offset, nbytes)`` ranges of the file that reading ``sel`` (all by default) of a
        leaf touches (none for plain values, aliases and data only HDF5 reads)."""
        if not isinstance(entry, (TensorEntry, ArrayEntry)) or getattr(entry, "same_as", None):
            return []
        where = self._where(entry)
        if where is None or isinstance(where, HDF5Read):
            return []
        lo, hi = 0, where.nbytes
        if sel is not None and not sel.empty:
            row = entry.dtype.itemsize * math.prod(entry.shape[1:]) if entry.shape else entry.dtype.itemsize
            first = sel.start[0] if entry.shape else 0
            last = first + (sel.count[0] - 1) * sel.step[0] + 1 if entry.shape else 1
            lo, hi = first * row, last * row  # the rows the selection touches
        if isinstance(where, Contiguous):
            return [(where.offset + lo, hi - lo)]
        out = []
        for k in range(where.locate(lo), len(where.chunks)):
            start, _ = where.span(k)
            if start >= hi:
                break
            out.append(where.chunks[k][:2])
        return out

    def _read_into(self, pairs: list[tuple[TensorEntry, torch.Tensor]], progress: bool | None, verify: bool) -> None:
        """Fill each target from its entry (shapes already checked; a target of another dtype
        is filled through a temporary of the stored dtype, cast like ``copy_``).

        Every dataset is checked first (storage, type, shape, byte range inside the file),
        and with ``verify`` every checksum, so a damaged file is refused before any target
        changes.
        """
        for entry, _ in pairs:
            self._where(entry)
        if verify:
            for entry, _ in pairs:
                self._verify_stored(entry)
        targets = {id(e): t for e, t in pairs}
        with self._batched(progress, sum(e.nbytes for e, _ in pairs)) as (bar, plan):
            if self._local and transfer.batched():  # device targets: many tensors per staging buffer
                staged = [(e, t) for e, t in pairs if _staged(t) and t.is_contiguous() and e.nbytes and
                          t.dtype == e.dtype.torch_dtype and isinstance(self._where(e), Contiguous)]
                self._stage_many(staged, lambda e: bar.update(e.nbytes))
                done = {id(e) for e, _ in staged}
                pairs = [(e, t) for e, t in pairs if id(e) not in done]
            for group, _ in self._fetched([e for e, _ in pairs]):
                for entry in group:
                    target = targets[id(entry)]
                    sel = whole(entry.shape)
                    if target.dtype == entry.dtype.torch_dtype:
                        self._read_tensor(entry, sel, target, restore_layout=False, plan=plan)
                    else:
                        value = self._read_tensor(entry, sel, None, restore_layout=False)
                        with torch.no_grad():
                            target.copy_(value)
                    bar.update(entry.nbytes)

    def _check_hashes(self, entry: TensorEntry, values: torch.Tensor) -> None:
        """Check the contiguous tensor ``values``, all of ``entry``'s stored bytes, against
        its checksums (none in format 1). Raises FormatError naming the key."""
        where = self._where(entry)
        if isinstance(where, Contiguous) and where.hashes is not None and \
                checksum.block_hashes(io.tensor_buffer(values), where.block) != list(where.hashes):
            raise FormatError(f"{self.path}: key {entry.path!r}: {_why(checksum.ChecksumError('its data'))}")

    def _verify_stored(self, entry: TensorEntry) -> None:
        """Check ``entry``'s stored checksums by reading its bytes once (nothing kept)."""
        where = self._where(entry)
        if where is None or isinstance(where, HDF5Read) or where.hashes is None:
            return
        scratch = torch.empty(min(entry.nbytes, io.PIECE_BYTES), dtype=torch.uint8, device="cpu")
        try:
            if isinstance(where, Contiguous):
                raw = self._rawfile()
                for i, h in enumerate(where.hashes):
                    n = min(where.block, where.nbytes - i * where.block)
                    view = io.tensor_buffer(scratch)[:n] if n <= scratch.numel() else memoryview(bytearray(n))
                    raw.pread(where.offset + i * where.block, view)
                    if checksum.digest(view) != h:
                        raise checksum.ChecksumError(f"block {i}, bytes {i * where.block}..{i * where.block + n} of its data")
            else:
                reader = ChunkReader(where, self._rawfile().pread, verify=True)
                dest = bytearray(where.chunk_bytes)
                for k in range(len(where.chunks)):
                    start, valid = where.span(k)
                    reader.read(start, memoryview(dest)[:valid])
        except _READ_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: {_why(e)}") from e

    @contextmanager
    def _batched(self, progress: bool | None, nbytes: int, cold: bool = False
                 ) -> Iterator[tuple[Progress, io.ReadPlan | None]]:
        """``(bar, plan)`` for a multi-tensor read: a progress bar over ``nbytes``, and one read
        plan for both cores when no bar is shown (reads then finish at the end of the block;
        with a bar each tensor is read as it comes, so the bar moves); ``cold`` (the bytes are
        not in the page cache): the plan keeps :data:`io.COLD_IO_THREADS` reads in flight. An
        error inside the block abandons the plan's queued reads; the bar is closed either way."""
        bar = Progress(progress, desc=f"loading {os.path.basename(self.path)}")
        bar.total(nbytes)
        threads = io.COLD_IO_THREADS if cold else None
        plan = io.ReadPlan(self._rawfile(), threads) if bar.silent and self._local else None
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

    def _rawfile(self) -> Any:
        if self._raw is None:
            raise ValueError(f"{self.path}: the store is closed")
        return self._raw

    def _run(self, plan: io.ReadPlan) -> None:
        try:
            plan.run()
        except TensorStoreError:
            raise
        except _READ_ERRORS as e:
            raise FormatError(f"{self.path}: cannot read tensor data: {_why(e)}") from e

    def _where(self, entry: TensorEntry | ArrayEntry) -> fmt.Extent | HDF5Read | None:
        """Where ``entry``'s bytes are: its checked extent, an HDF5Read (format 1 and foreign
        files only), or None when it has no bytes. Raises FormatError for anything the
        format does not allow."""
        if self._file is None:
            self._rawfile()
            return entry.extent
        packed = entry.packed if isinstance(entry, TensorEntry) else None
        key = (entry.dataset, packed)
        where = self._located.get(key)
        if where is None:
            if self._raw is None:
                raise ValueError(f"{self.path}: the store is closed")
            where = self._located[key] = hdf5source.locate(self._file, entry, self.path, self._raw.size, self._pack_len)
        if isinstance(where, Contiguous) and where.nbytes == 0:
            return None
        return where

    def _chunked(self, entry: TensorEntry) -> Chunked | None:
        """The checked chunk list of a compressed tensor, or None for other storage."""
        where = self._where(entry)
        return where if isinstance(where, Chunked) else None

    def _stored_bytes(self, entry: TensorEntry) -> int:
        where = self._where(entry)
        if where is None:
            return 0
        if isinstance(where, Contiguous):
            return where.nbytes
        if isinstance(where, Chunked):
            return where.stored_bytes
        return int(where.dsid.get_storage_size())

    def _compression(self, entry: TensorEntry) -> dict[str, Any] | None:
        where = self._where(entry)
        if isinstance(where, Chunked):
            return {"filters": [{"id": where.filter_id, "name": fmt.FILTERS.get(where.filter_id, str(where.filter_id)),
                                 "options": list(where.filter_values)}], "chunks": list(where.chunk_shape)}
        if isinstance(where, HDF5Read):
            from .compression import describe

            return describe(where.dsid.get_create_plist())
        return None

    def _keyed(self, job: Callable[[], None], entry: TensorEntry | ArrayEntry) -> Callable[[], None]:
        """``job`` with read errors turned into a FormatError naming the file and key (a
        failed request stays a RemoteError and gains the key)."""
        def run() -> None:
            try:
                if self._local:
                    job()
                else:
                    with self._fetching([entry.path]):
                        job()
            except TensorStoreError:
                raise
            except _READ_ERRORS as e:
                raise FormatError(f"{self.path}: key {entry.path!r}: {_why(e)}") from e
        return run

    @contextmanager
    def _fetching(self, keys: list[str]) -> Iterator[None]:
        """Remote errors raised inside name ``keys``, the keys whose bytes are fetched (an
        error that already names a key is left as it is)."""
        try:
            yield
        except remote.RemoteError as e:
            message, prefix = str(e), f"{self.path}: "
            if not keys or message.startswith(prefix + "key"):
                raise
            rest = message[len(prefix):] if message.startswith(prefix) else message
            names = few([repr(k) for k in keys])
            raise remote.RemoteError(f"{prefix}{'key' if len(keys) == 1 else 'keys'} {names}: {rest}") from e

    def _target(self, device: Device, key: str) -> torch.device | None:
        """The device a leaf goes to: None for the CPU (any spelling), else a device that
        exists here. Raises TensorStoreError naming the key and the device otherwise."""
        dev = _device_for(device, key)
        if dev is None:
            return None
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError, ValueError) as e:
            raise TensorStoreError(f"{self.path}: key {key!r}: invalid device {dev!r} ({e})") from e
        if d.type == "cpu":
            return None
        if d.type == "meta":
            raise TensorStoreError(f"{self.path}: key {key!r}: cannot load data onto the meta device")
        if d.type == "cuda" and not torch.cuda.is_available():
            raise TensorStoreError(f"{self.path}: key {key!r}: device {str(d)!r} is not available (this torch has no "
                                   "usable CUDA device)")
        return d

    def _read_leaf(self, entry: Any, cache: Any, device: Device, fmap: io.FileMap | None, plan: io.ReadPlan | None,
                   verify: bool, filled: torch.Tensor | None = None) -> Any:
        """A leaf's value. ``filled``: a CPU tensor already holding the entry's stored bytes
        (:meth:`_fetched`), checked (``verify``) and laid out here."""
        if isinstance(entry, ValueEntry):
            return entry.value
        if isinstance(entry, ForeignEntry):
            raise FormatError(f"{self.path}: key {entry.path!r} cannot be loaded as a tensor: {entry.reason}")
        if isinstance(entry, ArrayEntry):
            return self._read_array(entry, verify)
        origin = entry.same_as or entry.path
        t = cache.get(origin)
        if t is not None and (isinstance(t, torch.nn.Parameter), t.requires_grad) != (entry.parameter, entry.requires_grad):
            t = _flagged(t.detach(), entry)  # the same memory as another key, saved as another kind of tensor
        elif t is None:
            target = self._target(device, entry.path)
            t = self._mapped(entry, fmap, verify) if fmap is not None and target is None else None
            if filled is not None:
                if verify and filled.device.type == "cpu":
                    self._check_hashes(entry, filled)
                elif verify:  # device memory: the stored bytes are read once more on the host
                    self._verify_stored(entry)
                t = self._restore(filled, entry) if entry.stride is not None else filled
            elif t is None and target is not None:  # allocated on the device, filled through the staging buffers
                t = transfer.device_empty(entry.shape, entry.dtype.torch_dtype, target, entry.path)
                self._read_tensor(entry, whole(entry.shape), t, restore_layout=False, verify=verify)
                if entry.stride is not None:
                    t = self._restore(t, entry)  # on the device
            elif t is None:  # queued when nothing is done to it after the read
                where = self._where(entry) if plan is not None and entry.stride is None else None
                if type(where) is Contiguous and 0 < where.nbytes <= io.SMALL_READ_BYTES and \
                        (not where.hashes or len(where.hashes) == 1):  # read with its neighbours
                    assert plan is not None
                    t = self._empty(entry, entry.shape)
                    plan.add_small(where.offset, t, lambda job, e=entry: self._keyed(job, e),
                                   where.hashes[0] if verify and where.hashes else None)
                else:
                    t = self._read_tensor(entry, whole(entry.shape), None, restore_layout=True, plan=plan,
                                          verify=verify)
            t = _flagged(t, entry)
            cache[origin] = t
        return t

    def _read_array(self, entry: ArrayEntry, verify: bool) -> np.ndarray:
        out = np.empty(entry.shape, dtype=entry.dtype)
        where = self._where(entry)
        if where is None:
            return out
        raw = self._rawfile()
        try:
            view = memoryview(out.reshape(-1).view(np.uint8))
            if isinstance(where, Contiguous):
                raw.pread(where.offset, view)
                if verify and where.hashes is not None and checksum.block_hashes(view, where.block) != list(where.hashes):
                    raise checksum.ChecksumError("its data")
            elif isinstance(where, Chunked):
                ChunkReader(where, raw.pread, verify).read(0, view)
            else:
                where.dsid.read(hdf5source.h5py.h5s.ALL, hdf5source.h5py.h5s.ALL, out)
        except (*_READ_ERRORS, *hdf5source.H5_ERRORS) as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: {_why(e)}") from e
        return out

    def _empty(self, entry: TensorEntry, shape: tuple[int, ...], populate: bool = False) -> torch.Tensor:
        """A new CPU tensor for (part of) ``entry`` (``populate``: see :func:`io.empty`);
        TensorStoreError naming the key when the memory cannot be had."""
        try:
            return io.empty(shape, entry.dtype.torch_dtype, populate)
        except (OSError, MemoryError, RuntimeError) as e:
            nbytes = math.prod(shape) * entry.dtype.itemsize
            raise TensorStoreError(f"{self.path}: key {entry.path!r}: cannot allocate {human_bytes(nbytes)} for "
                                   f"{list(shape)} {entry.dtype.name} ({e})") from e

    def _restore(self, values: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        assert entry.stride is not None
        try:
            return io.restore_layout(values, entry.stride)
        except ValueError as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: {e}") from e

    def _hdf5_read(self, entry: TensorEntry, where: HDF5Read, sel: Selection, dest: torch.Tensor) -> None:
        """HDF5's own read of ``sel`` into ``dest`` (compact data, HDF5's filters, conversion;
        a version-1 packed tensor is the range of its pack at its offset)."""
        try:
            if entry.packed is None:
                io.read_hdf5(where.dsid, entry.dtype.h5_type, dest, sel)
                return
            full = self._empty(entry, entry.shape)
            span = select_index(slice(entry.packed, entry.packed + entry.numel), (self._pack_len[entry.dataset],))
            io.read_hdf5(where.dsid, entry.dtype.h5_type, full, span)
        except hdf5source.H5_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot read the data ({hdf5source._short(e)})") from e
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
            if dcpl.get_layout() == hdf5source.h5py.h5d.CHUNKED and tuple(dcpl.get_chunk()[1:]) == tuple(shape[1:]) \
                    and dcpl.get_chunk()[0] * row <= limit:
                align = dcpl.get_chunk()[0] * row  # whole chunks per block: none is decoded twice
        except hdf5source.H5_ERRORS:
            pass
        first = sel.start[0]

        def fill(off: int, buf: torch.Tensor) -> None:
            a = first + off // row
            self._hdf5_read(entry, where, select_index(slice(a, a + buf.numel() // row), shape), buf)
        return fill, align

    def _mapped(self, entry: TensorEntry, fmap: io.FileMap, verify: bool = False) -> torch.Tensor | None:
        """A tensor of ``fmap`` for a row-major, contiguous, unfiltered dataset whose data
        start at a multiple of the element size, else None (then it is read)."""
        where = self._where(entry)
        if not self._local or not isinstance(where, Contiguous) or entry.stride is not None or \
                where.offset % entry.dtype.itemsize:
            return None
        try:
            t = fmap.tensor(where.offset, entry.nbytes, entry.dtype.torch_dtype, entry.shape)
        except _READ_ERRORS as e:
            raise FormatError(f"{self.path}: key {entry.path!r}: cannot map the data ({_why(e)})") from e
        if verify:
            self._check_hashes(entry, t)
        return t

    def _read_tensor(self, entry: TensorEntry, sel: Selection, out: torch.Tensor | None, restore_layout: bool,
                     plan: io.ReadPlan | None = None, verify: bool = False, fetch: bool = False) -> torch.Tensor:
        """Read ``sel`` of ``entry`` into ``out`` (checked first) or a new tensor.

        With ``plan``, raw reads are only queued: the caller runs the plan before using the
        result (only for results that need no copy afterwards). ``verify`` (whole reads)
        checks the stored checksums. ``fetch``: a remote source first fetches the ranges the
        selection touches (callers that read many tensors fetch for all of them at once).
        """
        dtype = entry.dtype.torch_dtype
        if out is not None and (tuple(out.shape) != sel.shape or out.dtype != dtype):
            raise MismatchError(
                f"{self.path}: key {entry.path!r}: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                f"the selection needs {sel.shape} and {dtype}"
            )
        where = self._where(entry)
        raw = self._rawfile()
        verify = verify and sel.full
        if fetch and not self._local and not sel.empty:
            with self._fetching([entry.path]):
                raw.prefetch(self._ranges(entry, sel))  # the chunks or rows it touches, in few requests
        ranged = isinstance(where, (Contiguous, Chunked)) and sel.contiguous_rows
        skip = sum(a * st for a, st in zip(sel.start, contiguous_stride(entry.shape))) * entry.dtype.itemsize \
            if any(sel.start) else 0  # bytes before the selection's first element
        reader = ChunkReader(where, raw.pread, verify) if isinstance(where, Chunked) else None

        def fetch(off: int, buf: memoryview) -> None:  # logical bytes [off, off + len(buf)) of the dataset
            if reader is not None:
                reader.read(off, buf)
            else:
                assert isinstance(where, Contiguous)
                raw.pread(where.offset + off, buf)

        if out is not None and _staged(out) and out.is_contiguous() and not sel.empty:
            if verify:
                self._verify_stored(entry)
            if self._local and isinstance(where, Contiguous) and ranged and _gds(out) and \
                    transfer.gds_read(_fd_path(raw, self.path), where.offset + skip, out):
                return out
            stage, align = None, 1
            if ranged and reader is None and self._local:  # the block read by all the I/O threads at once
                assert isinstance(where, Contiguous)
                at = where.offset + skip
                stage = lambda off, buf: io.pread_split(raw.pread, at + off, io.tensor_buffer(buf))  # noqa: E731
            elif ranged:  # chunks decode on the I/O threads (ChunkReader.read); a remote source's bytes are fetched
                align = reader.chunk_bytes if reader is not None else 1
                stage = lambda off, buf: fetch(skip + off, io.tensor_buffer(buf))  # noqa: E731
            elif isinstance(where, HDF5Read):
                stage, align = self._hdf5_rows(entry, where, sel, self._stagers[out.device].block_bytes)
            if stage is not None:
                self._keyed(lambda: self._stagers[out.device].copy(out, stage, entry.path, align=align), entry)()
                return out
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct else self._empty(entry, sel.shape)
        post = (out is not None and not direct) or (out is None and restore_layout and entry.stride is not None)
        if not sel.empty and where is not None:
            queue = plan if plan is not None and not post else None
            if queue is None and (reader is not None or dest.numel() * dest.element_size() > io.PIECE_BYTES):
                queue = io.ReadPlan(raw)
            if isinstance(where, HDF5Read):
                self._hdf5_read(entry, where, sel, dest)
            elif not ranged:
                bits = bits_view(dest).view(sel.count) if dest.element_size() <= 8 else dest.view(sel.count)
                self._keyed(lambda: io.gather(fetch, entry.shape, entry.dtype.itemsize, sel, bits), entry)()
            elif reader is not None:
                for job in reader.tasks(skip, io.tensor_bytes(dest)):
                    assert queue is not None
                    queue.add_job(self._keyed(job, entry), job.n * DECODE_COST)
            elif queue is None:  # one small range: read it here
                self._keyed(lambda: fetch(skip, io.tensor_buffer(dest)), entry)()
                if verify:
                    self._check_hashes(entry, dest)
            else:
                assert isinstance(where, Contiguous)
                queue.add(where.offset + skip, dest, lambda job: self._keyed(job, entry),
                          where.hashes if verify else None, where.block)
            if queue is not None and queue is not plan:
                self._run(queue)
        if out is None:
            if restore_layout and entry.stride is not None:
                return self._restore(dest, entry)
            return dest
        if not direct:
            with torch.no_grad():
                bits_view(out).copy_(bits_view(dest))
        return out

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent). Handles of a closed store cannot read."""
        self._located.clear()
        self._stagers.clear()  # device staging buffers go back to the process's pool
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    @property
    def closed(self) -> bool:
        return self._raw is None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """A collapsible tree of the keys with dtype, shape, layout and size (Jupyter)."""
        from .display import TreeRow, tree_html

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

    def __repr__(self) -> str:
        n_t = sum(1 for e in self._layout.leaves if isinstance(e, TensorEntry))
        version = f"v{self._layout.version}" if self._layout.version else "foreign HDF5"
        state = ", closed" if self._raw is None else ""
        return f"<tensorstore_h5.Store {self.path!r} ({version}, {len(self)} keys, {n_t} tensors, {human_bytes(self.nbytes)}{state})>"


def _flagged(t: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``t`` as the ``nn.Parameter`` or grad-requiring tensor that ``entry`` was saved as."""
    if entry.parameter:
        return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
    if entry.requires_grad:
        t.requires_grad_(True)
    return t


def _why(e: BaseException) -> str:
    """The reason of a read failure, for a message that already names the file and key."""
    if isinstance(e, checksum.ChecksumError):
        return f"stored bytes do not match their checksum ({e}); the file is damaged"
    if isinstance(e, DecodeError):
        return f"a compressed chunk does not decode ({e}): the file is damaged"
    if isinstance(e, EOFError):
        return f"cannot read the data ({e})"
    return f"cannot read the data ({e})"


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


def _fd_path(raw: io.RawFile, path: str) -> str:
    """A path that opens the very file ``raw`` has open (Linux), else ``path``."""
    proc = f"/proc/self/fd/{raw._fileno()}"
    return proc if os.path.exists(proc) else path


def _staged(t: torch.Tensor) -> bool:
    """True for targets filled through staging buffers (device memory, not the CPU's)."""
    return t.device.type != "cpu"


def _gds(t: torch.Tensor) -> bool:
    """True for targets that GPUDirect Storage can fill (CUDA memory)."""
    return t.device.type == "cuda"


def _data_bytes(entry: Any) -> int:
    """Bytes a leaf reads from the file (0 for plain values and aliases)."""
    if isinstance(entry, ArrayEntry) or (isinstance(entry, TensorEntry) and entry.same_as is None):
        return entry.nbytes
    return 0


def _asked_once(device: Device) -> Device:
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


def _device_for(device: Device, path: str) -> Any:
    if device is None or isinstance(device, (str, torch.device, int)):
        return device
    if callable(device):
        return device(path)
    import fnmatch

    for pattern, dev in device.items():
        if path == pattern or fnmatch.fnmatchcase(path, pattern):
            return dev
    return None

