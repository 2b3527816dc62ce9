"""Constants that the command line needs before anything imports torch (one place for each)."""

from __future__ import annotations

__all__ = ["FORMAT_VERSION", "PRESET_NAMES"]

FORMAT_VERSION = 2
"""The on-disk format version this library writes (docs/FORMAT.md)."""

PRESET_NAMES = ("best", "lz4", "zstd")
"""The compression presets, sorted (``compression.PRESETS`` maps each to its filter)."""
