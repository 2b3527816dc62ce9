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

The comparison of a format-2 file's HDF5 groups with its layout, read without libhdf5, is
:mod:`..format.hdf5links`.
"""

from __future__ import annotations

import math
import os
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
    import torch

__all__ = ["H5_ERRORS", "HDF5Read", "open_file", "read_layout", "foreign_layout", "locate", "verify_layout",
           "BLOCK_BYTES", "read_hdf5", "write_hdf5", "row_blocks", "write_tensor"]

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
