"""The HDF5 part of a format-2 file read by hand, without libhdf5 (bounded by the file, and
never to locate data: the layout alone says where every byte is): the end of file its
superblock records (:func:`superblock_eof`) and the comparison of its groups' links with the
layout (:func:`link_changes`), which refuses a file that h5py or h5repack changed after it was
saved. ``reading.listing.check_links_first`` runs it on a file's first use; docs/FORMAT.md,
"Files changed by other HDF5 tools". Reads go through any object with ``size`` and
``read(offset, length)`` (a ``storage.files.RawFile``); nothing here imports torch or h5py.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Iterator
from typing import Any

from ..errors import FormatError
from . import layout as fmt
from .layout import Layout

__all__ = ["superblock_eof", "link_changes"]

# ------------------------------------------- files changed by other HDF5 tools (format 2)
#
# A format-2 file is read from its header and layout, not from its HDF5 metadata, so a change
# made through h5py (a renamed, deleted or added dataset) is invisible to those reads. What
# libhdf5 does to such a file, measured: any allocation (a new dataset or attribute, a link
# that does not fit, a free-space manager for a dense group's heap, h5repack's new file) moves
# the end of the file, which the superblock records; a deleted or renamed link of a group that
# keeps its links in its object header (HDF5's "compact" storage) is changed in place, and
# the file keeps its length. So: a length that differs from the header's while the superblock
# accounts for it is a change (parse_header); at an equal length, the links of every group are
# compared with the layout (:func:`link_changes`). This reads the HDF5 metadata without
# libhdf5, bounded by the file and never to locate data: the layout alone still says where
# every byte is.

_UNDEF = 0xFFFF_FFFF_FFFF_FFFF  # HDF5's undefined address
_DATA_KINDS = frozenset({"tensor", "ndarray"})
_HEAP_HEADER = struct.Struct("<4sBHHBIQQQQQQQQQQQQHQQHHQH")  # fractal heap header (version 0), but its checksum
_BTREE_HEADER = struct.Struct("<4sBBIHHBBQHQ")  # version-2 B-tree header (version 0), but its checksum
_OHDR_PREFIX = 512  # bytes read first of an object header (a group's, with a few links, fits)
_BLOCK = 2**16  # bytes of the file read at once while walking its groups
_LINK_INFO, _LINK, _CONTINUATION, _SYMBOL_TABLE = 0x02, 0x06, 0x10, 0x11


class _Changed(Exception):
    """The HDF5 part of the file differs from its layout (the message says how)."""


class _Unparsed(Exception):
    """The HDF5 metadata does not parse where it should be (damaged, or of a kind the
    writers of this format never produce)."""


def superblock_eof(source: Any) -> int | None:
    """The end-of-file address (bytes) that the HDF5 superblock at byte 4096 of ``source``
    records (any superblock version; h5repack writes version 0), or None when there is no
    superblock there. Addresses are stored relative to the superblock's base address, which
    is 4096 in files of this format; the end of file as libhdf5 stores it is absolute."""
    try:
        sb = source.read(fmt.USERBLOCK, 56) if source.size >= fmt.USERBLOCK + 56 else b""
    except (OSError, EOFError, ValueError):
        return None
    if sb[:8] != fmt.HDF5_SIGNATURE:
        return None
    version = sb[8]
    if version in (2, 3):
        return int.from_bytes(sb[28:36], "little") if sb[9] == 8 else None
    if version in (0, 1):
        at = 40 if version == 0 else 44
        return int.from_bytes(sb[at:at + 8], "little") if sb[13] == 8 else None
    return None


_CHECKED: dict[tuple[int, ...], bool] = {}
"""Files whose HDF5 links were found to match their layout, by (device, inode, size, mtime,
ctime in ns): a file opened again unchanged is not walked again (any write changes its ctime)."""


def link_changes(raw: Any, layout: Layout) -> str | None:
    """What shows that the HDF5 part of the format-2 file ``raw`` (a local
    :class:`~..storage.files.RawFile`) no longer holds the datasets and groups ``layout`` lists, in
    words, or None when it does. Raises FormatError when the HDF5 metadata does not parse.

    The superblock must be closed (no writer has it open), and where it ends the HDF5 part
    at the file's end, as libhdf5 leaves every file it changed (a file whose header length
    differs is refused before: :func:`~..format.layout.parse_header`), every group, walked
    from the root, must hold exactly the links the layout implies: a
    dataset for every tensor and array (``same_as`` ones are further hard links), a group for
    every container on the way to one, and ``%layout`` in the root. A dense group (a heap of
    links) that no link was ever removed from (its heap has no free-space manager, which
    libhdf5 makes on the first removal) and that holds no group is counted, not read: the
    10,000 keys of one flat group cost four small reads. Other groups' links are read.
    """
    try:
        st = os.fstat(raw._fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except (OSError, AttributeError, ValueError):
        key = None
    if key is not None and key in _CHECKED:
        return None
    try:
        found = _Links(raw, layout).changes()
    except _Changed as e:
        found = str(e)
    except (_Unparsed, IndexError, ValueError, struct.error) as e:
        raise FormatError(f"{layout.file}: the HDF5 part of the file does not parse as tensorstore_h5 wrote it ({e}): "
                          f"it was damaged, or rewritten by another HDF5 tool; if so, `tensorstore-h5 reindex "
                          f"{layout.file}` (or th5.reindex) rebuilds the layout from it") from None
    if found is None and key is not None:
        if len(_CHECKED) >= 256:
            _CHECKED.clear()
        _CHECKED[key] = True
    return found


class _Links:
    """One walk of a format-2 file's HDF5 groups against its layout (:func:`link_changes`)."""

    def __init__(self, raw: Any, layout: Layout) -> None:
        self.raw = raw
        self.size = raw.size
        self.layout = layout
        self.base = fmt.USERBLOCK
        self.budget = 2 * self.size + 2**20  # bytes the walk may read: a crafted file cannot make it read more
        self.blocks: dict[int, bytes] = {}

    # -- reads ---------------------------------------------------------------------------

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes at HDF5 address ``addr`` (relative to the superblock), through a cache
        of :data:`_BLOCK`-byte blocks (a file's groups lie close together: one read for many)."""
        at = self.base + addr
        if addr >= _UNDEF or n < 0 or at + n > self.size:
            raise _Unparsed(f"metadata at byte {at} ({n} bytes) outside the file")
        first = at // _BLOCK
        if (at + n - 1) // _BLOCK != first:
            return self._read(at, n)
        block = self.blocks.get(first)
        if block is None:
            block = self.blocks[first] = self._read(first * _BLOCK, min(_BLOCK, self.size - first * _BLOCK))
        lo = at - first * _BLOCK
        return block[lo:lo + n]

    def _read(self, at: int, n: int) -> bytes:
        self.budget -= n
        if self.budget < 0:
            raise _Unparsed("more metadata than the file holds")
        try:
            return self.raw.read(at, n)
        except (OSError, EOFError) as e:
            raise _Unparsed(f"cannot read byte {at}: {e}") from e

    def header(self, addr: int) -> list[tuple[int, bytes, int, int]]:
        """The messages of the version-2 object header at ``addr``, its continuation chunks
        included, as ``(type, data, start, end)`` (the body is ``data[start:end]``; checksums
        are not checked: this compares, never locates)."""
        head = self.read(addr, min(_OHDR_PREFIX, self.size - self.base - addr))
        if head[:5] != b"OHDR\x02":
            raise _Unparsed(f"no version-2 object header at byte {self.base + addr}")
        flags = head[5]
        p = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 3)
        end = p + width + int.from_bytes(head[p:p + width], "little")
        if end + 4 > len(head):
            head = self.read(addr, end + 4)
        step = 6 if flags & 0x04 else 4  # message header: type, size, flags (, creation order)
        out: list[tuple[int, bytes, int, int]] = []
        chunks = [(head, p + width, end)]
        seen: set[int] = set()
        while chunks:
            data, q, stop = chunks.pop()
            while q + step <= stop:
                kind = data[q]
                body = q + step
                q = body + (data[q + 1] | data[q + 2] << 8)
                if q > stop:
                    raise _Unparsed(f"object header at byte {self.base + addr}: a message runs past its chunk")
                if kind == _CONTINUATION:
                    at, n = struct.unpack_from("<QQ", data, body)
                    if at in seen or len(seen) >= 4096 or n < 8:
                        raise _Unparsed(f"object header at byte {self.base + addr}: bad continuation chunk")
                    seen.add(at)
                    chunk = self.read(at, n)
                    if chunk[:4] != b"OCHK":
                        raise _Unparsed(f"no continuation chunk at byte {self.base + at}")
                    chunks.append((chunk, 4, n - 4))
                elif kind:  # (0: a null message, space libhdf5 keeps for later)
                    out.append((kind, data, body, q))
        return out

    # -- groups --------------------------------------------------------------------------

    def changes(self) -> str | None:
        layout = self.layout
        sb = self.read(0, 48) if self.size >= self.base + 48 else b""
        if sb[:8] != fmt.HDF5_SIGNATURE or sb[8] not in (2, 3) or sb[9:11] != b"\x08\x08":
            version = sb[8] if len(sb) > 8 and sb[:8] == fmt.HDF5_SIGNATURE else None
            return ("its HDF5 superblock was rewritten" + (f" (version {version})" if version is not None else "")
                    if version is not None else "it has no HDF5 superblock at byte 4096")
        base, _ext, eof, root = struct.unpack_from("<4Q", sb, 12)
        if sb[11]:
            return "the HDF5 file is open for writing in another program, or one that had it open crashed"
        if base != self.base:
            return f"its HDF5 superblock records the base address {base}"
        if eof != self.size:  # not as libhdf5 leaves a file: what follows its HDF5 part was written otherwise
            return None
        kinds: list[str] = layout._kinds  # (the head's lists, already in memory: nothing is parsed)
        containers: dict[str, str] = layout._types
        index: dict[str, int] = layout._index
        expected = kinds.count("tensor") + kinds.count("ndarray")
        root_leaf = bool(kinds) and kinds[0] in _DATA_KINDS
        with_groups = {p.rpartition("/")[0] for p in layout.container_paths}  # groups that may hold groups
        found = 0
        has_layout = False
        stack = [("", root)]
        walked = 0
        while stack:
            path, addr = stack.pop()
            walked += 1
            if walked > len(containers) + 1:  # (the root is a group even when the saved object was a tensor)
                return "it has more HDF5 groups than its layout lists"
            counted, links = self.group(addr, path, path in with_groups)
            if counted is not None:  # a dense group of datasets, never changed: counted
                found += counted - (path == "")
                has_layout = has_layout or path == ""
                continue
            prefix = path + "/" if path else ""
            for name, target in links:
                child = prefix + name
                i = index.get(child)
                if i is not None and kinds[i] in _DATA_KINDS and target is not None:
                    found += 1
                elif target is None:
                    return f"{child!r} is now a soft or external link"
                elif child in containers:
                    stack.append((child, target))
                elif path == "" and name == fmt.LAYOUT_DATASET:
                    has_layout = True
                elif path == "" and name == fmt.ROOT_DATASET and root_leaf:
                    found += 1
                else:
                    return f"it has a dataset or group {child!r} that its layout does not list"
        if not has_layout:
            return f"its {fmt.LAYOUT_DATASET!r} dataset is gone"
        if found != expected:
            gone = expected - found
            return (f"{gone} of the {expected} datasets its layout lists {'is' if gone == 1 else 'are'} gone"
                    if gone > 0 else f"it has {-gone} more datasets than its layout lists")
        return None

    def group(self, addr: int, path: str, holds_groups: bool) -> tuple[int | None, list[tuple[str, int | None]]]:
        """The links of the group at ``addr``: ``(count, [])`` for a dense group that may be
        counted instead of read (see :func:`link_changes`), else ``(None, [(name, address or
        None for a soft/external link), ...])``."""
        links: list[tuple[str, int | None]] = []
        append = links.append
        info = None
        for kind, data, start, end in self.header(addr):
            if kind == _LINK:
                append(_any_link(data, start, end))
            elif kind == _LINK_INFO:
                info = data[start:end]
            elif kind == _SYMBOL_TABLE:
                raise _Changed(f"{path or '/'!r} is now an old-style HDF5 group (a symbol table)")
        if info is None:
            raise _Changed(f"{path or '/'!r} is no longer an HDF5 group")
        p = 2 + (8 if info[1] & 1 else 0)
        heap, names = struct.unpack_from("<QQ", info, p)
        if heap == _UNDEF:
            return None, links
        return self.dense(heap, names, holds_groups)

    def dense(self, heap_at: int, index_at: int, holds_groups: bool) -> tuple[int | None, list[tuple[str, int | None]]]:
        h = self.read(heap_at, _HEAP_HEADER.size)
        (sig, version, id_len, filter_len, _flags, max_managed, _huge_next, _huge_index, _free, space_manager, _managed,
         _allocated, _iterator, objects, _huge_size, huge, _tiny_size, tiny, width, start, max_direct, bits, _rows0,
         root, rows) = _HEAP_HEADER.unpack_from(h)
        b = self.read(index_at, _BTREE_HEADER.size)
        bsig, _bv, btype, node, rsize, depth, _split, _merge, broot, nroot, total = _BTREE_HEADER.unpack_from(b)
        if sig != b"FRHP" or version != 0 or bsig != b"BTHD" or btype != 5 or filter_len:
            raise _Unparsed(f"a dense group's link heap at byte {self.base + heap_at} is not one libhdf5 writes for links")
        if space_manager == _UNDEF and not holds_groups and total == objects + tiny:  # (any heap or index shape)
            return total, []
        if huge and not holds_groups:  # names of over 4 KiB, kept outside the heap's blocks: counted only
            return total, []
        heap = _Heap(self, id_len, width, start, max_direct, max_managed, bits, root, rows)
        links: list[tuple[str, int | None]] = []
        append = links.append
        o, n = 1 + heap.off_size, 1 + heap.off_size + heap.len_size
        starts, blocks = heap.starts, heap.blocks
        for rid in _records(self, broot, nroot, total, depth, node, rsize):
            if rid[0]:  # not a managed object of version 0: tiny, huge or unknown
                append(_link(*heap.get(rid)))
                continue
            off = int.from_bytes(rid[1:o], "little")
            i = bisect.bisect_right(starts, off) - 1
            if i < 0:
                raise _Unparsed("a heap ID outside its heap")
            data = blocks[i][1]
            lo = off - starts[i]
            hi = lo + int.from_bytes(rid[o:n], "little")
            if hi > len(data):
                raise _Unparsed("a heap ID outside its heap")
            append(_any_link(data, lo, hi))
        return None, links


