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
a Blosc2 frame must be one contiguous frame of exactly its stored bytes holding one chunk of
the dataset's type size, whose chunk header (sizes, block size, flags) is checked before it
is decoded, and a B2ND frame must hold exactly the chunk's shape in blocks that fit it.
c-blosc2's "uninitialized" special chunks, which decode by leaving the output as it was, are
refused. A shuffle + deflate chunk (format 3, the "gzip" preset) is inflated by zlib, or
python-isal where installed, with its output bounded by the chunk's bytes (``max_length``): it
must end exactly there, with no stored byte after it. Every decode must fill exactly the
chunk's bytes, or :class:`DecodeError` is raised: no byte of output is ever left unwritten.

Memory: a decode allocates at most twice the chunk's bytes (:data:`B2ND_SCRATCH`), plus the
codecs' own scratch (a few times a block, blocks being at most a chunk). B2ND chunks are
decoded here, not by c-blosc2's b2nd code, which decodes into a scratch buffer of the chunk
padded to whole blocks: up to 2^ndim times the chunk (18x in files hdf5plugin writes for odd
shapes, more when crafted).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import checksum
from . import DecodeError
from ..format.layout import BITSHUFFLE_ID, BLOSC2_ID, DEFLATE_ID, Chunked
from ..storage.parallel import run_jobs

__all__ = ["DECODE_COST", "DecodeError", "ChunkReader", "decoder_for", "INFLATE"]

DECODE_COST = 8
"""Decoding a byte costs about as much as reading this many (batches of jobs are sized by cost)."""

_BSHUF_LZ4, _BSHUF_ZSTD = 2, 3
_BSHUF_BLOCKED_MULT = 8  # bitshuffle blocks hold a multiple of 8 elements


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
    lib.blosc2_unshuffle.argtypes = [i32, i32, vp, vp]  # (type size, bytes, src, dst): the "gzip" preset's unshuffle
    lib.blosc2_unshuffle.restype = i32
    lib.blosc2_init.argtypes = []
    lib.blosc2_init.restype = None
    lib.blosc2_schunk_from_buffer.argtypes = [vp, i64, ctypes.c_bool]
    lib.blosc2_schunk_from_buffer.restype = vp
    lib.blosc2_schunk_decompress_chunk.argtypes = [vp, i64, vp, i32]
    lib.blosc2_schunk_decompress_chunk.restype = ctypes.c_int
    lib.blosc2_schunk_free.argtypes = [vp]
    lib.blosc2_schunk_free.restype = ctypes.c_int
    lib.blosc2_schunk_get_lazychunk.argtypes = [vp, i64, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_bool)]
    lib.blosc2_schunk_get_lazychunk.restype = ctypes.c_int
    lib.blosc2_getitem.argtypes = [vp, i32, ctypes.c_int, ctypes.c_int, vp, i32]
    lib.blosc2_getitem.restype = ctypes.c_int
    lib.blosc2_init()


_libc_handle: Any = None


def _libc() -> Any:
    """The C library (``free`` of what c-blosc2 allocated for the caller)."""
    global _libc_handle
    if _libc_handle is None:
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
        _libc_handle = libc
    return _libc_handle


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
_FRAME_MARKERS = ((10, 0xD2), (15, 0xCF), (24, 0xA4), (29, 0xD3), (38, 0xD3), (47, 0xD2), (52, 0xD2), (57, 0xD2))
"""msgpack markers of the cframe header's fields: header size (int32), frame size (uint64),
flags (4 bytes), decoded and stored bytes (int64), type size, block size, chunk size (int32)."""


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


