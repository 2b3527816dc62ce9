"""Conversion between tensorstore_h5 files and the formats people have: safetensors and
``torch.save`` files. Key by key, with bounded memory, never unpickling code.

Importing this module does not import torch (``tensorstore_h5`` imports it eagerly); the
conversions import what they need when called.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Any, Union

from .errors import FormatError, KeyNotFoundError, TensorStoreError, UnsupportedTypeError, WriteError

if TYPE_CHECKING:
    from .reading.store import Store
    PathLike = Union[str, "os.PathLike[str]"]  # (annotations only: the alias is ~0.07 ms of an import)

__all__ = ["convert", "format_of", "SUFFIXES"]


_ESCAPES = r"\x1b\[[0-?]*[ -/]*[@-~]"  # compiled on first use (re caches it): ~0.1 ms of an import
"""Terminal escape sequences (bold, colours) that torch's messages carry."""

SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
            ".ckpt": "torch"}
"""File name suffix -> the format :func:`convert` reads or writes."""

_PAIRS = {("safetensors", "h5"), ("torch", "h5"), ("h5", "safetensors"), ("h5", "h5")}

_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
    "uint64": "U64", "uint32": "U32", "uint16": "U16",
}
"""torch dtype name -> safetensors dtype code: the dtypes ``safetensors.torch`` reads."""



def format_of(path: PathLike) -> str:
    """``"h5"``, ``"safetensors"`` or ``"torch"`` from the file name's suffix (ValueError otherwise)."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    try:
        return SUFFIXES[suffix]
    except KeyError:
        what = f"suffix {suffix!r}" if suffix else "no suffix"
        raise ValueError(f"{os.fspath(path)}: unknown file type ({what}); name it with one of "
                         f"{', '.join(sorted(SUFFIXES))}") from None


def convert(src: PathLike, dst: PathLike, *, select: Any = None, progress: bool | None = None,
            **save_options: Any) -> None:
    """Convert ``src`` to ``dst``, by their suffixes (``.h5``/``.hdf5``, ``.safetensors``,
    ``.pt``/``.pth``/``.bin``/``.ckpt``).

    - safetensors -> h5: key by key through ``safe_open`` (one tensor in memory at a time);
      its metadata becomes ``Store.metadata``; shared storage is not visible there. Each
      tensor name is one top-level key (``model.layers.0.weight`` stays one flat key), except
      in a file that h5 -> safetensors wrote with the :data:`KEYS_MARKER` entry in its
      metadata: there the names are key paths again, so the round trip gives back the same
      keys, in the same order, and the same nesting of dicts (the marker itself is left out
      of ``Store.metadata``).
    - torch.save -> h5: ``torch.load(weights_only=True, mmap=True)``, so no code runs and
      tensors stay file-backed until written (legacy, non-zip files cannot be mapped and are
      loaded whole, still with ``weights_only``); nesting and plain values are kept.
    - h5 -> safetensors: tensors only (plain values are refused before anything is written),
      streamed key by key (one tensor in memory at a time), each written contiguous; tensors
      that share storage are written once per key (safetensors has no aliases). The file is
      written beside ``dst`` and renamed over it at the end: a failure leaves no partial file.
      Tensor names are the key paths (``model/layers.0.weight``); when one of them holds a
      ``/`` (nesting) or a ``%`` escape, the metadata gets ``{KEYS_MARKER: KEY_PATHS}``
      (``"tensorstore_h5.keys": "paths"``), from which safetensors -> h5 restores the nesting.
      Lists, tuples, non-``str`` dict keys and a state dict's ``_metadata`` are not kept:
      they come back as dicts of ``str`` keys.
    - h5 -> h5: loaded whole (nesting, aliases and values kept), then written.

    ``save_options`` (``compression=``, ``chunk_bytes=``, ``metadata=``, ``sync=``) go to the
    tensorstore_h5 writer; a .safetensors destination takes ``metadata=`` only (string
    values; others are written as their ``repr``). ``select`` picks keys of an .h5 or
    .safetensors source, as for :func:`tensorstore_h5.load`; a selection that picks nothing
    is an error. An h5 source's checksums are always verified (a damaged source is never
    copied into a new file). ``progress``: a progress bar by bytes, True/False to force it,
    None (default) to show it for work over 256 MiB in interactive output.

    Raises:
        ValueError: unknown suffixes, an unsupported pair, or options that do not apply.
        FileNotFoundError / IsADirectoryError: ``src`` is missing or a directory; ``dst`` is a
            directory or its directory does not exist.
        KeyNotFoundError: ``select`` names a key that is not there, or picks no key.
        FormatError / UnsupportedTypeError: the source cannot be read or converted.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    for path in (src, dst):
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory; give a file name ending in one of "
                                    f"{', '.join(sorted(SUFFIXES))}")
    kinds = format_of(src), format_of(dst)
    if kinds not in _PAIRS:
        raise ValueError(f"{src} -> {dst}: cannot convert {kinds[0]} to {kinds[1]}; the supported pairs are "
                         "safetensors->h5, torch->h5, h5->safetensors and h5->h5")
    if not os.path.exists(src):
        raise FileNotFoundError(errno.ENOENT, "no such file", src)
    head = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(head):
        raise FileNotFoundError(f"{dst}: the directory {os.path.dirname(dst) or head!r} does not exist; create it first "
                                "(nothing was written)")
    if kinds[1] == "safetensors":
        unknown = sorted(set(save_options) - {"metadata"})
        if unknown:
            raise ValueError(f"{dst}: {', '.join(u + '=' for u in unknown)} cannot be used for a .safetensors "
                             "destination (options of the .h5 writer; metadata= is the one that applies)")
    if select is not None and kinds[0] == "torch":
        raise ValueError(f"{src}: select applies to an .h5 or .safetensors source; convert the whole file to .h5, "
                         "then select from that")
    if kinds == ("safetensors", "h5"):
        _from_safetensors(src, dst, select, progress, save_options)
    elif kinds == ("torch", "h5"):
        _from_torch(src, dst, progress, save_options)
    elif kinds == ("h5", "safetensors"):
        _to_safetensors(src, dst, select, progress, save_options.get("metadata"))
    else:
        _h5_to_h5(src, dst, select, progress, save_options)


