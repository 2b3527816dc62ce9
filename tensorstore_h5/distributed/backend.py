"""``H5StorageWriter`` and ``H5StorageReader``: tensorstore_h5 files as DCP storage.

Saving (``dcp.save``, ``dcp.async_save``):

- every rank writes the items DCP planned for it into ``rank<r>.<save id>.h5`` (or
  ``thread_count`` files ``rank<r>_<k>.<save id>.h5`` written by as many threads), an ordinary
  format-2 file: a chunk of a sharded tensor is a dataset holding that chunk, at the tensor's key
  path (further chunks of one tensor on one rank at ``<key>@<offsets>``);
- plain values (DCP's ``BYTE_IO`` items, which DCP's planners would ``torch.save``) are stored
  in the index with the core format's JSON encoding (``tree.encode_value``), as the subtree of
  containers and values they are; anything that encoding cannot hold is refused, naming the key;
- the coordinator checks the pieces (same global shape and dtype on every rank, no overlap, no
  gap), then writes ``tensorstore_h5.json`` last and atomically, and only then removes the files
  of earlier saves that the new index does not name.

Loading (``dcp.load``) reads only the hyperslab where each stored piece overlaps each
destination, straight into it where the destination is contiguous, on the I/O threads, with
plain positional reads of the files (no HDF5 call, no pickle).
"""

from __future__ import annotations

import dataclasses
import io as _io
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import sharded
from ..codecs.presets import Compression
from ..errors import FormatError, UnsupportedTypeError
from ..format import tree
from ..format import layout as fmt
from ..format.dtypes import spec_for_torch
from ..format.layout import ValueEntry
from ..reading.tensors import checking
from ..sharded.reads import Reads, block_selection
from ..storage import memory
from ..writing.writer import Writer, few_links

__all__ = ["H5StorageWriter", "H5StorageReader", "save", "load"]

DCP_VERSION = "1.0.0"
"""The DCP metadata version recorded when the planner gives none (FileSystemWriter's)."""


# ---------------------------------------------------------------------------- what travels between ranks


@dataclass(frozen=True)
class _H5Plan:
    """``SavePlan.storage_data``: the save id (one per save, made by the coordinator) and the
    stem of the rank's file names."""

    save_id: str
    stem: str


@dataclass(frozen=True)
class _Stored:
    """``WriteResult.storage_data``: where a rank put an item, and the files it wrote for it.

    A tensor chunk: ``file``, ``key`` and ``shape`` of its dataset. A plain value: ``subtree``,
    its containers and values in pre-order as ``(path below the key, type, entry JSON)`` (tensors
    inside it as entries with one piece each). ``files``: ``(name, bytes, layout hash)``."""

    file: str = ""
    key: str = ""
    shape: tuple[int, ...] = ()
    subtree: tuple[tuple[str, str, Any], ...] | None = None
    files: tuple[tuple[str, int, str], ...] = ()


def key_path(fqn: str, mappings: Mapping[str, Any] | None) -> str:
    """The key path of a DCP key: its object path (DCP's flattening mapping) as escaped names
    (``("model", "layers.0.w")`` -> ``model/layers.0.w``, list indices as numbers), or the
    escaped key itself when the planner does not flatten."""
    path = mappings.get(fqn) if mappings else None
    if not path:
        return tree.escape(fqn)
    return "/".join(tree.escape(p) if type(p) is str else str(p) for p in path)


def _planner_paths(planner_data: Any, where: str) -> dict[str, list[Any]] | None:
    if planner_data is None:
        return None
    if not isinstance(planner_data, Mapping) or not all(
            type(k) is str and isinstance(v, (tuple, list)) and v and all(type(x) in (str, int) for x in v)
            for k, v in planner_data.items()):
        raise TypeError(f"{where}: the planner's planner_data ({type(planner_data).__name__}) is not DCP's flattening "
                        "mapping (key -> tuple of str and int); tensorstore_h5 stores metadata as JSON and cannot keep it")
    return {k: list(v) for k, v in planner_data.items()}


# ---------------------------------------------------------------------------- the writer


