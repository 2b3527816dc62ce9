"""Parallel decode of compressed datasets, byte-identical to HDF5's filter path.

HDF5 decodes a filtered dataset one chunk at a time, under h5py's global lock, on one core.
For datasets whose chunks are blocks of whole rows (what the writer makes, and what most
writers make for weights) and whose pipeline is a single filter this module knows, the raw
chunks are instead read with ``os.preadv`` and decoded by the very filter libraries that
``hdf5plugin`` ships and HDF5 itself calls (through ``ctypes``, which releases the GIL), on the
I/O thread pool. Known filters: Blosc2 (32026, plain and B2ND frames) and Bitshuffle (32008)
with LZ4 or Zstd. Any other dataset, and any chunk this module cannot decode, is read by HDF5.

Because row-block chunks are consecutive byte ranges of the row-major array, a compressed
dataset is read here like an uncompressed one: any byte range ``[offset, offset + n)`` of its
logical bytes, decoding only the chunks it touches. Chunks entirely inside the range decode
straight into the destination; the edge chunks (and HDF5's padded last chunk) decode into a
per-thread scratch buffer of one chunk.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from .io import read_hdf5, run_jobs
from .slicing import rows

__all__ = ["PARALLEL_DECODE", "DECODE_COST", "DecodeError", "RowChunks", "row_chunks", "decoder_for"]

PARALLEL_DECODE = True
"""Decode known filters here, in parallel; False sends every compressed read through HDF5's
own (single-threaded) filter path, as the benchmark does to compare the two."""

DECODE_COST = 8
"""Decoding a byte costs about as much as reading this many (batches of jobs are sized by cost)."""

BLOSC2_ID = 32026
BITSHUFFLE_ID = 32008
_BSHUF_LZ4, _BSHUF_ZSTD = 2, 3


class DecodeError(Exception):
    """A chunk that this module could not decode (the caller reads it through HDF5)."""


Decoder = Callable[[Any, int, int, int], None]
"""decode(src buffer, src bytes, destination address, destination bytes): fill exactly
``destination bytes`` bytes or raise DecodeError."""


_libs: dict[str, Any] = {}
_libs_lock = threading.Lock()


def _library(name: str) -> Any | None:
    """hdf5plugin's filter library ``name`` (the same file HDF5 loaded), or None."""
    with _libs_lock:
        if name not in _libs:
            try:
                import hdf5plugin

                lib = ctypes.CDLL(f"{hdf5plugin.PLUGIN_PATH}/{name}")
                _declare(name, lib)
            except (ImportError, OSError, AttributeError):
                lib = None
            _libs[name] = lib
        return _libs[name]


def _declare(name: str, lib: Any) -> None:
    vp, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    if name == "libh5bshuf.so":
        for fn in (lib.bshuf_decompress_lz4, lib.bshuf_decompress_zstd):
            fn.argtypes = [vp, vp, sz, sz, sz]
            fn.restype = i64
    else:
        lib.blosc2_init.argtypes = []
        lib.blosc2_init.restype = None
        lib.blosc2_schunk_from_buffer.argtypes = [vp, i64, ctypes.c_bool]
        lib.blosc2_schunk_from_buffer.restype = vp
        lib.blosc2_schunk_decompress_chunk.argtypes = [vp, i64, vp, ctypes.c_int32]
        lib.blosc2_schunk_decompress_chunk.restype = ctypes.c_int
        lib.blosc2_schunk_free.argtypes = [vp]
        lib.blosc2_schunk_free.restype = ctypes.c_int
        lib.b2nd_from_cframe.argtypes = [vp, i64, ctypes.c_bool, ctypes.POINTER(vp)]
        lib.b2nd_from_cframe.restype = ctypes.c_int
        lib.b2nd_to_cbuffer.argtypes = [vp, vp, i64]
        lib.b2nd_to_cbuffer.restype = ctypes.c_int
        lib.b2nd_free.argtypes = [vp]
        lib.b2nd_free.restype = ctypes.c_int
        lib.blosc2_init()


