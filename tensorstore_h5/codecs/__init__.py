"""Compression: presets that writers turn into HDF5 filters (:mod:`.presets`) and the checked,
parallel decoders that readers run on the I/O threads (:mod:`.decoders`).

Importing this package imports neither. The names of the former module ``tensorstore_h5.codecs``
(now :mod:`.decoders`) are still found here.
"""

from __future__ import annotations

from .._moved import former_module

__all__ = ["DecodeError"]


class DecodeError(Exception):
    """A chunk that does not decode to exactly its bytes (damaged or hostile). Defined here so
    that readers catch it without importing the decoders."""


# the former module tensorstore_h5.codecs: its names, found on the package
__getattr__ = former_module(__name__, "decoders", frozenset({"decoders", "presets"}))