class H5StorageWriter(StorageWriter, BlockingAsyncStager):
    """DCP storage writer: one tensorstore_h5 file per rank and a JSON index, written last.

    Example::

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from tensorstore_h5.distributed import H5StorageWriter

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=H5StorageWriter("ckpt/step100"))

    Args:
        path: the checkpoint directory (created if needed). A checkpoint already there is
            replaced: the old index and files stay until the new index is in place.
        compression: as for :func:`tensorstore_h5.save` (None, a preset ``"lz4"``, ``"zstd"``,
            ``"best"``, an hdf5plugin filter, or a callable ``(key path, tensor) -> ...``).
        chunk_bytes: chunk size of compressed datasets.
        thread_count: files each rank writes, each by its own thread (DCP's meaning).
        sync_files: ``fsync`` every file, the index and the directory (as FileSystemWriter).
        direct: write tensor data with ``O_DIRECT`` (see :class:`tensorstore_h5.Writer`); None
            (default): when ``sync_files`` is set.
        metadata: user metadata (a JSON object) kept in the index.
        overwrite: False refuses a directory that already holds a checkpoint.
        cache_staged_state_dict: for ``dcp.async_save``, keep the CPU copy between saves.
    """

    def __init__(self, path: str | os.PathLike[str], *, compression: Compression = None,
                 chunk_bytes: int | None = None, thread_count: int = 1, sync_files: bool = True,
                 metadata: Mapping[str, Any] | None = None, overwrite: bool = True,
                 cache_staged_state_dict: bool = False, direct: bool | None = None) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if thread_count < 1:
            raise ValueError("thread_count must be at least 1")
        self.path = os.fspath(path)
        self.compression = compression
        self.chunk_bytes = chunk_bytes
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.direct = direct
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        fmt.check_metadata(self.metadata)
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True
        self._save_id: str | None = None
        self._last_written: str | None = None

    # -- DCP's calls ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        if not self.overwrite and any(os.path.exists(os.path.join(self.path, n)) for n in (
                sharded.INDEX_NAME, sharded.rank_index_name(self.rank or 0))):
            raise RuntimeError(f"{self.path}: a checkpoint is already there and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Check what every rank will write, before anything is written: one global shape and
        dtype per key, pieces inside it that neither overlap nor (with collectives) leave a
        gap; then give every rank the new save id and its file names."""
        sizes: dict[str, tuple[torch.Size, torch.dtype, int]] = {}
        boxes: dict[str, list[tuple[Sequence[int], Sequence[int]]]] = {}
        owners: dict[str, list[str]] = {}
        kinds: dict[str, str] = {}
        ranks = range(len(plans)) if self.use_collectives else [self.rank or 0]
        for r, plan in zip(ranks, plans):
            if not plan.usable:
                raise ValueError(f"{self.path}: DCP plan caching (enable_plan_caching=True) is not supported by "
                                 "H5StorageWriter: every save writes files named with a new save id")
            for item in plan.items:
                fqn = item.index.fqn
                kind = "value" if item.type == WriteItemType.BYTE_IO else "tensor"
                if kinds.setdefault(fqn, kind) != kind:
                    raise ValueError(f"{self.path}: key {fqn!r} is a tensor on one rank and a plain value on another")
                if item.tensor_data is None:
                    continue
                td = item.tensor_data
                prev = sizes.setdefault(fqn, (td.size, td.properties.dtype, r))
                if (prev[0], prev[1]) != (td.size, td.properties.dtype):
                    raise ValueError(
                        f"{self.path}: key {fqn!r}: rank {prev[2]} saves a global tensor of shape {list(prev[0])} and "
                        f"{prev[1]}, rank {r} one of shape {list(td.size)} and {td.properties.dtype}; refusing to save")
                boxes.setdefault(fqn, []).append((td.chunk.offsets, td.chunk.sizes))
                owners.setdefault(fqn, []).append(f"of rank {r}")
        for fqn, blocks in boxes.items():
            problem = sharded.check_cover(sizes[fqn][0], blocks, complete=self.use_collectives, names=owners[fqn])
            if problem is not None:
                raise ValueError(f"{self.path}: key {fqn!r}: {problem}; refusing to save")
        self._save_id = sharded.new_save_id()
        return [dataclasses.replace(plan, storage_data=_H5Plan(self._save_id, sharded.rank_stem(r)))
                for r, plan in zip(ranks, plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        sp = plan.storage_data
        if not isinstance(sp, _H5Plan):
            raise ValueError(f"{self.path}: the plan was not prepared by H5StorageWriter.prepare_global_plan")
        if sp.save_id == self._last_written:
            raise ValueError(f"{self.path}: this plan was already written (DCP plan caching is not supported)")
        self._save_id = sp.save_id
        mappings = getattr(planner, "mappings", None)
        values: list[tuple[WriteItem, str, list[Any]]] = []
        nested: list[tuple[str, Any]] = []  # tensors and arrays inside plain values: (key path, value)
        for item in plan.items:  # plain values first: a value that cannot be stored stops the save before any write
            if item.type == WriteItemType.BYTE_IO:
                kp = key_path(item.index.fqn, mappings)
                nodes = self._flatten_value(self._lookup(planner, item), item.index.fqn, kp)
                values.append((item, kp, nodes))
                nested += [(n.path, n.value) for n in nodes if isinstance(n, tree.Leaf)
                           and isinstance(n.value, (torch.Tensor, np.ndarray))]
        tensors = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        buckets = _split(tensors, self.thread_count)
        names = [sharded.data_file_name(sp.stem if len(buckets) == 1 else f"{sp.stem}_{k}", sp.save_id)
                 for k in range(len(buckets))]
        outputs: list[Any] = [None] * len(buckets)
        errors: list[BaseException] = []

        def run(k: int) -> None:
            try:
                extra = nested if k == 0 else []
                if buckets[k] or extra:
                    outputs[k] = self._write_file(names[k], buckets[k], extra, planner, mappings)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread ended
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,), name=f"tensorstore_h5-dcp-{k}") for k in range(1, len(buckets))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        results: list[WriteResult] = []
        nested_at: dict[str, tuple[str, tuple[str, int, str]]] = {}
        for out in outputs:
            if out is None:
                continue
            info, written = out
            for item, key, shape, nbytes in written:
                if item is None:
                    nested_at[key] = (info[0], info)
                    continue
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                           storage_data=_Stored(file=info[0], key=key, shape=shape, files=(info,))))
        for item, kp, nodes in values:
            subtree, files = _subtree(nodes, kp, nested_at)
            results.append(WriteResult(index=item.index, size_in_bytes=len(repr(subtree)),
                                       storage_data=_Stored(key=kp, subtree=subtree, files=files)))
        self._last_written = sp.save_id
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the index (the coordinator; with ``use_collectives=False`` every rank writes its
        own) after checking it as a reader would, then remove what it supersedes."""
        rank = None if self.use_collectives else (self.rank or 0)
        name = sharded.INDEX_NAME if rank is None else sharded.rank_index_name(rank)
        with memory.gc_paused():
            obj = self._index(metadata, results, rank)
            sharded.parse_index(sharded.index_text(obj), os.path.join(self.path, name)).entries  # checks every entry
        sharded.commit_index(self.path, obj, rank=rank, sync=self.sync_files)
        storage: dict[MetadataIndex, Any] = {}
        for wr_list in results:
            for wr in wr_list:
                storage[wr.index] = (wr.storage_data.file, wr.storage_data.key)
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self._save_id)
        if metadata.version is None:
            metadata.version = DCP_VERSION

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in os.fspath(checkpoint_id)

    def __repr__(self) -> str:
        return f"<H5StorageWriter {self.path!r}>"

    # -- internals ------------------------------------------------------------------------

    def _lookup(self, planner: SavePlanner, item: WriteItem) -> Any:
        """The plain value of a BYTE_IO item, without the planner's ``torch.save``."""
        if isinstance(planner, DefaultSavePlanner) and type(planner).transform_object is DefaultSavePlanner.transform_object:
            return planner.lookup_object(item.index)
        data = planner.resolve_data(item)
        if isinstance(data, _io.BytesIO):  # a custom planner serialised it: our own process's bytes
            data.seek(0)
            try:
                return torch.load(data, weights_only=True)
            except Exception as e:  # noqa: BLE001 - the unpickler raises many types
                raise UnsupportedTypeError(f"{self.path}: key {item.index.fqn!r}: the planner serialised the value with "
                                           f"pickle and it is not a plain value ({e})") from e
        return data

    def _flatten_value(self, obj: Any, fqn: str, kp: str) -> list[Any]:
        try:
            nodes = tree.flatten(obj, kp)
            for n in nodes:
                if isinstance(n, tree.Leaf) and isinstance(n.value, torch.Tensor):
                    from ..writing.writer import _plain

                    _plain(n.value, n.path)
                elif isinstance(n, tree.Leaf) and isinstance(n.value, np.ndarray):
                    from ..writing.writer import _check_array

                    _check_array(n.value, n.path)
        except UnsupportedTypeError as e:
            where = os.path.join(self.path, sharded.INDEX_NAME)
            raise UnsupportedTypeError(f"{where}: DCP key {fqn!r}: {e}; nothing was written (tensorstore_h5 stores "
                                       "plain values as JSON in the index, never pickled)") from None
        return nodes

    def _write_file(self, name: str, items: list[WriteItem], nested: list[tuple[str, Any]], planner: SavePlanner,
                    mappings: Any) -> tuple[tuple[str, int, str], list[tuple[WriteItem | None, str, tuple[int, ...], int]]]:
        path = os.path.join(self.path, name)
        written: list[tuple[WriteItem | None, str, tuple[int, ...], int]] = []
        used: set[str] = set()
        paths = [key_path(item.index.fqn, mappings) for item in items] + [kp for kp, _ in nested]
        with Writer(path, compression=self.compression, chunk_bytes=self.chunk_bytes, sync=self.sync_files,
                    direct=self.direct, metadata={"save_id": self._save_id, **({"rank": self.rank} if self.rank is not None else {})},
                    _encode=few_links(paths)) as w:
            for item in items:
                kp = key_path(item.index.fqn, mappings)
                key = kp
                if key in used:
                    td = item.tensor_data
                    base = f"{kp}@{'_'.join(map(str, td.chunk.offsets))}" if td is not None else kp
                    key, n = base, 1
                    while key in used:
                        key, n = f"{base}~{n}", n + 1
                t = planner.resolve_data(item)
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{path}: key {item.index.fqn!r}: the planner resolved a tensor item to a "
                                    f"{type(t).__name__}")
                w.write(key, t)
                used.add(key)
                written.append((item, key, tuple(t.shape), t.numel() * t.element_size()))
                del t
            for kp, value in nested:
                w.write(kp, value)
                written.append((None, kp, tuple(value.shape), int(value.nbytes)))
        info = sharded.file_info(path)
        return (name, info["bytes"], info["layout_xxh3"]), written

    def _index(self, metadata: Metadata, results: list[list[WriteResult]], rank: int | None) -> dict[str, Any]:
        """The index object of this save (docs/FORMAT.md, "Sharded checkpoints")."""
        where = os.path.join(self.path, sharded.INDEX_NAME)
        paths_of = _planner_paths(metadata.planner_data, where)
        stored: dict[MetadataIndex, _Stored] = {}
        files: dict[str, dict[str, Any]] = {}
        for wr_list in results:
            for wr in wr_list:
                s = wr.storage_data
                if not isinstance(s, _Stored):
                    raise ValueError(f"{where}: a rank's write result was not made by H5StorageWriter")
                stored[wr.index] = s
                for name, nbytes, digest in s.files:
                    files[name] = {"bytes": nbytes, "layout_xxh3": digest}
        by_chunk = {(index.fqn, tuple(index.offset)): s for index, s in stored.items() if index.offset is not None}
        build = _TreeBuilder(where)
        fqns: dict[str, str] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            parts = paths_of.get(fqn) if paths_of else None
            kp = key_path(fqn, {fqn: parts} if parts else None)
            fqns[fqn] = kp
            build.parents(kp, parts)
            if isinstance(md, TensorStorageMetadata):
                pieces = []
                for chunk in md.chunks:
                    off, size = list(chunk.offsets), list(chunk.sizes)
                    s = by_chunk.get((fqn, tuple(off)))
                    if s is None:
                        raise ValueError(f"{where}: key {fqn!r}: no rank reported writing its chunk at offsets {off}")
                    if list(s.shape) != size:
                        raise ValueError(f"{where}: key {fqn!r}: the chunk at {off} was planned as {size} and written "
                                         f"as {list(s.shape)}")
                    piece: dict[str, Any] = {"file": s.file, "offsets": off, "shape": size}
                    if s.key != kp:
                        piece["key"] = s.key
                    pieces.append(piece)
                pieces.sort(key=lambda p: p["offsets"])
                spec = spec_for_torch(md.properties.dtype, kp)
                entry: dict[str, Any] = {"dtype": spec.name, "shape": list(md.size), "pieces": pieces}
                if md.properties.requires_grad and (md.properties.dtype.is_floating_point or md.properties.dtype.is_complex):
                    entry["requires_grad"] = True
                build.add(kp, "tensor", entry)
            else:
                s = stored.get(MetadataIndex(fqn))
                if s is None or s.subtree is None:
                    raise ValueError(f"{where}: key {fqn!r}: no rank reported writing this value")
                for rel, kind, item in s.subtree:
                    build.add(tree.join(kp, rel) if rel else kp, kind, item)
        obj: dict[str, Any] = {"format": sharded.INDEX_FORMAT, "version": sharded.INDEX_VERSION, "save_id": self._save_id,
                               "metadata": self.metadata, "files": files}
        obj.update(build.emit())
        obj["dcp"] = {"version": metadata.version or DCP_VERSION, "fqns": fqns, "planner_data": paths_of}
        if rank is not None:
            obj["rank"] = rank
        return obj


