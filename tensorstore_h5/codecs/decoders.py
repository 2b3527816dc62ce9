"""Decoding compressed chunks: in parallel, and with every chunk checked before a decoder sees it.

HDF5 decodes a filtered dataset one chunk at a time, under h5py's global lock, on one core,
and trusts every chunk. Here the stored chunks of a :class:`~tensorstore_h5.format.layout.Chunked`
extent are read with ``os.preadv`` and decoded by the very filter libraries that
``hdf5plugin`` ships (through ``ctypes``, which releases the GIL) on the I/O thread pool.
Because every chunk is one consecutive run of the logical bytes, a compressed dataset is
read like an uncompressed one: any byte range, decoding only the chunks it touches.

Hostile chunks: the C decoders trust lengths inside the chunk, so before calling one this
module checks the framing against the chunk's stored size and its decoded size against the
chunk's: Bitshuffle's block table is walked and must account for exactly the stored bytes;
a Blosc2 frame must have the dataset's type size, and a B2ND frame exactly the chunk's shape.
Every decode must fill exactly the chunk's bytes, or :class:`DecodeError` is raised: no byte
of output is ever left unwritten.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..format import checksum
from ..format.layout import BITSHUFFLE_ID, BLOSC2_ID, Chunked
from ..storage.parallel import run_jobs

__all__ = ["DECODE_COST", "DecodeError", "ChunkReader", "decoder_for"]

DECODE_COST = 8
"""Decoding a byte costs about as much as reading this many (batches of jobs are sized by cost)."""

_BSHUF_LZ4, _BSHUF_ZSTD = 2, 3
_BSHUF_BLOCKED_MULT = 8  # bitshuffle blocks hold a multiple of 8 elements


class DecodeError(Exception):
    """A chunk that does not decode to exactly its bytes (damaged or hostile)."""


Decoder = Callable[[Any, int, int, int], None]
"""decode(src buffer, src bytes, destination address, destination bytes): fill exactly
``destination bytes`` bytes or raise DecodeError."""

_libs: dict[str, Any] = {}
_libs_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    """In a forked child the parent's lock may have been held by a thread that is not there."""
    global _libs_lock
    _libs_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def _library(name: str) -> Any:
    """hdf5plugin's filter library ``name`` (the same file HDF5 loads). Raises DecodeError
    when hdf5plugin or the library is missing."""
    with _libs_lock:
        if name not in _libs:
            try:
                import hdf5plugin

                lib = ctypes.CDLL(f"{hdf5plugin.PLUGIN_PATH}/{name}")
                _declare(name, lib)
            except (ImportError, OSError, AttributeError) as e:
                lib = e
            _libs[name] = lib
        lib = _libs[name]
    if isinstance(lib, Exception):
        raise DecodeError(f"cannot load hdf5plugin's {name} ({lib}); install hdf5plugin")
    return lib


def _declare(name: str, lib: Any) -> None:
    vp, i64, sz, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int32
    if name == "libh5bshuf.so":
        for fn in (lib.bshuf_decompress_lz4, lib.bshuf_decompress_zstd):
            fn.argtypes = [vp, vp, sz, sz, sz]
            fn.restype = i64
        return
    lib.blosc2_init.argtypes = []
    lib.blosc2_init.restype = None
    lib.blosc2_schunk_from_buffer.argtypes = [vp, i64, ctypes.c_bool]
    lib.blosc2_schunk_from_buffer.restype = vp
    lib.blosc2_schunk_decompress_chunk.argtypes = [vp, i64, vp, i32]
    lib.blosc2_schunk_decompress_chunk.restype = ctypes.c_int
    lib.blosc2_schunk_free.argtypes = [vp]
    lib.blosc2_schunk_free.restype = ctypes.c_int
    lib.b2nd_from_schunk.argtypes = [vp, ctypes.POINTER(vp)]
    lib.b2nd_from_schunk.restype = ctypes.c_int
    lib.b2nd_to_cbuffer.argtypes = [vp, vp, i64]
    lib.b2nd_to_cbuffer.restype = ctypes.c_int
    lib.b2nd_free.argtypes = [vp]
    lib.b2nd_free.restype = ctypes.c_int
    lib.blosc2_init()


