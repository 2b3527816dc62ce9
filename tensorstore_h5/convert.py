"""Conversion between tensorstore_h5 files and the formats people have: safetensors and
``torch.save`` files. Key by key, with bounded memory, never unpickling code."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from .errors import FormatError, UnsupportedTypeError
from .store import Store
from .writer import Writer

__all__ = ["convert", "format_of"]

PathLike = Union[str, "os.PathLike[str]"]

_SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
             ".ckpt": "torch"}


def format_of(path: PathLike) -> str:
    """``"h5"``, ``"safetensors"`` or ``"torch"`` from the file name's suffix (ValueError otherwise)."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise ValueError(f"{os.fspath(path)}: unknown file type {suffix!r}; use one of {sorted(_SUFFIXES)}") from None


def convert(src: PathLike, dst: PathLike, *, select: Any = None, **save_options: Any) -> None:
    """Convert ``src`` to ``dst``, by their suffixes (``.h5``/``.hdf5``, ``.safetensors``,
    ``.pt``/``.pth``/``.bin``/``.ckpt``).

    - safetensors -> h5: key by key through ``safe_open`` (one tensor in memory at a time);
      its metadata becomes ``Store.metadata``; shared storage is not visible there.
    - torch.save -> h5: ``torch.load(weights_only=True, mmap=True)``, so no code runs and
      tensors stay file-backed until written (legacy, non-zip files cannot be mapped and are
      loaded whole, still with ``weights_only``); nesting and plain values are kept.
    - h5 -> safetensors: tensors only (plain values are refused), each written contiguous;
      tensors that share storage are cloned (safetensors has no aliases).

    ``save_options`` (``compression=``, ``chunk_bytes=``, ``progress=``, ``metadata=``) go to
    the tensorstore_h5 writer. ``select`` picks keys of an h5 source, whose checksums are
    always verified (a damaged source is never copied into a new file).

    Raises:
        ValueError: unknown suffixes or an unsupported pair.
        FormatError / UnsupportedTypeError: the source cannot be read or converted.
    """
    kinds = format_of(src), format_of(dst)
    if kinds == ("safetensors", "h5"):
        _from_safetensors(src, dst, save_options)
    elif kinds == ("torch", "h5"):
        _from_torch(src, dst, save_options)
    elif kinds == ("h5", "safetensors"):
        _to_safetensors(src, dst, select)
    elif kinds == ("h5", "h5"):
        with Store(src) as store:
            meta = save_options.pop("metadata", store.metadata)
            with Writer(dst, metadata=meta, **save_options) as w:
                w.write_root(store.load(select=select, verify=True))
    else:
        raise ValueError(f"cannot convert {kinds[0]} to {kinds[1]}; the supported pairs are safetensors->h5, torch->h5, "
                         "h5->safetensors and h5->h5")


def _from_safetensors(src: PathLike, dst: PathLike, options: dict[str, Any]) -> None:
    from safetensors import safe_open

    try:
        f = safe_open(os.fspath(src), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise FormatError(f"{os.fspath(src)}: not a readable safetensors file ({e})") from e
    with f:
        meta = options.pop("metadata", None)
        if meta is None:
            meta = dict(f.metadata() or {})
        with Writer(dst, metadata=meta, **options) as w:
            for key in f.keys():
                w.write(_escape_key(key), f.get_tensor(key))


def _escape_key(key: str) -> str:
    from .tree import escape

    return escape(key)


def _from_torch(src: PathLike, dst: PathLike, options: dict[str, Any]) -> None:
    path = os.fspath(src)
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # only the zip format can be mapped
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as e:  # unpickling errors come in many types
        raise FormatError(f"{path}: cannot load with weights_only=True, which refuses anything but tensors and plain "
                          f"values ({e})") from e
    with Writer(dst, metadata=options.pop("metadata", None), **options) as w:
        w.write_root(obj)


def _to_safetensors(src: PathLike, dst: PathLike, select: Any) -> None:
    from safetensors.torch import save_file

    with Store(src) as store:
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in store.items(select=select, verify=True):
            if not isinstance(value, torch.Tensor):
                raise UnsupportedTypeError(f"{store.path}: key {key!r} is a {type(value).__name__}; safetensors holds tensors only "
                                           "(use select= to pick the tensors)")
            t = value.contiguous()
            if t.untyped_storage().data_ptr() in seen and t.numel():
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t
        meta = {k: v if isinstance(v, str) else repr(v) for k, v in store.metadata.items()}
    save_file(tensors, os.fspath(dst), metadata=meta or None)
