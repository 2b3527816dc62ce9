"""Constants that the command line needs before anything imports torch (one place for each)."""

from __future__ import annotations

__all__ = ["FORMAT_VERSION", "DEFLATE_VERSION", "PRESET_NAMES", "KEYS_MARKER", "KEY_PATHS"]

FORMAT_VERSION = 2
"""The on-disk format version this library writes for every file without chunks of the
``"gzip"`` preset (docs/FORMAT.md); those files stay byte for byte what version 2 was."""

DEFLATE_VERSION = 3
"""The format version written instead when a file holds chunks of the ``"gzip"`` preset
(HDF5's own shuffle + deflate filters, which version-2 readers refuse as "a filter not in the
table"); readers of this library read 1, 2 and 3 (``format.layout.READ_VERSIONS``)."""

PRESET_NAMES = ("best", "gzip", "lz4", "zstd")
"""The compression presets, sorted (``compression.PRESETS`` maps each to its filter)."""

KEYS_MARKER = "tensorstore_h5.keys"
"""The ``__metadata__`` entry of a safetensors file written by ``convert`` whose tensor names
are tensorstore_h5 key paths (escaped names joined by ``/``, docs/FORMAT.md "Keys"); its value
is :data:`KEY_PATHS`. Written only when some name differs from the escaped form of itself (it
holds a ``/`` of nesting or a ``%`` escape): a plain name means the same either way."""

KEY_PATHS = "paths"