# ---------------------------------------------------------------------------- Bitshuffle


def bitshuffle_consumed(data: memoryview, elem_size: int, total: int, block_bytes: int) -> int:
    """Bytes that a Bitshuffle chunk body (after its 12-byte header) of ``total`` decoded
    bytes occupies, from its block table; DecodeError when the table runs past ``data``."""
    size, block = total // elem_size, block_bytes // elem_size
    blocks = [block] * (size // block)
    last = size % block
    last -= last % _BSHUF_BLOCKED_MULT
    if last:
        blocks.append(last)
    pos, n = 0, len(data)
    for _ in blocks:
        if pos + 4 > n:
            raise DecodeError("bitshuffle chunk ends inside its block table")
        pos += 4 + int.from_bytes(data[pos:pos + 4], "big")
        if pos > n:
            raise DecodeError("bitshuffle block runs past the end of its chunk")
    return pos + (size % _BSHUF_BLOCKED_MULT) * elem_size  # the last elements are stored as they are


def _bitshuffle(codec: int, elem_size: int) -> Decoder:
    lib = _library("libh5bshuf.so")
    fn = lib.bshuf_decompress_lz4 if codec == _BSHUF_LZ4 else lib.bshuf_decompress_zstd

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        view = memoryview(src).cast("B")[:n]
        if n < 12:
            raise DecodeError("bitshuffle chunk shorter than its header")
        total, block = int.from_bytes(view[:8], "big"), int.from_bytes(view[8:12], "big")
        if total != dst_n or total % elem_size:
            raise DecodeError(f"bitshuffle chunk holds {total} bytes, expected {dst_n}")
        if block <= 0 or block % elem_size or (block // elem_size) % _BSHUF_BLOCKED_MULT:
            raise DecodeError(f"bitshuffle block size {block} is not a multiple of 8 elements of {elem_size} bytes")
        if bitshuffle_consumed(view[12:], elem_size, total, block) != n - 12:
            raise DecodeError("bitshuffle block table does not account for the chunk's stored bytes")
        got = fn(ctypes.addressof(src) + 12, dst, total // elem_size, elem_size, block // elem_size)
        if got != n - 12:
            raise DecodeError(f"bitshuffle decode failed ({got})")

    return decode


# ---------------------------------------------------------------------------- Blosc2

_FRAME_MAGIC = b"b2frame\x00"
_FRAME_TYPESIZE = 47  # msgpack int32 marker, then the type size (big-endian), in every cframe header
_FRAME_METALAYERS = 87  # fixarray(3), uint16 index size, map16 of {name: int32 offset of its content}


def frame_metalayer(frame: bytes, names: tuple[bytes, ...] = (b"b2nd", b"caterva")) -> bytes | None:
    """The content of the first metalayer called one of ``names`` in a Blosc2 frame header
    (see c-blosc2's README_CFRAME_FORMAT), or None when it has none. Raises DecodeError for
    a header that does not parse."""
    try:
        if frame[10] != 0xD2:
            raise DecodeError("Blosc2 frame header has no size")
        hsize = struct.unpack_from(">i", frame, 11)[0]
        if not _FRAME_METALAYERS + 7 <= hsize <= len(frame):
            raise DecodeError("Blosc2 frame header size out of range")
        pos = _FRAME_METALAYERS
        if frame[pos] != 0x93 or frame[pos + 1] != 0xCD or frame[pos + 4] != 0xDE:
            raise DecodeError("Blosc2 frame header without a metalayer map")
        count = struct.unpack_from(">H", frame, pos + 5)[0]
        pos += 7
        for _ in range(count):
            n = frame[pos] - 0xA0
            if not 0 <= n < 32:
                raise DecodeError("Blosc2 metalayer name is not a short string")
            name = frame[pos + 1:pos + 1 + n]
            pos += 1 + n
            if frame[pos] != 0xD2:
                raise DecodeError("Blosc2 metalayer offset is not int32")
            at = struct.unpack_from(">i", frame, pos + 1)[0]
            pos += 5
            if name in names:
                if not 0 < at <= hsize - 5 or frame[at] != 0xC6:
                    raise DecodeError("Blosc2 metalayer content out of the header")
                length = struct.unpack_from(">i", frame, at + 1)[0]
                if not 0 <= length <= hsize - at - 5:
                    raise DecodeError("Blosc2 metalayer content out of the header")
                return bytes(frame[at + 5:at + 5 + length])
    except (IndexError, struct.error):
        raise DecodeError("truncated Blosc2 frame header") from None
    return None


def b2nd_shape(meta: bytes) -> tuple[int, ...]:
    """The array shape in a ``b2nd`` metalayer (msgpack: [version, ndim, shape, chunkshape,
    blockshape, dtype format, dtype]). Raises DecodeError for anything else."""
    try:
        if meta[0] & 0xF0 != 0x90 or meta[1] > 0x7F or meta[2] > 0x7F or meta[3] != 0x90 + meta[2]:
            raise DecodeError("not a b2nd metalayer")
        ndim, pos, shape = meta[2], 4, []
        for _ in range(ndim):
            if meta[pos] != 0xD3:
                raise DecodeError("b2nd shape is not int64")
            shape.append(struct.unpack_from(">q", meta, pos + 1)[0])
            pos += 9
    except (IndexError, struct.error):
        raise DecodeError("truncated b2nd metalayer") from None
    return tuple(shape)


def _blosc2(itemsize: int, chunk_shape: tuple[int, ...]) -> Decoder:
    lib = _library("libh5blosc2.so")

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        frame = memoryview(src).cast("B")[:n]
        if n < 52 or frame[2:10] != _FRAME_MAGIC or frame[_FRAME_TYPESIZE] != 0xD2:
            raise DecodeError("not a Blosc2 frame")
        if struct.unpack_from(">i", frame, _FRAME_TYPESIZE + 1)[0] != itemsize:
            raise DecodeError(f"Blosc2 frame of another type size than the dataset's {itemsize}")
        meta = frame_metalayer(frame)
        if meta is not None and b2nd_shape(meta) != chunk_shape:
            raise DecodeError(f"B2ND frame of shape {list(b2nd_shape(meta))}, expected {list(chunk_shape)}")
        schunk = lib.blosc2_schunk_from_buffer(ctypes.addressof(src), n, False)
        if not schunk:
            raise DecodeError("Blosc2 frame could not be parsed")
        if meta is None:  # a plain frame: its first chunk must be exactly the chunk's bytes
            try:
                if lib.blosc2_schunk_decompress_chunk(schunk, 0, dst, dst_n) != dst_n:
                    raise DecodeError("Blosc2 frame does not decode to the chunk's bytes")
            finally:
                lib.blosc2_schunk_free(schunk)
            return
        array = ctypes.c_void_p()  # B2ND: an array of exactly the chunk's shape and type size
        if lib.b2nd_from_schunk(schunk, ctypes.byref(array)) < 0 or not array.value:
            lib.blosc2_schunk_free(schunk)
            raise DecodeError("B2ND frame could not be parsed")
        try:  # the array owns the super-chunk now
            if lib.b2nd_to_cbuffer(array, dst, dst_n) < 0:
                raise DecodeError("B2ND frame could not be decoded")
        finally:
            lib.b2nd_free(array)

    return decode


def decoder_for(extent: Chunked) -> Decoder:
    """The decoder of an extent's filter (checked by ``format.check_chunked``)."""
    if extent.filter_id == BITSHUFFLE_ID:
        return _bitshuffle(extent.filter_values[4], extent.itemsize)
    if extent.filter_id == BLOSC2_ID:
        return _blosc2(extent.itemsize, extent.chunk_shape)
    raise DecodeError(f"no decoder for filter {extent.filter_id}")


# ---------------------------------------------------------------------------- reading chunks

_scratch = threading.local()


def _buffer(name: str, n: int) -> Any:
    """A per-thread ctypes byte buffer of at least ``n`` bytes (reused between chunks)."""
    buf = getattr(_scratch, name, None)
    if buf is None or len(buf) < n:
        buf = (ctypes.c_char * max(n, 1))()
        setattr(_scratch, name, buf)
    return buf


Pread = Callable[[int, memoryview], None]


class ChunkReader:
    """Reads logical byte ranges of a :class:`Chunked` extent, one job per touched chunk.

    With ``verify``, each chunk's logical bytes are checked against its recorded hash right
    after they are decoded (raising ``checksum.ChecksumError``).
    """

    def __init__(self, extent: Chunked, pread: Pread, verify: bool = False) -> None:
        self.extent = extent
        self._pread = pread
        self._decode = decoder_for(extent)
        self._verify = verify and extent.hashes is not None
        self.chunk_bytes = extent.chunk_bytes

    def tasks(self, offset: int, dest: Any) -> list[Callable[[], None]]:
        """Jobs that together fill ``dest`` (a writable buffer) with logical bytes
        ``[offset, offset + len(dest))``. With ``verify`` every touched chunk is read whole."""
        view = memoryview(dest).cast("B")
        n = len(view)
        if n == 0:
            return []
        ext = self.extent
        if offset < 0 or offset + n > ext.nbytes:
            raise ValueError(f"byte range {offset}..{offset + n} outside the dataset's {ext.nbytes} bytes")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        jobs = []
        k = ext.locate(offset)
        while True:
            start, valid = ext.span(k)
            if start >= offset + n:
                break
            lo, hi = max(offset, start), min(offset + n, start + valid)
            jobs.append(_Job(self, k, lo - start, hi - lo, address + lo - offset))
            k += 1
            if k >= len(ext.chunks):
                break
        return jobs

    def read(self, offset: int, dest: Any) -> None:
        """Fill ``dest`` with logical bytes from ``offset``, decoding chunks on the thread pool."""
        run_jobs(self.tasks(offset, dest))

    def decode_chunk(self, k: int, dst: int) -> None:
        """Decode chunk ``k`` (``chunk_bytes`` bytes) to address ``dst``; check its hash."""
        off, size, raw = self.extent.chunks[k]
        if raw:
            self._pread(off, memoryview((ctypes.c_char * size).from_address(dst)).cast("B"))
        else:
            src = _buffer("raw", size)
            self._pread(off, memoryview(src).cast("B")[:size])
            self._decode(src, size, dst, self.chunk_bytes)
        if self._verify:
            valid = self.extent.span(k)[1]
            assert self.extent.hashes is not None
            if checksum.digest(memoryview((ctypes.c_char * valid).from_address(dst)).cast("B")) != self.extent.hashes[k]:
                raise checksum.ChecksumError(f"chunk {k}")


@dataclass
class _Job:
    """Fill ``n`` bytes at address ``dst`` from byte ``lo`` of chunk ``k``."""

    reader: ChunkReader
    k: int
    lo: int
    n: int
    dst: int

    def __call__(self) -> None:
        rc = self.reader
        if self.lo == 0 and self.n == rc.chunk_bytes:
            rc.decode_chunk(self.k, self.dst)
            return
        scratch = _buffer("chunk", rc.chunk_bytes)
        rc.decode_chunk(self.k, ctypes.addressof(scratch))
        ctypes.memmove(self.dst, ctypes.addressof(scratch) + self.lo, self.n)
