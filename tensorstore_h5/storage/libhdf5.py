"""Files read and written through libhdf5 (h5py): format-1 and foreign HDF5 files, with the
hostile-file checks, and tensor data moved by HDF5's own reads and writes (hyperslabs,
filters, type conversion).

Format-2 files are read from their header and layout alone (:mod:`..format.layout`); this module is
for files whose byte locations only HDF5's metadata knows, and for ``verify``, which checks a
format-2 layout against that metadata. Before a dataset's bytes are read, every link on its
path must be a hard link (no soft link that leaves the path, no external link), the dataset
must be neither virtual nor stored in external files, its data must be all written and
inside the file, and its filters must be ones this library decodes itself (or HDF5's own
deflate / shuffle / fletcher32): see docs/FORMAT.md, "Version 1" and
"Files not written by tensorstore_h5". Any h5py error becomes a FormatError naming the file
and the key.

libhdf5's parser itself is not hardened against crafted metadata (SECURITY.md).

Also here, read without libhdf5 (bounded, and never to locate data): the comparison of a
format-2 file's HDF5 groups with its layout, which refuses a file that h5py or h5repack
changed after it was saved (:func:`link_changes`, which ``reading.store.check_links_first``
runs on a file's first use; docs/FORMAT.md,
"Files changed by other HDF5 tools").
"""

from __future__ import annotations

import bisect
import math
import os
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from ..format import layout as fmt
from ..format.dtypes import bits_view, spec_for_numpy
from ..format.layout import ArrayEntry, Chunked, Container, Contiguous, Extent, ForeignEntry, Layout, TensorEntry
from ..format.record import record
from ..format.slicing import Selection, rows

if TYPE_CHECKING:
    import torch  # (the link reader, which a listing runs, needs no torch; the reads get tensors)

__all__ = ["H5_ERRORS", "HDF5Read", "open_file", "read_layout", "foreign_layout", "locate", "verify_layout",
           "BLOCK_BYTES", "read_hdf5", "write_hdf5", "row_blocks", "write_tensor", "superblock_eof",
           "link_changes"]

class _LazyH5py:
    """Stands for the h5py module until first used (format-2 files are read without it: its
    import is ~20 ms of a fresh process's first open); then the module global is h5py itself."""

    def __getattr__(self, name: str) -> Any:
        import h5py as module

        globals()["h5py"] = module
        return getattr(module, name)


h5py: Any = _LazyH5py()

H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError)
"""What h5py raises for damaged files."""

_BUILTIN_FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32"}
"""HDF5's own filters, accepted in foreign files (read by HDF5, with bounded output)."""


@record
class HDF5Read:
    """A dataset that only HDF5 reads (compact data, HDF5's own filters, or values HDF5
    converts): checked, with its open dataset."""

    dsid: h5py.h5d.DatasetID
    convert: bool


def open_file(path: str, identity: tuple[int, int], source: Any = None) -> h5py.File:
    """Open ``path`` with h5py, read-only, and check it is the file whose (device, inode) is
    ``identity`` (the one the caller opened); or open a remote ``source`` through a file
    object. Raises FormatError for a non-HDF5 file and FileExistsError when the path now
    names another file (replaced meanwhile: try again)."""
    try:
        if source is not None:
            from .remote import HDF5FileObject

            return h5py.File(HDF5FileObject(source), "r")
        f = h5py.File(path, "r", locking=False)
    except H5_ERRORS as e:
        raise FormatError(f"{path}: not a readable HDF5 or tensorstore_h5 file ({_short(e)})") from e
    try:
        st = os.fstat(f.id.get_vfd_handle())
        same = (st.st_dev, st.st_ino) == identity
    except (OSError, TypeError, ValueError):
        same = False
    if not same:
        f.close()
        raise FileExistsError(f"{path} was replaced while it was being opened")
    return f


def _short(e: BaseException) -> str:
    """An h5py error's message without HDF5's internal details (addresses, buffer dumps)."""
    text = str(e).split(" (", 1)[0].strip()
    return text or type(e).__name__


