"""Nested values <-> key paths, and the JSON encoding of non-tensor leaves. No pickle, no h5py.

A *key path* joins the escaped keys of each nesting level with ``/``; it is the HDF5 path
of the leaf. ``escape`` maps any ``str`` key to a valid HDF5 link name and ``unescape``
inverts it exactly (see docs/FORMAT.md, "Keys").
"""

from __future__ import annotations

import base64
import functools
import math
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedTypeError
from .record import record

if TYPE_CHECKING:
    import numpy as np  # (a value of numpy's means numpy is imported: the command line lists a file without it)

__all__ = [
    "escape", "unescape", "join", "split", "name_for_key", "MAX_NAME_BYTES", "encode_value", "decode_value",
    "Leaf", "Container", "flatten", "inflate", "CONTAINER_TYPES",
]

MAX_NAME_BYTES = 65_522
"""The longest link name (UTF-8 bytes of one escaped key) written: the most that fits one HDF5
link message (2-byte message size, 13 bytes of it not the name). libhdf5 keeps longer names
only as "huge" objects of a group's fractal heap, which this library does not write."""

EMPTY_NAME = "%"
"""Link name of the empty-string key (a lone ``%`` is never produced otherwise)."""

_NEEDS_ESCAPE = "[%/\x00\ud800-\udfff]"  # patterns compiled on first use (re caches them): ~1 ms at import
_PERCENT = r"%([0-9A-F]{2})"


def _plain(name: str) -> bool:
    """True when ``name`` has nothing to escape, decided without a regex for ASCII names."""
    if name.isascii():
        return "%" not in name and "/" not in name and "\x00" not in name
    return re.search(_NEEDS_ESCAPE, name) is None


def escape(key: str) -> str:
    """The HDF5 link name of a ``str`` key.

    ``%``, ``/``, NUL and lone surrogates become ``%XX`` escapes of their UTF-8
    (surrogatepass) bytes; the names ``.`` and ``..`` become ``%2E`` runs; the empty
    string becomes ``%``. Everything else, unicode included, is kept as it is.
    """
    if key == "":
        return EMPTY_NAME
    if key in (".", ".."):
        return "%2E" * len(key)
    if _plain(key):
        return key
    return re.sub(_NEEDS_ESCAPE, lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8", "surrogatepass")), key)


def unescape(name: str) -> str:
    """Invert :func:`escape`. Raises ValueError for a name that ``escape`` cannot produce."""
    if name == EMPTY_NAME:
        return ""
    if name.isascii() and _plain(name) and name not in ("", ".", ".."):
        return name
    parts: list[bytes] = []
    pos = 0
    for m in re.finditer(_PERCENT, name):
        parts.append(name[pos:m.start()].encode("utf-8", "surrogatepass"))
        parts.append(bytes([int(m.group(1), 16)]))
        pos = m.end()
    parts.append(name[pos:].encode("utf-8", "surrogatepass"))
    try:
        key = b"".join(parts).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise ValueError(f"invalid escape in link name {name!r}") from None
    if escape(key) != name:
        raise ValueError(f"link name {name!r} is not in the escaped form that tensorstore_h5 writes")
    return key


def join(parent: str, name: str) -> str:
    """The key path of child ``name`` under key path ``parent`` (the root is ``""``)."""
    return f"{parent}/{name}" if parent else name


def split(path: str) -> list[str]:
    """The link names of a key path (``[]`` for the root)."""
    return path.split("/") if path else []


def name_for_key(key: Any, path: str) -> str:
    """The link name of a dict key: escaped ``str`` keys; ``str()`` of int, float, bool, None.

    Raises UnsupportedTypeError naming ``path`` for other key types and for names longer than
    :data:`MAX_NAME_BYTES`."""
    if type(key) is str:
        name = escape(key)
        if len(name) > MAX_NAME_BYTES // 4 and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise UnsupportedTypeError(
                f"dict key {key[:40]!r}... under key path {path!r} is {len(key):,} characters long "
                f"({len(name.encode('utf-8', 'surrogatepass')):,} bytes as an HDF5 link name); HDF5 link names written "
                f"here hold at most {MAX_NAME_BYTES:,} bytes: shorten the key"
            )
        return name
    if type(key) is int:
        return str(key)  # digits and "-": nothing to escape
    if key is None or type(key) in (float, bool):
        return escape(str(key))
    raise UnsupportedTypeError(
        f"dict key {key!r} of type {type(key).__name__} under key path {path!r} cannot be stored; "
        "use str, int, float, bool or None keys"
    )


_NP_KINDS = frozenset("biufc")


