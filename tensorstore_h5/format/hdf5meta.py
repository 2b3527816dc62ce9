"""The HDF5 metadata of an uncompressed format-2 file, encoded here instead of by libhdf5.

Creating a dataset through libhdf5 costs ~40 us, before any byte of it is written: 0.25-0.3 s
for the 6,000 small tensors of a model's optimizer state, more than ``torch.save`` takes for
all of it. A file whose datasets are all contiguous and uncompressed needs few kinds of HDF5
metadata, which :class:`Builder` encodes after the data is written (docs/FORMAT.md, "The
HDF5 part"): a version-3 superblock, and version-2 object headers (checksummed with Jenkins'
lookup3, as HDF5 does) for groups, with their links in the header or, in groups of more
than :data:`DENSE_LINKS` links, in a fractal heap indexed by a B-tree of name hashes, and for
datasets, with dataspace, datatype, fill value, contiguous layout, reference count (hard links)
and attributes. Datatype and fill-value messages are the bytes libhdf5 itself writes for the same
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
links, 0.233 ms a lookup through h5py in the header, 0.082 in dense storage written here,
0.089 in libhdf5's own)."""

MAX_DENSE_LINKS = (2**19 - 10) // 11
"""The most links (47,661) of a dense group encoded here: its name index is one B-tree leaf,
whose capacity libhdf5 must be able to count in 2 bytes (so a node of at most 2**19 bytes of
11-byte records). A group of more links keeps them in its header."""

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


def _dense_links(names: list[str], links: list[bytes], at: int) -> tuple[bytes, int, int] | None:
    """Dense storage of a group's links, laid out from ``at`` (relative to the superblock):
    ``(bytes, address of the fractal heap, address of the name index)``, or None where it
    does not fit the one direct block and one B-tree leaf written here.

    ``links`` are the encoded link messages (without message headers) of the link ``names``.
    The heap is a single direct block (the root, a power of two of at least 512 bytes holding
    every link), the index a version-2 B-tree (type 5) of depth 0: one leaf of records (name
    hash, heap ID) sorted by hash, then name, as libhdf5 compares them. No free-space manager:
    libhdf5 appends new links in new blocks.
    """
    if len(links) > MAX_DENSE_LINKS or max(map(len, links)) > _MAX_MANAGED:
        return None  # (so the block stays far under libhdf5's 2 GiB and the leaf within 2**19 bytes)
    raw = [n.encode("utf-8", "surrogatepass") for n in names]
    used = _DIRECT_PREFIX + sum(map(len, links))
    block = max(512, 1 << (used - 1).bit_length())
    node = max(512, 1 << (10 + 11 * len(links) - 1).bit_length())
    heap_at = at
    block_at = heap_at + _HEAP_HEADER.size + 4
    index_at = block_at + block
    leaf_at = index_at + _BTREE_HEADER.size + 4
    head = _HEAP_HEADER.pack(b"FRHP", 0, 7, 0, 0x02, _MAX_MANAGED, 0, _UNDEF, block - used, _UNDEF, block, block, block,
                             len(links), 0, 0, 0, 0, 4, block, max(block, 1 << 16), 32, 1, block_at, 0)
    ids = []
    data = bytearray(b"FHDB\x00" + heap_at.to_bytes(8, "little") + bytes(8))  # block offset 0, checksum to come
    for link in links:
        ids.append(b"\x00" + len(data).to_bytes(4, "little") + len(link).to_bytes(2, "little"))
        data += link
    data += bytes(block - len(data))
    data[_DIRECT_PREFIX - 4:_DIRECT_PREFIX] = lookup3(bytes(data)).to_bytes(4, "little")  # over the block, checksum 0
    records = sorted(zip(lookup3_many(raw), raw, ids))
    leaf = b"BTLF\x00\x05" + b"".join([h.to_bytes(4, "little") + i for h, _, i in records])
    leaf += lookup3(leaf).to_bytes(4, "little")
    index = _BTREE_HEADER.pack(b"BTHD", 0, 5, node, 11, 0, 100, 40, leaf_at, len(links), len(links))
    blob = b"".join([head, lookup3(head).to_bytes(4, "little"), data, index, lookup3(index).to_bytes(4, "little"),
                     leaf, bytes(node - len(leaf))])
    return blob, heap_at, index_at


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
