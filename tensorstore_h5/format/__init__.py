"""The on-disk format: what a tensorstore_h5 file is, independent of where its bytes come from.

- :mod:`.constants`: format version and preset names (no torch, for the command line's start)
- :mod:`.layout`: the header, the JSON Lines layout and its entries, format versions (docs/FORMAT.md)
- :mod:`.hdf5meta`: the HDF5 metadata of uncompressed files, encoded without libhdf5
- :mod:`.dtypes`: torch dtypes <-> HDF5 types; :mod:`.tree`: nested values <-> key paths
- :mod:`.checksum`: XXH3 of stored bytes; :mod:`.slicing`: index expressions -> hyperslabs

Importing this package imports none of them. The names of the former module
``tensorstore_h5.format`` (now :mod:`.layout`) are still found here.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_SUBMODULES = frozenset({"constants", "layout", "hdf5meta", "dtypes", "tree", "checksum", "slicing"})


def __getattr__(name: str) -> Any:  # the former module tensorstore_h5.format
    if name.startswith("__") or name in _SUBMODULES:  # submodules are imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    layout = import_module(f"{__name__}.layout")

    try:
        return getattr(layout, name)
    except AttributeError:
        raise AttributeError(f"module 'tensorstore_h5.format' has no attribute {name!r}") from None
