"""Checkpoint directories as one logical store: the sharded index (docs/FORMAT.md, "Sharded
checkpoints (directories)"), :class:`ShardedStore` over a directory written by
:mod:`tensorstore_h5.distributed` or by :func:`from_safetensors_dir`, the same view over a
Hugging Face sharded safetensors checkpoint, and conversions between them, key by key.

A directory holds format-2 files named ``<name>.<save id>.h5`` and the index
``tensorstore_h5.json``, written last. The index holds the *global* tree (keys, dtypes, shapes
and plain values of the whole checkpoint) and, for every tensor, its **pieces**: which dataset
of which file holds which block of it. Reading ``h[a:b]`` opens only the files whose pieces
overlap the selection and reads only the overlap of each piece (its hyperslab), straight into
the result where the destination is contiguous.

Nothing here imports ``torch.distributed``; the DCP backend builds on these pieces.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import gc
import itertools
import json
import math
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np
import torch

from . import checksum, io, tree
from . import format as fmt
from .display import Progress, human_bytes
from .dtypes import DtypeSpec, bits_view, spec_for_name
from .errors import FormatError, KeyNotFoundError, MismatchError, TensorStoreError
from .format import ArrayEntry, Chunked, Contiguous, TensorEntry, ValueEntry
from .select import Selector, closest, resolve
from .slicing import Selection, contiguous_stride, select as select_index
from .tree import Container, Leaf

__all__ = [
    "INDEX_NAME", "INDEX_FORMAT", "INDEX_VERSION", "ShardedStore", "ShardedTensorHandle", "Piece", "DirectoryIndex",
    "open_directory", "is_checkpoint_directory", "parse_index", "index_text", "commit_index", "check_cover",
    "new_save_id", "data_file_name", "rank_index_name", "file_info", "to_file", "from_safetensors_dir", "convert_dir",
]

PathLike = Union[str, "os.PathLike[str]"]
Device = Any

INDEX_NAME = "tensorstore_h5.json"
"""The index of a checkpoint directory, written last."""
INDEX_FORMAT = "tensorstore_h5.sharded"
INDEX_VERSION = 2
HF_INDEX_SUFFIX = ".safetensors.index.json"
DCP_METADATA = ".metadata"
"""The (pickled) metadata file of torch's own ``FileSystemWriter``; never read here."""

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

MAX_INDEX_BYTES = 1 << 31
"""Larger index files are refused (a hostile index cannot make a reader allocate without bound)."""

_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_DATA_FILE = re.compile(r"(?P<stem>[A-Za-z0-9][A-Za-z0-9_-]*)\.(?P<id>[0-9a-f]{16})\.h5")
_RANK_INDEX = re.compile(r"tensorstore_h5\.rank(?P<rank>[0-9]+)\.json")
_INDEX_PARTIAL = re.compile(r"\.tensorstore_h5(\.rank[0-9]+)?\.json\.[0-9a-f]{32}\.partial")
_WRITER_PARTIAL = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{32}\.partial")


# ---------------------------------------------------------------------------- names


def new_save_id() -> str:
    """A new save id: 16 lower-case hex digits, new for every save."""
    return uuid.uuid4().hex[:16]


def data_file_name(stem: str, save_id: str) -> str:
    """``<stem>.<save id>.h5``; ``stem`` is made of letters, digits, ``_`` and ``-``."""
    name = f"{stem}.{save_id}.h5"
    if _DATA_FILE.fullmatch(name) is None:
        raise ValueError(f"invalid data file stem {stem!r} or save id {save_id!r}")
    return name


def rank_index_name(rank: int) -> str:
    """The rank-local index of a save without collectives (``use_collectives=False``)."""
    return f"tensorstore_h5.rank{rank:05d}.json"


def rank_stem(rank: int) -> str:
    return f"rank{rank:05d}"


def _sanitize_stem(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", name) or "shard"
    return stem if stem[0].isalnum() else "s" + stem


def file_info(path: str) -> dict[str, Any]:
    """``{"bytes": length, "layout_xxh3": hex}`` of a format-2 file, from its header."""
    raw = io.RawFile(path)
    try:
        header = fmt.parse_header(raw.read(0, min(raw.size, fmt.HEADER_SIZE)), path, raw.size)
    finally:
        raw.close()
    return {"bytes": header.file_length, "layout_xxh3": checksum.to_hex(header.layout_hash)}


# ---------------------------------------------------------------------------- pieces and their cover


class Piece(NamedTuple):
    """The dataset ``key`` of ``file`` holds the block of the global tensor that starts at
    ``offsets`` and has ``shape``."""

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def check_cover(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]], complete: bool = True,
                names: Sequence[str] | None = None) -> str | None:
    """The problem with blocks ``(offsets, sizes)`` as pieces of a tensor of ``shape``, or None.

    Every block must lie inside the shape; no two blocks with elements may overlap; with
    ``complete`` they must cover every element (exactly once, then). Runs in about
    O(n log n) for the grids that sharding makes: blocks are swept along the dimension with the
    most distinct offsets.
    """
    shape = tuple(shape)
    ndim = len(shape)
    volume = 0
    live = []
    for i, (off, size) in enumerate(boxes):
        if len(off) != ndim or len(size) != ndim:
            return f"piece {_piece_name(names, i)} has {len(off)} offsets and {len(size)} sizes for {ndim} dimensions"
        for d, (o, s, n) in enumerate(zip(off, size, shape)):
            if o < 0 or s < 0 or o + s > n:
                return (f"piece {_piece_name(names, i)} at offsets {list(off)} of shape {list(size)} lies outside the "
                        f"global shape {list(shape)} (dimension {d})")
        v = math.prod(size)
        volume += v
        if v:
            live.append((tuple(off), tuple(size), i))
    if live and ndim:
        d = max(range(ndim), key=lambda k: len({b[0][k] for b in live}))
        live.sort(key=lambda b: b[0][d])
        active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        for box in live:
            start = box[0][d]
            active = [a for a in active if a[0][d] + a[1][d] > start]
            for a in active:
                if all(a[0][k] < box[0][k] + box[1][k] and box[0][k] < a[0][k] + a[1][k] for k in range(ndim)):
                    return (f"pieces {_piece_name(names, a[2])} (offsets {list(a[0])}, shape {list(a[1])}) and "
                            f"{_piece_name(names, box[2])} (offsets {list(box[0])}, shape {list(box[1])}) overlap")
            active.append(box)
    elif len(live) > 1:  # 0-d: each live piece is the one element
        return f"pieces {_piece_name(names, live[0][2])} and {_piece_name(names, live[1][2])} overlap"
    numel = math.prod(shape)
    if complete and volume != numel:
        return f"the pieces cover {volume} of the {numel} elements of shape {list(shape)}: they leave a gap"
    return None