def _nothing_selected(src: str, select: Any) -> KeyNotFoundError:
    if callable(select):
        what = "the select function"
    else:
        what = repr(select) if isinstance(select, str) else " or ".join(map(repr, select))
    return KeyNotFoundError(f"{src}: no key matches {what}; list the keys with `tensorstore-h5 ls {src}`")


def _h5_to_h5(src: str, dst: str, select: Any, progress: bool | None, options: dict[str, Any]) -> None:
    from .reading.store import Store
    from .writing.writer import Writer, few_links

    with Store(src) as store:
        if select is not None and not store.selected_keys(select):
            raise _nothing_selected(src, select)
        meta = options.pop("metadata", store.metadata)
        with Writer(dst, metadata=meta, progress=progress, **options,  # key by key: bounded memory
                    _encode=few_links(store._layout.leaf_paths + store._layout.container_paths)) as w:
            w.expect_bytes(store.nbytes_of(select))
            w.write_tree(store.walk(select, verify=True))


def _safetensors_sizes(path: str) -> dict[str, int]:
    """Bytes of each tensor of a safetensors file, in the order of its header (which
    ``safe_open`` checked; :func:`convert` writes it in the saved order of the keys)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return {k: int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        raise FormatError(f"{path}: not a readable safetensors file (header: {e})") from e


def _key_paths(src: str, keys: list[str]) -> tuple[dict[str, str], list[str]]:
    """The names of a safetensors file marked with :data:`KEYS_MARKER` as key paths:
    ``({path: name}, container paths)``, nesting restored. Raises FormatError naming the file
    and the key for a name that is not a key path, or a key path that is also a container."""
    from .format.constants import KEYS_MARKER
    from .format.tree import split, unescape

    containers: dict[str, None] = {}
    for key in keys:
        try:
            names = split(key)
            for name in names or [""]:
                unescape(name)
        except ValueError as e:
            raise FormatError(f"{src}: key {key!r} is not a tensorstore_h5 key path, as the file's __metadata__ "
                              f"({KEYS_MARKER!r}) says it is ({e}); nothing was written") from None
        for i in range(1, len(names)):
            containers["/".join(names[:i])] = None
    clash = [k for k in keys if k in containers]
    if clash:
        raise FormatError(f"{src}: key {clash[0]!r} is a tensor and also holds other keys ({clash[0] + '/'!r}...); "
                          "the file's key paths make no tree; nothing was written")
    return {key: key for key in keys}, list(containers)


def _from_safetensors(src: str, dst: str, select: Any, progress: bool | None, options: dict[str, Any]) -> None:
    from safetensors import safe_open

    from .reading.select import resolve
    from .format.constants import KEY_PATHS, KEYS_MARKER
    from .format.tree import escape
    from .writing.writer import Writer, few_links

    try:
        f = safe_open(src, framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise FormatError(f"{src}: not a readable safetensors file ({e})") from e
    with f:
        sizes = _safetensors_sizes(src)
        stored_meta = dict(f.metadata() or {})
        if stored_meta.get(KEYS_MARKER) == KEY_PATHS:  # written by convert: the names are key paths, nesting kept
            del stored_meta[KEYS_MARKER]
            listed = set(f.keys())
            names, containers = _key_paths(src, [k for k in sizes if k in listed])
        else:  # any other file: each name is one key at the top level (dots and slashes kept)
            names, containers = {escape(key): key for key in f.keys()}, []
        if select is not None:
            included = resolve(select, list(names), containers, src)
            names = {path: key for path, key in names.items() if path in included}
            if not names:
                raise _nothing_selected(src, select)
        meta = options.pop("metadata", None)
        if meta is None:
            meta = stored_meta
        with Writer(dst, metadata=meta, progress=progress, **options,
                    _encode=few_links(list(names) + containers)) as w:
            # Key by key, so the writer learns the total from here (write_root announces its own).
            w.expect_bytes(sum(sizes.get(key, 0) for key in names.values()))
            for path, key in names.items():
                w.write(path, f.get_tensor(key))


def _from_torch(src: str, dst: str, progress: bool | None, options: dict[str, Any]) -> None:
    import torch

    from .writing.writer import save

    with open(src, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # only the zip format can be mapped
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as e:  # unpickling errors come in many types
        m = re.search(r"Unsupported (?:global: GLOBAL |class )([\w.]+)", str(e))
        if type(e).__name__ == "UnpicklingError" and m:  # weights_only refused a global: a pickled object
            raise FormatError(
                f"{src}: holds a pickled {m.group(1)} object, not a state dict of tensors and plain values, and "
                f"tensorstore_h5 does not unpickle objects (that can run code). If you trust the file: obj = "
                f"torch.load({src!r}, weights_only=False), torch.save(obj.state_dict(), 'state.pt') (or a dict of "
                "its tensors and plain values), then convert state.pt") from e
        raise FormatError(f"{src}: cannot load with weights_only=True, which refuses anything but tensors and plain "
                          f"values ({re.sub(_ESCAPES, '', str(e))})") from e
    save(obj, dst, metadata=options.pop("metadata", None), progress=progress, **options)  # announces "saving <dst>"


def _what(entry: Any) -> str:
    from .format.layout import ArrayEntry, ForeignEntry, ValueEntry

    if isinstance(entry, ArrayEntry):
        return f"a numpy array ({entry.dtype})"
    if isinstance(entry, ValueEntry):
        return f"a plain value ({type(entry.value).__name__})"
    if isinstance(entry, ForeignEntry):
        return f"an HDF5 dataset that is not a tensor ({entry.reason})"
    return type(entry).__name__


def _safetensors_header(store: Store, keys: list[str], metadata: Any) -> tuple[bytes, list[tuple[str, int]]]:
    """The header of the safetensors file holding ``keys`` (checked: tensors of dtypes that
    safetensors holds) and ``[(key, nbytes)]`` in the order of the data."""
    from .format.constants import KEY_PATHS, KEYS_MARKER
    from .format.layout import TensorEntry
    from .format.tree import escape

    header: dict[str, Any] = {}
    if metadata and not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    meta = {str(k): v if isinstance(v, str) else repr(v) for k, v in (metadata or {}).items()}
    meta.pop(KEYS_MARKER, None)  # says how this file's names read, not the source's
    if any(escape(key) != key for key in keys):  # nesting or escapes: only the marker brings them back
        meta[KEYS_MARKER] = KEY_PATHS
    if meta:
        header["__metadata__"] = meta
    order: list[tuple[str, int]] = []
    offset = 0
    for key in keys:
        entry = store._entry(key)
        if not isinstance(entry, TensorEntry):
            raise UnsupportedTypeError(f"{store.path}: key {key!r} is {_what(entry)}; safetensors holds tensors only: pick "
                                       "the tensors with select= (tensorstore-h5 convert --select GLOB); nothing was written")
        code = _SAFETENSORS_DTYPES.get(entry.dtype.name)
        if code is None:
            raise UnsupportedTypeError(f"{store.path}: key {key!r} has dtype {entry.dtype.name}, which safetensors does not "
                                       "hold; leave it out with select= (tensorstore-h5 convert --select GLOB) or convert "
                                       "to .h5; nothing was written")
        header[key] = {"dtype": code, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes]}
        order.append((key, entry.nbytes))
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text, order


def _write_error(dst: str, e: OSError) -> WriteError:
    return WriteError(f"{dst}: cannot be written ({e.strerror or e}); nothing was written, any earlier file is unchanged")


def _to_safetensors(src: str, dst: str, select: Any, progress: bool | None, metadata: Any) -> None:
    import uuid  # (with platform, ~3 ms of the command line's start, which needs neither)

    from .display import Progress
    from .format.dtypes import bits_view
    from .storage.memory import tensor_bytes
    from .reading.store import Store

    with Store(src) as store:
        keys = store.selected_keys(select)
        if select is not None and not keys:
            raise _nothing_selected(src, select)
        head, order = _safetensors_header(store, keys, store.metadata if metadata is None else metadata)
        bar = Progress(progress, desc=f"converting {os.path.basename(src)}")
        bar.total(sum(n for _, n in order))
        tmp = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(dst)}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise _write_error(dst, e) from e
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(head)
                wanted = {key for key, _ in order}
                expected = iter(order)
                for key, value in store.items(select=lambda k: k in wanted, verify=True):
                    want, nbytes = next(expected)
                    t = value.detach().contiguous()
                    data = tensor_bytes(bits_view(t)) if t.numel() else b""
                    if key != want or len(data) != nbytes:
                        raise FormatError(f"{src}: key {key!r} read back as {tuple(t.shape)} {t.dtype}, not as its "
                                          "layout says")
                    out.write(data)
                    bar.update(nbytes)
                    del value, t, data  # not held while the next tensor is read
            os.replace(tmp, dst)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError) and not isinstance(e, TensorStoreError):  # the source's errors are FormatErrors
                raise _write_error(dst, e) from e
            raise
        finally:
            bar.close()