def _any_link(data: bytes, p: int, end: int) -> tuple[str, int | None]:
    """``(name, address)`` of the link message in ``data[p:end]``: the common form (hard, a name
    of < 256 bytes) parsed here, any other by :func:`_link`."""
    if data[p] == 1 and not data[p + 1] & 0x0F:
        q = p + 3 + (data[p + 1] >> 4 & 1)
        stop = q + data[q - 1]
        if stop + 8 > end:
            raise _Unparsed("a link message runs past its end")
        return data[q:stop].decode("utf-8", "replace"), int.from_bytes(data[stop:stop + 8], "little")
    return _link(data, p, end)


def _link(data: bytes, p: int, end: int) -> tuple[str, int | None]:
    """``(name, address)`` of the link message in ``data[p:end]`` (address None: not a hard link)."""
    if data[p] != 1:
        raise _Unparsed("a link message of an unknown version")
    flags = data[p + 1]
    q = p + 2
    hard = True
    if flags & 0x08:
        hard = data[q] == 0
        q += 1
    q += (8 if flags & 0x04 else 0) + (1 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    n = int.from_bytes(data[q:q + width], "little")
    q += width
    if q + n + (8 if hard else 0) > end:
        raise _Unparsed("a link message runs past its end")
    try:
        name = data[q:q + n].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        name = data[q:q + n].decode("utf-8", "replace")
    return name, int.from_bytes(data[q + n:q + n + 8], "little") if hard else None


def _size_bytes(n: int) -> int:
    """Bytes libhdf5 uses to store counts up to ``n`` (``H5VM_limit_enc_size``)."""
    return (max(n, 1).bit_length() - 1) // 8 + 1


def _records(links: _Links, root: int, nroot: int, total: int, depth: int, node: int, rsize: int) -> Iterator[bytes]:
    """The heap IDs of the records of a version-2 B-tree of link names (type 5), every node
    read once; internal nodes hold records too."""
    if not 5 <= rsize <= 64 or not 16 <= node <= 2**24 or depth > 16 or total * rsize > links.size:
        raise _Unparsed("a dense group's name index has impossible sizes")
    max_nrec = (node - 10) // rsize
    nrec_size = _size_bytes(max_nrec)
    cumulative, cum_size = [max_nrec], [0]
    for d in range(1, depth + 1):
        pointer = 8 + nrec_size + (cum_size[d - 1] if d > 1 else 0)
        m = (node - 10 - pointer) // (rsize + pointer)
        cumulative.append((m + 1) * cumulative[d - 1] + m)
        cum_size.append(_size_bytes(cumulative[d]))
    stack = [(root, nroot, depth)]
    seen = 0
    while stack:
        at, n, d = stack.pop()
        seen += n
        if seen > total or n * rsize > node:
            raise _Unparsed("a dense group's name index holds more records than it counts")
        pointer = 8 + nrec_size + (cum_size[d - 1] if d > 1 else 0) if d else 0
        data = links.read(at, 6 + n * rsize + ((n + 1) * pointer if d else 0))
        if data[:4] != (b"BTIN" if d else b"BTLF"):
            raise _Unparsed(f"no name-index node at byte {links.base + at}")
        for p in range(6, 6 + n * rsize, rsize):
            yield data[p + 4:p + rsize]
        p = 6 + n * rsize
        for _ in range(n + 1 if d else 0):
            child = int.from_bytes(data[p:p + 8], "little")
            count = int.from_bytes(data[p + 8:p + 8 + nrec_size], "little")
            stack.append((child, count, d - 1))
            p += pointer
    if seen != total:
        raise _Unparsed("a dense group's name index holds fewer records than it counts")


class _Heap:
    """The managed objects of a fractal heap of links: every direct block, by heap offset."""

    def __init__(self, links: _Links, id_len: int, width: int, start: int, max_direct: int, max_managed: int,
                 bits: int, root: int, rows: int) -> None:
        if not (width and start and max_direct) or width & (width - 1) or start & (start - 1) \
                or max_direct & (max_direct - 1) or max_direct < start or max_direct > 2**31 or bits > 64:
            raise _Unparsed("a dense group's link heap has impossible sizes")
        self.links = links
        self.width, self.start, self.max_direct = width, start, max_direct
        self.off_size = (bits + 7) // 8
        self.len_size = min((max_direct.bit_length() - 1 + 7) // 8, _size_bytes(max_managed))
        if 1 + self.off_size + self.len_size > id_len:
            raise _Unparsed("a dense group's link heap has impossible sizes")
        self.blocks: list[tuple[int, bytes]] = []
        if rows == 0:
            self._direct(root, start)
        else:
            self._indirect(root, rows, 0)
        self.blocks.sort(key=lambda b: b[0])
        self.starts = [b[0] for b in self.blocks]

    def _direct(self, at: int, size: int) -> None:
        data = self.links.read(at, size)
        if data[:4] != b"FHDB":
            raise _Unparsed(f"no heap block at byte {self.links.base + at}")
        self.blocks.append((int.from_bytes(data[13:13 + self.off_size], "little"), data))

    def _indirect(self, at: int, rows: int, depth: int) -> None:
        direct_rows = (self.max_direct.bit_length() - self.start.bit_length()) + 2
        if depth > 8 or rows > 64:
            raise _Unparsed("a dense group's link heap is too deep")
        entries = rows * self.width
        data = self.links.read(at, 13 + self.off_size + 8 * entries)
        if data[:4] != b"FHIB":
            raise _Unparsed(f"no heap block at byte {self.links.base + at}")
        p = 13 + self.off_size
        for i in range(entries):
            child = int.from_bytes(data[p:p + 8], "little")
            p += 8
            if child == _UNDEF:
                continue
            row = i // self.width
            size = self.start if row == 0 else self.start << (row - 1)
            if row < direct_rows:
                self._direct(child, size)
            else:
                first = (self.start.bit_length() - 1) + (self.width.bit_length() - 1)
                self._indirect(child, (size.bit_length() - 1) - first + 1, depth + 1)

    def get(self, rid: bytes) -> tuple[bytes, int, int]:
        """``(data, start, end)``: where the object of heap ID ``rid`` is."""
        kind = rid[0]
        if kind & 0xC0:
            raise _Unparsed("a heap ID of an unknown version")
        if kind & 0x30 == 0x20:  # tiny: the object is in the ID
            return rid, 1, 1 + (kind & 0x0F) + 1
        if kind & 0x30:
            raise _Unparsed("a link stored as a huge heap object")
        off = int.from_bytes(rid[1:1 + self.off_size], "little")
        n = int.from_bytes(rid[1 + self.off_size:1 + self.off_size + self.len_size], "little")
        i = bisect.bisect_right(self.starts, off) - 1
        if i < 0 or off - self.starts[i] + n > len(self.blocks[i][1]):
            raise _Unparsed("a heap ID outside its heap")
        lo = off - self.starts[i]
        return self.blocks[i][1], lo, lo + n