def _piece_name(names: Sequence[str] | None, i: int) -> str:
    return names[i] if names is not None else str(i)


# ---------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class ShardedTensorEntry:
    """A tensor of a directory: its global dtype and shape, and its pieces."""

    path: str
    key: Any
    dtype: DtypeSpec
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    parameter: bool = False
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ShardedArrayEntry:
    """A numpy array of a directory (stored whole, as one piece)."""

    path: str
    key: Any
    dtype: np.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


DirEntry = Union[Container, ShardedTensorEntry, ShardedArrayEntry, ValueEntry]

_TOP_FIELDS = frozenset({"format", "version", "save_id", "metadata", "files", "paths", "types", "entries"})
_TOP_OPTIONAL = frozenset({"dcp", "rank"})
_CONTAINER_FIELDS = frozenset({"key", "_metadata"})
_TENSOR_FIELDS = frozenset({"key", "dtype", "shape", "pieces", "parameter", "requires_grad"})
_ARRAY_FIELDS = frozenset({"key", "dtype", "shape", "pieces"})
_VALUE_FIELDS = frozenset({"key", "value"})
_PIECE_FIELDS = frozenset({"file", "key", "offsets", "shape"})
_HEX16 = re.compile(r"[0-9a-f]{16}")


class DirectoryIndex:
    """A parsed index. The structure (paths, types, files) is checked when it is opened; each
    entry, with its pieces and their cover, the first time it is used.

    ``rank`` is set for the rank-local index of a save without collectives: its pieces may
    leave gaps (they are the pieces that rank wrote)."""

    def __init__(self, path: str, obj: dict[str, Any], *, safetensors: bool = False) -> None:
        self.path = path
        self.directory = os.path.dirname(path)
        self.safetensors = safetensors
        self.save_id: str | None = obj.get("save_id")
        self.metadata: dict[str, Any] = obj["metadata"]
        self.rank: int | None = obj.get("rank")
        self.files: dict[str, tuple[int, int | None]] = {}
        for name, info in obj["files"].items():
            self.files[name] = (info["bytes"], checksum.from_hex(info["layout_xxh3"]) if "layout_xxh3" in info else None)
        self._paths: list[str] = obj["paths"]
        self._kinds: list[str] = obj["types"]
        self._raw: list[Any] = obj["entries"]
        self._index, self._types = fmt._structure(self._paths, self._kinds, path)
        self._parsed: list[DirEntry | None] = [None] * len(self._paths)
        self.leaf_paths = [p for p in self._index if p not in self._types]
        self.container_paths = [p for p in self._types if p]
        self.dcp: dict[str, Any] | None = obj.get("dcp")

    def entry(self, path: str) -> DirEntry | None:
        i = self._index.get(path)
        return None if i is None else self._parse(i)

    def select(self, included: set[str] | None) -> list[DirEntry]:
        wanted = range(len(self._paths)) if included is None else sorted(self._index[p] for p in included if p in self._index)
        return [self._parse(i) for i in wanted]

    @property
    def entries(self) -> list[DirEntry]:
        return self.select(None)

    def container_type(self, path: str) -> str | None:
        return self._types.get(path)

    def _parse(self, i: int) -> DirEntry:
        entry = self._parsed[i]
        if entry is None:
            path = self._paths[i]
            try:
                entry = self._parse_entry(self._raw[i], path, self._kinds[i])
            except (ValueError, TypeError, KeyError, RecursionError) as e:
                raise FormatError(f"{self.path}: damaged index entry {i} (key {path!r}): {e}") from e
            self._parsed[i] = entry
        return entry

    def _parse_entry(self, item: Any, path: str, kind: str) -> DirEntry:
        if type(item) is not dict:
            raise ValueError("the entry is not a JSON object")
        key = fmt._parse_key(item, path, self._types)
        if kind in tree.CONTAINER_TYPES:
            _fields(item, _CONTAINER_FIELDS)
            meta = None
            if "_metadata" in item:
                if kind != "OrderedDict":
                    raise ValueError("only an OrderedDict has _metadata")
                meta = fmt._parse_module_metadata(item["_metadata"])
            return Container(path, key, kind, meta)
        if kind == "value":
            _fields(item, _VALUE_FIELDS)
            if "value" not in item:
                raise ValueError("a value entry needs 'value'")
            return ValueEntry(path, key, tree.decode_value(item["value"]))
        if kind == "ndarray":
            _fields(item, _ARRAY_FIELDS)
            dt = fmt._numpy_dtype(item.get("dtype"))
            shape = fmt._parse_ints(item.get("shape"), "shape", minimum=0)
            pieces = self._pieces(item, path, shape)
            return ShardedArrayEntry(path, key, dt, shape, pieces)
        if kind != "tensor":
            raise ValueError(f"unknown entry type {kind!r}")
        _fields(item, _TENSOR_FIELDS)
        spec = spec_for_name(item.get("dtype"))  # type: ignore[arg-type]
        if spec is None:
            raise ValueError(f"unknown torch dtype {item.get('dtype')!r}")
        shape = fmt._parse_ints(item.get("shape"), "shape", minimum=0)
        for flag in ("parameter", "requires_grad"):
            if flag in item and item[flag] is not True:
                raise ValueError(f"{flag} must be true when present")
        if "requires_grad" in item and not (spec.torch_dtype.is_floating_point or spec.torch_dtype.is_complex):
            raise ValueError(f"a {spec.name} tensor cannot require grad")
        pieces = self._pieces(item, path, shape)
        return ShardedTensorEntry(path, key, spec, shape, pieces, "parameter" in item, "requires_grad" in item)

    def _pieces(self, item: dict[str, Any], path: str, shape: tuple[int, ...]) -> tuple[Piece, ...]:
        raw = item.get("pieces")
        if type(raw) is not list:
            raise ValueError("missing or invalid 'pieces'")
        pieces = []
        ndim, files = len(shape), self.files
        for j, p in enumerate(raw):
            if type(p) is not dict or not p.keys() <= _PIECE_FIELDS or "file" not in p:
                raise ValueError(f"piece {j} is not an object with file, offsets, shape and an optional key")
            name, key, off, shp = p["file"], p.get("key", path), p.get("offsets"), p.get("shape")
            if type(name) is not str or name not in files:
                raise ValueError(f"piece {j} names the file {name!r}, which is not among the index's files")
            if type(key) is not str:
                raise ValueError(f"piece {j} has an invalid key {key!r}")
            if type(off) is not list or type(shp) is not list or len(off) != ndim or len(shp) != ndim \
                    or not all(type(n) is int and 0 <= n < 2**62 for n in off + shp):
                raise ValueError(f"piece {j} has invalid offsets {off!r} or shape {shp!r} for {ndim} dimensions")
            pieces.append(Piece(name, key, tuple(off), tuple(shp)))
        boxes = [(p.offsets, p.shape) for p in pieces]
        if check_cover(shape, boxes, complete=self.rank is None) is not None:  # again, naming the pieces
            raise ValueError(check_cover(shape, boxes, self.rank is None, [f"{p.file}:{p.key}" for p in pieces]))
        return tuple(pieces)


