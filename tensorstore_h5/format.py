"""The on-disk layout, format version 1: names, attributes, and their parsing.

This is the only module that reads or writes HDF5 attributes. Everything read from a file
passes through the ``parse_*`` functions below into frozen dataclasses; anything that does
not parse raises :class:`FormatError` naming the file and the entry. docs/FORMAT.md is the
human-readable copy of this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import h5py
import numpy as np

from . import tree
from .dtypes import DtypeSpec, spec_for_name, spec_for_numpy
from .errors import FormatError
from .tree import Container

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "ROOT_DATASET", "PACK_GROUP", "ATTR_FORMAT", "ATTR_VERSION", "ATTR_LAYOUT",
    "ATTR_METADATA", "ATTR_TORCH_DTYPE", "ATTR_STRIDE", "Container", "TensorEntry", "ArrayEntry",
    "ValueEntry", "ForeignEntry", "Entry", "Layout", "read_layout", "parse_layout", "layout_json",
    "write_layout", "check_metadata", "write_tensor_attrs", "write_pack_attrs", "contiguous_stride",
]

FORMAT_NAME = "tensorstore_h5"
FORMAT_VERSION = 1
ROOT_DATASET = "data"
"""Dataset name used when the saved object itself is a tensor or array (no root dict)."""

PACK_GROUP = "%packed"
"""Group of the pack datasets (one 1-D dataset per dtype) that hold small tensors back to back.
``escape`` never produces this name, so it cannot collide with a key."""

ATTR_FORMAT = "tensorstore_h5.format"
ATTR_VERSION = "tensorstore_h5.version"
ATTR_LAYOUT = "tensorstore_h5.layout"
ATTR_METADATA = "tensorstore_h5.metadata"
ATTR_TORCH_DTYPE = "torch_dtype"
ATTR_STRIDE = "stride"


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major (C) stride of ``shape``, in elements."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorEntry:
    """A tensor leaf stored as the dataset ``dataset``.

    ``stride`` is None for row-major tensors. ``same_as`` names the key path of an earlier
    tensor that is the same view of the same storage (both paths link one dataset).
    ``requires_grad`` is None for plain tensors and a bool for ``nn.Parameter``.
    ``foreign`` marks datasets of files not written by tensorstore_h5 (values are
    converted by HDF5 into ``dtype``'s type instead of being copied as raw bytes).
    ``packed`` is the element offset of a small tensor inside the pack dataset ``dataset``
    (None for a tensor with a dataset of its own).
    """

    path: str
    key: Any
    dtype: DtypeSpec
    shape: tuple[int, ...]
    dataset: str
    stride: tuple[int, ...] | None = None
    same_as: str | None = None
    requires_grad: bool | None = None
    foreign: bool = False
    packed: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ArrayEntry:
    """A numpy array leaf stored as the dataset ``dataset`` with numpy dtype ``dtype``."""

    path: str
    key: Any
    dtype: np.dtype
    shape: tuple[int, ...]
    dataset: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ValueEntry:
    """A non-tensor leaf kept in the layout itself (decoded value)."""

    path: str
    key: Any
    value: Any


@dataclass(frozen=True)
class ForeignEntry:
    """A dataset of a foreign HDF5 file whose type has no torch equivalent."""

    path: str
    key: Any
    dataset: str
    reason: str


Entry = Union[Container, TensorEntry, ArrayEntry, ValueEntry, ForeignEntry]
Leaf = Union[TensorEntry, ArrayEntry, ValueEntry, ForeignEntry]


class Layout:
    """Everything known about a file from one read of its root attributes.

    Opening checks the structure of every entry (paths unique, parents first) in one fast
    pass; each entry is fully parsed and checked the first time it is used, so listing the
    keys of a 10,000-key file costs little. ``version`` is None for a foreign HDF5 file.
    """

    def __init__(self, file: str, version: int | None, metadata: Mapping[str, Any],
                 items: list[dict[str, Any]] | None = None, entries: Iterable[Entry] | None = None) -> None:
        self.file = file
        self.version = version
        self.metadata = metadata
        if entries is not None:
            parsed = list(entries)
            self._items: list[Any] = [None] * len(parsed)
            self._parsed: list[Entry | None] = list(parsed)
            self._index = {e.path: i for i, e in enumerate(parsed)}
            self._types = {e.path: e.type for e in parsed if isinstance(e, Container)}
        else:
            assert items is not None
            self._items = items
            self._parsed = [None] * len(items)
            self._index, self._types = _structure(items, file)
        self.leaf_paths = [p for p in self._index if p not in self._types]
        self.container_paths = [p for p in self._types if p]

    def entry(self, path: str) -> Entry | None:
        """The entry at ``path`` (parsed and checked now if it was not yet), or None."""
        i = self._index.get(path)
        return None if i is None else self._parse(i)

    def _parse(self, i: int) -> Entry:
        entry = self._parsed[i]
        if entry is None:
            item = self._items[i]
            try:
                entry = _parse_entry(item, self._types, _Earlier(self, i))
            except (ValueError, TypeError, KeyError) as e:
                raise FormatError(f"{self.file}: damaged layout entry {i} (key {item.get('path')!r}): {e}") from e
            self._parsed[i] = entry
        return entry

    @property
    def entries(self) -> list[Entry]:
        """Every entry in saved (pre-order) order, root first."""
        return [self._parse(i) for i in range(len(self._parsed))]

    @property
    def leaves(self) -> list[Leaf]:
        return [e for e in self.entries if not isinstance(e, Container)]


class _Earlier:
    """``get(path)``: the tensor entry at ``path`` if it comes before entry ``limit``."""

    def __init__(self, layout: Layout, limit: int) -> None:
        self._layout, self._limit = layout, limit

    def get(self, path: Any) -> TensorEntry | None:
        i = self._layout._index.get(path) if isinstance(path, str) else None
        if i is None or i >= self._limit:
            return None
        entry = self._layout._parse(i)
        return entry if isinstance(entry, TensorEntry) else None


def _structure(items: list[Any], file: str) -> tuple[dict[str, int], dict[str, str]]:
    """One pass over the raw entries: objects with a str path and a known type, unique
    paths, the root first, every parent an earlier container. Returns (path -> index,
    container path -> type)."""
    index: dict[str, int] = {}
    types: dict[str, str] = {}
    containers = tree.CONTAINER_TYPES
    known = frozenset(containers) | frozenset(_ENTRY_FIELDS)
    for i, item in enumerate(items):
        if type(item) is dict:
            path, kind = item.get("path"), item.get("type")
            # the common case, in one test: a new path under an earlier container, a known type
            if type(path) is str and kind in known and path not in index and path.rpartition("/")[0] in types:
                index[path] = i
                if kind in containers:
                    types[path] = kind
                continue
        else:
            path = kind = None
        why = None
        if type(path) is not str:
            why = "path is not a string"
        elif (i == 0) != (path == ""):
            why = "the root entry must come first, once"
        elif path in index:
            why = "duplicate path"
        elif path and path.rpartition("/")[0] not in types:
            why = f"parent {path.rpartition('/')[0]!r} is not an earlier container"
        elif kind not in containers and kind not in _ENTRY_FIELDS:
            why = f"unknown entry type {kind!r}"
        if why is not None:
            raise FormatError(f"{file}: damaged layout entry {i} (key {path!r}): {why}")
        index[path] = i
        if kind in containers:
            types[path] = kind
    return index, types


# ---------------------------------------------------------------------------- writing


def _key_json(entry: Any, parent_type: str | None) -> dict[str, Any]:
    if parent_type in ("dict", "OrderedDict") and type(entry.key) is not str:
        return {"key": tree.encode_value(entry.key, entry.path)}
    return {}


def entry_json(entry: Entry, parent_type: str | None) -> dict[str, Any]:
    """The JSON object of one layout entry (see FORMAT.md, "Layout")."""
    out: dict[str, Any] = {"path": entry.path}
    out.update(_key_json(entry, parent_type))
    if isinstance(entry, Container):
        out["type"] = entry.type
    elif isinstance(entry, TensorEntry):
        out.update(type="tensor", dtype=entry.dtype.name, shape=list(entry.shape))
        if entry.stride is not None:
            out["stride"] = list(entry.stride)
        if entry.same_as is not None:
            out["same_as"] = entry.same_as
        if entry.requires_grad is not None:
            out["parameter"] = {"requires_grad": entry.requires_grad}
        if entry.dataset != entry.path:
            out["dataset"] = entry.dataset
        if entry.packed is not None:
            out["offset"] = entry.packed
    elif isinstance(entry, ArrayEntry):
        out.update(type="ndarray", dtype=entry.dtype.str, shape=list(entry.shape))
        if entry.dataset != entry.path:
            out["dataset"] = entry.dataset
    elif isinstance(entry, ValueEntry):
        out.update(type="value", value=tree.encode_value(entry.value, entry.path))
    else:
        raise TypeError(f"cannot write {entry!r}")
    return out


def layout_json(entries: Iterable[Entry]) -> str:
    """The JSON text of the layout attribute for ``entries`` (pre-order, root first)."""
    types: dict[str, str] = {}
    items = []
    for e in entries:
        parent = e.path.rpartition("/")[0] if e.path else None
        items.append(entry_json(e, types.get(parent) if parent is not None else None))
        if isinstance(e, Container):
            types[e.path] = e.type
    return json.dumps({"entries": items}, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def check_metadata(metadata: Mapping[str, Any]) -> str:
    """The JSON text of user metadata. Raises TypeError unless it is a str-keyed JSON object."""
    if not all(type(k) is str for k in metadata):
        raise TypeError("metadata keys must be str")
    try:
        return json.dumps(dict(metadata), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (str keys; no NaN): {e}") from e


def write_layout(f: h5py.File, entries: Iterable[Entry], metadata: Mapping[str, Any]) -> None:
    """Write the root attributes; the layout goes last, so its presence marks a complete file."""
    meta_text = check_metadata(metadata)
    text = layout_json(entries)
    f.attrs[ATTR_FORMAT] = FORMAT_NAME
    f.attrs[ATTR_VERSION] = np.int64(FORMAT_VERSION)
    f.attrs[ATTR_METADATA] = meta_text
    f.attrs[ATTR_LAYOUT] = text


def _str_attr(dsid: h5py.h5d.DatasetID, name: bytes, value: str) -> None:
    """A scalar variable-length UTF-8 string attribute, as ``ds.attrs[name] = value`` writes it,
    through the low-level API (measured alone: 18 us against 46; it counts once per dataset)."""
    attr = h5py.h5a.create(dsid, name, _VLEN_STR, h5py.h5s.create(h5py.h5s.SCALAR))
    attr.write(np.array(value, dtype=h5py.string_dtype()))


_VLEN_STR = h5py.h5t.py_create(h5py.string_dtype(), logical=True)


def write_pack_attrs(dsid: h5py.h5d.DatasetID, spec: DtypeSpec) -> None:
    """Attributes of a pack dataset: the torch dtype of its elements."""
    _str_attr(dsid, ATTR_TORCH_DTYPE.encode(), spec.name)


def write_tensor_attrs(dsid: h5py.h5d.DatasetID, entry: TensorEntry) -> None:
    """The per-dataset attributes that let plain HDF5 readers interpret the data."""
    _str_attr(dsid, ATTR_TORCH_DTYPE.encode(), entry.dtype.name)
    if entry.stride is not None:
        h5py.Dataset(dsid).attrs[ATTR_STRIDE] = np.asarray(entry.stride, dtype=np.int64)


# ---------------------------------------------------------------------------- reading


def read_layout(f: h5py.File, file: str) -> Layout:
    """The layout of an open file: ours (checked, version-gated) or a foreign HDF5 file.

    Raises FormatError for a file of a newer format version, an incomplete file, or
    damaged layout attributes.
    """
    try:
        attrs = f.attrs
        fmt = attrs.get(ATTR_FORMAT)
    except (OSError, KeyError, RuntimeError) as e:
        raise FormatError(f"{file}: cannot read the root attributes: {e}") from e
    if fmt is None:
        return foreign_layout(f, file)
    if _as_str(fmt) != FORMAT_NAME:
        raise FormatError(f"{file}: root attribute {ATTR_FORMAT!r} is {fmt!r}, expected {FORMAT_NAME!r}")
    version = attrs.get(ATTR_VERSION)
    if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)):
        raise FormatError(f"{file}: damaged root attribute {ATTR_VERSION!r}: {version!r}")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{file}: written in tensorstore_h5 format version {int(version)}, newer than this "
            f"library reads ({FORMAT_VERSION}); upgrade tensorstore_h5"
        )
    if version < 1:
        raise FormatError(f"{file}: invalid format version {int(version)}")
    layout = attrs.get(ATTR_LAYOUT)
    if layout is None:
        raise FormatError(f"{file}: incomplete file: the layout attribute {ATTR_LAYOUT!r} is missing (interrupted save?)")
    meta = attrs.get(ATTR_METADATA, "{}")
    return parse_layout(_as_str(layout), file, int(version), _as_str(meta))


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else repr(value)


def parse_layout(text: str, file: str, version: int = FORMAT_VERSION, metadata: str = "{}") -> Layout:
    """Parse and check the layout JSON of ``file``. Raises FormatError on anything unexpected."""
    try:
        data = json.loads(text)
        meta = json.loads(metadata)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{file}: damaged layout attribute (not valid JSON): {e}") from e
    if not isinstance(meta, dict):
        raise FormatError(f"{file}: damaged metadata attribute: not a JSON object")
    items = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise FormatError(f"{file}: damaged layout attribute: no entries")
    return Layout(file, version, meta, items=items)


_CONTAINER_FIELDS = frozenset({"path", "key", "type"})
_ENTRY_FIELDS = {
    "tensor": {"path", "key", "type", "dtype", "shape", "stride", "same_as", "parameter", "dataset", "offset"},
    "ndarray": {"path", "key", "type", "dtype", "shape", "dataset"},
    "value": {"path", "key", "type", "value"},
}


def _parse_entry(item: dict[str, Any], types: Mapping[str, str], tensors: _Earlier) -> Entry:
    """One entry, whose structure :func:`_structure` has already checked."""
    path, kind = item["path"], item["type"]
    key = _parse_key(item, path, types)
    if kind in tree.CONTAINER_TYPES:
        if not item.keys() <= _CONTAINER_FIELDS:
            raise ValueError(f"unexpected fields {sorted(set(item) - _CONTAINER_FIELDS)}")
        return Container(path, key, kind)
    fields = _ENTRY_FIELDS.get(kind)
    if fields is None:
        raise ValueError(f"unknown entry type {kind!r}")
    if not item.keys() <= fields:
        raise ValueError(f"unexpected fields {sorted(set(item) - fields)}")
    if kind == "value":
        return ValueEntry(path, key, tree.decode_value(item["value"]))
    dataset = item.get("dataset", path or ROOT_DATASET)
    packed = item.get("offset")
    if packed is not None:
        if kind != "tensor" or type(packed) is not int or packed < 0 or dataset != f"{PACK_GROUP}/{item.get('dtype')}":
            raise ValueError(f"invalid packed tensor (dataset {dataset!r}, offset {packed!r})")
    elif not isinstance(dataset, str) or dataset != (path or ROOT_DATASET):
        raise ValueError(f"invalid dataset {dataset!r}")
    shape = _parse_ints(item.get("shape"), "shape", minimum=0)
    if kind == "ndarray":
        dt = np.dtype(str(item.get("dtype")))
        if dt.kind not in "biufc":
            raise ValueError(f"unsupported numpy dtype {dt}")
        return ArrayEntry(path, key, dt, shape, dataset)
    spec = spec_for_name(item.get("dtype"))  # type: ignore[arg-type]
    if spec is None:
        raise ValueError(f"unknown torch dtype {item.get('dtype')!r}")
    stride = None
    if "stride" in item:
        stride = _parse_ints(item["stride"], "stride", minimum=0)
        if len(stride) != len(shape):
            raise ValueError("stride and shape differ in length")
    same_as = item.get("same_as")
    if same_as is not None:
        orig = tensors.get(same_as)
        if orig is None or orig.same_as is not None or (orig.dtype, orig.shape, orig.stride, orig.dataset) != \
                (spec, shape, stride, dataset if packed is not None else orig.dataset) or orig.packed != packed:
            raise ValueError(f"same_as {same_as!r} does not name an earlier tensor of the same dtype, shape and stride")
    requires_grad = None
    if "parameter" in item:
        param = item["parameter"]
        if not isinstance(param, dict) or type(param.get("requires_grad")) is not bool:
            raise ValueError("invalid parameter field")
        requires_grad = param["requires_grad"]
    return TensorEntry(path, key, spec, shape, dataset, stride, same_as, requires_grad, packed=packed)


def _parse_key(item: dict[str, Any], path: str, types: Mapping[str, str]) -> Any:
    if path == "":
        if "key" in item:
            raise ValueError("the root has no key")
        return None
    parent, _, name = path.rpartition("/")
    ptype = types.get(parent)
    if ptype is None:
        raise ValueError(f"parent {parent!r} is not an earlier container")
    if ptype in ("list", "tuple"):
        if "key" in item or not name.isdigit():
            raise ValueError("list items are named by their index")
        return None
    if "key" in item:
        key = tree.decode_value(item["key"])
        if type(key) is str or tree.name_for_key(key, path) != name:
            raise ValueError(f"key {key!r} does not match name {name!r}")
        return key
    return tree.unescape(name)


def _parse_ints(value: Any, what: str, minimum: int) -> tuple[int, ...]:
    if type(value) is not list:
        raise ValueError(f"invalid {what} {value!r}")
    for n in value:
        if type(n) is not int or n < minimum:
            raise ValueError(f"invalid {what} {value!r}")
    return tuple(value)


# ---------------------------------------------------------------------------- foreign files


def foreign_layout(f: h5py.File, file: str) -> Layout:
    """The layout of an HDF5 file not written by tensorstore_h5: groups become dicts keyed by
    their link names, datasets become tensors where torch has their dtype (others become
    ForeignEntry leaves that raise FormatError when read). Attributes are ignored."""
    entries: list[Entry] = [Container("", None, "dict")]

    def visit(name: str, obj: Any) -> None:
        key = name.rpartition("/")[2]
        if isinstance(obj, h5py.Group):
            entries.append(Container(name, key, "dict"))
        elif isinstance(obj, h5py.Dataset):
            entries.append(_foreign_dataset(name, key, obj))

    try:
        f.visititems(visit)
    except (OSError, RuntimeError, KeyError) as e:
        raise FormatError(f"{file}: cannot read the HDF5 structure: {e}") from e
    return Layout(file, None, {}, entries=entries)


def _foreign_dataset(name: str, key: str, ds: h5py.Dataset) -> Entry:
    try:
        dtype, shape = ds.dtype, ds.shape
    except (OSError, TypeError, ValueError) as e:
        return ForeignEntry(name, key, name, f"unreadable dataset: {e}")
    if shape is None:
        return ForeignEntry(name, key, name, "empty (null dataspace) dataset")
    spec = spec_for_numpy(dtype)
    if spec is None:
        return ForeignEntry(name, key, name, f"HDF5 type {dtype} has no torch dtype")
    return TensorEntry(name, key, spec, tuple(int(n) for n in shape), name, foreign=True)
