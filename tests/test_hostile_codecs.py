"""Hostile compressed chunks (issue #30, second surface): decompression bombs, lying framing
and hostile filter parameters in crafted format-2 files.

Every case is a file crafted from a real save (hashes and header recomputed, so only the
part under attack is wrong): Bitshuffle headers and block tables, LZ4 / Zstd blocks that
expand past their block, Blosc2 frame and chunk headers (sizes, type sizes, block sizes,
special chunks of values never written, variable blocks), B2ND metadata (shapes, block
shapes that pad a chunk to many times its size), filter values, raw flags that lie.

The reads (``th5.load``, ``th5.load(verify=True)``, a handle slice ``h[1:3]``, and a read into
a tensor filled with a canary) run in a worker process with an address-space limit (its size
after importing torch + 1 GiB) and a time limit per call. Each must end in time, and either
in a ``TensorStoreError`` naming the file and the key, or (where the case allows it) with
values that some read filled: what was saved, or what the crafted file says, never the
canary. The worker measures each call's peak resident memory above what it held before it
(``/proc/self/clear_refs``): a bomb must not make the decoder allocate much more than the
tensor and one chunk.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.codecs import decoders
from tensorstore_h5.format import checksum
from tensorstore_h5.format import layout as fmt

from helpers import assert_same_tensor, bits
from hostile.hostile_files import entry, read_layout

REPO = Path(__file__).parents[1]
CALL_SECONDS = float(os.environ.get("TH5_HOSTILE_CALL_SECONDS", "20"))
"""Wall time one read may take in the worker (its alarm ends it after that)."""
STARTUP_SECONDS = 60.0
"""Extra wall time for a worker to import torch before its first read."""
SLACK = 48 << 20
"""Peak memory a read may add beyond three times the bytes of the tensors it reads."""
CANARY = bytes.fromhex("c0ffee11deadbeef5a5aa5a5feedface")
READS = ("load", "verify", "slice", "out")

REFUSE = "refuse"
"""Every read raises a TensorStoreError naming the file and the key."""
EITHER = "either"
"""Every read raises as above, or returns exactly what was saved (a harmless lie)."""
VALUES = "values"
"""Unchecked reads may return values the crafted file defines (never the canary);
``verify`` refuses them (the file's hashes are the saved ones)."""


# ---------------------------------------------------------------------------- the base file


def base_object() -> dict[str, torch.Tensor]:
    """Two Bitshuffle tensors (LZ4, Zstd), a B2ND-framed Blosc2 one and a plain-framed Blosc2
    one (1-D), each of several 8 KiB chunks, and one stored uncompressed."""
    g = torch.Generator().manual_seed(30)
    smooth = torch.randn(256, 64, generator=g) * 0.02
    return {"lz4": smooth.clone(), "bszstd": smooth * 2, "zstd": smooth.to(torch.bfloat16),
            "plain": torch.randn(8192, generator=g) * 0.02, "w": torch.randn(8, 8, generator=g)}


def save_base(path: Path) -> dict[str, torch.Tensor]:
    obj = base_object()
    choice = {"lz4": "lz4", "bszstd": hdf5plugin.Bitshuffle(cname="zstd"), "zstd": "zstd", "plain": "zstd"}
    th5.save(obj, path, compression=lambda k, t: choice.get(k), chunk_bytes=8192)
    return obj


def rewrite(path: Path, edit: Callable[[dict[str, Any], list[dict[str, Any]], int], None], append: bytes = b"") -> None:
    """Append ``append`` to a format-2 file, then its layout rewritten by ``edit(head, entries,
    offset of the appended bytes)``, with a valid header and layout hash."""
    head, entries = read_layout(path)
    raw = bytearray(path.read_bytes())
    at = len(raw)
    raw += append
    edit(head, entries, at)
    text = "\n".join(json.dumps(x) for x in [head, *entries]).encode()
    offset = len(raw)
    raw += text
    raw[:64] = fmt.pack_header(fmt.Header(2, len(raw), offset, len(text), checksum.digest(text)))
    path.write_bytes(bytes(raw))


def chunk_of(path: Path, key: str, k: int = 0) -> bytes:
    head, entries = read_layout(path)
    off, size = entry(head, entries, key)["chunks"]["at"][k][:2]
    return path.read_bytes()[off:off + size]


def set_chunk(path: Path, key: str, data: bytes, k: int = 0, raw: bool = False, hashes: list[str] | None = None) -> None:
    """Chunk ``k`` of ``key`` becomes ``data`` (appended; the layout points at it)."""
    def edit(head: dict[str, Any], entries: list[dict[str, Any]], at: int) -> None:
        e = entry(head, entries, key)
        e["chunks"]["at"][k] = [at, len(data), 1] if raw else [at, len(data)]
        if hashes is not None:
            e["xxh3"] = hashes
    rewrite(path, edit, data)


def edit_entry(key: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda p: rewrite(p, lambda h, es, at: change(entry(h, es, key)))


def edit_chunk(key: str, change: Callable[[bytearray], bytes | bytearray | None], k: int = 0) -> Callable[[Path], None]:
    """An edit of chunk ``k``'s bytes (``change`` edits them in place or returns new bytes)."""
    def edit(p: Path) -> None:
        data = bytearray(chunk_of(p, key, k))
        out = change(data)
        set_chunk(p, key, bytes(data if out is None else out), k)
    return edit


# ---------------------------------------------------------------------------- Bitshuffle chunks


def _bshuf_lib() -> Any:
    lib = ctypes.CDLL(f"{hdf5plugin.PLUGIN_PATH}/libh5bshuf.so")
    lib.LZ4_compress_default.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.LZ4_compress_default.restype = ctypes.c_int
    lib.ZSTD_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.ZSTD_compress.restype = ctypes.c_size_t
    return lib


def lz4_block(data: bytes) -> bytes:
    dst = ctypes.create_string_buffer(len(data) + len(data) // 200 + 64)
    n = _bshuf_lib().LZ4_compress_default(data, dst, len(data), len(dst))
    assert n > 0
    return dst.raw[:n]


def zstd_block(data: bytes) -> bytes:
    dst = ctypes.create_string_buffer(len(data) + 1024)
    n = _bshuf_lib().ZSTD_compress(dst, len(dst), data, len(data), 3)
    assert n < 2**63
    return dst.raw[:n]


def bshuf_blocks(chunk: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of each block's payload in a Bitshuffle chunk (after its 4-byte length)."""
    out, pos = [], 12
    while pos + 4 <= len(chunk):
        n = int.from_bytes(chunk[pos:pos + 4], "big")
        if pos + 4 + n > len(chunk):
            break
        out.append((pos + 4, n))
        pos += 4 + n
    return out


def bshuf_replace_block(chunk: bytes, i: int, payload: bytes) -> bytes:
    """The chunk with block ``i``'s payload replaced (its length updated): a consistent table."""
    off, n = bshuf_blocks(chunk)[i]
    return chunk[:off - 4] + len(payload).to_bytes(4, "big") + payload + chunk[off + n:]


def _u32(at: int, value: int) -> Callable[[bytearray], None]:
    def change(c: bytearray) -> None:
        c[at:at + 4] = (value % 2**32).to_bytes(4, "big")
    return change


def _u64(at: int, value: int) -> Callable[[bytearray], None]:
    def change(c: bytearray) -> None:
        c[at:at + 8] = value.to_bytes(8, "big")
    return change


# ---------------------------------------------------------------------------- Blosc2 frames

# cframe header fields (c-blosc2 README_CFRAME_FORMAT): msgpack markers then big-endian values
HEADER_LEN, FRAME_LEN, FLAGS, FRAME_TYPE, NBYTES, CBYTES, TYPESIZE, BLOCKSIZE, CHUNKSIZE = 11, 16, 25, 26, 30, 39, 48, 53, 58


def frame_field(frame: bytes, at: int) -> int:
    fmt_ = ">q" if at in (FRAME_LEN, NBYTES, CBYTES) else ">i"
    return struct.unpack_from(fmt_, frame, at)[0]


def set_field(frame: bytearray, at: int, value: int) -> None:
    struct.pack_into(">q" if at in (FRAME_LEN, NBYTES, CBYTES) else ">i", frame, at, value)


@dataclass(frozen=True)
class FrameParts:
    """A Blosc2 frame as hdf5plugin writes it: a fixed header, metalayers, one chunk, the
    offsets chunk (one int64, stored as it is) and the trailer."""

    fixed: bytes
    meta: bytes | None
    chunk: bytes
    offsets_header: bytes
    trailer: bytes


def split_frame(frame: bytes) -> FrameParts:
    hl, cb = frame_field(frame, HEADER_LEN), frame_field(frame, CBYTES)
    meta = decoders.frame_metalayer(frame)
    assert struct.unpack_from("<q", frame, hl + cb + 32)[0] == 0  # one chunk, right after the header
    return FrameParts(frame[:87], meta, frame[hl:hl + cb], frame[hl + cb:hl + cb + 32], frame[hl + cb + 40:])


def build_frame(parts: FrameParts, chunk: bytes | None = None, meta: bytes | None | bool = True,
                nbytes: int | None = None, typesize: int | None = None, blocksize: int | None = None,
                chunksize: int | None = None, offset: int = 0) -> bytes:
    """A frame from ``parts`` with another chunk, metalayer (True: the same; None: none) or
    header fields; sizes and lengths made consistent."""
    chunk = parts.chunk if chunk is None else chunk
    meta = parts.meta if meta is True else meta
    if meta is None:
        layers = bytes([0x93, 0xCD, 0, 7, 0xDE, 0, 0, 0xDC, 0, 0])
    else:
        index = bytes([0xDE, 0, 1, 0xA4]) + b"b2nd" + b"\xd2" + struct.pack(">i", 87 + 4 + 13 + 3)
        layers = b"\x93\xcd" + struct.pack(">H", 4 + len(index)) + index + b"\xdc\x00\x01\xc6" + \
            struct.pack(">i", len(meta)) + meta
    header = bytearray(parts.fixed + layers)
    n = len(header) + len(chunk) + 40 + len(parts.trailer)
    size = struct.unpack_from("<i", chunk, 4)[0] if nbytes is None else nbytes
    set_field(header, HEADER_LEN, len(header))
    set_field(header, FRAME_LEN, n)
    set_field(header, NBYTES, size)
    set_field(header, CBYTES, len(chunk))
    if typesize is not None:
        set_field(header, TYPESIZE, typesize)
    set_field(header, BLOCKSIZE, struct.unpack_from("<i", chunk, 8)[0] if blocksize is None else blocksize)
    set_field(header, CHUNKSIZE, size if chunksize is None else chunksize)
    return bytes(header) + chunk + parts.offsets_header + struct.pack("<q", offset) + parts.trailer


def b2nd_meta(shape: tuple[int, ...], chunkshape: tuple[int, ...], blockshape: tuple[int, ...], typesize: int,
              ndim: int | None = None) -> bytes:
    """A ``b2nd`` metalayer (msgpack: version, ndim, shape, chunk shape, block shape, dtype)."""
    k = len(shape)
    out = bytes([0x97, 0, k if ndim is None else ndim, 0x90 + k]) + b"".join(b"\xd3" + struct.pack(">q", s) for s in shape)
    out += bytes([0x90 + len(chunkshape)]) + b"".join(b"\xd2" + struct.pack(">i", c) for c in chunkshape)
    out += bytes([0x90 + len(blockshape)]) + b"".join(b"\xd2" + struct.pack(">i", b) for b in blockshape)
    dtype = f"|V{typesize}".encode()
    return out + b"\x00\xdb" + struct.pack(">i", len(dtype)) + dtype


ZERO, NAN, VALUE, UNINIT = 1, 2, 3, 4


def special_chunk(kind: int, nbytes: int, blocksize: int, typesize: int) -> bytes:
    """A Blosc2 chunk of one repeated value (``kind``) or of values never written (UNINIT):
    its 32-byte header alone (c-blosc2's blosc2_chunk_zeros and friends)."""
    return bytes([5, 1, 0x05, typesize]) + struct.pack("<iii", nbytes, blocksize, 32) + bytes(14) + bytes([0, kind << 4])


def _blosc2_lib() -> Any:
    lib = ctypes.CDLL(f"{hdf5plugin.PLUGIN_PATH}/libh5blosc2.so")
    lib.blosc2_init.restype = None
    lib.blosc1_set_blocksize.argtypes = [ctypes.c_size_t]
    lib.blosc1_set_blocksize.restype = None
    lib.blosc2_compress.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                                    ctypes.c_void_p, ctypes.c_int32]
    lib.blosc2_compress.restype = ctypes.c_int
    lib.blosc1_set_compressor.argtypes = [ctypes.c_char_p]
    lib.blosc1_set_compressor.restype = ctypes.c_int
    lib.blosc2_init()
    return lib


def blosc2_chunk(data: bytes, typesize: int, blocksize: int) -> bytes:
    """``data`` compressed as one Blosc2 chunk of ``blocksize``-byte blocks (byte shuffle)."""
    lib = _blosc2_lib()
    dst = ctypes.create_string_buffer(len(data) + 64)
    lib.blosc1_set_blocksize(blocksize)
    lib.blosc1_set_compressor(b"zstd")
    try:
        n = lib.blosc2_compress(5, 1, typesize, data, len(data), dst, len(dst))
    finally:
        lib.blosc1_set_blocksize(0)
    assert n > 0 and struct.unpack_from("<i", dst.raw, 8)[0] == blocksize
    return dst.raw[:n]


def chunk_header(change: Callable[[bytearray], None]) -> Callable[[bytearray], None]:
    """An edit of the 32-byte header of the frame's chunk (right after the frame header)."""
    def edit(frame: bytearray) -> None:
        hl = frame_field(frame, HEADER_LEN)
        head = bytearray(frame[hl:hl + 32])
        change(head)
        frame[hl:hl + 32] = head
    return edit


def header_field(at: int, value: int) -> Callable[[bytearray], None]:
    return lambda f: set_field(f, at, value)


def chunk_i32(at: int, value: int) -> Callable[[bytearray], None]:
    return chunk_header(lambda h: struct.pack_into("<i", h, at, value))


def chunk_u8(at: int, value: int) -> Callable[[bytearray], None]:
    def change(h: bytearray) -> None:
        h[at] = value
    return chunk_header(change)


def with_frame(change: Callable[[FrameParts], bytes]) -> Callable[[bytearray], bytes]:
    return lambda data: change(split_frame(bytes(data)))


def _offset_special(kind: int) -> Callable[[bytearray], bytes]:
    """The frame's chunk offset marked special (a chunk made by c-blosc2, none stored)."""
    return with_frame(lambda p: build_frame(p, offset=-(2**63) + (kind << 56)))


# ---------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    name: str
    key: str
    edit: Callable[[Path], None]
    kind: str = REFUSE


def _bshuf_expand(key: str, block: Callable[[bytes], bytes]) -> Case:
    """A block whose LZ4 / Zstd data decode to twice the block, its table consistent."""
    def change(c: bytearray) -> bytes:
        assert len(bshuf_blocks(bytes(c))) == 1  # one 8 KiB block per 8 KiB chunk
        return bshuf_replace_block(bytes(c), 0, block(bytes(2 * B)))
    return Case(f"bitshuffle-{key}-block-expands", key, edit_chunk(key, change))


def _bshuf_bomb_block(key: str) -> Case:
    """An LZ4 block of 263 bytes that would expand to 65 KB in an 8 KiB block (one long match)."""
    def change(c: bytearray) -> bytes:
        # a literal byte, then a match of offset 1 and length 15 + 255 * 255 + 4: one run of zeros, then one literal
        payload = bytes([0x1F, 0]) + b"\x01\x00" + b"\xff" * 255 + b"\x00" + bytes([0x10, 0])
        return bshuf_replace_block(bytes(c), 0, payload)
    return Case(f"bitshuffle-{key}-lz4-bomb", key, edit_chunk(key, change))


def _b2nd(name: str, meta: Callable[[int], bytes], kind: str = REFUSE) -> Case:
    """The B2ND chunk with another metalayer (same chunk data)."""
    return Case(f"b2nd-{name}", "zstd", edit_chunk("zstd", with_frame(lambda p: build_frame(p, meta=meta(2)))), kind)


def _filter_values(key: str, name: str, values: Callable[[list[int]], list[Any]], kind: str = REFUSE) -> Case:
    def change(e: dict[str, Any]) -> None:
        e["chunks"]["filter"][1] = values(list(e["chunks"]["filter"][1]))
    return Case(f"filter-values-{name}", key, edit_entry(key, change), kind)


def _set(values: list[int], i: int, v: Any) -> list[Any]:
    values = list(values)
    values[i] = v
    return values


def _raw_lie_compressed(p: Path) -> None:
    """The raw flag on a compressed chunk, its size set to the chunk's bytes."""
    def edit(h: dict[str, Any], es: list[dict[str, Any]], at: int) -> None:
        c = entry(h, es, "zstd")["chunks"]["at"]
        c[0] = [c[0][0], 8192, 1]
    rewrite(p, edit)


def _raw_data_unflagged(p: Path) -> None:
    """A chunk stored as raw bytes without the raw flag (the decoder must refuse it)."""
    set_chunk(p, "plain", bytes(bits(base_object()["plain"][:2048]).numpy()))


def _wrong_block_size_values(key: str) -> Case:
    return _filter_values(key, f"{key}-block-size-not-8", lambda v: _set(v, 3, 12))


B = 8192  # every chunk's bytes


CASES: list[Case] = [
    # -- Bitshuffle: the 12-byte header (decoded bytes, block bytes) and the block table
    Case("bitshuffle-total-3gib", "lz4", edit_chunk("lz4", _u64(0, 3 << 30))),
    Case("bitshuffle-total-2pow63", "lz4", edit_chunk("lz4", _u64(0, 2**63 + B))),
    Case("bitshuffle-total-smaller", "lz4", edit_chunk("lz4", _u64(0, B - 4 * 8))),
    Case("bitshuffle-total-not-elements", "lz4", edit_chunk("lz4", _u64(0, B + 2))),
    Case("bitshuffle-block-0", "lz4", edit_chunk("lz4", _u32(8, 0))),
    Case("bitshuffle-block-2pow32-32", "lz4", edit_chunk("lz4", _u32(8, 2**32 - 32)), EITHER),
    Case("bitshuffle-block-2pow31", "bszstd", edit_chunk("bszstd", _u32(8, 2**31)), EITHER),
    Case("bitshuffle-block-not-8-elements", "lz4", edit_chunk("lz4", _u32(8, 4 * 12))),
    Case("bitshuffle-block-not-elements", "lz4", edit_chunk("lz4", _u32(8, 4097))),
    Case("bitshuffle-block-smaller", "lz4", edit_chunk("lz4", _u32(8, 4 * 8))),
    Case("bitshuffle-table-2pow32-1", "lz4", edit_chunk("lz4", _u32(12, 2**32 - 1))),
    Case("bitshuffle-table-2pow31", "bszstd", edit_chunk("bszstd", _u32(12, 2**31))),
    Case("bitshuffle-table-short", "lz4", edit_chunk("lz4", lambda c: c[:-1])),
    Case("bitshuffle-table-long", "lz4", edit_chunk("lz4", lambda c: bytes(c) + b"\0\0\0\0")),
    Case("bitshuffle-header-only", "lz4", edit_chunk("lz4", lambda c: c[:12])),
    Case("bitshuffle-empty-chunk", "lz4", edit_chunk("lz4", lambda c: b"")),
    _bshuf_expand("lz4", lz4_block),
    _bshuf_expand("bszstd", zstd_block),
    _bshuf_bomb_block("lz4"),
    # -- Blosc2 frames (the plain frame of a 1-D tensor, and the B2ND frame of a 2-D one)
    Case("blosc2-nbytes-2pow40", "plain", edit_chunk("plain", header_field(NBYTES, 2**40))),
    Case("blosc2-nbytes-negative", "plain", edit_chunk("plain", header_field(NBYTES, -B))),
    Case("blosc2-nbytes-two-chunks", "plain", edit_chunk("plain", header_field(NBYTES, 2 * B))),
    Case("blosc2-chunksize-0", "plain", edit_chunk("plain", header_field(CHUNKSIZE, 0)), EITHER),
    Case("blosc2-chunksize-1", "plain", edit_chunk("plain", header_field(CHUNKSIZE, 1))),
    Case("blosc2-chunksize-negative", "plain", edit_chunk("plain", header_field(CHUNKSIZE, -1))),
    Case("blosc2-cbytes-2pow40", "plain", edit_chunk("plain", header_field(CBYTES, 2**40))),
    Case("blosc2-cbytes-negative", "plain", edit_chunk("plain", header_field(CBYTES, -1))),
    Case("blosc2-typesize-0", "plain", edit_chunk("plain", header_field(TYPESIZE, 0))),
    Case("blosc2-typesize-2pow31-1", "plain", edit_chunk("plain", header_field(TYPESIZE, 2**31 - 1))),
    Case("blosc2-frame-len-2pow40", "plain", edit_chunk("plain", header_field(FRAME_LEN, 2**40))),
    Case("blosc2-frame-len-short", "plain", edit_chunk("plain", header_field(FRAME_LEN, 100))),
    Case("blosc2-header-len-2pow31-1", "plain", edit_chunk("plain", header_field(HEADER_LEN, 2**31 - 1))),
    Case("blosc2-header-len-20", "plain", edit_chunk("plain", header_field(HEADER_LEN, 20))),
    Case("blosc2-sparse-frame", "plain", edit_chunk("plain", lambda f: f.__setitem__(FRAME_TYPE, 1))),
    Case("blosc2-variable-chunks", "plain", edit_chunk("plain", lambda f: f.__setitem__(FLAGS, f[FLAGS] | 0x40)), EITHER),
    Case("blosc2-frame-vl-blocks", "plain", edit_chunk("plain", lambda f: f.__setitem__(FLAGS, f[FLAGS] | 0x80)), EITHER),
    Case("blosc2-truncated", "plain", edit_chunk("plain", lambda f: f[:60])),
    Case("blosc2-chunk-nbytes-2pow31-1", "plain", edit_chunk("plain", chunk_i32(4, 2**31 - 1))),
    Case("blosc2-chunk-nbytes-smaller", "plain", edit_chunk("plain", chunk_i32(4, B - 4))),
    Case("blosc2-chunk-blocksize-0", "plain", edit_chunk("plain", chunk_i32(8, 0))),
    Case("blosc2-chunk-blocksize-negative", "plain", edit_chunk("plain", chunk_i32(8, -8))),
    Case("blosc2-chunk-blocksize-2pow31-1", "plain", edit_chunk("plain", chunk_i32(8, 2**31 - 1)), EITHER),
    Case("blosc2-chunk-blocksize-half", "plain", edit_chunk("plain", chunk_i32(8, B // 2))),
    Case("blosc2-chunk-cbytes-2pow31-1", "plain", edit_chunk("plain", chunk_i32(12, 2**31 - 1))),
    Case("blosc2-chunk-cbytes-16", "plain", edit_chunk("plain", chunk_i32(12, 16))),
    Case("blosc2-chunk-typesize-0", "plain", edit_chunk("plain", chunk_u8(3, 0))),
    Case("blosc2-chunk-typesize-255", "plain", edit_chunk("plain", chunk_u8(3, 255)), EITHER),
    Case("blosc2-chunk-memcpyed-flag", "plain", edit_chunk("plain", chunk_u8(2, 0x87))),
    Case("blosc2-chunk-vl-blocks", "plain", edit_chunk("plain", chunk_u8(30, 1))),
    Case("blosc2-chunk-lazy", "plain", edit_chunk("plain", chunk_u8(31, 0x08))),
    Case("blosc2-chunk-instrumented", "plain", edit_chunk("plain", chunk_u8(31, 0x80))),
    Case("blosc2-chunk-uninit", "plain", edit_chunk("plain", chunk_u8(31, UNINIT << 4))),
    Case("blosc2-chunk-uninit-no-data", "plain", edit_chunk("plain", with_frame(
        lambda p: build_frame(p, chunk=special_chunk(UNINIT, B, B, 4))))),
    Case("blosc2-offset-uninit", "plain", edit_chunk("plain", _offset_special(UNINIT))),
    Case("blosc2-offset-zeros", "plain", edit_chunk("plain", _offset_special(ZERO)), VALUES),
    Case("blosc2-offset-2pow40", "plain", edit_chunk("plain", with_frame(lambda p: build_frame(p, offset=2**40)))),
    Case("blosc2-offset-minus-1", "plain", edit_chunk("plain", with_frame(lambda p: build_frame(p, offset=-1))), VALUES),
    Case("blosc2-chunk-zeros", "plain", edit_chunk("plain", with_frame(
        lambda p: build_frame(p, chunk=special_chunk(ZERO, B, B, 4)))), VALUES),
    Case("blosc2-chunk-zeros-2pow31-1", "plain", edit_chunk("plain", with_frame(
        lambda p: build_frame(p, chunk=special_chunk(ZERO, 2**31 - 4, B, 4))))),
    Case("blosc2-chunk-value-wide", "plain", edit_chunk("plain", with_frame(
        lambda p: build_frame(p, chunk=special_chunk(VALUE, B, B, 4)[:12] + struct.pack("<i", 32 + 255) +
                              special_chunk(VALUE, B, B, 4)[16:] + bytes(255))))),
    Case("blosc2-uninit-b2nd", "zstd", edit_chunk("zstd", chunk_u8(31, UNINIT << 4))),
    Case("blosc2-offset-uninit-b2nd", "zstd", edit_chunk("zstd", _offset_special(UNINIT))),
    Case("blosc2-b2nd-frame-on-plain", "plain", edit_chunk("plain", with_frame(
        lambda p: build_frame(p, meta=b2nd_meta((2048,), (2048,), (2048,), 4)))), EITHER),
    # -- B2ND metadata
    _b2nd("ndim-9", lambda t: b2nd_meta((64,) * 9, (64,) * 9, (64,) * 9, t)),
    _b2nd("ndim-lies", lambda t: b2nd_meta((64, 64), (64, 64), (64, 64), t, ndim=100)),
    _b2nd("ndim-0", lambda t: b2nd_meta((), (), (), t)),
    _b2nd("shape-2pow62", lambda t: b2nd_meta((2**62, 64), (64, 64), (64, 64), t)),
    _b2nd("shape-negative", lambda t: b2nd_meta((-64, 64), (64, 64), (64, 64), t)),
    _b2nd("chunkshape-differs", lambda t: b2nd_meta((64, 64), (32, 64), (32, 64), t)),
    _b2nd("chunkshape-0", lambda t: b2nd_meta((64, 64), (0, 64), (64, 64), t)),
    _b2nd("blockshape-0", lambda t: b2nd_meta((64, 64), (64, 64), (0, 64), t)),
    _b2nd("blockshape-negative", lambda t: b2nd_meta((64, 64), (64, 64), (-64, 64), t)),
    _b2nd("blockshape-past-chunk", lambda t: b2nd_meta((64, 64), (64, 64), (128, 64), t)),
    _b2nd("blockshape-2pow31-1", lambda t: b2nd_meta((64, 64), (64, 64), (2**31 - 1, 64), t)),
    _b2nd("blockshape-other", lambda t: b2nd_meta((64, 64), (64, 64), (32, 64), t), EITHER),
    _b2nd("truncated", lambda t: b2nd_meta((64, 64), (64, 64), (64, 64), t)[:12]),
    _b2nd("chunkshape-missing", lambda t: b2nd_meta((64, 64), (64, 64), (64, 64), t)[:22]),
    Case("b2nd-chunk-nbytes-differs", "zstd", edit_chunk("zstd", chunk_i32(4, B // 2))),
    Case("b2nd-chunk-blocksize-differs", "zstd", edit_chunk("zstd", chunk_i32(8, B // 2))),
    Case("b2nd-frame-typesize-4", "zstd", edit_chunk("zstd", header_field(TYPESIZE, 4))),
    Case("b2nd-chunk-typesize-4", "zstd", edit_chunk("zstd", chunk_u8(3, 4))),
    # -- filter values in the layout
    _filter_values("lz4", "negative", lambda v: _set(v, 2, -4)),
    _filter_values("lz4", "2pow40", lambda v: _set(v, 3, 2**40)),
    _filter_values("lz4", "float", lambda v: _set(v, 3, 8.0)),
    _filter_values("lz4", "element-size-0", lambda v: _set(v, 2, 0)),
    _filter_values("lz4", "element-size-8", lambda v: _set(v, 2, 8)),
    _filter_values("lz4", "codec-0", lambda v: _set(v, 4, 0)),
    _filter_values("lz4", "codec-7", lambda v: _set(v, 4, 7)),
    _filter_values("lz4", "too-few", lambda v: v[:3]),
    _filter_values("lz4", "none", lambda v: []),
    _wrong_block_size_values("lz4"),
    _filter_values("lz4", "block-size-2pow32-8", lambda v: _set(v, 3, 2**32 - 8), EITHER),
    _filter_values("zstd", "typesize-0", lambda v: _set(v, 2, 0)),
    _filter_values("zstd", "typesize-4", lambda v: _set(v, 2, 4)),
    _filter_values("zstd", "chunk-bytes-huge", lambda v: _set(v, 3, 2**32 - 1)),
    _filter_values("zstd", "rank-2pow31", lambda v: _set(v, 7, 2**31)),
    _filter_values("zstd", "rank-9", lambda v: v[:7] + [9] + [64] * 9),
    _filter_values("zstd", "chunk-dims-differ", lambda v: v[:8] + [32, 64]),
    _filter_values("zstd", "without-rank", lambda v: v[:7], EITHER),
    Case("filter-unknown-id", "lz4", edit_entry("lz4", lambda e: e["chunks"]["filter"].__setitem__(0, 32015))),
    Case("filter-deflate", "lz4", edit_entry("lz4", lambda e: e["chunks"].__setitem__("filter", [1, [4]]))),
    Case("filter-blosc2-on-bitshuffle-data", "lz4", edit_entry(
        "lz4", lambda e: e["chunks"].__setitem__("filter", [32026, [1, 0, 4, B, 5, 1, 5]]))),
    Case("filter-bitshuffle-on-blosc2-data", "plain", edit_entry(
        "plain", lambda e: e["chunks"].__setitem__("filter", [32008, [0, 4, 4, 0, 2]]))),
    # -- raw flags that lie
    Case("raw-flag-on-compressed-chunk", "zstd", _raw_lie_compressed, VALUES),
    Case("raw-data-without-flag", "plain", _raw_data_unflagged),
]


# ---------------------------------------------------------------------------- the worker

WORKER = r'''
import json, os, resource, signal, sys, time, warnings
warnings.simplefilter("ignore")
import hashlib
import torch
import tensorstore_h5 as th5
from tensorstore_h5.errors import TensorStoreError
from tensorstore_h5.format.dtypes import bits_view
from tensorstore_h5.storage.memory import tensor_bytes

CANARY = bytes.fromhex(sys.argv[3])


def status(name):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name + ":"))


resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + 2**30, resource.RLIM_INFINITY))
calls, seconds = json.loads(sys.argv[1]), float(sys.argv[2])


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


signal.signal(signal.SIGALRM, _alarm)


def raw(t):
    return bytes(tensor_bytes(bits_view(t.detach()).contiguous()))


def plant():
    """Freed heap memory full of the canary: a tensor handed out unfilled shows it."""
    import ctypes
    blocks = [ctypes.create_string_buffer(CANARY * (n // 16)) for n in (4096, 8192, 65536, 262144) for _ in range(8)]
    del blocks


def read(call, p, key):
    if call == "load":
        return th5.load(p)[key]
    if call == "verify":
        return th5.load(p, verify=True)[key]
    with th5.open(p) as s:
        h = s[key]
        if call == "slice":
            return h[1:3]
        out = torch.empty(h.shape, dtype=h.dtype)
        n = out.numel() * out.element_size()
        canary = torch.frombuffer(bytearray((CANARY * (n // 16 + 1))[:n]), dtype=torch.uint8)
        bits_view(out).reshape(-1).view(torch.uint8).copy_(canary)
        h.read(out=out)
        return out


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


for call, p, key in calls:
    r = {"call": call, "path": p, "key": key}
    plant()
    measured = reset_peak()
    before = status("VmRSS")
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        t = read(call, p, key)
        signal.setitimer(signal.ITIMER_REAL, 0)
        b = raw(t)
        r.update(outcome="ok", sha=hashlib.sha256(b).hexdigest(), canary=CANARY[:8] in b or CANARY[8:] in b)
    except Hang:
        r["outcome"] = "hang"
    except BaseException as e:  # noqa: BLE001 - reported
        r.update(outcome="error", type=type(e).__name__, message=str(e)[:2000], library=isinstance(e, TensorStoreError))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    r["seconds"] = time.monotonic() - start
    r["grew"] = status("VmHWM") - before if measured else None
    sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.flush()
os._exit(0)
'''


def run_reads(calls: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Run ``(read, path, key)`` in limited workers, in order; a worker that dies is reported
    as the result of the call it was in, and a new one runs the calls left."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    results: list[dict[str, Any]] = []
    while len(results) < len(calls):
        left = calls[len(results):]
        try:
            r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(left), str(CALL_SECONDS), CANARY.hex()],
                               capture_output=True, text=True, env=env, cwd=REPO,
                               timeout=STARTUP_SECONDS + (CALL_SECONDS + 2) * len(left))
            out, err, code = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, code = "worker timed out", None
        done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results += done
        if len(results) < len(calls):
            call, p, key = calls[len(results)]
            results.append({"call": call, "path": p, "key": key, "outcome": "died", "code": code, "stderr": err[-3000:],
                            "seconds": 0.0, "grew": None})
    return results


# ---------------------------------------------------------------------------- checking


def expected_sha(obj: dict[str, torch.Tensor], key: str, call: str) -> str:
    t = obj[key][1:3] if call == "slice" else obj[key]
    return hashlib.sha256(bytes(bits(t.contiguous()).numpy())).hexdigest()


def problems_of(results: list[dict[str, Any]], kind: str, obj: dict[str, torch.Tensor], allowed_bytes: int) -> list[str]:
    out = []
    for r in results:
        where = f"{r['call']} of {r['key']!r}"
        if r["outcome"] in ("died", "hang"):
            out.append(f"{where}: {r['outcome']} {r.get('code', '')} {r.get('stderr', '')}")
            continue
        if r["seconds"] >= CALL_SECONDS:
            out.append(f"{where}: took {r['seconds']:.1f} s")
        if r["grew"] is not None and r["grew"] > allowed_bytes:
            out.append(f"{where}: peak memory grew by {r['grew'] / 2**20:.1f} MiB (at most {allowed_bytes / 2**20:.1f})")
        name = Path(r["path"]).name
        if r["outcome"] == "error":
            if not r["library"]:
                out.append(f"{where}: {r['type']} is not a TensorStoreError: {r['message']}")
            elif name not in r["message"] or repr(r["key"]) not in r["message"]:
                out.append(f"{where}: the message does not name the file and the key: {r['message']}")
            continue
        if r["canary"]:
            out.append(f"{where}: returned memory that no read filled (the canary)")
        elif kind == REFUSE:
            out.append(f"{where}: succeeded, expected a FormatError")
        elif kind == EITHER and r["sha"] != expected_sha(obj, r["key"], r["call"]):
            out.append(f"{where}: returned values that were not saved")
        elif kind == VALUES and r["call"] == "verify":
            out.append(f"{where}: a checked read returned values that were not saved")
    return out


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory) -> dict[str, tuple[Case, list[dict[str, Any]]]]:
    d = tmp_path_factory.mktemp("hostile-codecs")
    base = d / "base.h5"
    save_base(base)
    calls, made = [], {}
    for case in CASES:
        p = d / f"{case.name}.h5"
        shutil.copy(base, p)
        case.edit(p)
        made[case.name] = (case, str(p))
        calls += [(read, str(p), case.key) for read in READS]
    results = run_reads([("load", str(base), "lz4")] + calls)[1:]  # the first read warms the worker up
    out = {}
    for name, (case, p) in made.items():
        out[name] = (case, [r for r in results if r["path"] == p])
    return out


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_hostile_chunk_is_refused_cleanly(hostile_results, name) -> None:
    case, results = hostile_results[name]
    assert [r["call"] for r in results] == list(READS)
    problems = problems_of(results, case.kind, base_object(), 3 * 5 * 64 * 1024 + SLACK)
    assert not problems, "\n".join(problems)


def test_the_base_file_reads_exactly_through_every_read(tmp_path) -> None:
    path = tmp_path / "base.h5"
    obj = save_base(path)
    results = run_reads([(read, str(path), key) for key in obj for read in READS])
    assert [r["outcome"] for r in results] == ["ok"] * len(results), results
    assert [r["sha"] for r in results] == [expected_sha(obj, r["key"], r["call"]) for r in results]
    with th5.open(path) as s:  # the cases above attack what they think they attack
        assert s._reader.chunked(s["zstd"]._entry).filter_values[7:] == (2, 64, 64)
        assert len(s._reader.chunked(s["plain"]._entry).filter_values) == 7
    assert decoders.frame_metalayer(chunk_of(path, "zstd")) is not None
    assert decoders.frame_metalayer(chunk_of(path, "plain")) is None
    assert len(bshuf_blocks(chunk_of(path, "lz4"))) == 1


def test_the_frame_builder_rebuilds_real_frames(tmp_path) -> None:
    path = tmp_path / "base.h5"
    save_base(path)
    for key in ("zstd", "plain"):
        frame = chunk_of(path, key)
        assert build_frame(split_frame(frame)) == frame
    frame = chunk_of(path, "zstd")
    assert split_frame(frame).meta == b2nd_meta((64, 64), (64, 64), (64, 64), 2)


@pytest.mark.parametrize("preset", ["zstd", "best"])
@pytest.mark.parametrize("fill", [0.0, float("nan"), 3.5])
def test_chunks_of_one_repeated_value_still_decode(tmp_path, preset, fill) -> None:
    """c-blosc2 stores a chunk of one value as a special chunk (of zeros: as a special chunk
    offset, no chunk stored); those decode, plain or B2ND, whole or in part."""
    obj = {"flat": torch.full((8192,), fill), "b2nd": torch.full((256, 64), fill).to(torch.bfloat16),
           "odd": torch.full((62, 65, 65), fill)}
    path = tmp_path / "v.h5"
    th5.save(obj, path, compression=preset, chunk_bytes=8192)
    if fill == 0.0:  # a special offset: the chunk's bytes are the frame's offsets and trailer alone
        frame = chunk_of(path, "b2nd")
        assert struct.unpack_from("<q", frame, frame_field(frame, HEADER_LEN) + 32)[0] < 0
    got = th5.load(path, verify=True)
    with th5.open(path) as s:
        for key, t in obj.items():
            assert_same_tensor(got[key], t)
            assert_same_tensor(s[key][1:3], t[1:3], layout=False)


def test_an_uninitialized_chunk_never_returns_an_earlier_reads_bytes(tmp_path) -> None:
    """Before c-blosc2's UNINIT chunks were refused, a slice of one returned what the thread's
    scratch buffer held: the bytes of a chunk decoded before, from any file."""
    secret = tmp_path / "secret.h5"
    th5.save({"plain": torch.full((8192,), 1234.5)}, secret, compression="zstd", chunk_bytes=8192)
    path = tmp_path / "h.h5"
    save_base(path)
    edit_chunk("plain", chunk_u8(31, UNINIT << 4))(path)
    for _ in range(8):
        with th5.open(secret) as s:
            assert torch.all(s["plain"][1:3] == 1234.5)
        with th5.open(path) as s, pytest.raises(th5.FormatError, match=r"h\.h5: key 'plain'.*never written"):
            s["plain"][1:3]


# ---------------------------------------------------------------------------- B2ND block shapes that pad a chunk


def _b2nd_file(path: Path, shape: tuple[int, ...], blocks: tuple[int, ...], dtype: torch.dtype = torch.uint8,
               data: torch.Tensor | None = None, zeros: bool = False) -> torch.Tensor:
    """A file of one tensor of ``shape`` in one B2ND chunk whose blocks are ``blocks`` (its
    padded chunk: every dimension rounded up to whole blocks), holding ``data`` (random by
    default) as real compressed blocks, or a special all-zeros chunk (``zeros``)."""
    t = torch.zeros(shape, dtype=dtype) if data is None and zeros else data
    if t is None:
        rng, n = np.random.default_rng(len(shape)), math.prod(shape) * dtype.itemsize  # mostly zeros: it compresses
        raw = rng.integers(0, 256, size=n, dtype=np.uint8) * (rng.random(n) < 0.1)
        t = torch.from_numpy(raw.astype(np.uint8)).view(dtype).reshape(shape)
    isz = dtype.itemsize
    template = torch.arange(math.prod(shape)).reshape(shape).to(dtype)  # a real chunk (zeros would be a special offset)
    th5.save({"t": template}, path, compression="zstd", chunk_bytes=t.numel() * isz)
    parts = split_frame(chunk_of(path, "t"))
    grid = [-(-c // b) for c, b in zip(shape, blocks)]
    ext = tuple(g * b for g, b in zip(grid, blocks))
    block_bytes = math.prod(blocks) * isz
    if zeros:
        chunk = special_chunk(ZERO, math.prod(ext) * isz, block_bytes, isz)
    else:  # the padded chunk, block after block, each block row-major (as c-blosc2's b2nd lays it out)
        padded = np.zeros(ext + (isz,), dtype=np.uint8)
        padded[tuple(slice(0, c) for c in shape)] = bits(t).numpy().reshape(shape + (isz,))
        split = padded.reshape(sum(((g, b) for g, b in zip(grid, blocks)), ()) + (isz,))
        order = [2 * i for i in range(len(shape))] + [2 * i + 1 for i in range(len(shape))] + [2 * len(shape)]
        chunk = blosc2_chunk(split.transpose(order).tobytes(), isz, block_bytes)
    frame = build_frame(parts, chunk=chunk, meta=b2nd_meta(shape, shape, blocks, isz))
    set_chunk(path, "t", frame, hashes=[checksum.to_hex(checksum.digest(bytes(bits(t).numpy())))])
    return t


def _hdf5plugin_decodes(frame: bytes, shape: tuple[int, ...], dtype: torch.dtype, path: Path) -> bytes:
    """What HDF5's own Blosc2 filter (hdf5plugin, through libhdf5) decodes ``frame`` to, as
    the one chunk of a dataset of ``shape``."""
    isz = dtype.itemsize
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("t", shape=shape, dtype=f"<u{isz}" if isz <= 8 else "<c16", chunks=shape,
                              **hdf5plugin.Blosc2(cname="zstd"))
        ds.id.write_direct_chunk((0,) * len(shape), frame)
        raw = np.empty(math.prod(shape) * isz, dtype=np.uint8)
        ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=ds.id.get_type())
    return raw.tobytes()


@pytest.mark.parametrize("shape, blocks", [((130, 130), (50, 70)), ((33, 40, 25), (8, 16, 25)), ((9, 10, 11, 17), (4, 4, 4, 8)),
                                           ((64, 4096), (64, 512)), ((33, 33, 33), (32, 32, 32)), ((3, 8000), (1, 64)),
                                           ((1, 1, 41, 420), (1, 1, 7, 33)), ((128, 128), (128, 128)), ((128, 128), (4, 128)),
                                           ((2, 3, 5, 7, 11, 13), (1, 2, 4, 4, 8, 8))], ids=str)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.complex128], ids=str)
def test_b2nd_blocks_of_any_shape_decode_exactly(tmp_path, shape, blocks, dtype) -> None:
    """B2ND chunks whose blocks tile them in any way (padded past the chunk's edge or not)
    decode to exactly the array, as HDF5's own filter decodes them."""
    t = _b2nd_file(tmp_path / "b.h5", shape, blocks, dtype)
    with th5.open(tmp_path / "b.h5") as s:
        assert_same_tensor(s["t"].read(verify=True), t)
        assert_same_tensor(s["t"][1:2], t[1:2], layout=False)
    frame = chunk_of(tmp_path / "b.h5", "t")
    assert _hdf5plugin_decodes(frame, shape, dtype, tmp_path / "h.h5") == bytes(bits(t).numpy())


@pytest.mark.parametrize("shape, dtype, chunk_bytes", [((65, 65, 65), torch.bfloat16, None), ((257, 257), torch.float32, None),
                                                       ((9,) * 7, torch.uint8, 65536), ((17,) * 5, torch.float64, None),
                                                       ((4096, 300), torch.float32, None)], ids=str)
def test_hdf5plugin_b2nd_frames_with_padded_blocks_decode_as_hdf5_does(tmp_path, shape, dtype, chunk_bytes) -> None:
    """hdf5plugin pads chunks of odd shapes to whole blocks (up to 18x their bytes here)."""
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(shape, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 50, shape, generator=g, dtype=dtype)
    th5.save({"t": t}, tmp_path / "c.h5", compression="zstd", chunk_bytes=chunk_bytes)
    with th5.open(tmp_path / "c.h5") as s:
        assert s._reader.chunked(s["t"]._entry) is not None
        assert_same_tensor(s["t"].read(verify=True), t)
        assert_same_tensor(s["t"][1:3], t[1:3], layout=False)


def test_b2nd_block_shape_padding_a_chunk_does_not_allocate_the_padding(tmp_path) -> None:
    """A 2 MiB chunk whose blocks pad it to 14^7 bytes (100 MiB, all zeros): decoded into
    at most about the chunk's bytes of scratch, not the padded chunk."""
    path = tmp_path / "pad.h5"
    t = _b2nd_file(path, (8,) * 7, (7,) * 7, zeros=True)
    results = run_reads([("load", str(path), "t")] + [(read, str(path), "t") for read in READS])[1:]
    for r in results:
        assert r["outcome"] == "ok", r
        assert r["sha"] == expected_sha({"t": t}, "t", r["call"])
        if r["grew"] is not None:
            assert r["grew"] < 5 * t.numel() + (24 << 20), f"{r['call']}: grew by {r['grew'] / 2**20:.1f} MiB"
