"""The HDF5 metadata of an uncompressed format-2 file, encoded here instead of by libhdf5.

Creating a dataset through libhdf5 costs ~40 us, before any byte of it is written: 0.25-0.3 s
for the 6,000 small tensors of a model's optimizer state, more than ``torch.save`` takes for
all of it. A file whose datasets are all contiguous and uncompressed needs few kinds of HDF5
metadata, which :class:`Builder` encodes after the data is written (docs/FORMAT.md, "The
HDF5 part"): a version-3 superblock, and version-2 object headers (checksummed with Jenkins'
lookup3, as HDF5 does) for groups, with their links in the header or, in groups of more
than :data:`DENSE_LINKS` links, in a fractal heap indexed by a B-tree of name hashes (for a
large group, a heap of many blocks and a B-tree of many levels, as libhdf5 lays out its own:
:data:`ONE_BLOCK`), and for datasets, with dataspace, datatype, fill value, contiguous
layout, reference count (hard links) and attributes. Datatype and fill-value messages are the bytes libhdf5 itself writes for the same
type, taken once per type from a dataset it creates in memory.

Addresses in HDF5 metadata are relative to the superblock (``base``); every address this
module takes or returns is an absolute file offset.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

__all__ = ["Builder", "SUPERBLOCK_BYTES", "lookup3"]

SUPERBLOCK_BYTES = 48
"""Length of a version-3 superblock (no extension)."""

_UNDEF = 0xFFFF_FFFF_FFFF_FFFF  # HDF5's undefined address

# object header message types (HDF5 file format specification, IV.A.2)
_DATASPACE, _LINK_INFO, _DATATYPE, _FILL_VALUE, _LINK, _LAYOUT, _GROUP_INFO = 0x01, 0x02, 0x03, 0x05, 0x06, 0x08, 0x0A
_ATTRIBUTE, _ATTRIBUTE_INFO, _REFCOUNT = 0x0C, 0x15, 0x16
_CONSTANT, _DONT_SHARE = 0x01, 0x04  # message flags, as libhdf5 sets them
_LAYOUT_MESSAGE = struct.Struct("<BHBBBQQ")  # a contiguous layout message (version 3), header included

DENSE_LINKS = 64
"""Groups of more links than this keep them in a fractal heap indexed by a version-2 B-tree
of their names' hashes ("dense" storage, as libhdf5 does above 8 links) instead of in the
group's object header, where libhdf5 finds a name by a linear scan (in a group of 20,000
links, 0.233 ms a lookup through h5py in the header, 0.089 in libhdf5's own dense storage;
at 50,000 links, 1,000 lookups of random names through h5py took 236 ms in the header,
10-13 ms in dense storage written here, as in libhdf5's own: bench/large_groups.py)."""

MAX_DENSE_LINKS = 2**24
"""The most links (16,777,216) of a group encoded here in dense storage; a group of more keeps
them in its header. A guard, not a limit of the encoding: dense storage has any number of
B-tree levels, and its heap holds 4 GiB of link messages, as libhdf5's does (a group whose
links overflow it keeps them in its header too)."""

ONE_BLOCK = 1 << 15
"""A dense group whose link messages fit a block of this many bytes (some 1,000 links) keeps
them in one direct block, the root of its heap (a power of two of at least 512 bytes), and one
whose name index fits a B-tree node of this many bytes (2,978 links) keeps it in one leaf
(a power of two of at least 512 bytes). Larger ones are laid out as libhdf5 lays out its own:
heap blocks of at most 64 KiB under indirect blocks, and a B-tree of :data:`NAME_NODE`-byte
nodes. (A direct block is a single entry of libhdf5's metadata cache, read and checksummed
whole when the cache lets it go: a root block of 64 MiB, for 1.2 million links, made a
lookup take 95 ms. A root block of 64 KiB or more also leaves libhdf5 a heap it cannot grow
past eight blocks: its indirect rows would be of zero rows, and h5py adding links crashed.)"""

NAME_NODE = 512
"""Bytes of a node of the name index of a dense group too large for one leaf: libhdf5's own
(``H5G_NAME_BT2_NODE_SIZE``; split at 100 %, merged at 40 %, as here). Measured through h5py
on 50,000 links, nodes of 512 and 4,096 bytes were as fast as libhdf5's own index, nodes of
16-128 KiB up to 5 times slower (a node the metadata cache lets go is read and decoded
again whole)."""