def _fields(item: dict[str, Any], allowed: frozenset[str]) -> None:
    if not item.keys() <= allowed:
        raise ValueError(f"unexpected fields {sorted(set(item) - allowed)}")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: building the hundreds of thousands
    of objects of a large index (none of them in a cycle) otherwise runs it again and again
    (measured: half of the time a rank spends reading a 512-rank index)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_index(data: bytes, path: str) -> DirectoryIndex:
    """Parse the text of an index file (``path`` names it in errors). Raises FormatError."""
    try:
        with gc_paused():
            obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{path}: damaged index (not valid JSON): {e}") from e
    if type(obj) is not dict:
        raise FormatError(f"{path}: damaged index (not a JSON object)")
    if obj.get("format") != INDEX_FORMAT:
        raise FormatError(f"{path}: not a tensorstore_h5 directory index (format {obj.get('format')!r})")
    if obj.get("version") != INDEX_VERSION:
        raise FormatError(f"{path}: written in directory index version {obj.get('version')!r}, which this library does "
                          f"not read (it reads {INDEX_VERSION}); upgrade tensorstore_h5")
    missing, unknown = _TOP_FIELDS - obj.keys(), obj.keys() - _TOP_FIELDS - _TOP_OPTIONAL
    if missing or unknown:
        raise FormatError(f"{path}: damaged index (missing fields {sorted(missing)}, unknown fields {sorted(unknown)})")
    why = _check_top(obj)
    if why:
        raise FormatError(f"{path}: damaged index: {why}")
    return DirectoryIndex(path, obj)


def _check_top(obj: dict[str, Any]) -> str | None:
    if type(obj["save_id"]) is not str or _SAVE_ID.fullmatch(obj["save_id"]) is None:
        return f"invalid save_id {obj['save_id']!r}"
    if type(obj["metadata"]) is not dict:
        return "metadata is not a JSON object"
    if "rank" in obj and (type(obj["rank"]) is not int or obj["rank"] < 0):
        return f"invalid rank {obj['rank']!r}"
    files = obj["files"]
    if type(files) is not dict:
        return "files is not a JSON object"
    for name, info in files.items():
        if _DATA_FILE.fullmatch(name) is None:
            return f"invalid file name {name!r} (files are named <name>.<save id>.h5)"
        if type(info) is not dict or set(info) != {"bytes", "layout_xxh3"} or type(info["bytes"]) is not int \
                or info["bytes"] < fmt.USERBLOCK or type(info["layout_xxh3"]) is not str \
                or _HEX16.fullmatch(info["layout_xxh3"]) is None:
            return f"file {name!r}: expected {{'bytes': length, 'layout_xxh3': hex}}, got {info!r}"
    paths, kinds, entries = obj["paths"], obj["types"], obj["entries"]
    if type(paths) is not list or type(kinds) is not list or type(entries) is not list or not paths \
            or not len(paths) == len(kinds) == len(entries):
        return "paths, types and entries must be lists of one length"
    if not all(type(k) is str for k in kinds):
        return "types must be strings"
    dcp = obj.get("dcp")
    if dcp is not None:
        if type(dcp) is not dict or set(dcp) != {"version", "fqns", "planner_data"}:
            return "dcp must be {'version', 'fqns', 'planner_data'}"
        if type(dcp["fqns"]) is not dict or not all(type(v) is str for v in dcp["fqns"].values()):
            return "dcp.fqns must map DCP keys to key paths"
        pd = dcp["planner_data"]
        if pd is not None and (type(pd) is not dict or not all(
                type(v) is list and all(type(x) in (str, int) for x in v) for v in pd.values())):
            return "dcp.planner_data must map DCP keys to lists of str and int"
        if dcp["version"] is not None and type(dcp["version"]) is not str:
            return "dcp.version must be a string or null"
    return None