def b2nd_geometry(meta: bytes) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(shape, chunk shape, block shape)`` of a ``b2nd`` metalayer (msgpack: [version, ndim,
    shape (int64s), chunk shape (int32s), block shape (int32s), dtype format, dtype]). Raises
    DecodeError for anything else."""
    try:
        if meta[0] & 0xF0 != 0x90 or meta[0] & 0x0F < 5 or meta[1] > 0x7F or meta[2] > 0x7F or meta[3] != 0x90 + meta[2]:
            raise DecodeError("not a b2nd metalayer")
        ndim, pos, dims = meta[2], 4, []
        for i, (marker, code, width) in enumerate(((0xD3, ">q", 9), (0xD2, ">i", 5), (0xD2, ">i", 5))):
            if i and meta[pos] != 0x90 + ndim:
                raise DecodeError("b2nd chunk or block shape of another rank")
            pos += 1 if i else 0
            part = []
            for _ in range(ndim):
                if meta[pos] != marker:
                    raise DecodeError("b2nd shape of another integer type")
                part.append(struct.unpack_from(code, meta, pos + 1)[0])
                pos += width
            dims.append(tuple(part))
    except (IndexError, struct.error):
        raise DecodeError("truncated b2nd metalayer") from None
    return dims[0], dims[1], dims[2]


def b2nd_shape(meta: bytes) -> tuple[int, ...]:
    """The array shape in a ``b2nd`` metalayer (see :func:`b2nd_geometry`)."""
    return b2nd_geometry(meta)[0]


def frame_header(frame: Any, n: int) -> tuple[int, int]:
    """``(header bytes, decoded bytes)`` of a Blosc2 frame of exactly ``n`` bytes: contiguous
    (not sparse), with fixed-size chunks of which it holds one. Raises DecodeError for any
    other frame, before c-blosc2 reads it."""
    if n < _FRAME_METALAYERS + 7 or frame[2:10] != _FRAME_MAGIC:
        raise DecodeError("not a Blosc2 frame")
    if any(frame[at] != marker for at, marker in _FRAME_MARKERS):
        raise DecodeError("Blosc2 frame header does not parse")
    header_len = struct.unpack_from(">i", frame, 11)[0]
    frame_len, nbytes, cbytes = struct.unpack_from(">Q", frame, 16)[0], *struct.unpack_from(">qxq", frame, 30)
    chunksize = struct.unpack_from(">i", frame, 58)[0]
    if frame_len != n:
        raise DecodeError(f"Blosc2 frame of {frame_len} bytes stored in {n}")
    if not _FRAME_METALAYERS + 7 <= header_len <= n or not 0 <= cbytes <= n - header_len:
        raise DecodeError("Blosc2 frame header or data sizes out of range")
    if frame[25] & 0xC0 or frame[26] != 0:
        raise DecodeError("Blosc2 frame of variable chunks or blocks, or not contiguous")
    if nbytes <= 0 or chunksize != nbytes:
        raise DecodeError(f"Blosc2 frame of {nbytes} bytes in chunks of {chunksize}, not one chunk")
    return header_len, nbytes


_BLOSC2_EXTENDED = 0x05  # both shuffle bits: a Blosc2 (32-byte) chunk header
_BLOSC2_FLAGS_OK = 0x71  # the dictionary bit and the special values ZERO, NAN, VALUE
_SPECIAL_UNINIT = 4


def check_blosc2_chunk(header: bytes, cbytes: int, nbytes: int, itemsize: int, block_bytes: int | None) -> None:
    """Check the 32-byte header of the one chunk of a frame (c-blosc2's chunk format) before
    it is decoded: ``nbytes`` decoded bytes of ``itemsize``-byte items in blocks of
    ``block_bytes`` (None: any size up to ``nbytes``), ``cbytes`` stored; no variable-length
    blocks, no flags this reader does not decode, and never a chunk of values that were never
    written (c-blosc2's UNINIT special chunk, decoded by leaving its output as it was)."""
    if cbytes < 32 or len(header) < 32:
        raise DecodeError("Blosc2 chunk shorter than its header")
    c_nbytes, c_block, c_cbytes = struct.unpack_from("<iii", header, 4)
    if header[2] & _BLOSC2_EXTENDED != _BLOSC2_EXTENDED or header[3] != itemsize:
        raise DecodeError(f"Blosc2 chunk of type size {header[3]} (dataset: {itemsize}) or without a Blosc2 header")
    if c_nbytes != nbytes or c_cbytes != cbytes:
        raise DecodeError(f"Blosc2 chunk of {c_nbytes} bytes stored in {c_cbytes}, expected {nbytes} in {cbytes}")
    if not (c_block == block_bytes if block_bytes is not None else 0 < c_block <= nbytes):
        raise DecodeError(f"Blosc2 chunk of {c_block}-byte blocks")
    special = (header[31] >> 4) & 0x07
    if special == _SPECIAL_UNINIT:
        raise DecodeError("Blosc2 chunk of values that were never written (uninitialized special chunk)")
    if header[30] & 0x01 or header[31] & ~_BLOSC2_FLAGS_OK & 0xFF or special > _SPECIAL_UNINIT:
        raise DecodeError(f"Blosc2 chunk with flags {header[30]:#x} {header[31]:#x} this reader does not decode")


@dataclass(frozen=True)
class Blocks:
    """How a B2ND chunk is stored: ``chunk``-shaped, padded to whole ``block``-shaped blocks
    along every dimension, the blocks in row-major order of their grid, each row-major."""

    chunk: tuple[int, ...]
    block: tuple[int, ...]
    itemsize: int

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-c // b) for c, b in zip(self.chunk, self.block))

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block) * self.itemsize

    @property
    def padded_bytes(self) -> int:
        return math.prod(self.grid) * self.block_bytes

    @property
    def runs(self) -> bool:
        """Whether the stored bytes are the chunk's own row-major bytes (blocks that are runs
        of whole rows, in order)."""
        inner = [i for i, (b, c) in enumerate(zip(self.block, self.chunk)) if b != 1]
        return self.padded_bytes == math.prod(self.chunk) * self.itemsize and \
            all(self.block[i] == self.chunk[i] for i in inner[1:])


def b2nd_blocks(meta: bytes, chunk_shape: tuple[int, ...], itemsize: int) -> Blocks:
    """The block layout of a B2ND frame of exactly one chunk of ``chunk_shape``, checked: the
    array and its chunk of that shape, blocks of 1 to the chunk's size along each dimension,
    the padded chunk under 2 GiB (c-blosc2's limit). DecodeError otherwise."""
    shape, chunk, block = b2nd_geometry(meta)
    if shape != chunk_shape or chunk != chunk_shape:
        raise DecodeError(f"B2ND frame of shape {list(shape)} in chunks {list(chunk)}, expected {list(chunk_shape)}")
    if any(not 1 <= b <= c for b, c in zip(block, chunk)):
        raise DecodeError(f"B2ND blocks {list(block)} do not fit chunks {list(chunk)}")
    blocks = Blocks(chunk, block, itemsize)
    if blocks.padded_bytes >= 2**31:
        raise DecodeError(f"B2ND blocks {list(block)} pad the chunk to {blocks.padded_bytes} bytes")
    return blocks


def _scatter(run: Any, out: Any, blocks: Blocks, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
    """Copy the blocks ``lo <= grid index < hi`` (``run``: a buffer of their bytes as stored)
    into ``out`` (a buffer of the chunk's row-major bytes), without their padding: one strided
    copy per choice of whole or edge block along each dimension, each row of a block one
    element (numpy copies it with ``memcpy``)."""
    k, isz = len(blocks.chunk), blocks.itemsize
    box = [h - low for low, h in zip(lo, hi)]
    out_strides = [math.prod(blocks.chunk[i + 1:]) * isz for i in range(k)]
    grid_strides = [math.prod(box[i + 1:]) * blocks.block_bytes for i in range(k)]
    block_strides = [math.prod(blocks.block[i + 1:]) * isz for i in range(k)]
    parts = []
    for i, (c, b) in enumerate(zip(blocks.chunk, blocks.block)):
        whole = c // b  # grid indices below this are whole blocks; the one at it (if any) the edge
        part = [(lo[i], min(hi[i], whole), b)] if min(hi[i], whole) > lo[i] else []
        if hi[i] > whole:
            part.append((whole, hi[i], c - whole * b))
        parts.append(part)
    for combo in itertools.product(*parts):
        row = np.dtype((np.void, combo[-1][2] * isz))  # the valid part of a block's row
        shape = tuple(x for a, e, r in combo[:-1] for x in (e - a, r)) + (combo[-1][1] - combo[-1][0],)
        src = np.ndarray(shape, row, run, sum((a - lo[i]) * grid_strides[i] for i, (a, _, _) in enumerate(combo)),
                         tuple(x for i in range(k - 1) for x in (grid_strides[i], block_strides[i])) + (grid_strides[-1],))
        dst = np.ndarray(shape, row, out, sum(a * blocks.block[i] * out_strides[i] for i, (a, _, _) in enumerate(combo)),
                         tuple(x for i in range(k - 1) for x in (blocks.block[i] * out_strides[i], out_strides[i]))
                         + (blocks.block[-1] * out_strides[-1],))
        np.copyto(dst, src)


B2ND_SCRATCH = 2
"""A B2ND chunk whose blocks are not runs of its rows is decoded through at most this many
times its bytes of scratch, however far its blocks pad it. hdf5plugin pads chunks of odd
shapes by up to ~1.6x (18x for some 5-7 dimensional ones): within this bound the padded chunk
is decoded at once (as fast as c-blosc2's b2nd code; decoding it a run of blocks at a time
costs ~10-25% more per chunk, measured on the 2-core VM)."""


def _unblock(lib: Any, schunk: int, chunk: int, cbytes: int, blocks: Blocks, dst: int, dst_n: int) -> None:
    """Decode a B2ND chunk whose blocks are not runs of its rows into ``dst`` (``dst_n``
    bytes), through at most :data:`B2ND_SCRATCH` times ``dst_n`` bytes of scratch however
    far the blocks pad the chunk: the whole padded chunk when it fits, else runs of
    consecutive blocks (a block, or rows of the block grid) taken with ``blosc2_getitem``."""
    out = (ctypes.c_uint8 * dst_n).from_address(dst)
    grid, k, padded, budget = blocks.grid, len(blocks.chunk), blocks.padded_bytes, B2ND_SCRATCH * dst_n
    per = [blocks.block_bytes * math.prod(grid[m:]) for m in range(k + 1)]  # bytes of one index of dimension m - 1
    m = next(m for m in range(k + 1) if per[m] <= budget)  # per[k] (a block) always fits
    if m == 0:
        scratch = _buffer("blocks", padded)
        if lib.blosc2_schunk_decompress_chunk(schunk, 0, ctypes.addressof(scratch), padded) != padded:
            raise DecodeError("B2ND chunk does not decode to its padded bytes")
        _scatter(scratch, out, blocks, (0,) * k, grid)
        return
    d, step, block_items = m - 1, budget // per[m], math.prod(blocks.block)
    scratch = _buffer("blocks", min(step, grid[d]) * per[m])
    for outer in itertools.product(*(range(g) for g in grid[:d])):
        first_row = 0
        for i, o in enumerate(outer):
            first_row = first_row * grid[i] + o
        for s in range(0, grid[d], step):
            e = min(grid[d], s + step)
            nitems = (e - s) * math.prod(grid[m:]) * block_items
            start = (first_row * grid[d] + s) * math.prod(grid[m:]) * block_items
            nb = nitems * blocks.itemsize
            if lib.blosc2_getitem(chunk, cbytes, start, nitems, ctypes.addressof(scratch), nb) != nb:
                raise DecodeError("B2ND blocks do not decode")
            _scatter(scratch, out, blocks, tuple(outer) + (s,) + (0,) * (k - m),
                     tuple(o + 1 for o in outer) + (e,) + grid[m:])


def _blosc2(itemsize: int, chunk_shape: tuple[int, ...]) -> Decoder:
    lib = _library("libh5blosc2.so")

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        frame = memoryview(src).cast("B")[:n]
        header_len, nbytes = frame_header(frame, n)
        if struct.unpack_from(">i", frame, _FRAME_TYPESIZE + 1)[0] != itemsize:
            raise DecodeError(f"Blosc2 frame of another type size than the dataset's {itemsize}")
        meta = frame_metalayer(frame)
        blocks = None if meta is None else b2nd_blocks(meta, chunk_shape, itemsize)
        expected = dst_n if blocks is None else blocks.padded_bytes  # a plain frame: exactly the chunk's bytes
        if nbytes != expected:
            raise DecodeError(f"Blosc2 frame of {nbytes} bytes, expected {expected}")
        base = ctypes.addressof(src)
        schunk = lib.blosc2_schunk_from_buffer(base, n, False)
        if not schunk:
            raise DecodeError("Blosc2 frame could not be parsed")
        try:
            chunk, made = ctypes.c_void_p(), ctypes.c_bool(False)
            cbytes = lib.blosc2_schunk_get_lazychunk(schunk, 0, ctypes.byref(chunk), ctypes.byref(made))
            try:
                if cbytes < 32 or not chunk.value:
                    raise DecodeError("Blosc2 frame without its chunk")
                if not made.value and not base + header_len <= chunk.value <= base + n - cbytes:
                    raise DecodeError("Blosc2 chunk outside its frame")
                check_blosc2_chunk(ctypes.string_at(chunk.value, 32), cbytes, nbytes, itemsize,
                                   None if blocks is None else blocks.block_bytes)
                if blocks is None or blocks.runs:
                    if lib.blosc2_schunk_decompress_chunk(schunk, 0, dst, dst_n) != dst_n:
                        raise DecodeError("Blosc2 frame does not decode to the chunk's bytes")
                else:
                    _unblock(lib, schunk, chunk.value, cbytes, blocks, dst, dst_n)
            finally:
                if made.value and chunk.value:  # a chunk c-blosc2 made (a special offset): its malloc
                    _libc().free(chunk.value)
        finally:
            lib.blosc2_schunk_free(schunk)

    return decode


# ---------------------------------------------------------------------------- shuffle + deflate


def _inflate_module() -> Any:
    """``isal.isal_zlib`` where python-isal is installed (ISA-L's inflate, the same API and
    bounds as zlib's: measured 1.3-1.9x zlib's GB/s on the chunks of the "gzip" preset, see
    README "Compression"), else the standard library's ``zlib``."""
    try:
        from isal import isal_zlib
        return isal_zlib
    except ImportError:
        import zlib
        return zlib


INFLATE: Any = _inflate_module()
"""The module whose ``decompressobj`` inflates deflate chunks (``zlib`` or ``isal.isal_zlib``)."""


def _unshuffle(itemsize: int) -> Callable[[bytes, int, int], None]:
    """``unshuffle(src, dst, n)``: undo HDF5's byte shuffle of ``n`` bytes of ``itemsize``-byte
    elements (byte j of element i stored at j * n / itemsize + i) from ``src`` into address
    ``dst``: c-blosc2's SIMD unshuffle (the same transposition, GIL released) where hdf5plugin's
    library loads, else numpy."""
    if itemsize == 1:
        return lambda src, dst, n: ctypes.memmove(dst, src, n)
    try:
        fn = _library("libh5blosc2.so").blosc2_unshuffle
    except (DecodeError, AttributeError):
        fn = None

    def unshuffle(src: bytes, dst: int, n: int) -> None:
        if fn is not None and n < 2**31:
            if fn(itemsize, n, src, dst) == n:
                return
        out = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(dst))
        np.copyto(out.reshape(-1, itemsize), np.frombuffer(src, np.uint8, n).reshape(itemsize, -1).T)

    return unshuffle


def _deflate(itemsize: int) -> Decoder:
    """HDF5's shuffle + deflate: a zlib stream (RFC 1950) that must inflate to exactly the
    chunk's bytes, end there and account for every stored byte; the output is bounded by the
    chunk (``max_length``), so a bomb stops one byte past it."""
    unshuffle = _unshuffle(itemsize)
    module = INFLATE

    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        d = module.decompressobj()
        try:
            out = d.decompress(memoryview(src).cast("B")[:n], dst_n + 1)
        except module.error as e:
            raise DecodeError(f"deflate stream does not decode ({e})") from None
        if len(out) > dst_n:
            raise DecodeError(f"deflate stream inflates past the chunk's {dst_n} bytes")
        if not d.eof:
            raise DecodeError(f"deflate stream ends early, after {len(out)} of the chunk's {dst_n} bytes")
        if len(out) != dst_n:
            raise DecodeError(f"deflate stream holds {len(out)} bytes, expected {dst_n}")
        if d.unused_data:
            raise DecodeError(f"{len(d.unused_data)} stored bytes after the end of the deflate stream")
        unshuffle(out, dst, dst_n)

    return decode


def _refused(reason: str) -> Decoder:
    """A decoder that refuses every chunk (filter values no decoder accepts): raised when a
    chunk is read, where the reader names the file and the key."""
    def decode(src: Any, n: int, dst: int, dst_n: int) -> None:
        raise DecodeError(reason)
    return decode


def decoder_for(extent: Chunked) -> Decoder:
    """The decoder of an extent's filter (checked by ``format.check_chunked``; checked again
    here, so that no filter value reaches a C decoder unchecked)."""
    values, itemsize = extent.filter_values, extent.itemsize
    if not all(type(v) is int and 0 <= v < 2**32 for v in values) or not 0 < itemsize <= 16:
        return _refused(f"invalid filter values {list(values)} or item size {itemsize}")
    if extent.filter_id == BITSHUFFLE_ID:
        if len(values) < 5 or values[4] not in (_BSHUF_LZ4, _BSHUF_ZSTD) or values[2] != itemsize or values[3] % 8:
            return _refused(f"bitshuffle values {list(values)}: not LZ4/Zstd blocks of 8 elements of {itemsize} bytes")
        return _bitshuffle(values[4], itemsize)
    if extent.filter_id == DEFLATE_ID:  # format 3: HDF5's shuffle (element size) then deflate (level)
        if len(values) != 1 or values[0] > 9:
            return _refused(f"deflate values {list(values)}: one level, 0-9")
        return _deflate(itemsize)
    if extent.filter_id == BLOSC2_ID:
        if len(values) < 4 or values[2] != itemsize or values[3] != extent.chunk_bytes:
            return _refused(f"blosc2 values {list(values)} do not match the dataset")
        return _blosc2(itemsize, extent.chunk_shape)
    return _refused(f"no decoder for filter {extent.filter_id}")


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
