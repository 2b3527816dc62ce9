"""The on-disk layout: format 2 (written and read) and format 1 (read). docs/FORMAT.md is the
human-readable copy of this module.

This is the only module that knows the header, the layout text and the HDF5 attributes of
a file. Everything read from a file passes through the ``parse_*`` functions below into
frozen records (:mod:`.record`); anything that does not parse raises :class:`FormatError` naming the file
and the entry. Every byte range a format-2 layout names is checked against the file's length
here, before any reader sees it, and the ranges of entries selected together against each
other (``Layout.select``).
"""

from __future__ import annotations

import json
import math
import operator
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Union

from ..errors import FormatError
from . import checksum, tree
from .constants import DEFLATE_VERSION, FORMAT_VERSION
from .dtypes import DtypeSpec, spec_for_name
from .slicing import contiguous_stride, has_gaps, stride_span
from .record import record
from .tree import Container

if TYPE_CHECKING:
    import h5py
    import numpy as np  # imported by arrays, attributes and format 1: the command line lists a file without it

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "READ_VERSIONS", "ROOT_DATASET", "PACK_GROUP", "LAYOUT_DATASET", "USERBLOCK",
    "HEADER_SIZE", "MAGIC", "HDF5_SIGNATURE", "ALIGNMENT", "ATTR_FORMAT", "ATTR_VERSION", "ATTR_LAYOUT",
    "ATTR_METADATA", "ATTR_TORCH_DTYPE", "ATTR_STRIDE", "FILTERS", "BITSHUFFLE_ID", "BLOSC2_ID", "DEFLATE_ID",
    "SHUFFLE_ID", "FILTER_NAMES", "DEFLATE_VERSION", "filters_of", "version_for", "Header",
    "pack_header", "parse_header", "changed_error", "Contiguous", "Chunked", "Extent", "Container", "TensorSizes", "TensorEntry",
    "ArrayEntry", "ValueEntry", "ForeignEntry", "Entry", "Layout", "parse_layout", "parse_layout_v2", "read_layout_v1",
    "layout_text", "write_root_attrs", "write_dataset_attrs", "check_metadata", "contiguous_stride", "stride_span",
    "has_gaps", "claims_format", "decode_lines", "READ_AHEAD_MIN", "READ_AHEAD_MAX", "key_structure", "key_json",
    "parse_key", "parse_ints", "parse_module_metadata", "parse_numpy_dtype",
]

FORMAT_NAME = "tensorstore_h5"
READ_VERSIONS = (1, 2, 3)
"""The versions this library reads; readers refuse any other. Versions 2 and 3 have the header
and the layout text; 3 differs from 2 only in allowing the filter :data:`DEFLATE_ID`."""

ROOT_DATASET = "data"
"""Dataset name used when the saved object itself is a tensor or array (no root dict)."""
PACK_GROUP = "%packed"
"""Version 1: group of the pack datasets holding small tensors (never an escaped key)."""
LAYOUT_DATASET = "%layout"
"""Version 2: the dataset holding the layout text (never an escaped key)."""

USERBLOCK = 4096
"""Bytes before the HDF5 superblock; the header lives at their start."""
HEADER_SIZE = 64
MAGIC = b"\x89TSH5\r\n\x1a"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
ALIGNMENT = 64
"""Every dataset's data starts at a multiple of this many bytes (HDF5 file alignment)."""

ATTR_FORMAT = "tensorstore_h5.format"
ATTR_VERSION = "tensorstore_h5.version"
ATTR_LAYOUT = "tensorstore_h5.layout"  # version 1
ATTR_METADATA = "tensorstore_h5.metadata"  # version 1
ATTR_TORCH_DTYPE = "torch_dtype"
ATTR_STRIDE = "stride"

BITSHUFFLE_ID = 32008
BLOSC2_ID = 32026
FILTERS = {BITSHUFFLE_ID: "bitshuffle", BLOSC2_ID: "blosc2"}
"""The filters a version-2 file may use (one per dataset), by HDF5 filter id; also the only
ones that tensorstore_h5 decodes itself in format-1 and foreign files (a dataset of one filter)."""
DEFLATE_ID = 1
SHUFFLE_ID = 2
FILTER_NAMES = {**FILTERS, DEFLATE_ID: "shuffle+deflate"}
"""Version 3 adds the layout filter 1: HDF5's pipeline of shuffle (2) then deflate (1), the
``"gzip"`` preset, which every HDF5 build decodes. In format-1 and foreign files HDF5's own
deflate / shuffle stay HDF5's to decode (a deflate alone is not this pipeline)."""


def filters_of(version: int) -> dict[int, str]:
    """The layout filters a file of format ``version`` may use (FORMAT.md, the filter table)."""
    return FILTER_NAMES if version >= DEFLATE_VERSION else FILTERS


def version_for(entries: Iterable[Any]) -> int:
    """The format version a writer gives a file of ``entries``: :data:`DEFLATE_VERSION` when
    one of them has chunks of the filter :data:`DEFLATE_ID`, else :data:`FORMAT_VERSION`, so
    that a file without them stays a version-2 file that older readers read."""
    for e in entries:
        x = getattr(e, "extent", None)
        if type(x) is Chunked and x.filter_id == DEFLATE_ID and getattr(e, "same_as", None) is None:
            return DEFLATE_VERSION
    return FORMAT_VERSION

_HEADER = struct.Struct("<8sIIQQQQQQ")
_MAX_JSON_DEPTH = 64


# ---------------------------------------------------------------------------- the header


@record
class Header:
    """The format-2 header (FORMAT.md, "Header")."""

    version: int
    file_length: int
    layout_offset: int
    layout_length: int
    layout_hash: int


def pack_header(h: Header) -> bytes:
    """The 64 header bytes of ``h``."""
    body = _HEADER.pack(MAGIC, h.version, HEADER_SIZE, h.file_length, h.layout_offset, h.layout_length,
                        h.layout_hash, 0, 0)[:56]
    return body + struct.pack("<Q", checksum.digest(body))


def _quoted(path: str) -> str:
    """``path`` quoted for a shell (shlex, imported only for this message)."""
    import shlex

    return shlex.quote(path)


def changed_error(file: str, seen: str) -> FormatError:
    """The error for a format-2 file that another HDF5 tool changed (h5py, h5repack): ``seen``
    says what shows it (docs/FORMAT.md, "Files changed by other HDF5 tools")."""
    return FormatError(f"{file}: the file was changed by another HDF5 tool after tensorstore_h5 saved it ({seen}); its "
                       f"layout no longer describes it. Run `tensorstore-h5 reindex {_quoted(file)}` (or th5.reindex) "
                       "to adopt the changes, or open it as a plain HDF5 file with h5py.")