def index_text(obj: Mapping[str, Any]) -> bytes:
    """The bytes of an index object (compact JSON, ASCII, no NaN)."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def read_index(directory: str, name: str = INDEX_NAME) -> DirectoryIndex:
    """Read and parse ``directory/name``. Raises FileNotFoundError or FormatError."""
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise FormatError(f"{path}: the index is larger than {human_bytes(MAX_INDEX_BYTES)}; refused")
    return parse_index(data, path)


# ---------------------------------------------------------------------------- committing a directory


def commit_index(directory: PathLike, obj: Mapping[str, Any], *, rank: int | None = None, sync: bool = False) -> list[str]:
    """Put ``obj`` in place as the index of ``directory``, then remove what it supersedes.

    The index is written under a temporary name (locked while it is written), ``fsync``-ed
    with ``sync``, and renamed over ``tensorstore_h5.json`` (or, with ``rank``, over that rank's
    own index). Only then are removed: data files (``<name>.<save id>.h5``) that the new index
    does not name (with ``rank``: only that rank's own ``rank<r>`` files), rank-local indexes
    (a global index supersedes them) or the global index (a rank-local save supersedes it), and
    temporaries that no live process holds. Other files are never touched.

    Returns the names removed.
    """
    directory = os.fspath(directory)
    name = INDEX_NAME if rank is None else rank_index_name(rank)
    text = index_text(obj)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(text)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    if sync:
        _fsync_dir(directory)
    keep = set(obj.get("files", {}))
    return _sweep(directory, keep, rank)


def _fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _sweep(directory: str, keep: set[str], rank: int | None) -> list[str]:
    from .writer import sweep_partials

    removed = []
    own = None if rank is None else rank_stem(rank)
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        m = _DATA_FILE.fullmatch(name)
        stale = False
        if m is not None and name not in keep:
            stem = m.group("stem")
            stale = own is None or stem == own or stem.startswith(own + "_")
        elif rank is None and _RANK_INDEX.fullmatch(name):
            stale = True
        elif rank is not None and name == INDEX_NAME:
            stale = True
        elif _INDEX_PARTIAL.fullmatch(name):
            stale = _unlocked(full)
        elif (w := _WRITER_PARTIAL.fullmatch(name)) is not None and _DATA_FILE.fullmatch(w.group("name")):
            removed += [os.path.basename(p) for p in sweep_partials(os.path.join(directory, w.group("name")))]
            continue
        if stale:
            try:
                os.unlink(full)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _unlocked(path: str) -> bool:
    """True for a temporary that no live process holds (its writer died)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- where a piece's bytes are


class _Loc(NamedTuple):
    """A located piece: raw row-major bytes at ``offset`` of ``raw`` (uncompressed data), or
    ``handle`` (a TensorHandle of a compressed dataset), or neither (no elements)."""

    path: str
    key: str
    raw: io.RawFile | None = None
    offset: int = 0
    handle: Any = None


class _Th5Files:
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
        from .store import Store

        full = os.path.join(self.index.directory, name)
        size, layout_hash = self.index.files[name]
        where = f"{full}: key {key!r}"
        try:
            raw = io.RawFile(full)
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
        finally:
            raw.close()
        try:
            store = Store(full)
        except FormatError as e:
            raise FormatError(f"{e} (key {key!r})") from e
        if store.format_version != 2:
            store.close()
            raise FormatError(f"{where}: not a tensorstore_h5 format-2 file")
        return store

    def entry(self, piece: Piece, owner: str, kind: type = TensorEntry) -> tuple[Any, Any]:
        """The store and checked file entry of ``piece`` of the tensor at ``owner``."""
        store = self.store(piece.file, piece.key)
        e = store._layout.entry(piece.key)
        full = os.path.join(self.index.directory, piece.file)
        if not isinstance(e, kind):
            what = "no such key" if e is None else f"a {type(e).__name__}, not a {kind.__name__}"
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {owner!r}): {what} in the file the index "
                              f"{self.index.path} names")
        if tuple(e.shape) != tuple(piece.shape):
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {owner!r}): the dataset has shape {list(e.shape)}, "
                              f"the index {self.index.path} records {list(piece.shape)}")
        return store, e

    def locate(self, piece: Piece, entry: ShardedTensorEntry) -> _Loc:
        store, e = self.entry(piece, entry.path)
        full = os.path.join(self.index.directory, piece.file)
        if e.dtype != entry.dtype:
            raise FormatError(f"{full}: key {piece.key!r} (a piece of {entry.path!r}): dtype {e.dtype.name}, the index "
                              f"{self.index.path} records {entry.dtype.name}")
        where = e.extent
        if isinstance(where, Contiguous):
            return _Loc(full, piece.key, raw=store._rawfile(), offset=where.offset)
        if isinstance(where, Chunked):
            from .store import TensorHandle

            return _Loc(full, piece.key, handle=TensorHandle(store, e))
        return _Loc(full, piece.key)

    def verify(self, piece: Piece, owner: str) -> None:
        store, e = self.entry(piece, owner, (TensorEntry, ArrayEntry))  # type: ignore[arg-type]
        if isinstance(e, TensorEntry):
            store._verify_stored(e)
        else:
            store._read_array(e, verify=True)

    def read_array(self, entry: ShardedArrayEntry) -> np.ndarray:
        if len(entry.pieces) != 1 or any(entry.pieces[0].offsets):
            raise FormatError(f"{self.index.path}: key {entry.path!r}: an array is stored as one piece")
        store, e = self.entry(entry.pieces[0], entry.path, ArrayEntry)
        if e.dtype != entry.dtype:
            raise FormatError(f"{os.path.join(self.index.directory, entry.pieces[0].file)}: key {entry.pieces[0].key!r}: "
                              f"dtype {e.dtype}, the index records {entry.dtype}")
        return store._read_array(e, verify=False)

    def close(self) -> None:
        for s in self._stores.values():
            s.close()
        self._stores.clear()


# ---------------------------------------------------------------------------- reading hyperslabs


