"""The on-disk side of a checkpoint directory (docs/FORMAT.md, "Sharded checkpoints
(directories)"): file names, pieces and their cover, the index (parsed and checked), and the
commit that makes a save visible (the index renamed into place last, then the orphans removed)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np

from ..display import human_bytes
from ..errors import FormatError, TensorStoreError, WriteError
from ..format import checksum, tree
from ..format import layout as fmt
from ..format.dtypes import DtypeSpec, spec_for_name
from ..format.layout import ValueEntry
from ..format.tree import Container
from ..storage import files, memory

__all__ = [
    "INDEX_NAME", "INDEX_FORMAT", "INDEX_VERSION", "HF_INDEX_SUFFIX", "DCP_METADATA", "MAX_INDEX_BYTES",
    "RANK_INDEX", "new_save_id", "data_file_name", "rank_index_name", "rank_stem", "sanitize_stem", "file_info",
    "Piece", "check_cover", "ShardedTensorEntry", "ShardedArrayEntry", "DirEntry", "DirectoryIndex",
    "parse_index", "index_text", "read_index", "commit_index",
]

PathLike = Union[str, "os.PathLike[str]"]

INDEX_NAME = "tensorstore_h5.json"
"""The index of a checkpoint directory, written last."""
INDEX_FORMAT = "tensorstore_h5.sharded"
INDEX_VERSION = 2
HF_INDEX_SUFFIX = ".safetensors.index.json"
DCP_METADATA = ".metadata"
"""The (pickled) metadata file of torch's own ``FileSystemWriter``; never read here."""


MAX_INDEX_BYTES = 1 << 31
"""Largest directory index read (2 GiB: ~17 million pieces at ~125 bytes each). A larger index
file is refused from its size before any byte is read (a hostile index cannot make a reader
allocate without bound), and a save never writes one (:func:`commit_index`)."""

_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_DATA_FILE = re.compile(r"(?P<stem>[A-Za-z0-9][A-Za-z0-9_-]*)\.(?P<id>[0-9a-f]{16})\.h5")
RANK_INDEX = re.compile(r"tensorstore_h5\.rank(?P<rank>[0-9]+)\.json")
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


def sanitize_stem(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", name) or "shard"
    return stem if stem[0].isalnum() else "s" + stem


def file_info(path: str) -> dict[str, Any]:
    """``{"bytes": length, "layout_xxh3": hex}`` of a format-2 file, from its header."""
    raw = files.RawFile(path)
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
class ShardedTensorEntry(fmt.TensorSizes):
    """A tensor of a directory: its global dtype and shape, and its pieces."""

    path: str
    key: Any
    dtype: DtypeSpec
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    parameter: bool = False
    requires_grad: bool = False


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
        self._index, self._types = fmt.key_structure(self._paths, self._kinds, path)
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
        key = fmt.parse_key(item, path, self._types)
        if kind in tree.CONTAINER_TYPES:
            _fields(item, _CONTAINER_FIELDS)
            meta = None
            if "_metadata" in item:
                if kind != "OrderedDict":
                    raise ValueError("only an OrderedDict has _metadata")
                meta = fmt.parse_module_metadata(item["_metadata"])
            return Container(path, key, kind, meta)
        if kind == "value":
            _fields(item, _VALUE_FIELDS)
            if "value" not in item:
                raise ValueError("a value entry needs 'value'")
            return ValueEntry(path, key, tree.decode_value(item["value"]))
        if kind == "ndarray":
            _fields(item, _ARRAY_FIELDS)
            dt = fmt.parse_numpy_dtype(item.get("dtype"))
            shape = fmt.parse_ints(item.get("shape"), "shape", minimum=0)
            pieces = self._pieces(item, path, shape)
            return ShardedArrayEntry(path, key, dt, shape, pieces)
        if kind != "tensor":
            raise ValueError(f"unknown entry type {kind!r}")
        _fields(item, _TENSOR_FIELDS)
        spec = spec_for_name(item.get("dtype"))  # type: ignore[arg-type]
        if spec is None:
            raise ValueError(f"unknown torch dtype {item.get('dtype')!r}")
        shape = fmt.parse_ints(item.get("shape"), "shape", minimum=0)
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


def parse_index(data: bytes, path: str) -> DirectoryIndex:
    """Parse the text of an index file (``path`` names it in errors). Raises FormatError."""
    try:
        with memory.gc_paused():
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
    """Read and parse ``directory/name``, a regular file (or a symlink to one) of at most
    :data:`MAX_INDEX_BYTES` (:func:`files.read_small`). Raises FormatError (damaged, too large,
    or not a regular file: ``NotRegularFileError``), ``MissingFileError`` (a
    FileNotFoundError) or another ``PathError``, each naming the index."""
    path = os.path.join(directory, name)
    return parse_index(files.read_small(path, MAX_INDEX_BYTES, "directory index"), path)


# ---------------------------------------------------------------------------- committing a directory


def commit_index(directory: PathLike, obj: Mapping[str, Any], *, rank: int | None = None, sync: bool = False) -> list[str]:
    """Put ``obj`` in place as the index of ``directory``, then remove what it supersedes.

    The index is written under a temporary name (locked while it is written), ``fsync``-ed
    with ``sync``, and renamed over ``tensorstore_h5.json`` (or, with ``rank``, over that rank's
    own index). Only then are removed: data files (``<name>.<save id>.h5``) that the new index
    does not name (with ``rank``: only that rank's own ``rank<r>`` files), rank-local indexes
    (a global index supersedes them) or the global index (a rank-local save supersedes it), and
    temporaries that no live process holds. Other files are never touched.

    Returns the names removed. Raises WriteError, before anything is written, for an index
    larger than :data:`MAX_INDEX_BYTES` (readers would refuse it).
    """
    directory = os.fspath(directory)
    name = INDEX_NAME if rank is None else rank_index_name(rank)
    text = index_text(obj)
    if len(text) > MAX_INDEX_BYTES:
        raise WriteError(f"{os.path.join(directory, name)}: the index would be {human_bytes(len(text))}, more than the "
                         f"{human_bytes(MAX_INDEX_BYTES)} readers accept; nothing was committed")
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
    from ..writing.writer import sweep_partials

    removed = []
    own = None if rank is None else rank_stem(rank)
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        m = _DATA_FILE.fullmatch(name)
        stale = False
        if m is not None and name not in keep:
            stem = m.group("stem")
            stale = own is None or stem == own or stem.startswith(own + "_")
        elif rank is None and RANK_INDEX.fullmatch(name):
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
    """True for a temporary that no live process holds (its writer died); False for one that is
    not a regular file (not ours: a FIFO there never blocks the sweep)."""
    try:
        fd = files.open_regular(path, "temporary index")
    except TensorStoreError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