def _bitshuffle(lib: Any, codec: int, elem_size: int) -> Decoder:
    fn = lib.bshuf_decompress_lz4 if codec == _BSHUF_LZ4 else lib.bshuf_decompress_zstd

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        # Chunk header: uint64 BE decoded bytes, uint32 BE block size in bytes.
        head = bytes(memoryview(src)[:12]) if n >= 12 else b""
        if len(head) < 12:
            raise DecodeError("bitshuffle chunk shorter than its header")
        total, block = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:12], "big")
        if total != dst_n or total % elem_size or block % elem_size:
            raise DecodeError(f"bitshuffle chunk holds {total} bytes, expected {dst_n}")
        got = fn(ctypes.addressof(src) + 12, dst, total // elem_size, elem_size, block // elem_size)
        if got < 0 or got > n - 12:
            raise DecodeError(f"bitshuffle decode failed ({got})")

    return decode


def _blosc2(lib: Any, b2nd_first: bool) -> Decoder:
    def b2nd(src: Any, n: int, dst: int, dst_n: int) -> bool:
        array = ctypes.c_void_p()
        if lib.b2nd_from_cframe(ctypes.addressof(src), n, False, ctypes.byref(array)) < 0 or not array.value:
            return False
        try:
            return lib.b2nd_to_cbuffer(array, dst, dst_n) >= 0
        finally:
            lib.b2nd_free(array)

    def plain(src: Any, n: int, dst: int, dst_n: int) -> bool:
        schunk = lib.blosc2_schunk_from_buffer(ctypes.addressof(src), n, False)
        if not schunk:
            return False
        try:
            return lib.blosc2_schunk_decompress_chunk(schunk, 0, dst, dst_n) == dst_n
        finally:
            lib.blosc2_schunk_free(schunk)

    order = (b2nd, plain) if b2nd_first else (plain, b2nd)

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        if not (order[0](src, n, dst, dst_n) or order[1](src, n, dst, dst_n)):
            raise DecodeError("Blosc2 frame could not be decoded")

    return decode


def decoder_for(dcpl: h5py.h5p.PropDCID, itemsize: int) -> Decoder | None:
    """The decoder of a dataset's filter pipeline, or None if it is not one known filter."""
    if dcpl.get_nfilters() != 1:
        return None
    code, _flags, values, _name = dcpl.get_filter(0)
    if code == BITSHUFFLE_ID and len(values) >= 5 and values[4] in (_BSHUF_LZ4, _BSHUF_ZSTD):
        lib = _library("libh5bshuf.so")
        return None if lib is None else _bitshuffle(lib, values[4], values[2] or itemsize)
    if code == BLOSC2_ID:
        lib = _library("libh5blosc2.so")
        return None if lib is None else _blosc2(lib, b2nd_first=len(values) >= 8)
    return None


_scratch = threading.local()


def _buffer(name: str, n: int) -> Any:
    """A per-thread ctypes byte buffer of at least ``n`` bytes (reused between chunks)."""
    buf = getattr(_scratch, name, None)
    if buf is None or len(buf) < n:
        buf = (ctypes.c_char * max(n, 1))()
        setattr(_scratch, name, buf)
    return buf


@dataclass(frozen=True)
class _Chunk:
    offset: int  # file offset of the stored chunk
    size: int  # stored bytes
    filtered: bool  # False when HDF5 skipped the (optional) filter and stored the bytes raw


class RowChunks:
    """The chunk index and decoder of one row-chunked, filtered dataset.

    Chunk ``k`` holds logical bytes ``[k * chunk_bytes, (k + 1) * chunk_bytes)`` of the
    row-major array (the last one is padded by HDF5 to a full chunk).
    """

    def __init__(self, dsid: h5py.h5d.DatasetID, chunks: list[_Chunk], chunk_bytes: int, nbytes: int,
                 chunk_rows: int, decode: Decoder) -> None:
        self._dsid = dsid
        self.chunks = chunks
        self.chunk_bytes = chunk_bytes
        self.nbytes = nbytes
        self._chunk_rows = chunk_rows
        self._decode = decode
        self.fallbacks = 0  # chunks read through HDF5 because they did not decode here

    def tasks(self, pread: Callable[[int, memoryview], None], offset: int, dest: Any) -> list[Callable[[], None]]:
        """Jobs that together fill ``dest`` (a writable buffer: numpy uint8 array or memoryview)
        with logical bytes ``[offset, offset + len(dest))``, one job per touched chunk."""
        n = len(dest)
        if n == 0:
            return []
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"byte range {offset}..{offset + n} outside the dataset's {self.nbytes} bytes")
        address = np.frombuffer(dest, dtype=np.uint8).ctypes.data
        cb = self.chunk_bytes
        jobs = []
        for k in range(offset // cb, (offset + n - 1) // cb + 1):
            lo, hi = max(offset, k * cb), min(offset + n, (k + 1) * cb)
            jobs.append(_Job(self, pread, k, lo - k * cb, hi - lo, address + lo - offset))
        return jobs

    def read(self, pread: Callable[[int, memoryview], None], offset: int, dest: Any) -> None:
        """Fill ``dest`` with logical bytes from ``offset``, decoding the chunks on the thread pool."""
        run_jobs(self.tasks(pread, offset, dest))

    def _chunk_into(self, pread: Callable[[int, memoryview], None], k: int, dst: int) -> None:
        """Decode chunk ``k`` (``chunk_bytes`` bytes) to address ``dst``."""
        c = self.chunks[k]
        if not c.filtered and c.size == self.chunk_bytes:
            pread(c.offset, memoryview((ctypes.c_char * c.size).from_address(dst)).cast("B"))
            return
        src = _buffer("raw", c.size)
        pread(c.offset, memoryview(src).cast("B")[:c.size])
        try:
            if not c.filtered:
                raise DecodeError("unfiltered chunk of an unexpected size")
            self._decode(src, c.size, dst, self.chunk_bytes)
        except DecodeError:
            self.fallbacks += 1
            self._hdf5_chunk(k, dst)

    def _hdf5_chunk(self, k: int, dst: int) -> None:
        """HDF5's own read of chunk ``k``'s rows (its filter path) to address ``dst``."""
        rows_total = self._dsid.shape[0]
        first = k * self._chunk_rows
        stop = min(rows_total, first + self._chunk_rows)
        nbytes = (stop - first) * (self.chunk_bytes // self._chunk_rows)
        out = torch.frombuffer((ctypes.c_char * max(nbytes, 1)).from_address(dst), dtype=torch.uint8)[:nbytes]
        read_hdf5(self._dsid, self._dsid.get_type(), out, rows(self._dsid.shape, first, stop))


@dataclass
class _Job:
    """Fill ``n`` bytes at address ``dst`` from byte ``lo`` of chunk ``k``."""

    chunks: RowChunks
    pread: Callable[[int, memoryview], None]
    k: int
    lo: int
    n: int
    dst: int

    def __call__(self) -> None:
        rc = self.chunks
        if self.lo == 0 and self.n == rc.chunk_bytes:
            rc._chunk_into(self.pread, self.k, self.dst)
            return
        scratch = _buffer("chunk", rc.chunk_bytes)
        rc._chunk_into(self.pread, self.k, ctypes.addressof(scratch))
        ctypes.memmove(self.dst, ctypes.addressof(scratch) + self.lo, self.n)


def row_chunks(dsid: h5py.h5d.DatasetID, itemsize: int, dcpl: h5py.h5p.PropDCID | None = None) -> RowChunks | None:
    """The :class:`RowChunks` of a chunked, filtered dataset whose chunks are blocks of whole
    rows and whose filter this module decodes; None for anything else (read by HDF5).
    ``dcpl``: the dataset's creation properties, where the caller has them already."""
    dcpl = dsid.get_create_plist() if dcpl is None else dcpl
    if not PARALLEL_DECODE or dcpl.get_layout() != h5py.h5d.CHUNKED or dcpl.get_nfilters() == 0:
        return None
    shape = dsid.shape
    chunk = dcpl.get_chunk()
    if not shape or tuple(chunk[1:]) != tuple(shape[1:]) or dsid.get_type().get_size() != itemsize:
        return None
    decode = decoder_for(dcpl, itemsize)
    if decode is None:
        return None
    row_bytes = itemsize * math.prod(shape[1:])
    nbytes = row_bytes * shape[0]
    expected = -(-shape[0] // chunk[0]) if nbytes else 0
    found: dict[int, _Chunk] = {}

    def visit(info: Any) -> None:
        found[info.chunk_offset[0] // chunk[0]] = _Chunk(info.byte_offset, info.size, info.filter_mask == 0)

    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(visit)
    else:  # pragma: no cover - h5py < 3.8
        for i in range(dsid.get_num_chunks()):
            visit(dsid.get_chunk_info(i))
    if len(found) != expected or any(k not in found for k in range(expected)):
        return None  # unwritten chunks (fill values): HDF5 knows what to return
    return RowChunks(dsid, [found[k] for k in range(expected)], row_bytes * chunk[0], nbytes, chunk[0], decode)