_MAX_MANAGED = 4096  # libhdf5's largest object in a link heap (H5G_FHEAP_MAX_MAN_SIZE); larger: "huge" objects
_HEAP_HEADER = struct.Struct("<4sBHHBIQQQQQQQQQQQQHQQHHQH")  # a fractal heap header (version 0), but its checksum
_BTREE_HEADER = struct.Struct("<4sBBIHHBBQHQ")  # a version-2 B-tree header (version 0), but its checksum
_DIRECT_PREFIX = 21  # a direct block's signature, version, heap address, 4-byte block offset and checksum


# ---------------------------------------------------------------------------------- lookup3


def _lookup3_py(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``, as HDF5's ``H5_checksum_lookup3`` computes it."""
    m = 0xFFFF_FFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    pos = 0
    while n - pos > 12:
        x, y, z = struct.unpack_from("<3I", data, pos)
        a, b, c = (a + x) & m, (b + y) & m, (c + z) & m
        a = ((a - c) & m) ^ rot(c, 4); c = (c + b) & m  # noqa: E702 - the mix, step by step
        b = ((b - a) & m) ^ rot(a, 6); a = (a + c) & m  # noqa: E702
        c = ((c - b) & m) ^ rot(b, 8); b = (b + a) & m  # noqa: E702
        a = ((a - c) & m) ^ rot(c, 16); c = (c + b) & m  # noqa: E702
        b = ((b - a) & m) ^ rot(a, 19); a = (a + c) & m  # noqa: E702
        c = ((c - b) & m) ^ rot(b, 4); b = (b + a) & m  # noqa: E702
        pos += 12
    if n == pos:
        return c
    x, y, z = struct.unpack("<3I", data[pos:].ljust(12, b"\0"))
    a, b, c = (a + x) & m, (b + y) & m, (c + z) & m
    c = (c ^ b) - rot(b, 14) & m
    a = (a ^ c) - rot(c, 11) & m
    b = (b ^ a) - rot(a, 25) & m
    c = (c ^ b) - rot(b, 16) & m
    a = (a ^ c) - rot(c, 4) & m
    b = (b ^ a) - rot(a, 14) & m
    c = (c ^ b) - rot(b, 24) & m
    return c


@functools.cache
def _lookup3_c() -> Any:
    """libhdf5's own ``H5_checksum_lookup3`` (through h5py's extension), or None."""
    try:
        f = ctypes.CDLL(h5py.defs.__file__).H5_checksum_lookup3
    except (AttributeError, OSError):  # pragma: no cover - an HDF5 build that does not export it
        return None
    f.restype = ctypes.c_uint32
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32]
    return f


def lookup3(data: bytes, initval: int = 0) -> int:
    """The checksum HDF5 puts at the end of its version-2 metadata (a 32-bit int)."""
    f = _lookup3_c()
    return int(f(data, len(data), initval)) if f is not None else _lookup3_py(data, initval)


def _rot(x: np.ndarray, k: int) -> np.ndarray:
    return (x << np.uint32(k)) | (x >> np.uint32(32 - k))


def _lookup3_rows(rows: np.ndarray) -> np.ndarray:
    """lookup3 (initval 0) of every row of a 2-D uint8 array, in 32-bit lanes: the rows are
    hashed side by side, one numpy operation per step for all of them."""
    n, length = rows.shape
    c = np.full(n, (0xDEADBEEF + length) & 0xFFFF_FFFF, dtype=np.uint32)
    if length == 0:
        return c
    blocks = (length - 1) // 12  # full blocks mixed; the last 1-12 bytes go to the final step
    padded = np.zeros((n, 12 * (blocks + 1)), dtype=np.uint8)
    padded[:, :length] = rows
    words = padded.view("<u4").reshape(n, blocks + 1, 3)
    a, b = c.copy(), c.copy()
    for i in range(blocks):
        a += words[:, i, 0]
        b += words[:, i, 1]
        c += words[:, i, 2]
        a -= c; a ^= _rot(c, 4); c += b  # noqa: E702 - lookup3's mix, step by step
        b -= a; b ^= _rot(a, 6); a += c  # noqa: E702
        c -= b; c ^= _rot(b, 8); b += a  # noqa: E702
        a -= c; a ^= _rot(c, 16); c += b  # noqa: E702
        b -= a; b ^= _rot(a, 19); a += c  # noqa: E702
        c -= b; c ^= _rot(b, 4); b += a  # noqa: E702
    a += words[:, blocks, 0]
    b += words[:, blocks, 1]
    c += words[:, blocks, 2]
    c ^= b; c -= _rot(b, 14)  # noqa: E702 - lookup3's final
    a ^= c; a -= _rot(c, 11)  # noqa: E702
    b ^= a; b -= _rot(a, 25)  # noqa: E702
    c ^= b; c -= _rot(b, 16)  # noqa: E702
    a ^= c; a -= _rot(c, 4)  # noqa: E702
    b ^= a; b -= _rot(a, 14)  # noqa: E702
    c ^= b; c -= _rot(b, 24)  # noqa: E702
    return c


