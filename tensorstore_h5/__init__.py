"""tensorstore_h5: PyTorch checkpoints in HDF5 — selective, lazy, optionally compressed, never pickled.

    import tensorstore_h5 as th5
    th5.save({"model": model.state_dict(), "epoch": 3}, "ckpt.h5")
    with th5.open("ckpt.h5") as store:
        w = store["model/enc.weight"][:, :16]
    th5.load_into(model, "ckpt.h5", prefix="model/")
"""

from __future__ import annotations

import os as _os
import sys as _sys
from importlib import import_module as _import_module
from importlib.util import find_spec as _find_spec
from typing import TYPE_CHECKING, Any

# Importing the package does not import torch (about 2 s): the command line's --help and usage
# errors need none of it. The names that need torch are imported on first use (PEP 562), each
# with its own module only (``th5.open`` of a file imports no writer, DCP or sharded code).
# ``convert`` is bound here, not on first use: importing the submodule ``tensorstore_h5.convert``
# (the command line does) would set the package's attribute ``convert`` to the module.
from .convert import convert  # imports torch only when called
from .errors import (
    FileAccessError, FormatError, InvalidPathError, KeyNotFoundError, MismatchError, MissingFileError,
    NotRegularFileError, PathError, TensorStoreError, TensorStoreWarning, UnsupportedTypeError, WriteError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .api import LoadResult, load, load_into
    from .codecs.presets import PRESETS
    from .format.constants import FORMAT_VERSION
    from .format.tree import escape, unescape
    from .reading.compare import Diff, Stats
    from .reading.store import Store, TensorHandle
    from .sharded import ShardedStore
    from .writing.background import save_async
    from .writing.reindex import reindex
    from .writing.writer import Writer, save


class _FormerPaths:
    """Finds the module paths of the flat layout before the wings (``tensorstore_h5.store``,
    ``.io``, ...; see ``_moved.py``, imported only when such a path is asked for). Last on
    ``sys.meta_path``: consulted only after no module of that name was found."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
        if not name.startswith(__name__ + "."):
            return None
        from . import _moved

        return _moved.find_spec(name)


if not any(getattr(f, "__name__", "") == "_FormerPaths" for f in _sys.meta_path):
    _sys.meta_path.append(_FormerPaths)


__version__ = "0.1.0"

__all__ = [
    "save", "save_async", "load", "load_into", "open", "convert", "reindex", "Store", "ShardedStore", "TensorHandle",
    "Writer",
    "LoadResult", "diff", "stats", "Diff", "Stats",
    "escape", "unescape", "PRESETS", "FORMAT_VERSION",
    "TensorStoreError", "FormatError", "UnsupportedTypeError", "KeyNotFoundError", "MismatchError", "WriteError",
    "PathError", "MissingFileError", "FileAccessError", "NotRegularFileError", "InvalidPathError",
    "TensorStoreWarning", "__version__",
]


_LAZY = {
    "load": "api", "load_into": "api", "LoadResult": "api", "PRESETS": "codecs.presets",
    "FORMAT_VERSION": "format.constants", "escape": "format.tree", "unescape": "format.tree",
    "Store": "reading.store", "TensorHandle": "reading.store", "ShardedStore": "sharded",
    "Diff": "reading.compare", "Stats": "reading.compare",
    "save_async": "writing.background", "Writer": "writing.writer", "save": "writing.writer",
    "reindex": "writing.reindex",
}
"""The public names imported on first use, and the module (under this package) of each."""


def open(path: Any, *, storage_options: dict[str, Any] | None = None) -> Store | ShardedStore:
    """Open ``path`` read-only (use it as a context manager): a local path, an fsspec URL
    (``https://``, ``s3://``, ``file://``; ``storage_options`` go to fsspec) or a readable,
    seekable binary file object, as a :class:`Store`; a local directory (a checkpoint written by
    many ranks, or a Hugging Face sharded safetensors checkpoint: docs/DISTRIBUTED.md) as a
    :class:`ShardedStore`, the same interface over its global tensors.

    Raises:
        FileNotFoundError: no such file or directory.
        FormatError: not a checkpoint this library reads, or a damaged one (names the file).
        RemoteError: a URL that cannot be read.
    """
    # Here, not in api.py: the first open of a file imports the reader's modules only (the
    # ~0.5 ms of api.py's import is load_into's); the first import of each is made with the
    # collector paused, as a lazy name's (see _bind). (It shadows the builtin in this module,
    # which opens no file itself.)
    if isinstance(path, (str, _os.PathLike)) and _os.path.isdir(path):
        opener = _first_use("ShardedStore")
        return opener(path)  # type: ignore[no-any-return]
    opener = _first_use("Store")
    return opener(path, storage_options=storage_options)  # type: ignore[no-any-return]


def _first_use(name: str) -> Any:
    """The lazy name ``name`` (imported and bound on the first call, as ``th5.<name>`` would be)."""
    value = globals().get(name)
    return value if value is not None else _bind(name)


def diff(a: Any, b: Any, select: Any = None, *, storage_options: dict[str, Any] | None = None, **options: Any) -> Diff:
    """Compare two checkpoints key by key, streaming (memory holds a few tensors, never a
    checkpoint): ``a`` and ``b`` are anything :func:`open` takes (files, URLs, checkpoint
    directories, Hugging Face shards) or lone ``.safetensors`` files. Returns a :class:`Diff`,
    rows of ``key``, ``status``, ``max_abs``, ``rel_l2``, ... (a table with a figure in
    Jupyter); ``select``, ``progress`` and ``verify``: :func:`tensorstore_h5.reading.compare.diff`."""
    from .reading.compare import diff as compare

    return compare(a, b, select, opener=lambda p: open(p, storage_options=storage_options), **options)


def stats(source: Any, select: Any = None, *, storage_options: dict[str, Any] | None = None, **options: Any) -> Stats:
    """Per-tensor ``mean``, ``std``, ``min``, ``max`` and counts of ``nan``, ``inf`` and
    ``zeros`` of a checkpoint (anything :func:`open` takes, or a store), streaming, in float64.
    Returns a :class:`Stats`; details: :func:`tensorstore_h5.reading.compare.stats`."""
    from .reading.compare import stats as compare

    return compare(source, select, opener=lambda p: open(p, storage_options=storage_options), **options)


def _bind(name: str) -> Any:
    """Import the module of the lazy name ``name``, bind the name here and return it. The
    collector is paused meanwhile: with torch loaded, a full collection that an import's new
    objects set off costs ~150 ms (measured: th5.open + keys in a fresh process 270 -> 90 ms)."""
    from .storage import gc_paused

    with gc_paused():
        value = getattr(_import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def _import_all() -> None:
    """Bind every lazy public name (idempotent; what an eager import would have given)."""
    for name in _LAZY:
        if name not in globals():
            _bind(name)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _bind(name)
    # A submodule (``th5.transfer``, ``from . import tree``): imported by its own name only, so
    # that modules importing each other while a lazy name is bound never re-enter it.
    if not name.startswith("_") and _find_spec(f"{__name__}.{name}") is not None:
        return _import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_API_MODULES = ("distributed", "storage", "transfer")
"""Submodules the docs name as API: the DCP backend (``tensorstore_h5.distributed``) and the
settings of remote reads (``storage.remote``) and device transfers (``transfer``)."""


def __dir__() -> list[str]:
    """The public API (``__all__``, the submodules of :data:`_API_MODULES`) and the module's
    dunders: not the helpers this file imports (``Any``, ``TYPE_CHECKING``, ``annotations``)
    nor the submodules imported along the way (``api``, ``reading``, ...), which stay
    attributes."""
    dunders = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted(set(__all__) | set(_API_MODULES) | dunders)
