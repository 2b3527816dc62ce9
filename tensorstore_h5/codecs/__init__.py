"""Compression: presets that writers turn into HDF5 filters (:mod:`.presets`) and the checked,
parallel decoders that readers run on the I/O threads (:mod:`.decoders`).

Importing this package imports neither. The names of the former module ``tensorstore_h5.codecs``
(now :mod:`.decoders`) are still found here.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_SUBMODULES = frozenset({"decoders", "presets"})


def __getattr__(name: str) -> Any:  # the former module tensorstore_h5.codecs
    if name.startswith("__") or name in _SUBMODULES:  # submodules are imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    decoders = import_module(f"{__name__}.decoders")

    try:
        return getattr(decoders, name)
    except AttributeError:
        raise AttributeError(f"module 'tensorstore_h5.codecs' has no attribute {name!r}") from None
