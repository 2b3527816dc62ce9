"""Hugging Face sharded safetensors checkpoints (``model.safetensors.index.json`` + shards, or
a lone ``model.safetensors``) as a directory index whose pieces are the shards' tensors."""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

from ..errors import FormatError
from ..format import tree
from ..format import layout as fmt
from ..format.constants import KEY_PATHS, KEYS_MARKER
from ..format.dtypes import DtypeSpec, spec_for_name
from ..storage import files
from .index import DirectoryIndex, Piece, ShardedTensorEntry
from .reads import Loc

__all__ = ["safetensors_index"]

# ---------------------------------------------------------------------------- Hugging Face safetensors directories


_ST_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}
_ST_MAX_HEADER = 100 * 2**20


class _SafetensorsFile(NamedTuple):
    raw: files.RawFile
    data_start: int
    tensors: dict[str, tuple[DtypeSpec, tuple[int, ...], int]]  # name -> (dtype, shape, offset from data_start)
    metadata: dict[str, Any]


def _read_safetensors_header(path: str) -> _SafetensorsFile:
    """Parse and check a safetensors header: every tensor's byte range inside the file and of its
    dtype's and shape's size. Raises FormatError naming the file (and the key)."""
    try:
        raw = files.RawFile(path, what="safetensors shard")  # a regular file (or a symlink to one) only
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
                shape = fmt.parse_ints(info["shape"], "shape", 0)
                begin, end = fmt.parse_ints(info["data_offsets"], "data_offsets", 0)
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

    def locate(self, piece: Piece, entry: ShardedTensorEntry) -> Loc:
        f = self.files[piece.file]
        _spec, _shape, begin = f.tensors[piece.key]
        return Loc(os.path.join(self.directory, piece.file), piece.key, raw=f.raw, offset=f.data_start + begin)

    def close(self) -> None:
        for f in self.files.values():
            f.raw.close()


def _key_path(key: str, file: str) -> str:
    """``key``, a tensor name that is a tensorstore_h5 key path (the file says so), checked."""
    try:
        for name in tree.split(key):
            tree.unescape(name)
    except ValueError as e:
        raise FormatError(f"{file}: key {key!r} is not a tensorstore_h5 key path, as the file's __metadata__ "
                          f"({KEYS_MARKER!r}) says it is ({e})") from None
    if not key:
        raise FormatError(f"{file}: an empty tensor name")
    return key


def safetensors_index(directory: str, index_file: str | None) -> tuple[DirectoryIndex, _SafetensorsFiles]:
    """The view of a Hugging Face checkpoint: ``*.safetensors.index.json`` + shards, or a lone
    ``model.safetensors``. Keys are the escaped tensor names (as ``convert`` writes them).

    The index and every shard must be regular files (symlinks to them, as in the Hugging Face
    cache, are followed); the index at most :data:`files.MAX_JSON_BYTES`. Raises FormatError
    or ``PathError``, naming the file."""
    if index_file is not None:
        ipath = os.path.join(directory, index_file)
        data = files.read_small(ipath, files.MAX_JSON_BYTES, "safetensors index")
        try:
            obj = json.loads(data)
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
        # Written by convert from a tensorstore_h5 file: the names are key paths, nesting kept.
        nested = all(f.metadata.get(KEYS_MARKER) == KEY_PATHS for f in opened.values())
        if meta is not None and KEYS_MARKER in meta:
            meta = {k: v for k, v in meta.items() if k != KEYS_MARKER}
        paths, types, entries = [""], ["dict"], [{}]
        seen: set[str] = {""}
        for key, name in wmap.items():
            info = opened[name].tensors.get(key)
            if info is None:
                raise FormatError(f"{os.path.join(directory, name)}: key {key!r}: not in the file, which the index "
                                  f"{ipath} names for it")
            spec, shape, _ = info
            path = _key_path(key, os.path.join(directory, name)) if nested else tree.escape(key)
            if nested:
                parts = path.split("/")
                for i in range(1, len(parts)):  # each parent once, before its first child
                    parent = "/".join(parts[:i])
                    if parent not in seen:
                        seen.add(parent)
                        paths.append(parent)
                        types.append("dict")
                        entries.append({})
                if path in seen:
                    raise FormatError(f"{os.path.join(directory, name)}: key {key!r} is a tensor and also holds "
                                      "other keys, or is named twice; the file's key paths make no tree")
                seen.add(path)
            paths.append(path)
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
