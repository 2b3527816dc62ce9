"""Compression presets -> HDF5 filter pipelines, and chunk shapes. Used by the writer only:
HDF5 records the filters in each dataset, so readers need nothing from here (plain HDF5
readers need ``hdf5plugin`` imported, which :func:`ensure_plugins` does, for every preset but
``"gzip"``). The ``"gzip"`` preset's chunks are encoded here, in parallel
(:func:`write_gzip_chunks`)."""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import h5py
import numpy as np
import torch

from ..format import checksum
from ..format.dtypes import DtypeSpec, bits_view
from ..format.layout import BITSHUFFLE_ID, DEFLATE_ID, FILTERS, SHUFFLE_ID, Chunked
from ..storage import parallel
from ..storage.memory import tensor_buffer

__all__ = [
    "PRESETS", "DEFAULT_CHUNK_BYTES", "MIN_COMPRESS_BYTES", "GZIP_LEVEL", "GZIP_STRATEGY", "Compression", "Policy",
    "Gzip", "resolve_compression", "chunk_shape", "ensure_plugins", "describe", "gzip_pipeline", "layout_filter",
    "write_gzip_chunks",
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


GZIP_LEVEL = 1
"""The deflate level recorded in a ``"gzip"`` dataset's filter (what HDF5 would use if it
wrote chunks of the dataset itself)."""

GZIP_STRATEGY = zlib.Z_RLE
"""zlib's strategy for the ``"gzip"`` preset's chunks: Huffman codes and runs of one repeated
byte, no other matches. On trained all-MiniLM-L6-v2 weights, byte-shuffled, in 1 MiB chunks
(2-core VM), zlib's default strategy gives ratios float32 0.848 / bfloat16 0.721 at level 1
(0.06 GB/s a core) to 0.836 / 0.699 at level 9 (0.007 GB/s): the shuffled bytes of trained
weights hold few repeated strings, and matching them costs more than it finds. Run-length
only gives 0.822 / 0.672, better than level 9, at 0.14-0.16 GB/s a core; Huffman only gives
the same ratios but cannot shorten runs (a zero tensor: 0.126 against 0.001). Any strategy
is one deflate format: every inflater reads it."""


@dataclass(frozen=True)
class Gzip:
    """The ``"gzip"`` preset: HDF5's own byte shuffle (filter 2, by element size) then deflate
    (filter 1, zlib format) at :data:`GZIP_LEVEL`; the filters every HDF5 build has, so h5py
    without hdf5plugin, h5dump, MATLAB and HDFView read the values. Format version 3
    (docs/FORMAT.md): written only into files that hold such chunks."""

    level: int = GZIP_LEVEL
    filter_id = DEFLATE_ID

    @property
    def filter_options(self) -> tuple[int, ...]:
        return (self.level,)


PRESETS: dict[str, Callable[[], Any]] = {  # keys: constants.PRESET_NAMES (checked by the tests)
    "lz4": _bitshuffle_lz4,
    "zstd": lambda: _blosc2("zstd", 3),
    "best": lambda: _blosc2("zstd", 9),
    "gzip": Gzip,
}
"""Preset name -> factory of its filter, chosen from ratios measured on trained
all-MiniLM-L6-v2 weights (compressed/original; see README "Compression"):

- ``"lz4"``: Bitshuffle + LZ4, the fastest (float32 0.87, bfloat16 0.76);
- ``"zstd"``: Blosc2 Zstd level 3 with byte shuffle by element size (float32 0.85, bfloat16 0.72);
- ``"best"``: the same at level 9, the best ratio and slow to write (float32 0.84, bfloat16 0.70);
- ``"gzip"``: HDF5's shuffle + deflate (:class:`Gzip`), the one every HDF5 reader decodes without
  plugins (float32 0.82, bfloat16 0.67; format version 3).
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
    if isinstance(value, Gzip):
        if type(value.level) is not int or not 1 <= value.level <= 9:
            raise ValueError(f"Gzip level must be 1-9, got {value.level!r}")
        return value
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
        dcpl.set_chunk(chunk_shape(tuple(t.shape), spec.itemsize, self.chunk_bytes))
        if isinstance(filt, Gzip):  # HDF5's own: shuffle, then deflate (both optional, as HDF5 sets them)
            dcpl.set_shuffle()
            dcpl.set_deflate(filt.level)
            return dcpl
        if not h5py.h5z.filter_avail(filt.filter_id):
            raise ValueError(f"HDF5 filter {filt.filter_id} for key path {path!r} is not available; import hdf5plugin")
        dcpl.set_filter(filt.filter_id, h5py.h5z.FLAG_OPTIONAL, tuple(filt.filter_options))
        return dcpl


def resolve_compression(compression: Compression, chunk_bytes: int | None) -> Policy:
    """Check ``compression`` once (unknown preset names raise ValueError) and build the policy."""
    if isinstance(compression, (str, h5py.filters.FilterRefBase, Gzip)) or (compression is not None and not callable(compression)):
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


# ---------------------------------------------------------------------------- the "gzip" preset's chunks


def gzip_pipeline(dcpl: h5py.h5p.PropDCID) -> int | None:
    """The deflate level of a dataset whose filters are exactly HDF5's shuffle then deflate
    (the ``"gzip"`` preset: its chunks are encoded by :func:`write_gzip_chunks`), else None."""
    if dcpl.get_layout() != h5py.h5d.CHUNKED or dcpl.get_nfilters() != 2:
        return None
    first, second = dcpl.get_filter(0), dcpl.get_filter(1)
    if (first[0], second[0]) != (SHUFFLE_ID, DEFLATE_ID):
        return None
    return int(second[2][0]) if len(second[2]) == 1 else None


def layout_filter(dcpl: h5py.h5p.PropDCID) -> tuple[int, tuple[int, ...]]:
    """``(id, client values)`` of the one filter the layout records for a compressed dataset
    (docs/FORMAT.md, the filter table): the deflate of a shuffle + deflate pipeline (format
    3), else the dataset's single filter."""
    code, _flags, values, _name = dcpl.get_filter(1 if gzip_pipeline(dcpl) is not None else 0)
    return int(code), tuple(int(v) for v in values)


GZIP_AHEAD = 2 * parallel.IO_THREADS + 2
"""Chunks of a ``"gzip"`` dataset encoded ahead of the one being written (each holds its
chunk's bytes, shuffled and compressed: ~3 chunk sizes)."""


def _encode(piece: torch.Tensor, chunk_bytes: int, itemsize: int, level: int) -> tuple[Any, int, int]:
    """``(stored bytes, HDF5 filter mask, xxh3 of the logical bytes)`` of one chunk whose
    logical bytes are those of ``piece``: padded with zeros to the chunk's bytes, shuffled by
    element, deflated; stored raw (both filters skipped: mask 3) where deflate does not shrink it."""
    piece = piece.contiguous().cpu()
    valid = tensor_buffer(piece) if piece.numel() else memoryview(b"")
    digest = checksum.digest(valid)
    if len(valid) == chunk_bytes:
        data = np.frombuffer(valid, np.uint8)
    else:  # the last chunk along the blocked dimension: HDF5 stores whole chunks
        data = np.zeros(chunk_bytes, np.uint8)
        data[:len(valid)] = np.frombuffer(valid, np.uint8)
    shuffled = np.ascontiguousarray(data.reshape(-1, itemsize).T) if itemsize > 1 else data
    z = zlib.compressobj(level, zlib.DEFLATED, 15, 8, GZIP_STRATEGY)
    stored = z.compress(shuffled) + z.flush()
    if len(stored) >= chunk_bytes:
        return data, 3, digest
    return stored, 0, digest


def write_gzip_chunks(dsid: h5py.h5d.DatasetID, t: torch.Tensor, chunk: tuple[int, ...], itemsize: int,
                      level: int) -> tuple[int, ...]:
    """Write every chunk of the ``"gzip"`` dataset ``dsid`` (of ``t``'s shape, chunked as
    ``chunk``: a run of whole rows each) as HDF5's shuffle + deflate would store it, encoded
    on the I/O threads (zlib releases the GIL) and written in order with ``H5Dwrite_chunk``;
    returns the XXH3 of each chunk's logical bytes. ``t`` may be strided or on a device: each
    chunk is made contiguous on the CPU on its own."""
    shape = tuple(t.shape)
    shuffle = dsid.get_create_plist().get_filter(0)[2]  # HDF5's set_local: the element size of the file type
    if tuple(shuffle) != (itemsize,):
        raise ValueError(f"HDF5 shuffles elements of {list(shuffle)} bytes, the tensor's are {itemsize}")
    bits = bits_view(t)
    geometry = Chunked(shape, itemsize, chunk, DEFLATE_ID, (level,), ())
    chunk_bytes = geometry.chunk_bytes
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    count = math.prod(grid)

    def corner(k: int) -> tuple[int, ...]:
        out = []
        for g, c in zip(reversed(grid), reversed(chunk)):
            k, i = divmod(k, g)
            out.append(i * c)
        return tuple(reversed(out))

    results: list[Any] = [None] * count

    def job(k: int) -> Callable[[], None]:
        piece = bits[tuple(slice(a, a + c) for a, c in zip(corner(k), chunk))]  # a view: copied on the thread

        def encode() -> None:
            results[k] = _encode(piece, chunk_bytes, itemsize, level)
        return encode

    hashes = []
    pending: deque[tuple[int, Any]] = deque()

    def write_next() -> None:
        k, future = pending.popleft()
        future.result()
        stored, mask, digest = results[k]
        results[k] = None
        dsid.write_direct_chunk(corner(k), stored, filter_mask=mask)
        hashes.append(digest)

    try:
        for k in range(count):
            pending.append((k, parallel.submit_jobs([job(k)])[0]))
            if len(pending) > GZIP_AHEAD:
                write_next()
        while pending:
            write_next()
    except BaseException:
        for _, future in pending:  # nothing runs on after a failed write
            future.cancel()
        for _, future in pending:
            if not future.cancelled():
                future.exception()
        raise
    return tuple(hashes)
