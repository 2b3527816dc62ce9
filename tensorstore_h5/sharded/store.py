""":class:`ShardedStore`: a checkpoint directory opened read-only as one store of its global
tensors, in one process (no process group)."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import transfer
from ..display import Progress, human_bytes
from ..errors import FormatError, KeyNotFoundError, MismatchError, MissingFileError, TensorStoreError
from ..format import tree
from ..format.dtypes import bits_view
from ..format.layout import ArrayEntry, TensorEntry, ValueEntry
from ..format.slicing import Selection, contiguous_stride, select as select_index
from ..format.tree import Container, Leaf
from ..reading.listing import LayoutView
from ..reading.select import Selector
from ..reading.store import EntryView
from ..reading.tensors import checking
from ..storage import files, memory
from ..transfer import Device
from .index import (
    DCP_METADATA, DirEntry, DirectoryIndex, HF_INDEX_SUFFIX, INDEX_NAME, INDEX_VERSION, PathLike, Piece, RANK_INDEX,
    ShardedArrayEntry, ShardedTensorEntry, rank_index_name, read_index,
)
from .reads import Reads, Th5Files, _keyed, piece_overlap
from .safetensors import safetensors_index

__all__ = ["is_checkpoint_directory", "ShardedTensorHandle", "ShardedStore", "open_directory"]

INTO_BATCH_BYTES = 64 * 2**20
"""Bytes of targets whose reads :meth:`ShardedStore._read_into` queues before running them
(targets that need a temporary hold at most this much of it at once)."""

# ---------------------------------------------------------------------------- the view


def is_checkpoint_directory(path: PathLike) -> bool:
    """True when ``path`` is a directory that :class:`ShardedStore` opens."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    names = os.listdir(p)
    return INDEX_NAME in names or any(n.endswith(HF_INDEX_SUFFIX) for n in names) or "model.safetensors" in names \
        or any(RANK_INDEX.fullmatch(n) for n in names)


class ShardedTensorHandle(EntryView):
    """A lazy view of one global tensor of a directory: metadata now, bytes when indexed.

    ``h[10:20]``, ``h[:, 3:7]`` read only the pieces that overlap the selection, and of each
    only the overlap; :meth:`read` fills ``out`` in place.
    """

    __slots__ = ()
    _store: ShardedStore
    _entry: ShardedTensorEntry

    @property
    def stride(self) -> tuple[int, ...]:
        """Row-major: a global tensor has no saved stride of its own."""
        return contiguous_stride(self._entry.shape)

    @property
    def pieces(self) -> list[Piece]:
        """Where the tensor is stored: file, key in the file, offsets and shape of each block."""
        return list(self._entry.pieces)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index=index)

    def read(self, out: torch.Tensor | None = None, *, index: Any = None, verify: bool | None = None) -> torch.Tensor:
        """Read the tensor, or the part selected by ``index`` (integers, slices with a positive
        step, ``...``), into ``out`` (any tensor of the selection's shape and of this dtype,
        checked first) or a new CPU tensor. ``verify`` checks the stored checksums of the
        pieces read, before ``out`` changes (one more pass over their bytes): by default
        (None) for a read of the whole tensor; True also for a slice (every piece it
        overlaps); False never."""
        return self._store._read_handle(self._entry, index, out, verify)

    def __repr__(self) -> str:
        e = self._entry
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"<ShardedTensorHandle {e.path!r} shape={list(e.shape)} dtype={dtype} {human_bytes(e.nbytes)} "
                f"in {len(e.pieces)} piece(s)>")