def lookup3_many(blobs: list[bytes]) -> list[int]:
    """:func:`lookup3` of each blob: blobs of one length (most object headers of a
    checkpoint) are hashed together with numpy, a third of the time of one call each."""
    out: list[int] = [0] * len(blobs)
    by_length: dict[int, list[int]] = {}
    for i, blob in enumerate(blobs):
        by_length.setdefault(len(blob), []).append(i)
    for length, idx in by_length.items():
        if len(idx) < 16:
            for i in idx:
                out[i] = lookup3(blobs[i])
            continue
        rows = np.frombuffer(b"".join([blobs[i] for i in idx]), dtype=np.uint8).reshape(len(idx), length)
        for i, h in zip(idx, _lookup3_rows(rows).tolist()):
            out[i] = h
    return out


# ------------------------------------------------------------------- messages libhdf5 writes


def contiguous_dcpl() -> h5py.h5p.PropDCID:
    """The creation properties of a contiguous dataset, as both writers make it: no fill
    value written, space allocated at creation, no timestamps."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_obj_track_times(False)
    return dcpl


@functools.lru_cache(maxsize=256)
def _type_messages(encoded: bytes) -> tuple[bytes, bytes]:
    """The datatype and fill-value messages libhdf5 writes for a contiguous dataset of the type
    ``encoded`` (``TypeID.encode()``), created with :func:`contiguous_dcpl` in an
    in-memory file of the format's library-version bounds."""
    tid = h5py.h5t.decode(encoded)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_fapl_core(backing_store=False)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_V110)
    name = f"tensorstore_h5-{id(tid)}.h5".encode()
    fid = h5py.h5f.create(name, h5py.h5f.ACC_TRUNC, fapl=fapl)
    try:
        dsid = h5py.h5d.create(fid, b"d", tid, h5py.h5s.create_simple((1,)), dcpl=contiguous_dcpl())
        addr = h5py.h5o.get_info(dsid).addr
        del dsid
        h5py.h5f.flush(fid)
        image = fid.get_file_image()
    finally:
        fid.close()
    found = {kind: body for kind, _, body in parse_object_header(image, addr)}
    return found[_DATATYPE], found[_FILL_VALUE]


def parse_object_header(image: bytes, addr: int) -> list[tuple[int, int, bytes]]:
    """The ``(type, flags, body)`` messages of the version-2 object header at ``addr`` of
    ``image`` (one chunk; for tests and for reading what libhdf5 wrote). Raises ValueError
    when there is no such header or its checksum is wrong."""
    if image[addr:addr + 5] != b"OHDR\x02":
        raise ValueError(f"no version-2 object header at {addr}")
    flags = image[addr + 5]
    p = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    size = int.from_bytes(image[p:p + width], "little")
    p += width
    end = p + size
    if lookup3(bytes(image[addr:end])) != int.from_bytes(image[end:end + 4], "little"):
        raise ValueError(f"object header at {addr}: checksum mismatch")
    out = []
    while p + 4 <= end:
        kind, length, mflags = image[p], int.from_bytes(image[p + 1:p + 3], "little"), image[p + 3]
        p += 4 + (2 if flags & 0x04 else 0)
        out.append((kind, mflags, bytes(image[p:p + length])))
        p += length
    return out


# ------------------------------------------------------------------------------- encoding


def _message(kind: int, body: bytes, flags: int = 0) -> bytes:
    if len(body) > 0xFFFF:
        raise ValueError(f"an HDF5 header message of {len(body)} bytes (at most 65,535)")
    return struct.pack("<BHB", kind, len(body), flags) + body


def _unsummed_header(body: bytes) -> bytes:
    """A version-2 object header of one chunk holding the encoded messages ``body``, but for
    its checksum (4 bytes, lookup3 of all of it, appended by :meth:`Builder.encode`)."""
    n = len(body)
    code, width = (0, 1) if n < 1 << 8 else (1, 2) if n < 1 << 16 else (2, 4) if n < 1 << 32 else (3, 8)
    return b"OHDR\x02" + bytes([code]) + n.to_bytes(width, "little") + body