class _Reads:
    """Hyperslab reads of many pieces into their destinations, run on the I/O thread pool.

    Raw reads are queued as jobs of about :data:`io.PIECE_BYTES` each; destinations that are not
    contiguous CPU tensors of the stored dtype are read into a temporary and copied after
    :meth:`run` (cast like ``copy_``)."""

    def __init__(self) -> None:
        self.plan = io.ReadPlan(None)  # type: ignore[arg-type]  # jobs only: each names its own file
        self.posts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def region(self, loc: _Loc, shape: tuple[int, ...], spec: DtypeSpec, sel: Selection, dest: torch.Tensor) -> None:
        """Read ``sel`` (a box or strided selection, ``sel.shape == sel.count``) of the stored
        piece of ``shape`` into ``dest`` (any tensor of shape ``sel.count``)."""
        if sel.empty:
            return
        dtype = spec.torch_dtype
        direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
        buf = dest if direct else io.empty(sel.count, dtype)
        if not direct:
            self.posts.append((dest, buf))
        if loc.raw is not None:
            self._raw(loc, shape, spec.itemsize, sel, buf)
        elif loc.handle is not None:
            index = tuple(slice(a, a + (c - 1) * s + 1, s) for a, c, s in zip(sel.start, sel.count, sel.step))
            loc.handle.read(out=buf, index=index)
        else:
            raise FormatError(f"{loc.path}: key {loc.key!r}: the dataset holds no data")

    def _raw(self, loc: _Loc, shape: tuple[int, ...], itemsize: int, sel: Selection, buf: torch.Tensor) -> None:
        raw, base = loc.raw, loc.offset
        assert raw is not None
        strides = contiguous_stride(shape)
        wrap = functools.partial(_keyed, loc)
        if sel.contiguous_rows:
            first = base + sum(a * s for a, s in zip(sel.start, strides)) * itemsize
            view = memoryview(io.tensor_bytes(buf))
            for i in range(0, len(view), io.PIECE_BYTES):
                piece = view[i:i + io.PIECE_BYTES]
                self.plan.add_job(wrap(functools.partial(raw.pread, first + i, piece)), len(piece))
            return
        if all(s == 1 for s in sel.step):
            self._box_jobs(raw, base, shape, itemsize, sel, buf, wrap)
            return
        bits = bits_view(buf)
        fetch = functools.partial(_fetch, raw, base)
        self.plan.add_job(wrap(functools.partial(io.gather, fetch, shape, itemsize, sel, bits)),
                          buf.numel() * itemsize)

    def _box_jobs(self, raw: io.RawFile, base: int, shape: tuple[int, ...], itemsize: int, sel: Selection,
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
        view = memoryview(io.tensor_bytes(buf))
        first = base + (sel.start[d - 1] * strides[d - 1] + sel.start[d] * strides[d]) * itemsize
        outer = [range(a, a + c) for a, c in zip(sel.start[:d - 1], sel.count[:d - 1])]
        per = max(1, (io.PIECE_BYTES if exact else WINDOW_BYTES) // (run if exact else pitch))
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


def _read_runs(raw: io.RawFile, offsets: list[int], view: memoryview, run: int) -> None:
    """Fill consecutive ``run``-byte slices of ``view`` from the file offsets, one system call
    each (a short read is finished by :meth:`io.RawFile.pread`, which raises at the end of
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


def _read_window(raw: io.RawFile, offset: int, pitch: int, run: int, n: int, dest: torch.Tensor) -> None:
    """Read ``n`` rows of ``pitch`` bytes from ``offset`` in one system call and copy the first
    ``run`` bytes of each into ``dest`` (contiguous uint8, ``n * run`` bytes)."""
    window = _window((n - 1) * pitch + run)
    raw.pread(offset, memoryview(window.numpy()))
    dest.view(n, run).copy_(window.as_strided((n, run), (pitch, 1)))


def _fetch(raw: io.RawFile, base: int, off: int, view: memoryview) -> None:
    raw.pread(base + off, view)


def _keyed(loc: _Loc, job: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            job()
        except TensorStoreError:
            raise
        except (OSError, EOFError, ValueError) as e:
            raise FormatError(f"{loc.path}: key {loc.key!r}: cannot read the data ({e})") from e
    return run


def _overlap(sel: Selection, piece: Piece) -> tuple[Selection, tuple[slice, ...]] | None:
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


def _box(shape: tuple[int, ...], start: Sequence[int], count: Sequence[int]) -> Selection:
    cnt = tuple(int(c) for c in count)
    return Selection(tuple(shape), tuple(int(a) for a in start), cnt, (1,) * len(shape), cnt)


# ---------------------------------------------------------------------------- Hugging Face safetensors directories


_ST_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}
_ST_MAX_HEADER = 100 * 2**20


class _SafetensorsFile(NamedTuple):
    raw: io.RawFile
    data_start: int
    tensors: dict[str, tuple[DtypeSpec, tuple[int, ...], int]]  # name -> (dtype, shape, offset from data_start)
    metadata: dict[str, Any]


def _read_safetensors_header(path: str) -> _SafetensorsFile:
    """Parse and check a safetensors header: every tensor's byte range inside the file and of its
    dtype's and shape's size. Raises FormatError naming the file (and the key)."""
    try:
        raw = io.RawFile(path)
    except FileNotFoundError:
        raise FormatError(f"{path}: the file is missing; the safetensors index names it") from None
    try:
        if raw.size < 8:
            raise FormatError(f"{path}: not a safetensors file (shorter than its header length)")
        n = int.from_bytes(raw.read(0, 8), "little")
        if n > _ST_MAX_HEADER or 8 + n > raw.size:
            raise FormatError(f"{path}: not a safetensors file (header length {n} for a file of {raw.size} bytes)")
        try:
            head = json.loads(raw.read(8, n))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}: damaged safetensors header ({e})") from e
        if type(head) is not dict:
            raise FormatError(f"{path}: damaged safetensors header (not a JSON object)")
        meta = head.pop("__metadata__", None) or {}
        if type(meta) is not dict:
            raise FormatError(f"{path}: damaged safetensors header (__metadata__ is not an object)")
        data_start, body = 8 + n, raw.size - 8 - n
        tensors = {}
        for name, info in head.items():
            where = f"{path}: key {name!r}"
            if type(info) is not dict or not {"dtype", "shape", "data_offsets"} <= info.keys():
                raise FormatError(f"{where}: damaged safetensors header entry")
            dname = _ST_DTYPES.get(info["dtype"]) if type(info["dtype"]) is str else None
            spec = spec_for_name(dname) if dname is not None else None
            if spec is None:
                raise FormatError(f"{where}: safetensors dtype {info['dtype']!r} is not supported")
            try:
                shape = fmt._parse_ints(info["shape"], "shape", 0)
                begin, end = fmt._parse_ints(info["data_offsets"], "data_offsets", 0)
            except ValueError as e:
                raise FormatError(f"{where}: damaged safetensors header entry ({e})") from e
            if not begin <= end <= body or end - begin != math.prod(shape) * spec.itemsize:
                raise FormatError(f"{where}: data range {begin}..{end} does not hold {list(shape)} {spec.name} inside "
                                  f"the file's {body} data bytes")
            tensors[name] = (spec, shape, begin)
    except BaseException:
        raw.close()
        raise
    return _SafetensorsFile(raw, data_start, tensors, meta)


class _SafetensorsFiles:
    """The shards of a Hugging Face checkpoint, their headers parsed when the view opens."""

    def __init__(self, directory: str, files: dict[str, _SafetensorsFile]) -> None:
        self.directory = directory
        self.files = files

    def locate(self, piece: Piece, entry: ShardedTensorEntry) -> _Loc:
        f = self.files[piece.file]
        _spec, _shape, begin = f.tensors[piece.key]
        return _Loc(os.path.join(self.directory, piece.file), piece.key, raw=f.raw, offset=f.data_start + begin)

    def close(self) -> None:
        for f in self.files.values():
            f.raw.close()


def _safetensors_index(directory: str, index_file: str | None) -> tuple[DirectoryIndex, _SafetensorsFiles]:
    """The view of a Hugging Face checkpoint: ``*.safetensors.index.json`` + shards, or a lone
    ``model.safetensors``. Keys are the escaped tensor names (as ``convert`` writes them)."""
    if index_file is not None:
        ipath = os.path.join(directory, index_file)
        try:
            with open(ipath, "rb") as f:
                obj = json.loads(f.read(MAX_INDEX_BYTES))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{ipath}: damaged safetensors index ({e})") from e
        wmap = obj.get("weight_map") if type(obj) is dict else None
        if type(wmap) is not dict or not all(type(k) is str and type(v) is str for k, v in wmap.items()):
            raise FormatError(f"{ipath}: not a safetensors index (no weight_map of names to files)")
        meta = obj.get("metadata") or {}
        if type(meta) is not dict:
            raise FormatError(f"{ipath}: damaged safetensors index (metadata is not an object)")
    else:
        ipath = os.path.join(directory, "model.safetensors")
        wmap, meta = None, None
    names = sorted(set(wmap.values())) if wmap is not None else ["model.safetensors"]
    opened: dict[str, _SafetensorsFile] = {}
    try:
        for name in names:
            if "/" in name or name in (".", ".."):
                raise FormatError(f"{ipath}: the file name {name!r} leaves the directory")
            opened[name] = _read_safetensors_header(os.path.join(directory, name))
        if wmap is None:
            wmap = {k: names[0] for k in opened[names[0]].tensors}
            meta = dict(opened[names[0]].metadata)
        paths, types, entries = [""], ["dict"], [{}]
        for key, name in wmap.items():
            info = opened[name].tensors.get(key)
            if info is None:
                raise FormatError(f"{os.path.join(directory, name)}: key {key!r}: not in the file, which the index "
                                  f"{ipath} names for it")
            spec, shape, _ = info
            paths.append(tree.escape(key))
            types.append("tensor")
            entries.append({"dtype": spec.name, "shape": list(shape),
                            "pieces": [{"file": name, "key": key, "offsets": [0] * len(shape), "shape": list(shape)}]})
        obj2 = {"metadata": dict(meta or {}), "files": {n: {"bytes": f.raw.size} for n, f in opened.items()},
                "paths": paths, "types": types, "entries": entries}
        index = DirectoryIndex(ipath, obj2, safetensors=True)
    except BaseException:
        for f in opened.values():
            f.raw.close()
        raise
    return index, _SafetensorsFiles(directory, opened)


# ---------------------------------------------------------------------------- the view


def is_checkpoint_directory(path: PathLike) -> bool:
    """True when ``path`` is a directory that :class:`ShardedStore` opens."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    names = os.listdir(p)
    return INDEX_NAME in names or any(n.endswith(HF_INDEX_SUFFIX) for n in names) or "model.safetensors" in names \
        or any(_RANK_INDEX.fullmatch(n) for n in names)


class ShardedTensorHandle:
    """A lazy view of one global tensor of a directory: metadata now, bytes when indexed.

    ``h[10:20]``, ``h[:, 3:7]`` read only the pieces that overlap the selection, and of each
    only the overlap; :meth:`read` fills ``out`` in place.
    """

    __slots__ = ("_store", "_entry")

    def __init__(self, store: ShardedStore, entry: ShardedTensorEntry) -> None:
        self._store = store
        self._entry = entry

    @property
    def key(self) -> str:
        return self._entry.path

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._entry.dtype.torch_dtype

    @property
    def stride(self) -> tuple[int, ...]:
        return contiguous_stride(self._entry.shape)

    @property
    def nbytes(self) -> int:
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
    def pieces(self) -> list[Piece]:
        """Where the tensor is stored: file, key in the file, offsets and shape of each block."""
        return list(self._entry.pieces)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index=index)

    def read(self, out: torch.Tensor | None = None, *, index: Any = None, verify: bool = False) -> torch.Tensor:
        """Read the tensor, or the part selected by ``index`` (integers, slices with a positive
        step, ``...``), into ``out`` (any tensor of the selection's shape and of this dtype,
        checked first) or a new CPU tensor. ``verify`` checks the stored checksums of the
        pieces read (a second pass over their bytes)."""
        return self._store._read_handle(self._entry, index, out, verify)

    def __repr__(self) -> str:
        e = self._entry
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"<ShardedTensorHandle {e.path!r} shape={list(e.shape)} dtype={dtype} {human_bytes(e.nbytes)} "
                f"in {len(e.pieces)} piece(s)>")