class ShardedStore(LayoutView):
    """A checkpoint directory opened read-only as one store, in one process (no process group).

    Opens a directory written by :mod:`tensorstore_h5.distributed` (DCP) or by
    :func:`from_safetensors_dir` (``tensorstore_h5.json``), or a Hugging Face sharded
    safetensors checkpoint (``model.safetensors.index.json`` + shards, or a lone
    ``model.safetensors``). Keys, shapes and dtypes are those of the *global* tensors.

    Example::

        with ShardedStore("ckpt/") as store:
            store.keys()
            h = store["model/layers.0.attn.wq.weight"]   # the whole tensor, whichever ranks wrote it
            rows = h[0:16]                                # reads only the pieces holding rows 0..15

    Args:
        path: the directory (or its index file).
        rank: open the rank-local index of a save made without collectives
            (``use_collectives=False``), which holds only that rank's pieces.

    Every index and data file read must be a regular file (or a symlink to one): a FIFO,
    device, socket or directory in its place is refused before it is read
    (:func:`tensorstore_h5.storage.files.open_regular`).

    Raises:
        FileNotFoundError: no such directory (``MissingFileError``, a TensorStoreError).
        FormatError: no index, a damaged index, an index or data file that is not a regular
            file (``NotRegularFileError``), or a directory of another kind.
        TensorStoreError: another problem with the path (``PathError``: a NUL in it, no
            permission to list it), naming it.
    """

    def __init__(self, path: PathLike, *, rank: int | None = None) -> None:
        p = os.fspath(path)
        files.check_path(p)
        index_file = None
        if (os.path.basename(p) == INDEX_NAME or p.endswith(HF_INDEX_SUFFIX)) and os.path.lexists(p) \
                and not os.path.isdir(p):  # the index itself (read, and checked to be a regular file, below)
            p, index_file = os.path.dirname(p) or ".", os.path.basename(p)
        if not os.path.isdir(p):
            if not os.path.exists(p):
                raise MissingFileError(f"{p}: no such checkpoint directory", p, errno.ENOENT)
            raise FormatError(f"{p}: not a directory (open files with tensorstore_h5.open)")
        self.path = p
        try:
            names = set(os.listdir(p))
        except OSError as e:
            raise files.path_error(e, p, "checkpoint directory") from e
        self._files: Any
        if rank is not None:
            self._layout = self._read_ours(rank_index_name(rank))
            self._files = Th5Files(self._layout)
        elif index_file == INDEX_NAME or (index_file is None and INDEX_NAME in names):
            self._layout = self._read_ours(INDEX_NAME)
            self._files = Th5Files(self._layout)
        else:
            hf = [index_file] if index_file else sorted(n for n in names if n.endswith(HF_INDEX_SUFFIX))
            if "model.safetensors.index.json" in hf:
                hf = ["model.safetensors.index.json"]
            if len(hf) == 1 or (not hf and "model.safetensors" in names):
                self._layout, self._files = safetensors_index(p, hf[0] if hf else None)
            elif len(hf) > 1:
                raise FormatError(f"{p}: several safetensors indexes ({', '.join(hf)}); open one of them by its path")
            elif DCP_METADATA in names:  # named, never opened: whatever it is (a FIFO, /dev/zero), it is not read
                raise FormatError(f"{os.path.join(p, DCP_METADATA)}: the metadata of a checkpoint of "
                                  "torch.distributed.checkpoint's FileSystemWriter, which is pickled: tensorstore_h5 "
                                  "does not unpickle; load it with dcp.load and save it again with "
                                  "tensorstore_h5.distributed.H5StorageWriter")
            elif any(RANK_INDEX.fullmatch(n) for n in names):
                ranks = sorted(int(m.group("rank")) for n in names if (m := RANK_INDEX.fullmatch(n)))
                raise FormatError(f"{p}: only rank-local indexes (a save with use_collectives=False, ranks "
                                  f"{ranks[:8]}{'...' if len(ranks) > 8 else ''}); open one with ShardedStore(path, rank=r)")
            else:
                raise FormatError(f"{p}: not a checkpoint directory: no {INDEX_NAME}, no *{HF_INDEX_SUFFIX} and no "
                                  "model.safetensors")
        self.index_path = self._layout.path
        self._closed = False
        self._stagers = transfer.Stagers()

    def _read_ours(self, name: str) -> DirectoryIndex:
        try:
            return read_index(self.path, name)
        except FileNotFoundError:
            raise FormatError(f"{os.path.join(self.path, name)}: no such index in the directory") from None

    # -- mapping-like view ---------------------------------------------------------------

    @property
    def kind(self) -> str:
        """``"tensorstore_h5"`` (format-2 files and an index) or ``"safetensors"`` (Hugging Face)."""
        return "safetensors" if self._layout.safetensors else "tensorstore_h5"

    @property
    def format_version(self) -> int | None:
        """The directory index version (2), or None for a safetensors directory."""
        return None if self._layout.safetensors else INDEX_VERSION

    @property
    def save_id(self) -> str | None:
        return self._layout.save_id

    @property
    def files(self) -> list[str]:
        """The data files of the directory that the index names."""
        return list(self._layout.files)

    def __getitem__(self, key: str) -> Any:
        """A :class:`ShardedTensorHandle` for a tensor; the value of other leaves (arrays are read)."""
        entry = self._entry(key)
        if isinstance(entry, ShardedTensorEntry):
            return ShardedTensorHandle(self, entry)
        return self._read_leaf(entry, None, False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._layout.entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry)))

    def stats(self, select: Selector = None, **options: Any) -> Any:
        """Per-tensor ``mean``, ``std``, ``min``, ``max``, ``nan``, ``inf``, ``zeros``, streaming
        (:func:`tensorstore_h5.reading.compare.stats`)."""
        from ..reading.compare import stats

        return stats(self, select, **options)

    def leaf_info(self, key: str) -> dict[str, Any]:
        """What ``tensorstore-h5 ls`` prints for ``key`` (the same fields as for a file, and the
        number of pieces)."""
        e = self._entry(key)
        if isinstance(e, ShardedTensorEntry):
            return {"key": key, "kind": "tensor", "shape": list(e.shape), "dtype": e.dtype.name, "nbytes": e.nbytes,
                    "pieces": len(e.pieces)}
        if isinstance(e, ShardedArrayEntry):
            return {"key": key, "kind": "ndarray", "shape": list(e.shape), "dtype": str(e.dtype), "nbytes": e.nbytes}
        assert isinstance(e, ValueEntry)
        return {"key": key, "kind": "value", "type": type(e.value).__name__, "value": repr(e.value)[:60]}

    def info(self) -> dict[str, Any]:
        """Totals, and per tensor its dtype, shape, bytes and number of pieces."""
        tensors = {}
        for e in self._layout.entries:
            if isinstance(e, ShardedTensorEntry):
                tensors[e.path] = {"dtype": e.dtype.name, "shape": list(e.shape), "nbytes": e.nbytes, "pieces": len(e.pieces)}
        file_bytes = 0
        for name in self._layout.files:
            try:
                file_bytes += os.path.getsize(os.path.join(self.path, name))
            except OSError:
                pass
        return {"file": self.path, "kind": self.kind, "format_version": self.format_version, "save_id": self.save_id,
                "files": len(self._layout.files), "file_bytes": file_bytes, "keys": len(self),
                "data_bytes": self.nbytes, "metadata": self.metadata, "tensors": tensors}

    # -- loading ------------------------------------------------------------------------

    def items(self, select: Selector = None, device: Device = None, *, verify: bool | None = None
              ) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, value)`` of the selected leaves one at a time, in saved order (each
        tensor read from its pieces when it is reached; nothing is kept). ``verify`` as for
        :meth:`load`."""
        included = self._included(select)
        device = transfer.asked_once(device)  # looked up when checked and again when placed
        for entry in self._layout.select(included):
            if not isinstance(entry, Container):
                yield entry.path, self._read_leaf(entry, device, verify)

    def load(self, select: Selector = None, device: Device = None, progress: bool | None = None, *,
             verify: bool | None = None) -> Any:
        """Load the selected leaves into the saved nesting (pruned to the selection), reading
        every piece of every selected tensor once, on the I/O threads.

        Args:
            select: a glob, a list of exact keys or globs, or a callable on the key path.
            device: where tensors go: None (CPU), a device, or a mapping / callable from key
                path to device.
            progress: a progress bar by bytes (see :func:`tensorstore_h5.save`).
            verify: check the stored checksums of every piece read: by default (None) and
                with True; not with False. Pieces of whole rows staged to a device are checked in
                the staging buffers as they are read; the others by one more pass over their
                bytes, from the page cache, hashed on the I/O threads. Safetensors directories
                carry no checksums.
        """
        included = self._included(select)
        entries = self._layout.select(included)
        device = transfer.asked_once(device)  # looked up when checked and again when placed
        bar = Progress(progress, desc=f"loading {os.path.basename(self.path.rstrip('/'))}")
        bar.total(sum(e.nbytes for e in entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry))))
        items: list[Any] = []
        pending: list[tuple[int, ShardedTensorEntry, torch.Tensor]] = []
        staged: dict[torch.device, list[tuple[torch.Tensor, transfer.Fill]]] = {}
        checked: set[int] = set()  # id() of the entries staged with every block checked as it was read
        try:
            reads = Reads()
            for entry in entries:
                if isinstance(entry, Container):
                    items.append(entry)
                elif isinstance(entry, ShardedTensorEntry):
                    dev = self._check_device(device, entry.path)
                    parts = None
                    if dev is not None and transfer.staged(dev) and transfer.batched():
                        parts = self._stageable(entry, dev if verify is not False else None)
                    if parts is not None:
                        assert dev is not None
                        t = transfer.device_empty(entry.shape, entry.dtype.torch_dtype, dev, entry.path)
                        _queue_rows(staged, t, parts)
                        if verify is not False and all(f.hashes is not None for _, _, f in parts):
                            checked.add(id(entry))  # every piece's blocks checked in the staging buffers
                    else:
                        t = self._empty(entry, entry.shape)
                        self._fill(entry, select_index((), entry.shape), t, reads)
                    pending.append((len(items), entry, t))
                    items.append(None)
                    if not bar.silent and parts is None:
                        reads.run()
                        bar.update(entry.nbytes)
                else:
                    items.append(Leaf(entry.path, entry.key, self._read_leaf(entry, device, verify)))
            reads.run()
            self._copy_staged(staged, bar)
            if verify is not False:  # what was read on the host, or staged without checksums that fit a buffer
                self._verify_many([entry for _, entry, _ in pending if id(entry) not in checked])
        finally:
            bar.close()
        for i, entry, t in pending:
            items[i] = Leaf(entry.path, entry.key, self._finish(t, entry, device))
        return tree.inflate(items)

    def _stageable(self, entry: ShardedTensorEntry, check_on: torch.device | None = None
                   ) -> list[tuple[int, int, transfer.Fill]] | None:
        """For a tensor going to a device: ``(first row, end row, fill)`` of each stored piece
        when every piece holds whole rows (offsets only in the first dimension) as raw bytes,
        so each piece is one contiguous range of the destination filled through the staging
        buffers (``fill(offset, buf)`` reads its bytes; errors name the file and the key);
        None when a piece is compressed or narrower than the rows (then it is read on the host
        and copied). ``check_on``: the device whose staging buffers check the pieces' checksums
        as they are read (a :class:`transfer.FileFill` with ``hashes``, for pieces whose
        checksum blocks fit a buffer); None: not checked there."""
        located = self._located(entry, select_index((), entry.shape))  # checked, and covered
        if any(any(piece.offsets[1:]) or tuple(piece.shape[1:]) != tuple(entry.shape[1:]) or loc.raw is None
               for loc, piece, _, _ in located):
            return None
        within = self._stagers[check_on].block_bytes if check_on is not None else 0
        parts = []
        for loc, piece, _, _ in located:
            first = piece.offsets[0] if piece.offsets else 0
            rows = piece.shape[0] if piece.shape else 1
            # (neighbouring pieces of one file are read together: transfer.FileFill)
            checks = loc.hashes is not None and 0 < loc.block <= within
            fill = transfer.FileFill(loc.raw, loc.offset, lambda job, loc=loc: _keyed(loc, job)(),
                                     loc.hashes if checks else None, loc.block if checks else 0)
            parts.append((first, first + rows, fill))
        return parts

    def _copy_staged(self, staged: dict[torch.device, list[tuple[torch.Tensor, transfer.Fill]]], bar: Progress) -> None:
        """Run the copies :func:`_queue_rows` queued, through each device's staging buffers."""
        for dev, parts in staged.items():
            self._stagers[dev].copy_many(parts, lambda part: bar.update(part.numel() * part.element_size()))

    def _read_leaf(self, entry: DirEntry, device: Device, verify: bool | None) -> Any:
        if isinstance(entry, ValueEntry):
            return entry.value
        if isinstance(entry, ShardedArrayEntry):
            if self._layout.safetensors:
                raise FormatError(f"{self.path}: key {entry.path!r}: arrays are not stored in safetensors directories")
            if verify is not False:
                self._verify_many([entry])
            return self._files.read_array(entry)
        assert isinstance(entry, ShardedTensorEntry)
        self._check_device(device, entry.path)
        t = self._empty(entry, entry.shape)
        if verify is not False:
            self._verify_many([entry])
        reads = Reads()
        self._fill(entry, select_index((), entry.shape), t, reads)
        reads.run()
        return self._finish(t, entry, device)

    def materialize(self, path: str, *, device: Device = None) -> Any:
        """The value at ``path`` (a leaf or a container, rebuilt with everything under it)."""
        sub = self._layout.entry(path)
        if sub is None:
            raise KeyNotFoundError(f"{self.path}: no key {path!r}")
        if not isinstance(sub, Container):
            return self._read_leaf(sub, device, None)
        result = self.load(select=[path] if path else None, device=device)
        for name in tree.split(path):
            kind = type(result)
            result = result[int(name)] if kind in (list, tuple) else _child(result, name)
        return result

    def _check_device(self, device: Device, key: str) -> torch.device | None:
        """The device of ``key`` (None: the CPU), checked to be usable."""
        dev = self._device(device, key)
        if dev is not None:
            transfer.check_available(dev, key, self.path)
        return dev

    def _device(self, device: Device, key: str) -> torch.device | None:
        """The device of ``key`` (None: the CPU), not checked to be available."""
        return transfer.target_device(device, key, self.path, available=False)

    def _finish(self, t: torch.Tensor, entry: ShardedTensorEntry, device: Device) -> torch.Tensor:
        dev = self._device(device, entry.path)
        if dev is not None and t.device != dev:
            t = t.to(dev)
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        if entry.requires_grad:
            t.requires_grad_(True)
        return t

    def _empty(self, entry: ShardedTensorEntry, shape: Sequence[int]) -> torch.Tensor:
        try:
            return memory.empty(tuple(shape), entry.dtype.torch_dtype)
        except (OSError, MemoryError, RuntimeError) as e:
            nbytes = math.prod(shape) * entry.dtype.itemsize
            raise TensorStoreError(f"{self.path}: key {entry.path!r}: cannot allocate {human_bytes(nbytes)} ({e})") from e

    def _verify_many(self, entries: Sequence[DirEntry], sel: Selection | None = None) -> None:
        """Check the stored checksums of every piece of ``entries`` (with ``sel``, of one entry:
        the pieces it overlaps), each file's pieces in one pass over their bytes on the I/O
        threads (:meth:`TensorReader.verify_many`). Raises FormatError naming the file and
        key. Safetensors directories carry no checksums."""
        pieces: list[tuple[Piece, str]] = []
        for entry in entries:
            if isinstance(entry, ShardedArrayEntry):
                pieces.append((entry.pieces[0], entry.path))
            elif isinstance(entry, ShardedTensorEntry):
                pieces += [(p, entry.path) for p in entry.pieces
                           if p.numel and (sel is None or piece_overlap(sel, p) is not None)]
        self._verify_pieces(pieces)

    def _verify_pieces(self, pieces: Sequence[tuple[Piece, str]]) -> None:
        """Check the stored checksums of ``(piece, owner key)`` pieces, each file's in one pass
        (see :meth:`_verify_many`)."""
        if self._layout.safetensors:
            return
        by_file: dict[int, tuple[Any, list[Any]]] = {}
        for piece, owner in pieces:
            store, e = self._files.entry(piece, owner, (TensorEntry, ArrayEntry))
            by_file.setdefault(id(store), (store, []))[1].append(e)
        for store, stored in by_file.values():
            store._reader.verify_many(stored)

    def _fill(self, entry: ShardedTensorEntry, sel: Selection, box: torch.Tensor, reads: Reads) -> None:
        """Queue the reads of ``sel`` of ``entry`` into ``box`` (shaped ``sel.count``)."""
        for loc, piece, local, dest in self._located(entry, sel):
            reads.region(loc, piece.shape, entry.dtype, local, box[dest] if dest else box)

    def _located(self, entry: ShardedTensorEntry, sel: Selection) -> list[tuple[Any, Piece, Selection, tuple[slice, ...]]]:
        """The stored pieces of ``entry`` that ``sel`` overlaps, each with its checked location
        (file, dataset, byte range: :meth:`Th5Files.locate`), its own selection and the slices
        of the result it fills. Raises FormatError naming the file and the key, before any
        byte of the selection is read."""
        self._check_open()
        out = []
        for piece in entry.pieces:
            if not piece.numel:
                continue
            hit = piece_overlap(sel, piece)
            if hit is not None:
                out.append((self._files.locate(piece, entry), piece, *hit))
        if self._layout.rank is not None and sum(math.prod(local.count) for _, _, local, _ in out) != math.prod(sel.count):
            raise FormatError(f"{self.index_path}: key {entry.path!r}: the selection is not all stored in this "
                              f"rank-local index (rank {self._layout.rank}); open the directory's global index")
        return out

    def _read_into(self, pairs: list[tuple[ShardedTensorEntry, torch.Tensor]], progress: bool | None,
                   verify: bool | None) -> None:
        """Fill each target (its shape already checked; contiguous device targets of the stored
        dtype straight from the files through the staging buffers where every piece holds whole
        rows; others through a temporary, cast like ``copy_``) with its global tensor, for
        :func:`tensorstore_h5.load_into`. Every piece's file and dataset is checked first, and
        unless ``verify`` is False every checksum, so a damaged directory is refused before any target
        changes. Reads run in batches of about :data:`INTO_BATCH_BYTES`."""
        for entry, _ in pairs:
            self._located(entry, select_index((), entry.shape))
        if verify is not False:
            self._verify_many([e for e, _ in pairs])
        bar = Progress(progress, desc=f"loading {os.path.basename(self.path.rstrip('/'))}")
        bar.total(sum(e.nbytes for e, _ in pairs))
        staged: dict[torch.device, list[tuple[torch.Tensor, transfer.Fill]]] = {}
        try:
            reads, queued = Reads(), 0
            for entry, target in pairs:
                parts = self._stageable(entry) if transfer.staged(target.device) and target.is_contiguous() and \
                    target.dtype == entry.dtype.torch_dtype and transfer.batched() else None
                if parts is not None:  # device targets: straight from the files through the staging buffers
                    _queue_rows(staged, target.detach(), parts)
                    continue
                self._fill(entry, select_index((), entry.shape), target, reads)
                queued += entry.nbytes
                if queued >= INTO_BATCH_BYTES:
                    reads.run()
                    bar.update(queued)
                    reads, queued = Reads(), 0
            reads.run()
            bar.update(queued)
            self._copy_staged(staged, bar)
        finally:
            bar.close()

    def _read_handle(self, entry: ShardedTensorEntry, index: Any, out: torch.Tensor | None, verify: bool | None
                     ) -> torch.Tensor:
        sel = select_index(() if index is None else index, entry.shape)
        dtype = entry.dtype.torch_dtype
        if out is not None:
            if tuple(out.shape) != sel.shape or out.dtype != dtype:
                raise MismatchError(f"{self.path}: key {entry.path!r}: out has shape {tuple(out.shape)} and dtype "
                                    f"{out.dtype}, the selection needs {sel.shape} and {dtype}")
            result = out
        else:
            result = self._empty(entry, sel.shape)
        try:
            box = result.view(sel.count)
            post = None
        except RuntimeError:
            box = self._empty(entry, sel.count)
            post = result
        if checking(verify, sel.full):
            self._verify_many([entry], None if sel.full else sel)
        reads = Reads()
        self._fill(entry, sel, box, reads)
        reads.run()
        if post is not None:
            with torch.no_grad():
                bits_view(post).copy_(bits_view(box).view(sel.shape))
        return result

    # -- checking -------------------------------------------------------------------------

    def verify(self) -> dict[str, Any]:
        """Read every piece of every tensor, checking stored checksums (tensorstore_h5 files), the
        files against the index (length, layout hash, keys, dtypes, shapes), each file's layout
        against its HDF5 metadata, and the pieces' cover. Returns ``{"keys", "tensor_bytes",
        "files", "problems"}``; no exception for problems found in the data."""
        problems: list[str] = []
        n = total = 0
        for e in self._layout.entries:
            if isinstance(e, Container):
                continue
            n += 1
            try:
                if isinstance(e, ShardedTensorEntry):
                    t = self._read_leaf(e, None, True)
                    total += t.numel() * t.element_size()
                    del t
                elif isinstance(e, ShardedArrayEntry):
                    total += self._read_leaf(e, None, True).nbytes
            except (FormatError, KeyNotFoundError) as err:
                problems.append(str(err))
        if not self._layout.safetensors:
            from ..storage.libhdf5 import verify_layout

            for name in self._layout.files:
                try:
                    store = self._files.store(name, "(any)")
                except FormatError as err:
                    if str(err) not in problems:
                        problems.append(str(err))
                    continue
                problems += [f"{os.path.join(self.path, name)}: {p}" for p in verify_layout(store.path, store._layout)]
        return {"keys": n, "tensor_bytes": total, "files": len(self._layout.files), "problems": problems}

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the store is closed")

    def close(self) -> None:
        """Close every file opened (idempotent)."""
        if not self._closed:
            self._files.close()
            self._stagers.clear()  # device staging buffers go back to the process's pool
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """A collapsible tree of the keys with dtype, shape, pieces and size (Jupyter)."""
        from ..display.views import TreeRow, tree_html

        rows = []
        for e in self._layout.entries:
            if isinstance(e, ShardedTensorEntry):
                rows.append(TreeRow(e.path, f"{e.dtype.name} {list(e.shape)}, {len(e.pieces)} piece(s)", e.nbytes))
            elif isinstance(e, ShardedArrayEntry):
                rows.append(TreeRow(e.path, f"ndarray {e.dtype} {list(e.shape)}", e.nbytes))
            elif isinstance(e, ValueEntry):
                rows.append(TreeRow(e.path, f"{type(e.value).__name__} = {repr(e.value)[:40]}"))
        return tree_html(repr(self), rows)

    def __repr__(self) -> str:
        n_t = sum(1 for e in self._layout.entries if isinstance(e, ShardedTensorEntry))
        state = ", closed" if self._closed else ""
        return (f"<tensorstore_h5.ShardedStore {self.path!r} ({self.kind}, {len(self._layout.files)} files, {len(self)} "
                f"keys, {n_t} tensors, {human_bytes(self.nbytes)}{state})>")


def _queue_rows(staged: dict[torch.device, list[tuple[torch.Tensor, transfer.Fill]]], dest: torch.Tensor,
                parts: list[tuple[int, int, transfer.Fill]]) -> None:
    """Queue in ``staged`` the fill of each ``(first row, end row, fill)`` part of the
    contiguous tensor ``dest`` (:meth:`ShardedStore._stageable`)."""
    if parts:  # (none for a tensor without elements)
        rows = dest.reshape(dest.shape[0] if dest.dim() else 1, -1)
        staged.setdefault(dest.device, []).extend((rows[a:b], fill) for a, b, fill in parts)


def _child(container: Any, name: str) -> Any:
    key = tree.unescape(name)
    if key in container:
        return container[key]
    for k, v in container.items():  # non-str keys are named by str(key)
        if type(k) is not str and tree.name_for_key(k, "") == name:
            return v
    raise KeyError(key)


def open_directory(path: PathLike, *, rank: int | None = None) -> ShardedStore:
    """Open a checkpoint directory read-only (see :class:`ShardedStore`)."""
    return ShardedStore(path, rank=rank)
