"""Compression: presets that writers turn into HDF5 filters (:mod:`.presets`) and the checked,
parallel decoders that readers run on the I/O threads (:mod:`.decoders`).

Importing this package imports neither. The names of the former module ``tensorstore_h5.codecs``
(now :mod:`.decoders`) are still found here.
"""

from __future__ import annotations

from typing import Any

from ..errors import DecodeError

__all__ = ["DecodeError"]

_SUBMODULES = frozenset({"decoders", "presets"})


def __getattr__(name: str) -> Any:
    """The former module tensorstore_h5.codecs: its names, found on the package (``_moved``,
    imported only when such a name is asked for)."""
    if name in _SUBMODULES or name.startswith("__"):  # (``from .codecs import presets`` asks first)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._moved import former_module

    return former_module(__name__, "decoders", _SUBMODULES)(name)