class ShardedStore:
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

    Raises:
        FileNotFoundError: no such directory.
        FormatError: no index, a damaged index, or a directory of another kind.
    """

    def __init__(self, path: PathLike, *, rank: int | None = None) -> None:
        p = os.fspath(path)
        index_file = None
        if os.path.isfile(p) and (os.path.basename(p) == INDEX_NAME or p.endswith(HF_INDEX_SUFFIX)):
            p, index_file = os.path.dirname(p) or ".", os.path.basename(p)
        if not os.path.isdir(p):
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p}: no such checkpoint directory")
            raise FormatError(f"{p}: not a directory (open files with tensorstore_h5.open)")
        self.path = p
        names = set(os.listdir(p))
        self._files: Any
        if rank is not None:
            self._layout = self._read_ours(rank_index_name(rank))
            self._files = _Th5Files(self._layout)
        elif index_file == INDEX_NAME or (index_file is None and INDEX_NAME in names):
            self._layout = self._read_ours(INDEX_NAME)
            self._files = _Th5Files(self._layout)
        else:
            hf = [index_file] if index_file else sorted(n for n in names if n.endswith(HF_INDEX_SUFFIX))
            if "model.safetensors.index.json" in hf:
                hf = ["model.safetensors.index.json"]
            if len(hf) == 1 or (not hf and "model.safetensors" in names):
                self._layout, self._files = _safetensors_index(p, hf[0] if hf else None)
            elif len(hf) > 1:
                raise FormatError(f"{p}: several safetensors indexes ({', '.join(hf)}); open one of them by its path")
            elif DCP_METADATA in names:
                raise FormatError(f"{p}: a checkpoint of torch.distributed.checkpoint's FileSystemWriter, whose metadata "
                                  "is pickled: tensorstore_h5 does not unpickle; load it with dcp.load and save it again "
                                  "with tensorstore_h5.distributed.H5StorageWriter")
            elif any(_RANK_INDEX.fullmatch(n) for n in names):
                ranks = sorted(int(m.group("rank")) for n in names if (m := _RANK_INDEX.fullmatch(n)))
                raise FormatError(f"{p}: only rank-local indexes (a save with use_collectives=False, ranks "
                                  f"{ranks[:8]}{'...' if len(ranks) > 8 else ''}); open one with ShardedStore(path, rank=r)")
            else:
                raise FormatError(f"{p}: not a checkpoint directory: no {INDEX_NAME}, no *{HF_INDEX_SUFFIX} and no "
                                  "model.safetensors")
        self.index_path = self._layout.path
        self._closed = False

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

    def keys(self) -> list[str]:
        """Key paths of every leaf, in saved order."""
        return list(self._layout.leaf_paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.leaf_paths)

    def __len__(self) -> int:
        return len(self._layout.leaf_paths)

    def __contains__(self, key: object) -> bool:
        e = self._layout.entry(key) if isinstance(key, str) else None
        return e is not None and not isinstance(e, Container)

    def __getitem__(self, key: str) -> Any:
        """A :class:`ShardedTensorHandle` for a tensor; the value of other leaves (arrays are read)."""
        entry = self._entry(key)
        if isinstance(entry, ShardedTensorEntry):
            return ShardedTensorHandle(self, entry)
        return self._read_leaf(entry, None, False)

    def _entry(self, key: str) -> DirEntry:
        entry = self._layout.entry(key)
        if entry is None or isinstance(entry, Container):
            if entry is not None:
                raise KeyNotFoundError(f"{self.path}: {key!r} is a container, not a leaf; use store.load(select={key!r})")
            near = closest(key, self._layout.leaf_paths)
            hint = f"; closest keys: {', '.join(map(repr, near))}" if near else ""
            raise KeyNotFoundError(f"{self.path}: no key {key!r}{hint}")
        return entry

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata (a copy)."""
        return dict(self._layout.metadata)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._layout.entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry)))

    def selected_keys(self, select: Selector = None) -> list[str]:
        included = resolve(select, self._layout.leaf_paths, self._layout.container_paths, self.path)
        return [p for p in self._layout.leaf_paths if p in included]

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

    def items(self, select: Selector = None, device: Device = None, *, verify: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, value)`` of the selected leaves one at a time, in saved order (each
        tensor read from its pieces when it is reached; nothing is kept)."""
        included = resolve(select, self._layout.leaf_paths, self._layout.container_paths, self.path)
        for entry in self._layout.select(included):
            if not isinstance(entry, Container):
                yield entry.path, self._read_leaf(entry, device, verify)

    def load(self, select: Selector = None, device: Device = None, progress: bool | None = None, *,
             verify: bool = False) -> Any:
        """Load the selected leaves into the saved nesting (pruned to the selection), reading
        every piece of every selected tensor once, on the I/O threads.

        Args:
            select: a glob, a list of exact keys or globs, or a callable on the key path.
            device: where tensors go: None (CPU), a device, or a mapping / callable from key
                path to device.
            progress: a progress bar by bytes (see :func:`tensorstore_h5.save`).
            verify: check the stored checksums of every piece read (a second pass).
        """
        included = resolve(select, self._layout.leaf_paths, self._layout.container_paths, self.path)
        entries = self._layout.select(included)
        bar = Progress(progress, desc=f"loading {os.path.basename(self.path.rstrip('/'))}")
        bar.total(sum(e.nbytes for e in entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry))))
        items: list[Any] = []
        pending: list[tuple[int, ShardedTensorEntry, torch.Tensor]] = []
        try:
            reads = _Reads()
            for entry in entries:
                if isinstance(entry, Container):
                    items.append(entry)
                elif isinstance(entry, ShardedTensorEntry):
                    self._check_device(device, entry.path)
                    t = self._empty(entry, entry.shape)
                    if verify:
                        self._verify(entry)
                    self._fill(entry, select_index((), entry.shape), t, reads)
                    pending.append((len(items), entry, t))
                    items.append(None)
                    if not bar.silent:
                        reads.run()
                        bar.update(entry.nbytes)
                else:
                    items.append(Leaf(entry.path, entry.key, self._read_leaf(entry, device, verify)))
            reads.run()
        finally:
            bar.close()
        for i, entry, t in pending:
            items[i] = Leaf(entry.path, entry.key, self._finish(t, entry, device))
        return tree.inflate(items)

    def _read_leaf(self, entry: DirEntry, device: Device, verify: bool) -> Any:
        if isinstance(entry, ValueEntry):
            return entry.value
        if isinstance(entry, ShardedArrayEntry):
            if self._layout.safetensors:
                raise FormatError(f"{self.path}: key {entry.path!r}: arrays are not stored in safetensors directories")
            if verify:
                self._files.verify(entry.pieces[0], entry.path)
            return self._files.read_array(entry)
        assert isinstance(entry, ShardedTensorEntry)
        self._check_device(device, entry.path)
        t = self._empty(entry, entry.shape)
        if verify:
            self._verify(entry)
        reads = _Reads()
        self._fill(entry, select_index((), entry.shape), t, reads)
        reads.run()
        return self._finish(t, entry, device)

    def materialize(self, path: str, *, device: Device = None) -> Any:
        """The value at ``path`` (a leaf or a container, rebuilt with everything under it)."""
        sub = self._layout.entry(path)
        if sub is None:
            raise KeyNotFoundError(f"{self.path}: no key {path!r}")
        if not isinstance(sub, Container):
            return self._read_leaf(sub, device, False)
        result = self.load(select=[path] if path else None, device=device)
        for name in tree.split(path):
            kind = type(result)
            result = result[int(name)] if kind in (list, tuple) else _child(result, name)
        return result

    def _check_device(self, device: Device, key: str) -> None:
        dev = self._device(device, key)
        if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
            raise TensorStoreError(f"{self.path}: key {key!r}: device {str(dev)!r} is not available (this torch has no "
                                   "usable CUDA device)")

    def _device(self, device: Device, key: str) -> torch.device | None:
        from .store import _device_for

        dev = _device_for(device, key)
        if dev is None:
            return None
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError, ValueError) as e:
            raise TensorStoreError(f"{self.path}: key {key!r}: invalid device {dev!r} ({e})") from e
        if d.type == "meta":
            raise TensorStoreError(f"{self.path}: key {key!r}: cannot load data onto the meta device")
        return None if d.type == "cpu" else d

    def _finish(self, t: torch.Tensor, entry: ShardedTensorEntry, device: Device) -> torch.Tensor:
        dev = self._device(device, entry.path)
        if dev is not None:
            t = t.to(dev)
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        if entry.requires_grad:
            t.requires_grad_(True)
        return t

    def _empty(self, entry: ShardedTensorEntry, shape: Sequence[int]) -> torch.Tensor:
        try:
            return io.empty(tuple(shape), entry.dtype.torch_dtype)
        except (OSError, MemoryError, RuntimeError) as e:
            nbytes = math.prod(shape) * entry.dtype.itemsize
            raise TensorStoreError(f"{self.path}: key {entry.path!r}: cannot allocate {human_bytes(nbytes)} ({e})") from e

    def _verify(self, entry: ShardedTensorEntry) -> None:
        if self._layout.safetensors:
            return  # safetensors files carry no checksums
        for piece in entry.pieces:
            if piece.numel:
                self._files.verify(piece, entry.path)

    def _fill(self, entry: ShardedTensorEntry, sel: Selection, box: torch.Tensor, reads: _Reads) -> None:
        """Queue the reads of ``sel`` of ``entry`` into ``box`` (shaped ``sel.count``)."""
        self._check_open()
        for piece in entry.pieces:
            if not piece.numel:
                continue
            hit = _overlap(sel, piece)
            if hit is None:
                continue
            local, dest = hit
            loc = self._files.locate(piece, entry)
            reads.region(loc, piece.shape, entry.dtype, local, box[dest] if dest else box)
        if self._layout.rank is not None:
            covered = sum(math.prod(h[0].count) for p in entry.pieces if p.numel and (h := _overlap(sel, p)) is not None)
            if covered != math.prod(sel.count):
                raise FormatError(f"{self.index_path}: key {entry.path!r}: the selection is not all stored in this "
                                  f"rank-local index (rank {self._layout.rank}); open the directory's global index")

    def _read_handle(self, entry: ShardedTensorEntry, index: Any, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
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
        if verify:
            self._verify(entry)
        reads = _Reads()
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
                    self._verify(e)
                    t = self._read_leaf(e, None, False)
                    total += t.numel() * t.element_size()
                    del t
                elif isinstance(e, ShardedArrayEntry):
                    total += self._read_leaf(e, None, True).nbytes
            except (FormatError, KeyNotFoundError) as err:
                problems.append(str(err))
        if not self._layout.safetensors:
            from .hdf5source import verify_layout

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
        from .display import TreeRow, tree_html

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


# ---------------------------------------------------------------------------- conversions


def to_file(src: PathLike, dst: PathLike, *, select: Selector = None, verify: bool = True,
            metadata: Mapping[str, Any] | None = None, **save_options: Any) -> None:
    """Write a checkpoint directory (ours, or Hugging Face safetensors) as one tensorstore_h5
    file, key by key: each global tensor is assembled from its pieces when the writer reaches
    it and dropped once written (at most the one being written and the one before are in memory).

    ``save_options`` go to :class:`tensorstore_h5.Writer` (``compression=``, ``chunk_bytes=``,
    ``progress=``, ``sync=``). ``verify`` checks every piece's checksums first (tensorstore_h5
    directories). The nesting, containers and plain values are kept.
    """
    from .writer import Writer

    with ShardedStore(src) as store:
        meta = dict(metadata) if metadata is not None else store.metadata
        included = resolve(select, store._layout.leaf_paths, store._layout.container_paths, store.path)
        entries = store._layout.select(included)

        def nodes() -> Iterator[Any]:
            for e in entries:
                yield e if isinstance(e, Container) else Leaf(e.path, e.key, store._read_leaf(e, None, verify))

        with Writer(dst, metadata=meta, **save_options) as w:
            w.expect_bytes(sum(e.nbytes for e in entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry))))
            w.write_tree(nodes())


def from_safetensors_dir(src: PathLike, dst: PathLike, *, compression: Any = None, chunk_bytes: int | None = None,
                         sync: bool = False, metadata: Mapping[str, Any] | None = None,
                         progress: bool | None = None) -> list[str]:
    """Convert a Hugging Face sharded safetensors checkpoint into a tensorstore_h5 directory:
    one format-2 file per shard (``<shard stem>.<save id>.h5``), then the index, key by key
    (one tensor in memory at a time). ``dst`` may already hold a checkpoint: it is replaced as
    a save replaces it (the index last; files of the old one removed after). Returns the names
    of the files written.
    """
    from .writer import Writer

    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    save_id = new_save_id()
    with ShardedStore(src) as store:
        if store.kind != "safetensors":
            raise ValueError(f"{store.path}: not a safetensors checkpoint directory")
        leaves = [e for e in store._layout.entries if isinstance(e, ShardedTensorEntry)]
        by_file: dict[str, list[ShardedTensorEntry]] = {}
        for e in leaves:
            by_file.setdefault(e.pieces[0].file, []).append(e)
        names: dict[str, str] = {}
        files: dict[str, Any] = {}
        for shard, entries in by_file.items():
            stem = _sanitize_stem(shard.removesuffix(".safetensors"))
            name = data_file_name(stem, save_id)
            path = os.path.join(dst, name)
            with Writer(path, compression=compression, chunk_bytes=chunk_bytes, sync=sync, progress=progress,
                        metadata={"save_id": save_id, "source": shard}) as w:
                for e in entries:
                    t = store._read_leaf(e, None, False)
                    w.write(e.path, t)
                    del t
            files[name] = file_info(path)
            names[shard] = name
        paths, types, out = [""], ["dict"], [{}]
        for e in leaves:
            paths.append(e.path)
            types.append("tensor")
            out.append({"dtype": e.dtype.name, "shape": list(e.shape),
                        "pieces": [{"file": names[e.pieces[0].file], "offsets": [0] * len(e.shape), "shape": list(e.shape)}]})
        meta = dict(metadata) if metadata is not None else store.metadata
    fmt.check_metadata(meta)
    obj = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "save_id": save_id, "metadata": meta, "files": files,
           "paths": paths, "types": types, "entries": out}
    parse_index(index_text(obj), os.path.join(dst, INDEX_NAME)).entries  # every entry checked before it is committed
    commit_index(dst, obj, sync=sync)
    return list(files)


def convert_dir(src: PathLike, dst: PathLike, *, select: Selector = None, **options: Any) -> None:
    """``tensorstore-h5 convert`` for directories: a directory (ours or Hugging Face) to one
    ``.h5``/``.hdf5`` file (:func:`to_file`), or a Hugging Face directory to a tensorstore_h5
    directory (:func:`from_safetensors_dir`)."""
    s, d = os.fspath(src), os.fspath(dst)
    if d.lower().endswith((".h5", ".hdf5")):
        to_file(s, d, select=select, **options)
        return
    if select is not None:
        raise ValueError("select applies to a conversion into one .h5 file")
    if os.path.exists(d) and not os.path.isdir(d):
        raise ValueError(f"{d}: the destination of a directory conversion is a directory or an .h5 file")
    from_safetensors_dir(s, d, **options)