def parse_header(data: bytes, file: str, size: int, hdf5_eof: Callable[[], int | None] | None = None) -> Header:
    """Parse and check the first 64 bytes of a format-2 file of ``size`` bytes.

    Raises FormatError for a damaged header, a version this library does not read, a file
    of another length than recorded, or a layout range outside the file. ``hdf5_eof``, asked
    only when the length differs, gives the end of file that the HDF5 superblock records:
    where it is the file's length, another HDF5 tool changed the file (:func:`changed_error`).
    """
    if len(data) < HEADER_SIZE:
        raise FormatError(f"{file}: truncated file: {size} bytes, shorter than the tensorstore_h5 header")
    magic, version, hsize, length, offset, nbytes, lhash, _zero, hhash = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{file}: not a tensorstore_h5 file (no header)")
    if checksum.digest(data[:56]) != hhash:
        raise FormatError(f"{file}: damaged tensorstore_h5 header (checksum mismatch)")
    if version not in READ_VERSIONS or version == 1:
        raise FormatError(f"{file}: written in tensorstore_h5 format version {version}, which this library "
                          f"does not read (it reads {', '.join(map(str, READ_VERSIONS))}); upgrade tensorstore_h5")
    if hsize != HEADER_SIZE:
        raise FormatError(f"{file}: damaged tensorstore_h5 header (header length {hsize})")
    if length != size:
        if hdf5_eof is not None and hdf5_eof() == size:
            raise changed_error(file, f"its length went from {length} to {size} bytes, as its HDF5 superblock records")
        what = "truncated" if size < length else "has bytes appended"
        raise FormatError(f"{file}: the file {what}: {size} bytes, the header records {length}")
    if not USERBLOCK <= offset <= offset + nbytes <= size or nbytes == 0:
        raise FormatError(f"{file}: damaged tensorstore_h5 header (layout at {offset}+{nbytes} outside the file)")
    return Header(version, length, offset, nbytes, lhash)


# ---------------------------------------------------------------------------- where bytes are


@record
class Contiguous:
    """``nbytes`` logical bytes stored at file offset ``offset``; ``hashes`` are the XXH3 of
    consecutive ``block``-byte blocks (None where the file has no checksums)."""

    offset: int
    nbytes: int
    hashes: tuple[int, ...] | None = None
    block: int = checksum.HASH_BLOCK

    def __init__(self, offset: int, nbytes: int, hashes: tuple[int, ...] | None = None,
                 block: int = checksum.HASH_BLOCK) -> None:
        self.__dict__.update(offset=offset, nbytes=nbytes, hashes=hashes, block=block)  # see TensorEntry.__init__


@record
class Chunked:
    """Compressed data: chunks of ``chunk_shape`` of a dataset of ``shape``, each one
    consecutive run of the logical bytes (FORMAT.md, "Where the bytes are").

    ``chunks`` are ``(file offset, stored bytes, stored raw)`` in row-major order of the
    chunk grid; ``hashes`` the XXH3 of each chunk's logical bytes (None: no checksums).
    """

    shape: tuple[int, ...]
    itemsize: int
    chunk_shape: tuple[int, ...]
    filter_id: int
    filter_values: tuple[int, ...]
    chunks: tuple[tuple[int, int, bool], ...]
    hashes: tuple[int, ...] | None = None

    def __init__(self, shape: tuple[int, ...], itemsize: int, chunk_shape: tuple[int, ...], filter_id: int,
                 filter_values: tuple[int, ...], chunks: tuple[tuple[int, int, bool], ...],
                 hashes: tuple[int, ...] | None = None) -> None:
        self.__dict__.update(shape=shape, itemsize=itemsize, chunk_shape=chunk_shape, filter_id=filter_id,
                             filter_values=filter_values, chunks=chunks, hashes=hashes,
                             _geometry=_chunk_geometry(shape, chunk_shape, itemsize))  # (not a field: ValueError here)

    @property
    def nbytes(self) -> int:
        """Logical bytes of the whole dataset."""
        return math.prod(self.shape) * self.itemsize

    @cached_property
    def chunk_bytes(self) -> int:
        """Decoded bytes of one chunk (HDF5 pads edge chunks to this size)."""
        return math.prod(self.chunk_shape) * self.itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(c[1] for c in self.chunks)

    def span(self, k: int) -> tuple[int, int]:
        """``(first logical byte, valid bytes)`` of chunk ``k``."""
        row, block, grid = self._geometry
        o, j = divmod(k, grid)
        start = j * block
        return o * row + start, min(block, row - start)

    def locate(self, offset: int) -> int:
        """The chunk holding logical byte ``offset``."""
        row, block, grid = self._geometry
        o, r = divmod(offset, row)
        return o * grid + r // block