def read_layout(f: h5py.File, file: str) -> Layout:
    """The layout of an HDF5 file without a format-2 header: format 1, or a foreign file.

    A file with any ``tensorstore_h5.*`` root attribute is ours and is never read as a
    foreign file. Raises FormatError for damaged attributes or an unknown version.
    """
    try:
        names = list(f.attrs.keys())
    except H5_ERRORS as e:
        raise FormatError(f"{file}: cannot read the root attributes ({_short(e)})") from e
    if not fmt.claims_format(names):
        return foreign_layout(f, file)

    def attr(name: str) -> Any:
        try:
            return f.attrs[name] if name in names else None
        except H5_ERRORS as e:
            raise FormatError(f"{file}: damaged root attribute {name!r} ({_short(e)})") from e

    kind = attr(fmt.ATTR_FORMAT)
    kind = kind.decode("utf-8", "replace") if isinstance(kind, bytes) else kind
    if kind != fmt.FORMAT_NAME:
        raise FormatError(f"{file}: root attribute {fmt.ATTR_FORMAT!r} is {kind!r}, expected {fmt.FORMAT_NAME!r} "
                          "(a damaged tensorstore_h5 file)")
    return fmt.read_layout_v1(attr, file)


def foreign_layout(f: h5py.File, file: str) -> Layout:
    """The layout of an HDF5 file not written by tensorstore_h5: groups become dicts keyed by
    their link names, datasets tensors where torch has their dtype (others ForeignEntry
    leaves that raise FormatError when read). Only hard links are followed; attributes are
    ignored."""
    entries: list[Any] = [Container("", None, "dict")]

    def visit(name: str, obj: Any) -> None:
        key = name.rpartition("/")[2]
        if isinstance(obj, h5py.Group):
            entries.append(Container(name, key, "dict"))
        elif isinstance(obj, h5py.Dataset):
            entries.append(_foreign_dataset(name, key, obj))

    try:
        f.visititems(visit)
    except H5_ERRORS as e:
        raise FormatError(f"{file}: cannot read the HDF5 structure ({_short(e)})") from e
    return Layout(file, None, {}, entries=entries)


def _foreign_dataset(name: str, key: str, ds: h5py.Dataset) -> Any:
    try:
        dtype, shape = ds.dtype, ds.shape
    except H5_ERRORS as e:
        return ForeignEntry(name, key, name, f"unreadable dataset: {_short(e)}")
    if shape is None:
        return ForeignEntry(name, key, name, "empty (null dataspace) dataset")
    spec = spec_for_numpy(dtype)
    if spec is None:
        return ForeignEntry(name, key, name, f"HDF5 type {dtype} has no torch dtype")
    return TensorEntry(name, key, spec, tuple(int(n) for n in shape), name, foreign=True)


# ---------------------------------------------------------------------------- datasets