def encode_value(value: Any, path: str) -> Any:
    """The JSON form of a non-container, non-tensor leaf (see FORMAT.md, "Values").

    Raises UnsupportedTypeError naming ``path`` for anything that cannot be stored exactly.
    """
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if t is complex:
        return {"complex": [encode_value(value.real, path), encode_value(value.imag, path)]}
    if t is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if t.__module__ == "torch":  # (a value of torch's means torch is imported: no import here)
        import torch

        if t is torch.dtype:
            return {"torch.dtype": str(value).removeprefix("torch.")}
        if t is torch.Size:
            return {"torch.Size": list(value)}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic) and t is type(value) and value.dtype.kind in _NP_KINDS \
            and value.dtype.itemsize <= 16 and value.dtype != np.longdouble and value.dtype != np.clongdouble:
        return {"numpy": value.dtype.str, "value": encode_value(value.item(), path)}
    hint = ""
    if callable(getattr(value, "state_dict", None)):
        hint = ("; it is an object with a state_dict() (a model, optimizer, scheduler): did you mean "
                "th5.save(model.state_dict(), path) (or {'model': model.state_dict(), 'optim': opt.state_dict()})?")
    raise UnsupportedTypeError(
        f"value of type {t.__module__}.{t.__qualname__} at key path {path!r} cannot be stored without pickle; "
        "store tensors, numpy arrays, dict/list/tuple containers, or None/bool/int/float/complex/str/bytes" + hint
    )


def decode_value(data: Any) -> Any:
    """Invert :func:`encode_value`. Raises ValueError for JSON it cannot produce."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is dict and len(data) in (1, 2):
        if len(data) == 1:
            (tag, arg), = data.items()
            if tag == "float" and arg in ("nan", "inf", "-inf"):
                return float(arg)
            if tag == "complex" and type(arg) is list and len(arg) == 2:
                re_, im = (decode_value(a) for a in arg)
                if type(re_) is float and type(im) is float:
                    return complex(re_, im)
            if tag == "bytes" and type(arg) is str:
                return base64.b64decode(arg, validate=True)
            if tag == "torch.dtype" and type(arg) is str and arg in _torch_dtypes():
                return _torch_dtypes()[arg]
            if tag == "torch.Size" and type(arg) is list and all(type(n) is int for n in arg):
                import torch

                return torch.Size(arg)
        elif set(data) == {"numpy", "value"} and type(data["numpy"]) is str:
            dt = numpy_dtype(data["numpy"])
            if dt is not None:
                value = decode_value(data["value"])
                try:
                    return dt.type(value)
                except (TypeError, ValueError, OverflowError) as e:
                    raise ValueError(f"{value!r} does not fit {dt.name} ({e})") from e
    raise ValueError(f"unrecognised value encoding {data!r}")


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    """torch's dtypes by attribute name: a stored name is looked up here, never with getattr on
    the torch module (whose lazy attributes import submodules). Imports torch (a layout of
    plain values is listed without it)."""
    import torch

    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}

_NUMPY_NAME = r"[<>|=]?[biufc](1|2|4|8|16)"


def numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype that ``name`` spells as ``dtype.str`` does (``"<f4"``, ``"|b1"``): bool,
    integer, float or complex of any byte order; None for anything else. Untrusted names never
    reach numpy's full dtype parser, which evaluates parts of a string (``"f4,,2"`` raised
    SyntaxError from ``ast.literal_eval``)."""
    if not re.fullmatch(_NUMPY_NAME, name):
        return None
    import numpy as np

    try:
        dt = np.dtype(name)
    except TypeError:  # "b16" and the like: the letters and sizes that make no type
        return None
    return dt if dt.kind in _NP_KINDS else None


CONTAINER_TYPES: dict[str, type] = {"dict": dict, "OrderedDict": OrderedDict, "list": list, "tuple": tuple}
_TYPE_NAMES = {v: k for k, v in CONTAINER_TYPES.items()}


@record
class Container:
    """A dict, OrderedDict, list or tuple at ``path``; ``key`` is its key in the parent dict
    (None for list/tuple items and the root). ``module_metadata`` is the ``_metadata``
    attribute of an OrderedDict made by ``Module.state_dict()`` (module prefix -> plain
    values, e.g. ``{"": {"version": 2}}``), or None."""

    path: str
    key: Any
    type: str
    module_metadata: dict[str, dict[str, Any]] | None = None

    def __init__(self, path: str, key: Any, type: str,
                 module_metadata: dict[str, dict[str, Any]] | None = None) -> None:
        # One update, not a setattr a field: flattening a state of thousands of small objects
        # makes one per container and leaf.
        self.__dict__.update(path=path, key=key, type=type, module_metadata=module_metadata)