@functools.lru_cache(maxsize=1024)
def _dataspace(shape: tuple[int, ...]) -> bytes:
    """A version-2 dataspace message: scalar for ``()``, else simple, maximum = current."""
    if not shape:
        return b"\x02\x00\x00\x00"
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    return bytes([2, len(shape), 1, 1]) + dims + dims


def _attribute(name: str, value: np.ndarray) -> bytes:
    """A version-3 attribute message holding ``value`` (fixed-length strings and numbers)."""
    dtype, _ = _type_messages(h5py.h5t.py_create(value.dtype).encode())
    space = _dataspace(tuple(value.shape))
    raw = name.encode("utf-8") + b"\0"
    data = np.ascontiguousarray(value).tobytes()
    return struct.pack("<BBHHHB", 3, 0, len(raw), len(dtype), len(space), 0) + raw + dtype + space + data


@functools.lru_cache(maxsize=4096)  # names repeat across groups ("weight", "exp_avg", "step")
def _link_head(name: str) -> bytes:
    """A hard-link message (version 1, the name stored as UTF-8), header included, but for
    the 8-byte address that ends it."""
    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) < 1 << 8:
        body = bytes([1, 0x10, 1, len(raw)]) + raw
    else:
        body = bytes([1, 0x11, 1]) + struct.pack("<H", len(raw)) + raw
    return struct.pack("<BHB", _LINK, len(body) + 8, 0) + body


def _enc_size(n: int) -> int:
    """Bytes libhdf5 stores a count of up to ``n`` in (``H5VM_limit_enc_size``)."""
    return (max(n, 1).bit_length() - 1) // 8 + 1


def _node_info(node: int, rsize: int, depth: int) -> list[tuple[int, int, int]]:
    """``(max records, max records of its subtree, bytes of a pointer to one of its children)``
    of a node at each level ``0..depth`` of a version-2 B-tree of ``node``-byte nodes and
    ``rsize``-byte records, as libhdf5 computes them (``H5B2__hdr_init``, whose values it reads
    the nodes with): a leaf holds ``(node - 10) // rsize`` records; an internal node at level
    ``d`` holds ``m`` records and ``m + 1`` child pointers of an address, the child's record
    count (in the width of a leaf's max) and, for ``d > 1``, the records of the child's subtree
    (in the width of the subtree max of level ``d - 1``)."""
    leaf = (node - 10) // rsize
    nrec_size = _enc_size(leaf)
    out = [(leaf, leaf, 0)]
    for d in range(1, depth + 1):
        pointer = 8 + nrec_size + (_enc_size(out[d - 1][1]) if d > 1 else 0)
        m = (node - 10 - pointer) // (rsize + pointer)
        out.append((m, (m + 1) * out[d - 1][1] + m, pointer))
    return out