def _hard_path(f: h5py.File, path: str, file: str, key: str) -> None:
    """Every link on ``path`` must be a hard link (soft and external links are refused)."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        try:
            kind = f.id.links.get_info(prefix.encode("utf-8")).type
        except H5_ERRORS as e:
            raise FormatError(f"{file}: key {key!r}: {prefix!r} is missing ({_short(e)})") from e
        if kind != h5py.h5l.TYPE_HARD:
            what = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}.get(kind, "a user link")
            raise FormatError(f"{file}: key {key!r}: {prefix!r} is {what}; tensorstore_h5 reads data only through "
                              "hard links inside the file")


def _open(f: h5py.File, path: str, file: str, key: str) -> h5py.h5d.DatasetID:
    _hard_path(f, path, file, key)
    try:
        return h5py.h5d.open(f.id, path.encode("utf-8"))
    except H5_ERRORS as e:
        raise FormatError(f"{file}: key {key!r}: {path!r} is not a dataset ({_short(e)})") from e


def locate(f: h5py.File, entry: TensorEntry | ArrayEntry, file: str, size: int, pack_len: dict[str, int]) -> Extent | HDF5Read:
    """Check ``entry``'s dataset (links, storage, type, shape, filters, ranges) and say where
    its bytes are: a Contiguous or Chunked extent (read here, raw), or an HDF5Read.

    ``pack_len`` collects the length of version-1 pack datasets. Raises FormatError naming
    the file and the key for anything the format does not allow, before any byte is read.
    """
    key = entry.path
    dsid = _open(f, entry.dataset, file, key)
    try:
        dcpl = dsid.get_create_plist()
        layout = dcpl.get_layout()
        external = dcpl.get_external_count()
        shape = dsid.shape
        ftype = dsid.get_type()
    except H5_ERRORS as e:
        raise FormatError(f"{file}: key {key!r}: unreadable dataset header ({_short(e)})") from e
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT):
        raise FormatError(f"{file}: key {key!r}: a virtual dataset (its data live in other files); refused")
    if external:
        raise FormatError(f"{file}: key {key!r}: data stored in external files; refused")
    packed = isinstance(entry, TensorEntry) and entry.packed is not None
    if packed:
        if shape is None or len(shape) != 1:
            raise FormatError(f"{file}: key {key!r}: pack dataset {entry.dataset!r} is not 1-D")
        pack_len[entry.dataset] = shape[0]
        if entry.packed + entry.numel > shape[0]:  # type: ignore[operator]
            raise FormatError(f"{file}: key {key!r}: packed range ends past its dataset {entry.dataset!r}")
    elif shape != entry.shape:
        raise FormatError(f"{file}: key {key!r}: dataset shape {shape} does not match the layout's {entry.shape}")
    foreign = isinstance(entry, TensorEntry) and entry.foreign
    mtype = entry.dtype.h5_type if isinstance(entry, TensorEntry) else h5py.h5t.py_create(entry.dtype)
    same_type = ftype == mtype
    if not same_type and not foreign:
        raise FormatError(f"{file}: key {key!r}: dataset type does not match the layout's dtype "
                          f"{entry.dtype.name if isinstance(entry, TensorEntry) else entry.dtype}")
    itemsize = entry.dtype.itemsize
    nbytes = (shape[0] if packed else math.prod(entry.shape)) * itemsize
    if layout == h5py.h5d.COMPACT:
        return HDF5Read(dsid, not same_type)
    if layout == h5py.h5d.CONTIGUOUS:
        try:
            offset = dsid.get_offset()
            stored = dsid.get_storage_size()
        except H5_ERRORS as e:
            raise FormatError(f"{file}: key {key!r}: unreadable dataset header ({_short(e)})") from e
        if nbytes and (offset is None or stored < nbytes):
            raise FormatError(f"{file}: key {key!r}: the dataset's data were never written (unallocated); refused")
        if nbytes and not 0 <= offset <= offset + nbytes <= size:
            raise FormatError(f"{file}: key {key!r}: data end at byte {offset + nbytes}, past the end of the file "
                              f"({size} bytes): truncated file")
        if not same_type:
            return HDF5Read(dsid, True)
        start = (offset or 0) + (entry.packed * itemsize if packed else 0)  # type: ignore[operator]
        return Contiguous(start, entry.nbytes if packed else nbytes)  # type: ignore[union-attr]
    return _chunked(dsid, dcpl, ftype, entry, shape, itemsize, same_type, file, size)


def _chunk_index(dsid: h5py.h5d.DatasetID, shape: tuple[int, ...], chunk: tuple[int, ...]) -> dict[int, tuple[int, int, bool]]:
    """The stored chunks of a chunked dataset by their row-major place in the chunk grid:
    ``(file offset, stored bytes, stored raw)``, as libhdf5's chunk index lists them. Raises
    what h5py raises for a damaged index (``H5_ERRORS``)."""
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    strides = [math.prod(grid[i + 1:]) for i in range(len(grid))]
    found: dict[int, tuple[int, int, bool]] = {}

    def visit(info: Any) -> None:
        k = sum(o // c * s for o, c, s in zip(info.chunk_offset, chunk, strides))
        found[k] = (int(info.byte_offset), int(info.size), info.filter_mask != 0)

    if math.prod(grid):
        dsid.chunk_iter(visit)
    return found


def _chunked(dsid: h5py.h5d.DatasetID, dcpl: Any, ftype: Any, entry: Any, shape: tuple[int, ...], itemsize: int,
             same_type: bool, file: str, size: int) -> Extent | HDF5Read:
    key = entry.path
    try:
        filters = [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())]
        chunk = tuple(int(c) for c in dcpl.get_chunk())
    except H5_ERRORS as e:
        raise FormatError(f"{file}: key {key!r}: unreadable filter pipeline ({_short(e)})") from e
    ids = [int(code) for code, _, _ in filters]
    own = len(ids) == 1 and ids[0] in fmt.FILTERS
    if not own and not all(i in _BUILTIN_FILTERS for i in ids):
        names = ", ".join(str(i) for i in ids)
        raise FormatError(f"{file}: key {key!r}: filters [{names}] are not ones tensorstore_h5 reads (it decodes "
                          f"{', '.join(f'{k} ({v})' for k, v in fmt.FILTERS.items())} itself, and HDF5's "
                          "deflate/shuffle/fletcher32); refused")
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    try:
        found = _chunk_index(dsid, shape, chunk)
    except H5_ERRORS as e:
        raise FormatError(f"{file}: key {key!r}: unreadable chunk index ({_short(e)})") from e
    chunks = tuple(found[k] for k in sorted(found))
    try:
        if not own:  # HDF5's own filters: every chunk written and inside the file, sizes bounded
            if sorted(found) != list(range(math.prod(grid))):
                raise ValueError(f"{len(found)} chunks stored, the chunk grid has {math.prod(grid)} (unwritten chunks)")
            chunk_bytes = math.prod(chunk) * int(ftype.get_size())
            limit = chunk_bytes + chunk_bytes // 16 + 1024
            for off, n, _ in chunks:
                if not 0 <= off <= off + n <= size or n > limit:
                    raise ValueError(f"chunk at {off}+{n} outside the file or too large")
            return HDF5Read(dsid, not same_type)
        extent = Chunked(shape, itemsize, chunk, ids[0], tuple(int(v) for v in filters[0][2]), chunks)
        fmt.check_chunked(extent, size, start=0)
    except ValueError as e:
        raise FormatError(f"{file}: key {key!r}: {e}; refused") from e
    if not same_type:
        raise FormatError(f"{file}: key {key!r}: compressed data of another byte order or type than {entry.dtype} "
                          "would need HDF5's filter to decode it before conversion; refused")
    return extent


# ---------------------------------------------------------------------------- verify (format 2)


def verify_layout(path: str, layout: Layout, source: Any = None) -> Iterator[str]:
    """Problems found when checking a format-2 or 3 layout against the HDF5 part of the file:
    every key path a hard-linked dataset of the layout's shape and HDF5 type, stored where
    the layout says, and no two datasets' data overlapping. Yields one message per problem.
    ``source``: a remote byte source to read instead of the local ``path`` (then only named)."""
    try:
        if source is not None:
            from .remote import HDF5FileObject

            f = h5py.File(HDF5FileObject(source), "r")
        else:
            f = h5py.File(path, "r", locking=False)
    except H5_ERRORS as e:
        yield f"the HDF5 part does not open ({_short(e)})"
        return
    with f:
        try:
            if int(f.attrs.get(fmt.ATTR_VERSION, -1)) != layout.version:
                yield f"root attribute {fmt.ATTR_VERSION!r} is not {layout.version}, the layout's format version"
        except H5_ERRORS as e:
            yield f"unreadable root attributes ({_short(e)})"
        ranges: list[tuple[int, int, str]] = []
        size = layout.file_size or 0
        for entry in layout.leaves:
            if not isinstance(entry, (TensorEntry, ArrayEntry)) or getattr(entry, "same_as", None):
                continue
            try:
                found = locate(f, entry, path, size, {})
            except FormatError as e:
                yield str(e).removeprefix(f"{path}: ")
                continue
            expected = entry.extent
            if isinstance(found, HDF5Read) and isinstance(expected, Chunked) and expected.filter_id == fmt.DEFLATE_ID:
                found = _gzip_preset(found.dsid, entry.shape, entry.dtype.itemsize) or found  # libhdf5's 2 filters
            if isinstance(found, HDF5Read) or (expected is None) != (entry.nbytes == 0):
                yield f"key {entry.path!r}: stored by HDF5 in another form than the layout says"
                continue
            if expected is None:
                continue
            if isinstance(expected, Contiguous):
                same = isinstance(found, Contiguous) and (found.offset, found.nbytes) == (expected.offset, expected.nbytes)
                ranges.append((expected.offset, expected.offset + expected.nbytes, entry.path))
            else:
                same = isinstance(found, Chunked) and (found.chunk_shape, found.filter_id, found.chunks) == \
                    (expected.chunk_shape, expected.filter_id, expected.chunks)
                ranges.extend((o, o + n, entry.path) for o, n, _ in expected.chunks)
            if not same:
                yield f"key {entry.path!r}: the layout's byte locations differ from HDF5's"
        ranges.sort()
        for (a0, a1, ka), (b0, b1, kb) in zip(ranges, ranges[1:]):
            if b0 < a1:
                yield f"the data of keys {ka!r} and {kb!r} overlap (bytes {b0}..{min(a1, b1)})"


def _gzip_preset(dsid: h5py.h5d.DatasetID, shape: tuple[int, ...], itemsize: int) -> Chunked | None:
    """The chunks of a dataset written with the ``"gzip"`` preset (HDF5's shuffle of
    ``itemsize``-byte elements, then deflate), as the layout records them (one filter,
    :data:`~..format.layout.DEFLATE_ID`, of the deflate level); None for any other pipeline."""
    try:
        dcpl = dsid.get_create_plist()
        filters = [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())]
        chunk = tuple(int(c) for c in dcpl.get_chunk())
        if [int(f[0]) for f in filters] != [fmt.SHUFFLE_ID, fmt.DEFLATE_ID] or tuple(filters[0][2]) != (itemsize,):
            return None
        found = _chunk_index(dsid, shape, chunk)
        return Chunked(shape, itemsize, chunk, fmt.DEFLATE_ID, tuple(int(v) for v in filters[1][2]),
                       tuple(found[k] for k in sorted(found)))
    except (*H5_ERRORS, ValueError):
        return None


BLOCK_BYTES = 64 * 2**20
"""Largest extra buffer (bytes) a write of a non-contiguous or device tensor holds at once."""


def _spaces(sel: Selection | None, dsid: h5py.h5d.DatasetID) -> tuple[h5py.h5s.SpaceID, h5py.h5s.SpaceID]:
    if sel is None or sel.full:
        return h5py.h5s.ALL, h5py.h5s.ALL
    fspace = dsid.get_space()
    fspace.select_hyperslab(sel.start, sel.count, sel.step)
    return h5py.h5s.create_simple(sel.count), fspace


def read_hdf5(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, out: torch.Tensor, sel: Selection | None = None) -> None:
    """Read the selection (all of it by default) into ``out``, a contiguous CPU tensor with the
    selection's number of elements. ``mtype`` is the memory type: the file's own type makes
    HDF5 copy raw bytes, another type makes it convert."""
    if out.numel() == 0:
        return
    mspace, fspace = _spaces(sel, dsid)
    from .memory import tensor_bytes  # (memory imports torch: the link reader, which a listing runs, does not)

    dsid.read(mspace, fspace, tensor_bytes(out), mtype=mtype)


def write_hdf5(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, src: torch.Tensor, sel: Selection | None = None) -> np.ndarray:
    """Write ``src`` (contiguous, CPU) into the selection (all of the dataset by default);
    returns the bytes written (a uint8 view of ``src``)."""
    from .memory import tensor_bytes

    data = tensor_bytes(src)
    if src.numel():
        mspace, fspace = _spaces(sel, dsid)
        dsid.write(mspace, fspace, data, mtype=mtype)
    return data


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` row ranges of dimension 0 holding at most ``block_bytes`` each
    (at least one row)."""
    if not shape:
        yield 0, 1
        return
    row = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, block_bytes // row)
    for first in range(0, shape[0], step):
        yield first, min(shape[0], first + step)


def write_tensor(dsid: h5py.h5d.DatasetID, mtype: h5py.h5t.TypeID, t: torch.Tensor, block_bytes: int | None = None,
                 on_bytes: Callable[[np.ndarray], None] | None = None) -> None:
    """Write the logical (row-major) values of any strided tensor ``t`` to the whole dataset.

    A contiguous CPU tensor is written from its own memory; otherwise row blocks of at most
    ``block_bytes`` (default :data:`BLOCK_BYTES`) are made contiguous (and moved to the CPU)
    one at a time. ``on_bytes`` sees every byte written, in order (to hash them).
    """
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        data = write_hdf5(dsid, mtype, t)
        if on_bytes is not None:
            on_bytes(data)
        return
    bits = bits_view(t)
    shape = tuple(t.shape)
    for first, stop in row_blocks(shape, t.element_size(), block_bytes or BLOCK_BYTES):
        block = bits[first:stop] if shape else bits
        data = write_hdf5(dsid, mtype, block.contiguous().cpu(), rows(shape, first, stop) if shape else None)
        if on_bytes is not None:
            on_bytes(data)


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
    :class:`~.files.RawFile`) no longer holds the datasets and groups ``layout`` lists, in
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