def _split(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into ``bins`` lists of about equal bytes (largest first to the lightest), each in
    plan order; lists left empty are dropped (at least one remains)."""
    if bins == 1:
        return [list(items)]
    order = {id(it): i for i, it in enumerate(items)}
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    load = [0] * bins
    for it in sorted(items, key=lambda it: -(it.tensor_storage_size() or 0)):
        k = load.index(min(load))
        buckets[k].append(it)
        load[k] += it.tensor_storage_size() or 0
    kept = [sorted(b, key=lambda it: order[id(it)]) for b in buckets if b]
    return kept or [[]]


def _subtree(nodes: list[Any], kp: str, nested_at: Mapping[str, tuple[str, tuple[str, int, str]]]
             ) -> tuple[tuple[tuple[str, str, Any], ...], tuple[tuple[str, int, str], ...]]:
    """The index entries of a plain value's nodes (paths relative to its key path ``kp``)."""
    out = []
    files: dict[str, tuple[str, int, str]] = {}
    types: dict[str, str] = {}
    for n in nodes:
        parent = n.path.rpartition("/")[0] if n.path != kp else None
        ptype = types.get(parent) if parent is not None else None
        rel = n.path[len(kp) + 1:] if n.path != kp else ""
        if isinstance(n, tree.Container):
            types[n.path] = n.type
            out.append((rel, n.type, fmt.entry_json(n, ptype)))
            continue
        value = n.value
        if isinstance(value, (torch.Tensor, np.ndarray)):
            name, info = nested_at[n.path]
            files[name] = info
            shape = list(value.shape)
            piece = {"file": name, "key": n.path, "offsets": [0] * len(shape), "shape": shape}
            head = fmt.key_json(n, ptype)
            if isinstance(value, torch.Tensor):
                head.update(dtype=spec_for_torch(value.dtype, n.path).name, shape=shape, pieces=[piece])
                out.append((rel, "tensor", head))
            else:
                head.update(dtype=value.dtype.str, shape=shape, pieces=[piece])
                out.append((rel, "ndarray", head))
            continue
        out.append((rel, "value", fmt.entry_json(ValueEntry(n.path, n.key, value), ptype)))
    return tuple(out), tuple(files.values())


class _TreeBuilder:
    """The global tree of an index: containers made on the way to each key, leaves and value
    subtrees, emitted in pre-order (list items in index order, gaps filled with None, as DCP's
    ``set_element`` fills them)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.kinds: dict[str, str] = {"": "dict"}
        self.entries: dict[str, Any] = {"": {}}
        self.children: dict[str, list[str]] = {"": []}

    def parents(self, kp: str, parts: Sequence[Any] | None) -> None:
        names = tree.split(kp)
        for i in range(len(names) - 1):
            path = "/".join(names[:i + 1])
            kind = "list" if parts is not None and len(parts) > i + 1 and type(parts[i + 1]) is int else "dict"
            have = self.kinds.get(path)
            if have is None:
                self.add(path, kind, {})
            elif have not in ("dict", "list"):
                raise ValueError(f"{self.where}: key path {path!r} is both a leaf and a container")
            elif have != kind:
                raise ValueError(f"{self.where}: key path {path!r} holds both dict keys and list items")

    def add(self, path: str, kind: str, entry: Any) -> None:
        if path in self.entries:
            raise ValueError(f"{self.where}: key path {path!r} was stored twice")
        parent = path.rpartition("/")[0]
        if parent not in self.children:
            raise ValueError(f"{self.where}: the parent of key path {path!r} is not a container")
        self.entries[path] = entry
        self.kinds[path] = kind
        self.children[parent].append(path.rpartition("/")[2])
        if kind in tree.CONTAINER_TYPES:
            self.children[path] = []

    def emit(self) -> dict[str, list[Any]]:
        paths: list[str] = []
        kinds: list[str] = []
        entries: list[Any] = []
        stack = [""]
        while stack:
            path = stack.pop()
            paths.append(path)
            kinds.append(self.kinds[path])
            entries.append(self.entries[path])
            kids = self.children.get(path)
            if not kids:
                continue
            if self.kinds[path] in ("list", "tuple"):
                numbers = {int(k) for k in kids}
                for i in range(max(numbers) + 1):
                    if i not in numbers:
                        gap = tree.join(path, str(i))
                        self.entries[gap], self.kinds[gap] = {"value": None}, "value"
                kids = [str(i) for i in range(max(numbers) + 1)]
            stack.extend(tree.join(path, k) for k in reversed(kids))
        return {"paths": paths, "types": kinds, "entries": entries}


# ---------------------------------------------------------------------------- the reader


class H5StorageReader(StorageReader):
    """DCP storage reader of a directory written by :class:`H5StorageWriter` (or converted from
    a Hugging Face checkpoint by :func:`tensorstore_h5.sharded.from_safetensors_dir`, or a
    Hugging Face safetensors directory itself).

    Every rank reads only the hyperslabs of the stored pieces that overlap its destination
    tensors (resharding: N ranks' ``Shard(0)`` into M ranks' ``Shard(1)``, ``Replicate()`` or
    one process), straight into them where they are contiguous. Plain values are decoded from
    the index's JSON and placed in the state dict without pickle (DCP's default planners;
    a planner that overrides ``load_bytes`` gets them as ``torch.save`` bytes).

    Args:
        path: the checkpoint directory.
        verify: check the stored checksums of the pieces read, before any destination
            changes (one more pass over their bytes, hashed on the I/O threads): by default
            (None) of every piece read whole, with True of every piece read from, with False
            of none.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.load_id = sharded.new_save_id()
        self.storage_data: dict[MetadataIndex, tuple[str, int | None]] = {}
        self._store: sharded.ShardedStore | None = None
        self.rank: int | None = None
        self.use_collectives = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = sharded.new_save_id()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The DCP metadata, from the JSON index (the rank-local one with ``rank=``)."""
        self.close()
        store = self._store = sharded.ShardedStore(self.path, rank=kwargs.get("rank"))
        return dcp_metadata(store._layout, self.path, self.load_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, then close the files (DCP calls it once per load; a file
        held open would keep its pages, and a removed checkpoint's disk space, in use)."""
        if self._store is None:
            self._store = sharded.ShardedStore(self.path, rank=None if self.use_collectives else self.rank)
        try:
            self._read(plan, planner, self._store)
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner, store: sharded.ShardedStore) -> None:
        layout = store._layout
        reads = Reads()
        commits = []
        regions = []
        checked: dict[tuple[str, str], tuple[sharded.Piece, str]] = {}
        for req in plan.items:
            kp, j = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                _set_value(planner, req, store.materialize(kp))
                continue
            entry = layout.entry(kp)
            assert isinstance(entry, sharded.ShardedTensorEntry) and j is not None
            piece = entry.pieces[j]
            dest = planner.resolve_tensor(req).detach()
            if tuple(dest.shape) != tuple(req.lengths):
                raise ValueError(f"{self.path}: key {kp!r}: the planner's destination has shape {list(dest.shape)}, the "
                                 f"read needs {list(req.lengths)}")
            if piece.numel:
                loc = store._files.locate(piece, entry)
                local = block_selection(piece.shape, req.storage_offsets, req.lengths)
                if checking(self.verify, local.full):
                    checked[(piece.file, piece.key)] = (piece, kp)
                regions.append((loc, piece.shape, entry.dtype, local, dest))
            commits.append((req, dest))
        store._verify_pieces(list(checked.values()))  # before any destination changes
        for region in regions:
            reads.region(*region)
        reads.run()
        for req, dest in commits:
            planner.commit_tensor(req, dest)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return sharded.is_checkpoint_directory(checkpoint_id)
        except (OSError, TypeError):
            return False

    def close(self) -> None:
        """Close the index and files of the current load (``read_data`` does it when it ends;
        they stay open from ``read_metadata`` to then)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def __repr__(self) -> str:
        return f"<H5StorageReader {self.path!r}>"


def dcp_metadata(layout: sharded.DirectoryIndex, checkpoint_id: str, load_id: str | None = None) -> Metadata:
    """DCP's ``Metadata`` of a directory index: every DCP key's global shape, dtype and stored
    chunks (the pieces) or a plain value, and where each is (``storage_data``)."""
    with memory.gc_paused():
        return _dcp_metadata(layout, checkpoint_id, load_id)


def _dcp_metadata(layout: sharded.DirectoryIndex, checkpoint_id: str, load_id: str | None) -> Metadata:
    fqns, paths_of = _fqns(layout)
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, tuple[str, int | None]] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}  # one torch.Size per distinct tuple: pieces repeat them

    def size(t: tuple[int, ...]) -> torch.Size:
        s = sizes.get(t)
        if s is None:
            s = sizes[t] = torch.Size(t)
        return s

    for fqn, kp in fqns.items():
        e = layout.entry(kp)
        if e is None:
            raise FormatError(f"{layout.path}: DCP key {fqn!r} names key path {kp!r}, which the index does not hold")
        if isinstance(e, sharded.ShardedTensorEntry):
            chunks = [ChunkStorageMetadata(offsets=size(p.offsets), sizes=size(p.shape)) for p in e.pieces]
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=e.dtype.torch_dtype, requires_grad=e.requires_grad),
                                             torch.Size(e.shape), chunks)
            for j, c in enumerate(chunks):
                storage[MetadataIndex(fqn, c.offsets)] = (kp, j)
        else:
            sdm[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = (kp, None)
    version = layout.dcp.get("version") if layout.dcp else None
    return Metadata(state_dict_metadata=sdm, planner_data={k: tuple(v) for k, v in paths_of.items()},
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=layout.save_id, load_id=load_id),
                    version=version)


def _fqns(layout: sharded.DirectoryIndex) -> tuple[dict[str, str], dict[str, list[Any]]]:
    """DCP key -> key path, and DCP key -> object path: as recorded by the writer, or for a
    directory not written through DCP, one DCP key per leaf (its names joined with dots)."""
    dcp = layout.dcp
    if dcp is not None:
        return dict(dcp["fqns"]), dict(dcp["planner_data"] or {})
    fqns: dict[str, str] = {}
    paths_of: dict[str, list[Any]] = {}
    for kp in layout.leaf_paths:
        names = tree.split(kp)
        obj: list[Any] = []
        for i, name in enumerate(names):
            parent = "/".join(names[:i])
            obj.append(int(name) if layout.container_type(parent) in ("list", "tuple") else tree.unescape(name))
        fqn = ".".join(map(str, obj))
        if fqn in fqns:
            raise FormatError(f"{layout.path}: key paths {fqns[fqn]!r} and {kp!r} make the same DCP key {fqn!r}")
        fqns[fqn], paths_of[fqn] = kp, obj
    return fqns, paths_of


def _set_value(planner: LoadPlanner, req: Any, value: Any) -> None:
    """Place a plain value where DCP's ``load_bytes`` would, without unpickling anything."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = req.dest_index.fqn
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    buf = _io.BytesIO()  # a planner of its own: it gets what DCP gives it, bytes of torch.save
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(req, buf)


# ---------------------------------------------------------------------------- shortcuts


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], **options: Any) -> Metadata:
    """``dcp.save(state_dict, storage_writer=H5StorageWriter(path, **writer options))``;
    ``planner=``, ``process_group=``, ``no_dist=`` and ``use_collectives=`` go to ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    dcp_keys = {"planner", "process_group", "no_dist", "use_collectives"}
    dcp_args = {k: options.pop(k) for k in list(options) if k in dcp_keys}
    return dcp.save(state_dict, storage_writer=H5StorageWriter(path, **options), **dcp_args)


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], **options: Any) -> None:
    """``dcp.load(state_dict, storage_reader=H5StorageReader(path, verify=...))`` (in place);
    ``planner=``, ``process_group=`` and ``no_dist=`` go to ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    dcp_keys = {"planner", "process_group", "no_dist"}
    dcp_args = {k: options.pop(k) for k in list(options) if k in dcp_keys}
    reader = H5StorageReader(path, **options)
    try:
        dcp.load(state_dict, storage_reader=reader, **dcp_args)
    finally:
        reader.close()

