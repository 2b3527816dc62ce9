"""Compression presets -> HDF5 filter pipelines, and chunk shapes. Used by the writer only:
HDF5 records the filters in each dataset, so readers need nothing from here (they only need
``hdf5plugin`` imported, which :func:`ensure_plugins` does)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import h5py
import torch

from ..format.dtypes import DtypeSpec
from ..format.layout import BITSHUFFLE_ID, FILTERS

__all__ = [
    "PRESETS", "DEFAULT_CHUNK_BYTES", "MIN_COMPRESS_BYTES", "Compression", "Policy",
    "resolve_compression", "chunk_shape", "ensure_plugins", "describe",
]

DEFAULT_CHUNK_BYTES = 2**20
"""Target size in bytes of one chunk of a compressed dataset (row blocks along dim 0)."""

MIN_COMPRESS_BYTES = 16 * 2**10
"""Tensors smaller than this (bytes) are stored uncompressed whatever the policy."""


def ensure_plugins() -> None:
    """Register hdf5plugin's filters with HDF5 (imports hdf5plugin once, ~0.15 s)."""
    import hdf5plugin  # noqa: F401


def _blosc2(cname: str, clevel: int) -> Any:
    ensure_plugins()
    import hdf5plugin

    return hdf5plugin.Blosc2(cname=cname, clevel=clevel, filters=hdf5plugin.Blosc2.SHUFFLE)


def _bitshuffle_lz4() -> Any:
    ensure_plugins()
    import hdf5plugin

    return hdf5plugin.Bitshuffle(cname="lz4")


PRESETS: dict[str, Callable[[], Any]] = {  # keys: constants.PRESET_NAMES (checked by the tests)
    "lz4": _bitshuffle_lz4,
    "zstd": lambda: _blosc2("zstd", 3),
    "best": lambda: _blosc2("zstd", 9),
}
"""Preset name -> factory of its hdf5plugin filter, chosen from ratios measured on trained
all-MiniLM-L6-v2 weights (compressed/original; see README "Compression"):

- ``"lz4"``: Bitshuffle + LZ4, the fastest (float32 0.87, bfloat16 0.76);
- ``"zstd"``: Blosc2 Zstd level 3 with byte shuffle by element size (float32 0.85, bfloat16 0.72);
- ``"best"``: the same at level 9, the best ratio and slow to write (float32 0.84, bfloat16 0.70).
"""

Compression = Union[None, str, Any, Callable[[str, torch.Tensor], Any]]


def _filter(value: Any) -> Any:
    """A filter object (or None) from a preset name or a filter object."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return PRESETS[value]()
        except KeyError:
            raise ValueError(f"unknown compression preset {value!r}; the presets are {sorted(PRESETS)}") from None
    if isinstance(value, h5py.filters.FilterRefBase):
        if value.filter_id not in FILTERS:
            raise ValueError(f"compression filter {value.filter_id} ({type(value).__name__}) cannot be used: the format "
                             "allows hdf5plugin.Bitshuffle (lz4, zstd) and hdf5plugin.Blosc2, which tensorstore_h5 "
                             "decodes itself with checks; or a preset " + str(sorted(PRESETS)))
        options = tuple(value.filter_options)
        if value.filter_id == BITSHUFFLE_ID and (len(options) < 2 or options[1] not in (2, 3)):
            raise ValueError("hdf5plugin.Bitshuffle needs cname='lz4' or cname='zstd' (uncompressed bitshuffle is not allowed)")
        return value
    raise TypeError(
        f"compression must be None, a preset name {sorted(PRESETS)}, an hdf5plugin filter, "
        f"or a callable (key_path, tensor) -> one of those; got {type(value).__name__}"
    )


def chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Chunks of about ``chunk_bytes``: whole trailing dimensions, then a block of the
    first dimension that does not fit (rows along dim 0 for ordinary weights)."""
    budget = max(1, chunk_bytes // itemsize)
    chunk = list(shape)
    for d in range(len(shape) - 1, -1, -1):
        inner = math.prod(chunk[d + 1:])
        if inner * max(shape[d], 1) > budget:
            chunk[d] = max(1, budget // inner)
            for e in range(d):
                chunk[e] = 1
            break
    return tuple(max(1, c) for c in chunk)


@dataclass(frozen=True)
class Policy:
    """What the writer asks for each tensor: the creation properties of its compressed dataset."""

    choice: Compression
    chunk_bytes: int

    def filter_for(self, path: str, t: torch.Tensor) -> Any:
        choice = self.choice
        if callable(choice) and not isinstance(choice, h5py.filters.FilterRefBase):
            choice = choice(path, t)
        return _filter(choice)

    def dcpl(self, path: str, t: torch.Tensor, spec: DtypeSpec) -> h5py.h5p.PropDCID | None:
        """The creation properties of the compressed dataset for tensor ``t`` at ``path``, or
        None when it is stored contiguous and uncompressed."""
        filt = self.filter_for(path, t) if self.choice is not None else None
        nbytes = t.numel() * spec.itemsize
        if filt is None or t.dim() == 0 or nbytes < MIN_COMPRESS_BYTES:
            return None
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)
        if not h5py.h5z.filter_avail(filt.filter_id):
            raise ValueError(f"HDF5 filter {filt.filter_id} for key path {path!r} is not available; import hdf5plugin")
        dcpl.set_chunk(chunk_shape(tuple(t.shape), spec.itemsize, self.chunk_bytes))
        dcpl.set_filter(filt.filter_id, h5py.h5z.FLAG_OPTIONAL, tuple(filt.filter_options))
        return dcpl


def resolve_compression(compression: Compression, chunk_bytes: int | None) -> Policy:
    """Check ``compression`` once (unknown preset names raise ValueError) and build the policy."""
    if isinstance(compression, (str, h5py.filters.FilterRefBase)) or (compression is not None and not callable(compression)):
        _filter(compression)
    chunk = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return Policy(compression, chunk)


_NAMES = {1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 32001: "blosc", 32026: "blosc2",
          32004: "lz4", 32015: "zstd", 32008: "bitshuffle"}


def describe(dcpl: h5py.h5p.PropDCID) -> dict[str, Any] | None:
    """Filters and chunk shape of a dataset's creation property list, or None if uncompressed."""
    if dcpl.get_layout() != h5py.h5d.CHUNKED or dcpl.get_nfilters() == 0:
        return None
    filters = []
    for i in range(dcpl.get_nfilters()):
        code, _flags, options, name = dcpl.get_filter(i)
        filters.append({"id": int(code), "name": _NAMES.get(code, name.decode("ascii", "replace")), "options": list(options)})
    return {"filters": filters, "chunks": list(dcpl.get_chunk())}
