"""The on-disk format: what a tensorstore_h5 file is, independent of where its bytes come from.

- :mod:`.constants`: format version and preset names (no torch, for the command line's start)
- :mod:`.layout`: the header, the JSON Lines layout and its entries, format versions (docs/FORMAT.md)
- :mod:`.hdf5meta`: the HDF5 metadata of uncompressed files, encoded without libhdf5;
  :mod:`.hdf5links`: that metadata read back, to check a file's links against its layout
- :mod:`.dtypes`: torch dtypes <-> HDF5 types; :mod:`.tree`: nested values <-> key paths
- :mod:`.checksum`: XXH3 of stored bytes; :mod:`.slicing`: index expressions -> hyperslabs

Importing this package imports none of them. The names of the former module
``tensorstore_h5.format`` (now :mod:`.layout`) are still found here.
"""

from __future__ import annotations

from typing import Any

_SUBMODULES = frozenset({"constants", "layout", "hdf5meta", "hdf5links", "dtypes", "tree", "checksum", "slicing"})


def __getattr__(name: str) -> Any:
    """The former module tensorstore_h5.format: its names, found on the package (``_moved``,
    imported only when such a name is asked for)."""
    if name in _SUBMODULES or name.startswith("__"):  # (``from .format import tree`` asks first)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._moved import former_module

    return former_module(__name__, "layout", _SUBMODULES)(name)