@record
class Leaf:
    """A tensor, numpy array or plain value at ``path``; ``key`` as for :class:`Container`."""

    path: str
    key: Any
    value: Any

    def __init__(self, path: str, key: Any, value: Any) -> None:
        self.__dict__.update(path=path, key=key, value=value)  # see Container.__init__


def flatten(obj: Any, root: str = "", key: Any = None) -> list[Container | Leaf]:
    """The containers and leaves of ``obj`` in pre-order, the order that ``inflate`` restores.

    Validates everything: raises UnsupportedTypeError naming the key path of the first
    value that cannot be stored, before anything is returned.
    """
    out: list[Container | Leaf] = []
    _flatten(obj, root, key, out, set())
    return out


def _flatten(obj: Any, path: str, key: Any, out: list[Container | Leaf], active: set[int]) -> None:
    t = type(obj)
    if t in _TYPE_NAMES:
        if id(obj) in active:
            raise UnsupportedTypeError(f"the value at key path {path!r} contains itself; cycles cannot be stored")
        active.add(id(obj))
        out.append(Container(path, key, _TYPE_NAMES[t], _module_metadata(obj, path)))
        if isinstance(obj, dict):
            seen: dict[str, Any] = {}
            for k, v in obj.items():
                name = name_for_key(k, path)
                if name in seen:
                    raise UnsupportedTypeError(
                        f"dict keys {seen[name]!r} and {k!r} under key path {path!r} both map to the name {name!r}"
                    )
                seen[name] = k
                _flatten(v, join(path, name), k, out, active)
        else:
            for i, v in enumerate(obj):
                _flatten(v, join(path, str(i)), None, out, active)
        active.discard(id(obj))
    elif _is_tensor(obj):
        out.append(Leaf(path, key, obj))
    elif t is getattr(sys.modules.get("numpy"), "ndarray", None):  # (no numpy imported: no array here)
        out.append(Leaf(path, key, obj))
    else:
        encode_value(obj, path)  # validates
        out.append(Leaf(path, key, obj))


def _is_tensor(obj: Any) -> bool:
    """isinstance(obj, torch.Tensor), without importing torch where no tensor can be."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _module_metadata(obj: Any, path: str) -> dict[str, dict[str, Any]] | None:
    """A plain copy of an OrderedDict's ``_metadata`` (checked to hold only plain values)."""
    meta = getattr(obj, "_metadata", None) if type(obj) is OrderedDict else None
    if meta is None:
        return None
    if not isinstance(meta, Mapping) or not all(type(k) is str and isinstance(v, Mapping) for k, v in meta.items()):
        raise UnsupportedTypeError(f"the _metadata of the state dict at key path {path!r} is not a mapping of "
                                   "module prefixes to mappings; it cannot be stored")
    out: dict[str, dict[str, Any]] = {}
    for prefix, values in meta.items():
        for name, value in values.items():
            if type(name) is not str:
                raise UnsupportedTypeError(f"_metadata[{prefix!r}] of the state dict at key path {path!r} has a "
                                           f"non-str key {name!r}")
            encode_value(value, f"{path}._metadata[{prefix!r}][{name!r}]")
        out[prefix] = dict(values)
    return out


def inflate(items: Iterable[Container | Leaf]) -> Any:
    """Rebuild the nested value from pre-order containers and leaves whose values are
    already materialised. Children are placed in the order given; absent siblings are
    simply left out (pruned selections). Returns None when there are no items."""
    children: dict[str, list[tuple[Any, Any]]] = {}
    types: dict[str, str] = {}
    metadata: dict[str, dict[str, dict[str, Any]]] = {}
    for item in items:
        if item.path == "" and isinstance(item, Leaf):
            return item.value
        if isinstance(item, Container):
            types[item.path] = item.type
            children[item.path] = []
            if item.module_metadata is not None and item.type == "OrderedDict":
                metadata[item.path] = item.module_metadata
        if item.path:
            value = _Pending(item.path) if isinstance(item, Container) else item.value
            children[item.path.rpartition("/")[0]].append((item.key, value))
    built: dict[str, Any] = {}
    for path in reversed(types):  # pre-order reversed: descendants before ancestors
        pairs = [(k, built.pop(v.path) if isinstance(v, _Pending) else v) for k, v in children[path]]
        cls = CONTAINER_TYPES[types[path]]
        built[path] = cls(v for _, v in pairs) if cls in (list, tuple) else cls(pairs)
        if path in metadata:
            built[path]._metadata = OrderedDict((k, dict(v)) for k, v in metadata[path].items())
    return built.get("")


@record
class _Pending:
    path: str