def _btree(records: list[bytes], btype: int, node: int, at: int) -> tuple[bytes, int, int, int]:
    """The nodes of a version-2 B-tree of ``node``-byte nodes holding the sorted ``records`` (of
    one length), laid out from ``at``: ``(bytes, root address, records in the root, depth)``.

    The depth is the least whose subtree max holds them all. A subtree's records are split
    evenly among the fewest children that hold them, a record between each two children kept
    in their parent (an internal node's records are records of the tree, in order between its
    children's, not copies of theirs), so that every node but the root is at least half full,
    above libhdf5's merge threshold (40 %). Each node is padded to ``node`` bytes (libhdf5
    reads it whole).
    """
    depth = 0
    while _node_info(node, len(records[0]), depth)[-1][1] < len(records):
        depth += 1
    info = _node_info(node, len(records[0]), depth)
    nrec_size = _enc_size(info[0][0])
    kind = bytes([0, btype])  # version 0, type
    parts: list[bytes] = []
    pos = at

    def place(body: bytes) -> int:
        nonlocal pos
        where = pos
        parts.append(body + lookup3(body).to_bytes(4, "little") + bytes(node - len(body) - 4))
        pos += node
        return where

    def build(lo: int, n: int, d: int) -> tuple[int, int]:  # the subtree of records[lo:lo + n]: (address, records in its root)
        if d == 0:
            return place(b"BTLF" + kind + b"".join(records[lo:lo + n])), n
        below = info[d - 1][1]
        children = -(-(n + 1) // (below + 1))
        share, extra = divmod(n - (children - 1), children)
        keys, pointers = [], []
        for i in range(children):
            count = share + (i < extra)
            child, nrec = build(lo, count, d - 1)
            pointers.append(child.to_bytes(8, "little") + nrec.to_bytes(nrec_size, "little")
                            + (count.to_bytes(_enc_size(below), "little") if d > 1 else b""))
            lo += count
            if i < children - 1:
                keys.append(records[lo])
                lo += 1
        return place(b"BTIN" + kind + b"".join(keys) + b"".join(pointers)), children - 1

    root, nroot = build(0, len(records), depth)
    return b"".join(parts), root, nroot, depth


# A link heap's doubling table, as libhdf5 creates it for a group (H5G_FHEAP_MAN_*): 4 entries
# a row, direct blocks of 512 bytes to 64 KiB (two rows of 512, then doubling), heap offsets of
# 32 bits. Rows of larger spans hold indirect blocks, of such rows themselves.
_WIDTH, _START, _MAX_DIRECT, _HEAP_BITS = 4, 512, 1 << 16, 32
_DIRECT_ROWS = _MAX_DIRECT.bit_length() - _START.bit_length() + 2  # rows of direct blocks in an indirect block (9)
_ROOT_ROWS = _HEAP_BITS - (_START * _WIDTH).bit_length() + 2  # the most rows of the root indirect block (22)


def _row_size(row: int) -> int:
    """Heap bytes of one entry of ``row`` of an indirect block: a direct block's size, or the
    span of a child indirect block."""
    return _START if row == 0 else _START << (row - 1)


def _row_offset(row: int) -> int:
    """Heap offset of ``row``'s first entry from its indirect block's (the span of the rows
    before it)."""
    return 0 if row == 0 else (_START * _WIDTH) << (row - 1)


def _child_rows(row: int) -> int:
    """Rows of a child indirect block in ``row`` (``H5HF__dtable_size_to_rows``)."""
    return row - _WIDTH.bit_length() + 1


@functools.cache
def _row_free(row: int) -> int:
    """Bytes for objects in the direct blocks under one entry of ``row``, allocated or not:
    libhdf5 counts them all as the free space of a heap whose root spans the row."""
    if row < _DIRECT_ROWS:
        return _row_size(row) - _DIRECT_PREFIX
    return _WIDTH * sum(map(_row_free, range(_child_rows(row))))


def _direct_blocks(offset: int, rows: int) -> Iterable[tuple[int, int]]:
    """``(heap offset, size)`` of the direct blocks under an indirect block of ``rows`` rows at
    heap ``offset``, in heap order: the order libhdf5 allocates them in."""
    for row in range(rows):
        size = _row_size(row)
        for col in range(_WIDTH):
            at = offset + _row_offset(row) + col * size
            if row < _DIRECT_ROWS:
                yield at, size
            else:
                yield from _direct_blocks(at, _child_rows(row))


def _direct_block(heap_at: int, offset: int) -> bytearray:
    """The start of a direct block at heap ``offset``: signature, version, heap address, block
    offset (4 bytes) and a checksum to come (:func:`_sum_direct`)."""
    return bytearray(b"FHDB\x00" + heap_at.to_bytes(8, "little") + offset.to_bytes(4, "little") + bytes(4))


def _sum_direct(data: bytearray, size: int) -> bytes:
    """The direct block ``data`` padded to ``size`` bytes, with its checksum (lookup3 of the
    whole block, the checksum's bytes zero)."""
    data += bytes(size - len(data))
    data[_DIRECT_PREFIX - 4:_DIRECT_PREFIX] = lookup3(bytes(data)).to_bytes(4, "little")
    return bytes(data)


def _one_block_heap(links: list[bytes], heap_at: int) -> tuple[bytes, list[bytes]]:
    """A link heap whose root is one direct block holding every link (a power of two of at least
    512 bytes, at most :data:`ONE_BLOCK`: libhdf5 grows it from there as a table of blocks of
    up to 64 KiB): ``(header and block, heap ID of each link)``."""
    used = _DIRECT_PREFIX + sum(map(len, links))
    block = max(_START, 1 << (used - 1).bit_length())
    assert block < _MAX_DIRECT
    head = _HEAP_HEADER.pack(b"FRHP", 0, 7, 0, 0x02, _MAX_MANAGED, 0, _UNDEF, block - used, _UNDEF, block, block, block,
                             len(links), 0, 0, 0, 0, _WIDTH, block, _MAX_DIRECT, _HEAP_BITS, 1,
                             heap_at + _HEAP_HEADER.size + 4, 0)
    data = _direct_block(heap_at, 0)
    ids = []
    for link in links:
        ids.append(b"\x00" + len(data).to_bytes(4, "little") + len(link).to_bytes(2, "little"))
        data += link
    return b"".join([head, lookup3(head).to_bytes(4, "little"), _sum_direct(data, block)]), ids


def _table_heap(links: list[bytes], heap_at: int) -> tuple[bytes, list[bytes]] | None:
    """A link heap laid out as libhdf5 grows one for a group: a root indirect block of 1, 2, 4,
    8, 16 or 22 rows (libhdf5 doubles it), direct blocks of 512 bytes to 64 KiB in its rows and
    in those of indirect blocks below it, filled in libhdf5's order of allocation, each link in
    the first that has room for it (a block too small for a link stays empty, as libhdf5 skips
    it). ``(header and blocks, heap ID of each link)``, or None where the links overflow a heap
    of 4 GiB. No free-space manager: libhdf5 adds new links in new blocks, from the heap's
    allocation offset, and makes one at the first removal."""
    filled: dict[int, tuple[int, bytearray]] = {}  # heap offset -> (size, contents) of each direct block
    order = _direct_blocks(0, _ROOT_ROWS)
    ids = []
    offset = size = 0
    data = bytearray()
    for link in links:
        while len(data) + len(link) > size:
            offset, size = next(order, (0, 0))
            if not size:
                return None
            data = filled.setdefault(offset, (size, _direct_block(heap_at, offset)))[1]
        ids.append(b"\x00" + (offset + len(data)).to_bytes(4, "little") + len(link).to_bytes(2, "little"))
        data += link
    end = offset + size  # the heap offset of the next block libhdf5 allocates
    rows = 1
    while _row_offset(rows) < end:
        rows = min(2 * rows, _ROOT_ROWS)
    parts: list[bytes] = []
    pos = heap_at + _HEAP_HEADER.size + 4

    def indirect(offset: int, nrows: int) -> int:  # an indirect block and the blocks under it, from pos: its address
        nonlocal pos
        where = pos
        body = bytearray(b"FHIB\x00" + heap_at.to_bytes(8, "little") + offset.to_bytes(4, "little"))
        pos += len(body) + 8 * _WIDTH * nrows + 4
        slot = len(parts)
        parts.append(b"")
        for row in range(nrows):
            for col in range(_WIDTH):
                at = offset + _row_offset(row) + col * _row_size(row)
                if at >= end:  # not allocated yet
                    child = _UNDEF
                elif row < _DIRECT_ROWS:
                    child = pos
                    parts.append(_sum_direct(filled[at][1], _row_size(row)))
                    pos += _row_size(row)
                else:
                    child = indirect(at, _child_rows(row))
                body += child.to_bytes(8, "little")
        parts[slot] = bytes(body) + lookup3(bytes(body)).to_bytes(4, "little")
        return where

    root = indirect(0, rows)
    allocated = sum(size for size, _ in filled.values())
    free = _WIDTH * sum(map(_row_free, range(rows))) - sum(map(len, links))
    head = _HEAP_HEADER.pack(b"FRHP", 0, 7, 0, 0x02, _MAX_MANAGED, 0, _UNDEF, free, _UNDEF, _row_offset(rows), allocated,
                             end, len(links), 0, 0, 0, 0, _WIDTH, _START, _MAX_DIRECT, _HEAP_BITS, 1, root, rows)
    return b"".join([head, lookup3(head).to_bytes(4, "little"), *parts]), ids


def _dense_links(names: list[str], links: list[bytes], at: int) -> tuple[bytes, int, int] | None:
    """Dense storage of a group's links, laid out from ``at`` (relative to the superblock):
    ``(bytes, address of the fractal heap, address of the name index)``, or None where it does
    not fit (more than :data:`MAX_DENSE_LINKS` links, a link message over 4,096 bytes, or
    links that overflow the heap).

    ``links`` are the encoded link messages (without message headers) of the link ``names``.
    The heap is one direct block or libhdf5's table of blocks (:data:`ONE_BLOCK`), holding the
    links in the order of the index's records (a walk of the index, as libhdf5 does to list a
    group's names, reads the blocks in turn, where in libhdf5's own heap, in creation order,
    it reads them across at random: 125 against 326 ms for 120,000 names through h5py), the
    index a version-2 B-tree (type 5) of records (name hash, heap ID) sorted by hash, then
    name, as libhdf5 compares them (``strcmp``), of one leaf or of :data:`NAME_NODE`-byte
    nodes (:func:`_btree`).
    """
    if len(links) > MAX_DENSE_LINKS or max(map(len, links)) > _MAX_MANAGED:
        return None
    raw = [n.encode("utf-8", "surrogatepass") for n in names]
    hashes = lookup3_many(raw)
    order = sorted(range(len(links)), key=lambda i: (hashes[i], raw[i]))
    links = [links[i] for i in order]  # the heap in the index's order
    if _DIRECT_PREFIX + sum(map(len, links)) <= ONE_BLOCK:
        heap, ids = _one_block_heap(links, at)
    else:
        table = _table_heap(links, at)
        if table is None:
            return None
        heap, ids = table
    records = [hashes[i].to_bytes(4, "little") + heap_id for i, heap_id in zip(order, ids)]
    leaf = 10 + 11 * len(records)
    node = max(512, 1 << (leaf - 1).bit_length()) if leaf <= ONE_BLOCK else NAME_NODE
    index_at = at + len(heap)
    nodes, root, nroot, depth = _btree(records, 5, node, index_at + _BTREE_HEADER.size + 4)
    index = _BTREE_HEADER.pack(b"BTHD", 0, 5, node, 11, depth, 100, 40, root, nroot, len(records))
    return b"".join([heap, index, lookup3(index).to_bytes(4, "little"), nodes]), at, index_at


class _Dataset:
    """A dataset's object header to be: ``head`` (its dataspace, datatype and fill-value
    messages), its data's absolute offset ``at`` (None: it has none) and length, attributes,
    and how many links name it."""

    __slots__ = ("head", "at", "nbytes", "attrs", "refs")

    def __init__(self, head: bytes, at: int | None, nbytes: int) -> None:
        self.head, self.at, self.nbytes = head, at, nbytes
        self.attrs: list[tuple[str, np.ndarray]] = []
        self.refs = 1


@dataclass
class _Group:
    links: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # link name -> (_link_head, object path)
    attrs: list[tuple[str, np.ndarray]] = field(default_factory=list)


class Builder:
    """Collects the groups, datasets, hard links and attributes of an HDF5 file whose data
    is already placed, then encodes their metadata (:meth:`encode`) and the superblock.

    Args:
        base: absolute offset of the superblock (the user block's length).
    """

    def __init__(self, base: int) -> None:
        self.base = base
        self._objects: dict[str, _Dataset | _Group] = {"": _Group()}
        # (id(type), shape) -> (the type, its dataspace + datatype + fill-value messages)
        self._heads: dict[tuple[int, tuple[int, ...]], tuple[h5py.h5t.TypeID, bytes]] = {}

    def dataset(self, path: str, h5type: h5py.h5t.TypeID, shape: tuple[int, ...], at: int | None, nbytes: int,
                attrs: Iterable[tuple[str, np.ndarray]] = ()) -> None:
        """A contiguous dataset at ``path`` (link names joined by ``/``; missing groups on the
        way are made) whose ``nbytes`` bytes of data start at absolute offset ``at``."""
        key = (id(h5type), shape)
        hit = self._heads.get(key)
        if hit is None or hit[0] is not h5type:  # the type is held, so its id is not reused meanwhile
            dtype, fill = _type_messages(h5type.encode())
            head = (_message(_DATASPACE, _dataspace(shape)) + _message(_DATATYPE, dtype, _CONSTANT)
                    + _message(_FILL_VALUE, fill, _CONSTANT))
            hit = self._heads[key] = (h5type, head)
        parent, name = self._parent(path)
        parent.links[name] = (_link_head(name), path)
        d = self._objects[path] = _Dataset(hit[1], at if nbytes else None, nbytes)
        if attrs:
            d.attrs.extend(attrs)

    def attrs(self, path: str, attrs: Iterable[tuple[str, np.ndarray]]) -> None:
        """Attributes of the dataset at ``path`` (fixed-length byte strings and numbers)."""
        obj = self._objects[path]
        assert isinstance(obj, _Dataset)
        obj.attrs.extend(attrs)

    def hard_link(self, path: str, target: str) -> None:
        """Another name, ``path``, for the dataset at ``target``."""
        obj = self._objects[target]
        assert isinstance(obj, _Dataset)
        obj.refs += 1
        parent, name = self._parent(path)
        parent.links[name] = (_link_head(name), target)

    def root_attrs(self, attrs: Iterable[tuple[str, np.ndarray]]) -> None:
        root = self._objects[""]
        assert isinstance(root, _Group)
        root.attrs.extend(attrs)

    def encode(self, start: int) -> tuple[bytes, int]:
        """The object headers (and the heaps and name indexes of dense groups), laid out from
        absolute offset ``start``: ``(bytes, absolute offset of the root group's header)``.
        Children come before their parents, so each group's links name addresses already
        placed."""
        parts: list[bytes] = []
        heads: list[int] = []  # the indexes in parts of object headers still without their checksum
        where: dict[str, int] = {}
        pos = start
        for path, obj in self._objects.items():
            if type(obj) is _Dataset:
                where[path] = pos
                heads.append(len(parts))
                parts.append(self._dataset_header(obj))
                pos += len(parts[-1]) + 4
        groups = sorted((p for p, o in self._objects.items() if isinstance(o, _Group)), key=lambda p: -p.count("/") - bool(p))
        base = self.base
        for path in groups:
            group = self._objects[path]
            assert isinstance(group, _Group)
            links = [head + (where[target] - base).to_bytes(8, "little") for head, target in group.links.values()]
            heap = index = _UNDEF  # links in the header (compact), unless dense storage holds them
            if len(links) > DENSE_LINKS:  # the link messages without their 4-byte headers
                dense = _dense_links(list(group.links), [link[4:] for link in links], pos - base)
                if dense is not None:
                    blob, heap, index = dense
                    parts.append(blob)
                    pos += len(blob)
                    links = []
            messages = [_message(_LINK_INFO, b"\x00\x00" + struct.pack("<QQ", heap, index)),
                        _message(_GROUP_INFO, b"\x00\x00", _CONSTANT), *links]
            messages += self._attribute_messages(group.attrs)
            where[path] = pos
            heads.append(len(parts))
            parts.append(_unsummed_header(b"".join(messages)))
            pos += len(parts[-1]) + 4
        for i, total in zip(heads, lookup3_many([parts[i] for i in heads])):
            parts[i] += total.to_bytes(4, "little")
        return b"".join(parts), where[""]

    def superblock(self, root: int, eof: int) -> bytes:
        """The version-3 superblock (at ``base``): root group header at absolute ``root``, the
        file ``eof`` bytes long."""
        head = b"\x89HDF\r\n\x1a\n" + bytes([3, 8, 8, 0]) + struct.pack("<4Q", self.base, _UNDEF, eof, root - self.base)
        return head + struct.pack("<I", lookup3(head))

    # -- internals -----------------------------------------------------------------------

    def _parent(self, path: str) -> tuple[_Group, str]:
        """The group that holds ``path``'s last link (made, with the groups above it, when
        missing), and that link's name."""
        head, _, name = path.rpartition("/")
        group = self._objects.get(head)
        if group is None:
            parent, gname = self._parent(head)
            group = self._objects[head] = _Group()
            parent.links[gname] = (_link_head(gname), head)
        elif type(group) is not _Group:
            raise ValueError(f"{head!r} is a dataset, not a group")
        if name in group.links:
            raise ValueError(f"{path!r} is already linked")
        return group, name

    def _dataset_header(self, d: _Dataset) -> bytes:
        if d.at is None:
            body = d.head + _LAYOUT_MESSAGE.pack(_LAYOUT, 18, 0, 3, 1, _UNDEF, 0)
        else:
            body = d.head + _LAYOUT_MESSAGE.pack(_LAYOUT, 18, _CONSTANT, 3, 1, d.at - self.base, d.nbytes)
        if d.refs > 1:
            body += _message(_REFCOUNT, struct.pack("<BI", 0, d.refs), _DONT_SHARE)
        if d.attrs:
            body += b"".join(self._attribute_messages(d.attrs))
        return _unsummed_header(body)

    @staticmethod
    def _attribute_messages(attrs: list[tuple[str, np.ndarray]]) -> list[bytes]:
        if not attrs:
            return []
        info = _message(_ATTRIBUTE_INFO, b"\x00\x00" + struct.pack("<QQ", _UNDEF, _UNDEF), _DONT_SHARE)
        return [info] + [_message(_ATTRIBUTE, _attribute(name, value)) for name, value in attrs]