def _chunk_geometry(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
    """``(bytes per index of the blocked dimension's outer rows, bytes per chunk block, chunks
    per row)`` for a chunk shape of the form (1, …, 1, c, whole dims…). Raises ValueError for
    any other form or a chunk larger than the dataset."""
    if len(chunk) != len(shape) or any(type(c) is not int or c < 1 for c in chunk):
        raise ValueError(f"invalid chunk shape {list(chunk)} for shape {list(shape)}")
    if any(c > max(n, 1) for c, n in zip(chunk, shape)):
        raise ValueError(f"chunk shape {list(chunk)} exceeds the dataset shape {list(shape)}")
    blocked = [i for i, (c, n) in enumerate(zip(chunk, shape)) if c < n]
    d = blocked[-1] if blocked else 0
    if any(c != 1 for c in chunk[:d]):
        raise ValueError(f"chunk shape {list(chunk)} is not a run of whole rows of shape {list(shape)}")
    inner = math.prod(shape[d + 1:]) * itemsize
    row = (shape[d] if shape else 1) * inner
    block = (chunk[d] if chunk else 1) * inner
    return max(row, 1), max(block, 1), max(1, -(-row // max(block, 1)))


def check_chunked(extent: Chunked, file_size: int | None, start: int = USERBLOCK, version: int = FORMAT_VERSION) -> None:
    """Check a chunk list, its filter and its ranges (FORMAT.md, "What readers refuse"):
    every chunk inside ``[start, file_size)`` (``file_size`` None skips that), no two chunks'
    stored bytes overlapping, a filter that format ``version`` allows. Raises ValueError
    saying what is wrong."""
    expected = 1
    for n, c in zip(extent.shape, extent.chunk_shape):
        expected *= -(-n // c)
    if len(extent.chunks) != expected:
        raise ValueError(f"{len(extent.chunks)} chunks stored, the chunk grid has {expected} (unwritten chunks?)")
    cb = extent.chunk_bytes
    limit = cb + cb // 16 + 1024
    last, ordered = 0, True  # chunks in increasing offsets (as libhdf5 writes them), each after the last one's end
    for off, size, raw in extent.chunks:
        if type(off) is not int or type(size) is not int or size < 0:
            raise ValueError(f"invalid chunk [{off!r}, {size!r}]")
        if file_size is not None and not start <= off <= off + size <= file_size:
            raise ValueError(f"chunk at {off}+{size} lies outside the file ({file_size} bytes)")
        if raw and size != cb:
            raise ValueError(f"unfiltered chunk of {size} bytes, expected {cb}")
        if size > limit:
            raise ValueError(f"stored chunk of {size} bytes exceeds the bound for {cb}-byte chunks")
        if size:
            ordered = ordered and off >= last
            last = off + size
    if not ordered:  # any other order: sorted by start, disjoint iff each starts at or after the previous one's end
        spans = sorted([(off, off + size, k) for k, (off, size, _) in enumerate(extent.chunks) if size])
        for (a0, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"stored chunks {i} ({a0}+{a1 - a0}) and {j} ({b0}+{b1 - b0}) overlap")
    _check_filter(extent, filters_of(version))
    if extent.hashes is not None and len(extent.hashes) != len(extent.chunks):
        raise ValueError(f"{len(extent.hashes)} chunk hashes for {len(extent.chunks)} chunks")


def _check_filter(extent: Chunked, filters: Mapping[int, str]) -> None:
    fid, values = extent.filter_id, extent.filter_values
    if fid not in filters:
        raise ValueError(f"filter {fid} is not one this format allows ({', '.join(f'{k} {v}' for k, v in filters.items())})")
    if any(type(v) is not int or not 0 <= v < 2**32 for v in values):
        raise ValueError(f"invalid filter values {list(values)}")
    if fid == DEFLATE_ID:
        if len(values) != 1 or values[0] > 9:
            raise ValueError(f"deflate values {list(values)}: one level, 0-9")
    elif fid == BITSHUFFLE_ID:
        if len(values) < 5 or values[4] not in (2, 3) or values[2] != extent.itemsize:
            raise ValueError(f"bitshuffle values {list(values)}: only LZ4/Zstd of the dataset's element size")
    else:
        if len(values) < 4 or values[2] != extent.itemsize or values[3] != extent.chunk_bytes:
            raise ValueError(f"blosc2 values {list(values)} do not match the dataset")
        if len(values) >= 8 and (values[7] != len(extent.shape) or tuple(values[8:8 + values[7]]) != extent.chunk_shape):
            raise ValueError(f"blosc2 values {list(values)}: rank or chunk shape differ from the dataset's")


Extent = Union[Contiguous, Chunked]


# ---------------------------------------------------------------------------- entries


class TensorSizes:
    """``numel`` and ``nbytes`` of a tensor entry (of a file or of a directory's index) from its
    ``shape`` and ``dtype`` (a :class:`DtypeSpec`)."""

    shape: tuple[int, ...]
    dtype: DtypeSpec

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.numel * self.dtype.itemsize


@record
class TensorEntry(TensorSizes):
    """A tensor leaf stored as the dataset ``dataset``.

    ``stride`` is None for row-major tensors. ``same_as`` names the key path of an earlier
    tensor that is the same view of the same storage (both paths link one dataset).
    ``parameter`` marks an ``nn.Parameter``; ``requires_grad`` a tensor that required grad.
    ``foreign`` marks datasets of files not written by tensorstore_h5 (values are converted
    by HDF5 into ``dtype``'s type instead of being copied as raw bytes). ``packed`` is the
    element offset of a small tensor inside the version-1 pack dataset ``dataset``.
    ``extent`` says where the bytes are (format 2); None where HDF5 must be asked (format 1,
    foreign files) or there are none (no elements, or ``same_as``).
    """

    path: str
    key: Any
    dtype: DtypeSpec
    shape: tuple[int, ...]
    dataset: str
    stride: tuple[int, ...] | None = None
    same_as: str | None = None
    parameter: bool = False
    requires_grad: bool = False
    foreign: bool = False
    packed: int | None = None
    extent: Extent | None = None

    def __init__(self, path: str, key: Any, dtype: DtypeSpec, shape: tuple[int, ...], dataset: str,
                 stride: tuple[int, ...] | None = None, same_as: str | None = None, parameter: bool = False,
                 requires_grad: bool = False, foreign: bool = False, packed: int | None = None,
                 extent: Extent | None = None) -> None:
        # One update, not a setattr a field (a frozen dataclass's way: 2 us an entry, against 1 us
        # here); a checkpoint of many small tensors makes thousands.
        self.__dict__.update(path=path, key=key, dtype=dtype, shape=shape, dataset=dataset, stride=stride,
                             same_as=same_as, parameter=parameter, requires_grad=requires_grad, foreign=foreign,
                             packed=packed, extent=extent)


@record
class ArrayEntry:
    """A numpy array leaf stored as the dataset ``dataset`` with numpy dtype ``dtype``."""

    path: str
    key: Any
    dtype: np.dtype
    shape: tuple[int, ...]
    dataset: str
    extent: Extent | None = None

    def __init__(self, path: str, key: Any, dtype: np.dtype, shape: tuple[int, ...], dataset: str,
                 extent: Extent | None = None) -> None:
        self.__dict__.update(path=path, key=key, dtype=dtype, shape=shape, dataset=dataset, extent=extent)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@record
class ValueEntry:
    """A non-tensor leaf kept in the layout itself (decoded value)."""

    path: str
    key: Any
    value: Any

    def __init__(self, path: str, key: Any, value: Any) -> None:
        self.__dict__.update(path=path, key=key, value=value)


@record
class ForeignEntry:
    """A dataset of a foreign HDF5 file whose type has no torch equivalent."""

    path: str
    key: Any
    dataset: str
    reason: str


Entry = Union[Container, TensorEntry, ArrayEntry, ValueEntry, ForeignEntry]
Leaf = Union[TensorEntry, ArrayEntry, ValueEntry, ForeignEntry]


class Layout:
    """Everything known about a file from its layout.

    Opening checks the structure (paths unique, parents first) in one fast pass over the
    paths and types; each entry is parsed and checked the first time it is used, so listing
    the keys of a 10,000-key file costs little. That no two entries share stored bytes is
    checked when entries are selected together (:meth:`select`, :meth:`check_disjoint`), the
    whole layout once. ``version`` is None for a foreign HDF5 file. ``layout_span`` is the
    ``(offset, end)`` of the layout text in the file, where the caller gave it.
    """

    def __init__(self, file: str, version: int | None, metadata: Mapping[str, Any], *,
                 items: list[Any] | None = None, entries: Iterable[Entry] | None = None,
                 v2: tuple[list[Any], list[str], list[bytes], int, int] | None = None,
                 layout_span: tuple[int, int] | None = None) -> None:
        self.file = file
        self.version = version
        self.metadata = metadata
        self.hash_block = checksum.HASH_BLOCK
        self.file_size: int | None = None
        self.layout_span = layout_span
        self._disjoint = False  # every entry's stored bytes checked against every other's
        self._lines: list[bytes] | None = None
        self._items: list[Any] | None = None
        self._last = -1    # the entry last parsed on its own (see _read_ahead)
        self._window = 0
        if entries is not None:
            parsed = list(entries)
            self._parsed: list[Entry | None] = list(parsed)
            self._paths = [e.path for e in parsed]
            self._kinds = [e.type if isinstance(e, Container) else "" for e in parsed]
            self._index = {p: i for i, p in enumerate(self._paths)}
            self._types = {e.path: e.type for e in parsed if isinstance(e, Container)}
        else:
            if v2 is not None:
                self._paths, self._kinds, self._lines, self.hash_block, self.file_size = v2
            else:
                assert items is not None
                self._items = items
                self._paths, self._kinds = _v1_paths(items, file)
            self._parsed = [None] * len(self._paths)
            self._index, self._types = key_structure(self._paths, self._kinds, file)
        self.leaf_paths = [p for p in self._index if p not in self._types]
        self.container_paths = [p for p in self._types if p]

    def entry(self, path: str) -> Entry | None:
        """The entry at ``path`` (parsed and checked now if it was not yet), or None."""
        i = self._index.get(path)
        if i is None:
            return None
        if self._parsed[i] is None and self._lines is not None:
            self._read_ahead(i)
        return self._parse(i)

    def _read_ahead(self, i: int) -> None:
        """Parse the entries after ``i`` too when entries are asked for in order (a loop over
        the keys): a window of lines, doubling from 16 to 1,024 while the order holds, is
        decoded at once. An entry of the window that is damaged is left unparsed, to be refused
        when it is asked for. Parsing one line at a time between reads cost 3x as much a line."""
        sequential = 0 < i - self._last <= 4
        self._last = i
        if not sequential:
            self._window = 0
            return
        assert self._lines is not None
        self._window = min(max(2 * self._window, READ_AHEAD_MIN), READ_AHEAD_MAX)
        stop = min(len(self._lines), i + self._window)
        for j, raw in decode_lines(self._lines, [j for j in range(i, stop) if self._parsed[j] is None]):
            try:
                self._parse(j, raw)
            except FormatError:
                pass
        self._last = stop - 1

    def _parse(self, i: int, raw: Any = None) -> Entry:
        entry = self._parsed[i]
        if entry is None:
            path = self._paths[i]
            try:
                if self._items is not None:
                    entry = _parse_entry_v1(self._items[i], self._types, _Earlier(self, i))
                else:
                    assert self._lines is not None
                    data = json.loads(self._lines[i]) if raw is None else raw
                    entry = _parse_entry_v2(data, path, self._kinds[i], self, i)
            except (ValueError, TypeError, KeyError, RecursionError) as e:
                raise FormatError(f"{self.file}: damaged layout entry {i} (key {path!r}): {e}") from e
            self._parsed[i] = entry
        return entry

    @property
    def entries(self) -> list[Entry]:
        """Every entry in saved (pre-order) order, root first."""
        return self.select(None)

    def select(self, paths: set[str] | None) -> list[Entry]:
        """The entries at ``paths`` (all when None), in saved order; only those are parsed.

        Raises FormatError for a damaged entry, or for two of the selected entries whose
        stored bytes overlap (:meth:`check_disjoint`): what one load of them allocates is
        then bounded by the file (uncompressed) or by their declared shapes (compressed)."""
        wanted = range(len(self._parsed)) if paths is None else sorted(self._index[p] for p in paths if p in self._index)
        missing = [i for i in wanted if self._parsed[i] is None]
        if self._lines is not None and len(missing) > 16:  # decoded together (a damaged line on its own, below)
            for i, raw in decode_lines(self._lines, missing):
                self._parse(i, raw)
        out = [self._parse(i) for i in wanted]
        if not self._disjoint:
            self._check_disjoint(out, len(out) == len(self._parsed))
        return out

    def check_disjoint(self, paths: set[str] | None = None) -> None:
        """Refuse the file when two entries (all when ``paths`` is None, else those at
        ``paths``) have stored bytes in common: contiguous data, compressed chunks (of two
        entries or of one), or the layout text (where ``layout_span`` is known). Only a
        ``same_as`` entry, which has no data of its own, shares its original's bytes. The
        whole layout is checked once (one pass over the ranges, or a sort of them when they
        are not stored in saved order): later calls cost nothing. Reads of many entries get
        this from :meth:`select`; a read of one entry (:meth:`entry`) is bounded by the file
        on its own, and calls this only where the whole file is to be refused.

        Raises FormatError naming the file and both keys."""
        self.select(paths)

    def _check_disjoint(self, entries: list[Entry], whole: bool) -> None:
        # One pass over the stored ranges in saved order: a writer stores them in increasing
        # offsets, so each starting at or after the previous one's end proves them disjoint.
        # Any other order is sorted by start and scanned again, which names the two keys.
        if whole:  # a same_as entry has no data of its own; its original is among the entries
            extents = [e.extent for e in entries if (type(e) is TensorEntry and e.same_as is None) or type(e) is ArrayEntry]
        else:
            extents = [x for _, x in self._owned(entries, False)]
        last = 0
        for x in extents:
            if x is None:
                continue
            if type(x) is Contiguous:
                if x.offset < last:
                    break
                last = x.offset + x.nbytes
            else:
                for off, size, _ in x.chunks:  # type: ignore[union-attr]
                    if size:
                        if off < last:
                            break
                        last = off + size
                else:
                    continue
                break
        else:
            if self.layout_span is None or last <= self.layout_span[0] or self.layout_span[0] == self.layout_span[1]:
                if whole:
                    self._disjoint = True
                return
        self._find_overlap(entries, whole)

    def _owned(self, entries: list[Entry], whole: bool) -> Iterator[tuple[Entry, Extent]]:
        """``(owner, extent)`` of each of ``entries`` with stored bytes; a ``same_as`` entry
        gives its original's once, where the original is not among ``entries`` itself."""
        selected = None if whole else {e.path for e in entries}
        tied: set[str] = set()
        for e in entries:
            if type(e) is TensorEntry:
                x = e.extent
                if x is None:
                    continue
                if e.same_as is not None:
                    if selected is None or e.same_as in selected or e.same_as in tied:
                        continue  # the original's bytes, counted once (with the original where it is selected)
                    tied.add(e.same_as)
                    yield self._parse(self._index[e.same_as]), x
                else:
                    yield e, x
            elif type(e) is ArrayEntry and e.extent is not None:
                yield e, e.extent

    def _find_overlap(self, entries: list[Entry], whole: bool) -> None:
        """Sort every stored range of ``entries`` (and the layout text) by start and raise
        FormatError naming the first two that overlap; mark the layout checked if none do."""
        spans: list[tuple[int, int, Any, int]] = []  # (start, end, owner entry (None: the layout), chunk or -1)
        for owner, x in self._owned(entries, whole):
            if type(x) is Contiguous:
                spans.append((x.offset, x.offset + x.nbytes, owner, -1))
            else:
                spans.extend((off, off + size, owner, k) for k, (off, size, _) in enumerate(x.chunks) if size)  # type: ignore[union-attr]
        if self.layout_span is not None and self.layout_span[1] > self.layout_span[0]:
            spans.append((*self.layout_span, None, -1))
        spans.sort(key=_START)
        for a, b in zip(spans, spans[1:]):
            if b[0] < a[1]:  # sorted by start: disjoint iff each range starts at or after the previous one's end
                raise FormatError(f"{self.file}: the stored bytes of {_span_name(a)} and {_span_name(b)} overlap; "
                                  "entries share data only through same_as; refused")
        if whole:
            self._disjoint = True

    @property
    def leaves(self) -> list[Leaf]:
        return [e for e in self.entries if not isinstance(e, Container)]  # type: ignore[misc]


_START = operator.itemgetter(0)


def _span_name(span: tuple[int, int, Any, int]) -> str:
    start, end, owner, k = span
    where = f"({start}+{end - start})"
    if owner is None:
        return f"the layout text {where}"
    return f"key {owner.path!r} {where}" if k < 0 else f"key {owner.path!r} (stored chunk {k} {where})"


READ_AHEAD_MIN, READ_AHEAD_MAX = 16, 1024
"""Entry lines a layout decodes at once when its entries are asked for in order (doubling)."""

_scan = json.JSONDecoder().scan_once


def decode_lines(lines: Sequence[bytes], indexes: Sequence[int]) -> list[tuple[int, Any]]:
    """``(i, value)`` for each line ``lines[i]`` (``i`` in ``indexes``) that is exactly one JSON
    text of ASCII characters, decoded together: ~2.5x faster a line than ``json.loads`` each.
    Lines of any other form are left out, so that ``json.loads`` decodes (or refuses) each
    alone: joining lines into one JSON array instead would let a line holding ``1,2`` and two
    lines holding halves of one value decode as well-formed entries, shifted."""
    picked = [i for i in indexes if lines[i].isascii()]
    text = "\n".join([lines[i].decode("ascii") for i in picked])
    out, pos = [], 0
    for i in picked:
        stop = pos + len(lines[i])
        try:
            value, end = _scan(text, pos)
        except (StopIteration, ValueError, RecursionError):
            end = -1
        if end == stop:
            out.append((i, value))
        pos = stop + 1
    return out


class _Earlier:
    """``get(path)``: the tensor entry at ``path`` if it comes before entry ``limit``."""

    def __init__(self, layout: Layout, limit: int) -> None:
        self._layout, self._limit = layout, limit

    def get(self, path: Any) -> TensorEntry | None:
        i = self._layout._index.get(path) if isinstance(path, str) else None
        if i is None or i >= self._limit:
            return None
        entry = self._layout._parse(i)
        return entry if isinstance(entry, TensorEntry) else None


_LEAF_TYPES = frozenset({"tensor", "ndarray", "value"})


def _v1_paths(items: list[Any], file: str) -> tuple[list[str], list[str]]:
    paths, kinds = [], []
    for i, item in enumerate(items):
        path = item.get("path") if type(item) is dict else None
        if type(path) is not str:
            raise FormatError(f"{file}: damaged layout entry {i} (key {path!r}): path is not a string")
        kind = item.get("type")
        paths.append(path)
        kinds.append(kind if type(kind) is str else repr(kind))
    return paths, kinds


def key_structure(paths: list[Any], kinds: list[str], file: str) -> tuple[dict[str, int], dict[str, str]]:
    """One pass over the paths and types: str paths of known types, unique, the root first,
    every parent an earlier container. Returns (path -> index, container path -> type)."""
    index: dict[str, int] = {}
    types: dict[str, str] = {}
    containers = tree.CONTAINER_TYPES
    known = frozenset(containers) | _LEAF_TYPES
    for i, (path, kind) in enumerate(zip(paths, kinds)):
        # the common case, in one test: a new path under an earlier container, a known type
        if type(path) is str and kind in known and path not in index and path.rpartition("/")[0] in types:
            index[path] = i
            if kind in containers:
                types[path] = kind
            continue
        why = None
        if type(path) is not str:
            why = "path is not a string"
        elif (i == 0) != (path == ""):
            why = "the root entry must come first, once"
        elif path in index:
            why = "duplicate path"
        elif path and path.rpartition("/")[0] not in types:
            why = f"parent {path.rpartition('/')[0]!r} is not an earlier container"
        elif kind not in known:
            why = f"unknown entry type {kind!r}"
        if why is not None:
            raise FormatError(f"{file}: damaged layout entry {i} (key {path!r}): {why}")
        index[path] = i
        if kind in containers:
            types[path] = kind
    return index, types


# ---------------------------------------------------------------------------- writing (format 2)


def key_json(entry: Any, parent_type: str | None) -> dict[str, Any]:
    """``{"key": ...}`` for an entry whose dict key is not a string (JSON-encoded), else ``{}``:
    a string key is its path's last name, a list index its number."""
    if parent_type in ("dict", "OrderedDict") and type(entry.key) is not str:
        return {"key": tree.encode_value(entry.key, entry.path)}
    return {}


def _extent_json(extent: Extent | None) -> dict[str, Any]:
    if extent is None:
        return {}
    hashes = [checksum.to_hex(h) for h in extent.hashes or ()]
    if isinstance(extent, Contiguous):
        return {"at": extent.offset, "xxh3": hashes}
    chunks = [[o, s, 1] if raw else [o, s] for o, s, raw in extent.chunks]
    return {"chunks": {"shape": list(extent.chunk_shape), "filter": [extent.filter_id, list(extent.filter_values)],
                       "at": chunks}, "xxh3": hashes}


def entry_json(entry: Entry, parent_type: str | None) -> dict[str, Any]:
    """The JSON object of one format-2 entry line (FORMAT.md, "The layout text")."""
    out: dict[str, Any] = key_json(entry, parent_type)
    if isinstance(entry, Container):
        if entry.module_metadata is not None and entry.type == "OrderedDict":
            out["_metadata"] = {p: {k: tree.encode_value(v, entry.path) for k, v in vals.items()}
                                for p, vals in entry.module_metadata.items()}
    elif isinstance(entry, TensorEntry):
        out.update(dtype=entry.dtype.name, shape=list(entry.shape))
        if entry.stride is not None:
            out["stride"] = list(entry.stride)
        if entry.same_as is not None:
            out["same_as"] = entry.same_as
        if entry.parameter:
            out["parameter"] = True
        if entry.requires_grad:
            out["requires_grad"] = True
        if entry.same_as is None:
            out.update(_extent_json(entry.extent))
    elif isinstance(entry, ArrayEntry):
        out.update(dtype=entry.dtype.str, shape=list(entry.shape))
        out.update(_extent_json(entry.extent))
    elif isinstance(entry, ValueEntry):
        out["value"] = tree.encode_value(entry.value, entry.path)
    else:
        raise TypeError(f"cannot write {entry!r}")
    return out


def _plain_tensor_line(e: TensorEntry, parent_type: str | None) -> str | None:
    """The entry line of a row-major, contiguous, uncompressed tensor under a ``str`` key (most
    of a checkpoint's entries), formatted directly: what ``entry_json`` gives, in a third of the
    time; None for every other entry."""
    if (e.stride is not None or e.same_as is not None or e.parameter or e.requires_grad or type(e.extent) is not Contiguous
            or (type(e.key) is not str and parent_type in ("dict", "OrderedDict"))):
        return None
    hashes = ",".join([f'"{h:016x}"' for h in e.extent.hashes or ()])
    return f'{{"dtype":"{e.dtype.name}","shape":[{",".join(map(str, e.shape))}],"at":{e.extent.offset},"xxh3":[{hashes}]}}'


_JSON_ATOMS = {None: "null", True: "true", False: "false"}


def _simple_line(e: Entry, parent_type: str | None) -> str | None:
    """The entry line of a container without ``_metadata`` or of an int, bool or None value,
    under a ``str`` or ``int`` key or in a list (an optimizer state's many step groups and
    parameter indices), formatted directly: what ``entry_json`` gives; None for every other
    entry."""
    if parent_type in ("dict", "OrderedDict") and type(e.key) is not str:
        if type(e.key) is not int:
            return None
        fields = f'"key":{e.key}'
    else:
        fields = ""
    if type(e) is Container:
        return None if e.module_metadata is not None else "{" + fields + "}"
    if type(e) is ValueEntry:
        v = e.value
        if type(v) is int:
            text = str(v)
        elif v is None or type(v) is bool:
            text = _JSON_ATOMS[v]
        else:
            return None
        return "{" + fields + ("," if fields else "") + '"value":' + text + "}"
    return None


def _type_name(entry: Entry) -> str:
    if isinstance(entry, Container):
        return entry.type
    return {TensorEntry: "tensor", ArrayEntry: "ndarray", ValueEntry: "value"}[type(entry)]


def layout_text(entries: Iterable[Entry], metadata: Mapping[str, Any], hash_block: int = checksum.HASH_BLOCK) -> bytes:
    """The format-2 layout text (JSON Lines) for ``entries`` (pre-order, root first)."""
    entries = list(entries)
    types: dict[str, str] = {}
    lines = []
    for e in entries:
        parent = e.path.rpartition("/")[0] if e.path else None
        parent_type = types.get(parent) if parent is not None else None
        line = _plain_tensor_line(e, parent_type) if type(e) is TensorEntry else _simple_line(e, parent_type)
        lines.append(line if line is not None else _dumps(entry_json(e, parent_type)))
        if isinstance(e, Container):
            types[e.path] = e.type
    head = {"format": FORMAT_NAME, "version": version_for(entries), "metadata": dict(metadata), "hash_block": hash_block,
            "paths": [e.path for e in entries], "types": [_type_name(e) for e in entries]}
    return "\n".join([_dumps(head), *lines]).encode("ascii")


_dumps = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode
"""One compact JSON text (``json.dumps`` with these options would build an encoder per call:
a third of the layout's cost for 10,000 small entries)."""


def check_metadata(metadata: Mapping[str, Any]) -> str:
    """The JSON text of user metadata. Raises TypeError unless it is a str-keyed JSON object."""
    if not all(type(k) is str for k in metadata):
        raise TypeError("metadata keys must be str")
    try:
        return json.dumps(dict(metadata), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (str keys; no NaN): {e}") from e


def root_attrs(version: int = FORMAT_VERSION) -> list[tuple[str, np.ndarray]]:
    """The root attributes of a format-2 (or 3) file, for readers that do not read the header:
    fixed-length strings and integers only (no global heap, so the metadata is checksummed)."""
    import numpy as np

    return [(ATTR_FORMAT, np.bytes_(FORMAT_NAME)), (ATTR_VERSION, np.int64(version))]


def dataset_attrs(entry: TensorEntry) -> list[tuple[str, np.ndarray]]:
    """The attributes that let plain HDF5 readers interpret a tensor's dataset: its torch
    dtype where the HDF5 type does not name it, and its stride where it has one."""
    import numpy as np

    attrs: list[tuple[str, np.ndarray]] = []
    if entry.dtype.storage != "native":
        attrs.append((ATTR_TORCH_DTYPE, np.bytes_(entry.dtype.name)))
    if entry.stride is not None:
        attrs.append((ATTR_STRIDE, np.asarray(entry.stride, dtype=np.int64)))
    return attrs


def write_root_attrs(f: h5py.File, version: int = FORMAT_VERSION) -> None:
    """Write :func:`root_attrs` through libhdf5."""
    for name, value in root_attrs(version):
        f.attrs.create(name, value)


def write_dataset_attrs(dsid: h5py.h5d.DatasetID, entry: TensorEntry) -> None:
    """Write :func:`dataset_attrs` through libhdf5."""
    attrs = dataset_attrs(entry)
    if attrs:
        import h5py  # (only writers and format-1 readers use h5py: a format-2 file is read without it)

        ds = h5py.Dataset(dsid)
        for name, value in attrs:
            ds.attrs.create(name, value)


def claims_format(attr_names: Iterable[str]) -> bool:
    """True when root attribute names show a tensorstore_h5 file (then it must never be read
    as a foreign HDF5 file, even when its layout is damaged)."""
    return any(n.startswith(FORMAT_NAME + ".") for n in attr_names)


# ---------------------------------------------------------------------------- reading (format 2)


def parse_layout_v2(text: bytes, file: str, file_size: int, layout_at: int | None = None,
                    version: int | None = None) -> Layout:
    """Parse the format-2 or 3 layout text of ``file`` (``file_size`` bytes), stored at file
    offset ``layout_at`` (given, no entry's bytes may overlap it), whose header says format
    ``version`` (given, the head must say the same). Raises FormatError."""
    lines = text.split(b"\n")
    try:
        head = json.loads(lines[0])
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{file}: damaged layout (head is not valid JSON): {e}") from e
    if type(head) is not dict or set(head) != {"format", "version", "metadata", "hash_block", "paths", "types"}:
        raise FormatError(f"{file}: damaged layout head (fields {sorted(head) if type(head) is dict else type(head).__name__})")
    if head["format"] != FORMAT_NAME or type(head["version"]) is not int or head["version"] not in (2, DEFLATE_VERSION) \
            or (version is not None and head["version"] != version):
        raise FormatError(f"{file}: damaged layout head (format {head['format']!r}, version {head['version']!r})")
    paths, kinds, block = head["paths"], head["types"], head["hash_block"]
    if type(head["metadata"]) is not dict:
        raise FormatError(f"{file}: damaged metadata: not a JSON object")
    if type(block) is not int or block < 2**16 or block > 2**30 or block & (block - 1):
        raise FormatError(f"{file}: damaged layout head (hash_block {block!r})")
    if type(paths) is not list or type(kinds) is not list or not paths or len(paths) != len(kinds) \
            or len(lines) != len(paths) + 1:
        raise FormatError(f"{file}: damaged layout head: {len(lines) - 1} entry lines for "
                          f"{len(paths) if type(paths) is list else '?'} paths and "
                          f"{len(kinds) if type(kinds) is list else '?'} types")
    span = None if layout_at is None else (layout_at, layout_at + len(text))
    return Layout(file, head["version"], head["metadata"], v2=(paths, [k if type(k) is str else repr(k) for k in kinds],
                                                     lines[1:], block, file_size), layout_span=span)


_V2_FIELDS = {
    "tensor": {"key", "dtype", "shape", "stride", "same_as", "parameter", "requires_grad", "at", "chunks", "xxh3"},
    "ndarray": {"key", "dtype", "shape", "at", "chunks", "xxh3"},
    "value": {"key", "value"},
}
_CONTAINER_V2 = frozenset({"key", "_metadata"})


def _parse_entry_v2(item: Any, path: str, kind: str, layout: Layout, i: int) -> Entry:
    if type(item) is not dict:
        raise ValueError("entry line is not a JSON object")
    key = parse_key(item, path, layout._types)
    if kind in tree.CONTAINER_TYPES:
        if not item.keys() <= _CONTAINER_V2:
            raise ValueError(f"unexpected fields {sorted(set(item) - _CONTAINER_V2)}")
        meta = None
        if "_metadata" in item:
            if kind != "OrderedDict":
                raise ValueError("only an OrderedDict has _metadata")
            meta = parse_module_metadata(item["_metadata"])
        return Container(path, key, kind, meta)
    fields = _V2_FIELDS[kind]
    if not item.keys() <= fields:
        raise ValueError(f"unexpected fields {sorted(set(item) - fields)}")
    if kind == "value":
        if "value" not in item:
            raise ValueError("a value entry needs 'value'")
        return ValueEntry(path, key, tree.decode_value(item["value"]))
    dataset = path or ROOT_DATASET
    shape = parse_ints(item.get("shape"), "shape", minimum=0)
    if kind == "ndarray":
        dt = parse_numpy_dtype(item.get("dtype"))
        extent = _parse_extent(item, shape, dt.itemsize, layout)
        return ArrayEntry(path, key, dt, shape, dataset, extent)
    spec = spec_for_name(item.get("dtype"))  # type: ignore[arg-type]
    if spec is None:
        raise ValueError(f"unknown torch dtype {item.get('dtype')!r}")
    stride = _parse_stride(item, shape) if "stride" in item else None
    if "parameter" in item or "requires_grad" in item:
        for flag in ("parameter", "requires_grad"):
            if flag in item and item[flag] is not True:
                raise ValueError(f"{flag} must be true when present")
        if "requires_grad" in item and not _differentiable(spec):
            raise ValueError(f"a {spec.name} tensor cannot require grad")
    same_as = item.get("same_as")
    if same_as is not None:
        if item.keys() & {"at", "chunks", "xxh3"}:
            raise ValueError("a same_as entry has no data of its own")
        orig = _Earlier(layout, i).get(same_as)
        if orig is None or orig.same_as is not None or (orig.dtype, orig.shape, orig.stride) != (spec, shape, stride):
            raise ValueError(f"same_as {same_as!r} does not name an earlier tensor of the same dtype, shape and stride")
        return TensorEntry(path, key, spec, shape, orig.dataset, stride, same_as, "parameter" in item,
                           "requires_grad" in item, extent=orig.extent)
    extent = _parse_extent(item, shape, spec.itemsize, layout)
    return TensorEntry(path, key, spec, shape, dataset, stride, None, "parameter" in item, "requires_grad" in item,
                       extent=extent)


def _differentiable(spec: DtypeSpec) -> bool:
    """True for dtypes that can require grad (floating point and complex; told by the name, as
    torch's ``is_floating_point``/``is_complex`` would: no torch import to list a layout)."""
    return spec.name.startswith(("float", "bfloat", "complex"))


def parse_module_metadata(data: Any) -> dict[str, dict[str, Any]]:
    """A state dict's ``_metadata`` (module prefix -> its values). Raises ValueError."""
    if type(data) is not dict or not all(type(v) is dict for v in data.values()):
        raise ValueError("_metadata must map module prefixes to objects")
    return {p: {k: tree.decode_value(v) for k, v in vals.items()} for p, vals in data.items()}


def _parse_stride(item: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if "stride" not in item:
        return None
    stride = parse_ints(item["stride"], "stride", minimum=0)
    if len(stride) != len(shape):
        raise ValueError("stride and shape differ in length")
    if has_gaps(shape, stride) or stride_span(shape, stride) > math.prod(shape):
        raise ValueError(f"stride {list(stride)} leaves gaps in storage for shape {list(shape)}")
    return stride


_HEX_DIGITS = "0123456789abcdef"


def _parse_extent(item: dict[str, Any], shape: tuple[int, ...], itemsize: int, layout: Layout) -> Extent | None:
    nbytes = math.prod(shape) * itemsize
    size = layout.file_size
    assert size is not None
    if nbytes == 0:
        if item.keys() & {"at", "chunks", "xxh3"}:
            raise ValueError("an empty tensor has no data")
        return None
    hashes = item.get("xxh3")
    if type(hashes) is not list:
        raise ValueError("missing or invalid xxh3")
    try:  # strings of 16 lower-case hex digits, checked together (from_hex, a call a hash, names a bad one)
        hexes = not "".join(hashes).strip(_HEX_DIGITS)
    except TypeError:
        hexes = False
    parsed = tuple([int(h, 16) for h in hashes if len(h) == 16]) if hexes else None
    if parsed is None or len(parsed) != len(hashes):
        parsed = tuple(map(checksum.from_hex, hashes))
    if ("at" in item) == ("chunks" in item):
        raise ValueError("needs exactly one of 'at' and 'chunks'")
    if "at" in item:
        at = item["at"]
        if type(at) is not int or at % ALIGNMENT or not USERBLOCK <= at <= at + nbytes <= size:
            raise ValueError(f"data at {at!r}+{nbytes} is not an aligned range inside the file ({size} bytes)")
        if len(parsed) != -(-nbytes // layout.hash_block):
            raise ValueError(f"{len(parsed)} block hashes for {nbytes} bytes")
        return Contiguous(at, nbytes, parsed, layout.hash_block)
    c = item["chunks"]
    if type(c) is not dict or set(c) != {"shape", "filter", "at"}:
        raise ValueError("invalid chunks")
    filt, at = c["filter"], c["at"]
    if type(filt) is not list or len(filt) != 2 or type(filt[0]) is not int or type(filt[1]) is not list:
        raise ValueError(f"invalid filter {filt!r}")
    if type(at) is not list or not all(type(a) is list and len(a) in (2, 3) and (len(a) == 2 or a[2] == 1) for a in at):
        raise ValueError("invalid chunk list")
    extent = Chunked(shape, itemsize, parse_ints(c["shape"], "chunk shape", minimum=1), filt[0], tuple(filt[1]),
                     tuple((a[0], a[1], len(a) == 3) for a in at), parsed)
    check_chunked(extent, size, version=layout.version or FORMAT_VERSION)
    return extent


_NUMPY_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}


def parse_numpy_dtype(name: Any) -> np.dtype:
    """A numpy dtype of a stored array: bool, integer, float or complex (either byte order)."""
    dt = tree.numpy_dtype(name) if type(name) is str else None
    if dt is None or dt.itemsize not in _NUMPY_SIZES.get(dt.kind, ()):
        raise ValueError(f"unsupported numpy dtype {name!r}")
    return dt


# ---------------------------------------------------------------------------- reading (format 1)


def read_layout_v1(attrs: Callable[[str], Any], file: str) -> Layout:
    """The layout of a format-1 file from its root attributes (``attrs(name)`` returns one or
    None). Raises FormatError for an incomplete file or damaged attributes."""
    import numpy as np  # (h5py, which read the attributes, imported it)

    version = attrs(ATTR_VERSION)
    if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)):
        raise FormatError(f"{file}: damaged root attribute {ATTR_VERSION!r}: {version!r}")
    if int(version) in (2, DEFLATE_VERSION):
        raise FormatError(f"{file}: a format-{int(version)} file without its header (damaged, or its first 4096 bytes "
                          "replaced)")
    if int(version) not in READ_VERSIONS:
        raise FormatError(
            f"{file}: written in tensorstore_h5 format version {int(version)}, which this library does not read "
            f"(it reads {', '.join(map(str, READ_VERSIONS))}); upgrade tensorstore_h5"
        )
    layout = attrs(ATTR_LAYOUT)
    if layout is None:
        raise FormatError(f"{file}: incomplete file: the layout attribute {ATTR_LAYOUT!r} is missing (interrupted save?)")
    meta = attrs(ATTR_METADATA)
    return parse_layout(_as_str(layout), file, _as_str(meta if meta is not None else "{}"))


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else repr(value)


def parse_layout(text: str, file: str, metadata: str = "{}") -> Layout:
    """Parse and check the format-1 layout JSON of ``file``. Raises FormatError on anything unexpected."""
    try:
        data = json.loads(text)
        meta = json.loads(metadata)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{file}: damaged layout attribute (not valid JSON): {e}") from e
    if not isinstance(meta, dict):
        raise FormatError(f"{file}: damaged metadata attribute: not a JSON object")
    items = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise FormatError(f"{file}: damaged layout attribute: no entries")
    return Layout(file, 1, meta, items=items)


_CONTAINER_FIELDS = frozenset({"path", "key", "type"})
_ENTRY_FIELDS = {
    "tensor": {"path", "key", "type", "dtype", "shape", "stride", "same_as", "parameter", "dataset", "offset"},
    "ndarray": {"path", "key", "type", "dtype", "shape", "dataset"},
    "value": {"path", "key", "type", "value"},
}


def _parse_entry_v1(item: dict[str, Any], types: Mapping[str, str], tensors: _Earlier) -> Entry:
    """One format-1 entry, whose structure :func:`key_structure` has already checked."""
    path, kind = item["path"], item["type"]
    key = parse_key(item, path, types)
    if kind in tree.CONTAINER_TYPES:
        if not item.keys() <= _CONTAINER_FIELDS:
            raise ValueError(f"unexpected fields {sorted(set(item) - _CONTAINER_FIELDS)}")
        return Container(path, key, kind)
    fields = _ENTRY_FIELDS[kind]
    if not item.keys() <= fields:
        raise ValueError(f"unexpected fields {sorted(set(item) - fields)}")
    if kind == "value":
        return ValueEntry(path, key, tree.decode_value(item["value"]))
    dataset = item.get("dataset", path or ROOT_DATASET)
    packed = item.get("offset")
    if packed is not None:
        if kind != "tensor" or type(packed) is not int or packed < 0 or dataset != f"{PACK_GROUP}/{item.get('dtype')}":
            raise ValueError(f"invalid packed tensor (dataset {dataset!r}, offset {packed!r})")
    elif not isinstance(dataset, str) or dataset != (path or ROOT_DATASET):
        raise ValueError(f"invalid dataset {dataset!r}")
    shape = parse_ints(item.get("shape"), "shape", minimum=0)
    if kind == "ndarray":
        return ArrayEntry(path, key, parse_numpy_dtype(item.get("dtype")), shape, dataset)
    spec = spec_for_name(item.get("dtype"))  # type: ignore[arg-type]
    if spec is None:
        raise ValueError(f"unknown torch dtype {item.get('dtype')!r}")
    stride = None
    if "stride" in item:
        stride = parse_ints(item["stride"], "stride", minimum=0)
        if len(stride) != len(shape):
            raise ValueError("stride and shape differ in length")
        if has_gaps(shape, stride):
            stride = None  # version 1 kept steps; the values come back contiguous
    same_as = item.get("same_as")
    if same_as is not None:
        orig = tensors.get(same_as)
        if orig is None or orig.same_as is not None or (orig.dtype, orig.shape, orig.stride, orig.dataset) != \
                (spec, shape, stride, dataset if packed is not None else orig.dataset) or orig.packed != packed:
            raise ValueError(f"same_as {same_as!r} does not name an earlier tensor of the same dtype, shape and stride")
    requires_grad = False
    if "parameter" in item:
        param = item["parameter"]
        if not isinstance(param, dict) or type(param.get("requires_grad")) is not bool:
            raise ValueError("invalid parameter field")
        requires_grad = param["requires_grad"]
        if requires_grad and not _differentiable(spec):
            raise ValueError(f"a {spec.name} parameter cannot require grad")
    return TensorEntry(path, key, spec, shape, dataset, stride, same_as, "parameter" in item, requires_grad,
                       packed=packed)


def parse_key(item: dict[str, Any], path: str, types: Mapping[str, str]) -> Any:
    """The dict key or list index of the entry at ``path`` (from ``item['key']`` or the path's
    last name), checked against its parent's type. Raises ValueError."""
    if path == "":
        if "key" in item:
            raise ValueError("the root has no key")
        return None
    parent, _, name = path.rpartition("/")
    ptype = types.get(parent)
    if ptype is None:
        raise ValueError(f"parent {parent!r} is not an earlier container")
    if ptype in ("list", "tuple"):
        if "key" in item or not name.isdigit():
            raise ValueError("list items are named by their index")
        return None
    if "key" in item:
        key = tree.decode_value(item["key"])
        if type(key) is str or tree.name_for_key(key, path) != name:
            raise ValueError(f"key {key!r} does not match name {name!r}")
        return key
    if name.isascii() and "%" not in name and "\x00" not in name and name not in ("", ".", ".."):
        return name  # nothing escaped (tree.unescape's answer, without its call: a key an entry)
    return tree.unescape(name)


def parse_ints(value: Any, what: str, minimum: int) -> tuple[int, ...]:
    """A JSON list of at most 64 integers >= ``minimum`` (a shape, stride, offsets) as a tuple.
    Raises ValueError naming ``what``."""
    if type(value) is not list or len(value) > 64:
        raise ValueError(f"invalid {what} {value!r}")
    for n in value:
        if type(n) is not int or n < minimum or n >= 2**62:
            raise ValueError(f"invalid {what} {value!r}")
    return tuple(value)
