"""Constants that the command line needs before anything imports torch (one place for each)."""

from __future__ import annotations

__all__ = ["FORMAT_VERSION", "PRESET_NAMES", "KEYS_MARKER", "KEY_PATHS"]

FORMAT_VERSION = 2
"""The on-disk format version this library writes (docs/FORMAT.md)."""

PRESET_NAMES = ("best", "lz4", "zstd")
"""The compression presets, sorted (``compression.PRESETS`` maps each to its filter)."""

KEYS_MARKER = "tensorstore_h5.keys"
"""The ``__metadata__`` entry of a safetensors file written by ``convert`` whose tensor names
are tensorstore_h5 key paths (escaped names joined by ``/``, docs/FORMAT.md "Keys"); its value
is :data:`KEY_PATHS`. Written only when some name differs from the escaped form of itself (it
holds a ``/`` of nesting or a ``%`` escape): a plain name means the same either way."""

KEY_PATHS = "paths"
