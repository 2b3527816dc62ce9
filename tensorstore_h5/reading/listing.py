"""What a file holds, without torch: its keys, entries, metadata and sizes.

:class:`Listing` is the mapping-like view of a parsed layout that :class:`.store.Store`
reads from. :meth:`Listing.open` opens a local format-2 or 3 file for that view alone:
the header, the layout text (its checksum checked) and, on first use of an entry, the
comparison of the HDF5 links with it (:func:`check_links_first`). Nothing here imports torch,
so the command line's ``ls`` and ``info`` of such a file start in ~0.1 s instead of the ~1.5 s
that importing torch takes (issue #29); what needs tensors is the store's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import FormatError, KeyNotFoundError
from ..format import checksum
from ..format import layout as fmt
from ..format.layout import ArrayEntry, Container, Layout, TensorEntry
from ..storage import Deferred, files
from .select import Selector, closest, resolve

hdf5links: Any = Deferred(f"{__package__.rpartition('.')[0]}.format.hdf5links", globals(), "hdf5links")  # on first use

__all__ = ["LayoutView", "Listing", "check_links_first", "layout_v2", "data_bytes"]


def data_bytes(entry: Any) -> int:
    """Bytes a leaf reads from the file (0 for plain values and aliases)."""
    if isinstance(entry, ArrayEntry) or (isinstance(entry, TensorEntry) and entry.same_as is None):
        return entry.nbytes
    return 0


def check_links_first(layout: Layout, raw: Any) -> None:
    """Make the first use of ``layout``'s entries (any read, ``load``, ``info``, ``in``)
    compare the HDF5 part of ``raw``'s file with it (:func:`hdf5links.link_changes`) and raise
    :func:`~..format.layout.changed_error` where they differ; later uses cost nothing. Opening
    a file and listing its keys read no HDF5 metadata and import no HDF5 code (the open of
    10,000 keys is benchmarked)."""
    ref = weakref.ref(layout)  # (the layout keeps these functions: no cycle through them)

    def first(name: str) -> Any:
        method = getattr(type(layout), name)

        def checked(*args: Any, **kwargs: Any) -> Any:
            owner = ref()
            assert owner is not None
            result = method(owner, *args, **kwargs)  # the layout's own checks first (damaged or overlapping entries)
            seen = hdf5links.link_changes(raw, owner)
            if seen is not None:
                raise fmt.changed_error(owner.file, seen)
            owner.__dict__.pop("entry", None)  # checked: the class's own methods again
            owner.__dict__.pop("select", None)
            return result

        return checked

    layout.entry = first("entry")  # type: ignore[method-assign]
    layout.select = first("select")  # type: ignore[method-assign]


def layout_v2(raw: Any, path: str, head: bytes) -> Layout:
    """The layout of the format-2 or 3 file that ``raw`` reads (``head``: its first
    :data:`~..format.layout.HEADER_SIZE` bytes, which start with the magic): header and
    layout text parsed and checked, the HDF5 links compared on first use for a local file.
    Raises FormatError naming ``path``."""
    header = fmt.parse_header(head, path, raw.size, hdf5_eof=lambda: hdf5links.superblock_eof(raw))
    text = raw.read(header.layout_offset, header.layout_length)
    if checksum.digest(text) != header.layout_hash:
        raise FormatError(f"{path}: damaged layout (checksum mismatch)")
    layout = fmt.parse_layout_v2(text, path, raw.size, header.layout_offset, version=header.version)
    if isinstance(raw, files.RawFile):  # before any entry is used, the HDF5 links are compared with it
        check_links_first(layout, raw)
    return layout


class LayoutView:
    """The mapping-like view of a parsed layout (``_layout``: a file's :class:`Layout` or a
    directory's index, each with ``leaf_paths``, ``container_paths``, ``entry`` and
    ``metadata``) that every store shares: keys, membership, entries, ``select=``."""

    path: str
    _layout: Any

    def keys(self) -> list[str]:
        """Key paths of every leaf, in saved order."""
        return list(self._layout.leaf_paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.leaf_paths)

    def __len__(self) -> int:
        return len(self._layout.leaf_paths)

    def __contains__(self, key: object) -> bool:
        e = self._layout.entry(key) if isinstance(key, str) else None
        return e is not None and not isinstance(e, Container)

    def _entry(self, key: str) -> Any:
        entry = self._layout.entry(key)
        if entry is None or isinstance(entry, Container):
            if entry is not None:
                raise KeyNotFoundError(f"{self.path}: {key!r} is a container, not a leaf; use store.load(select={key!r})")
            near = closest(key, self._layout.leaf_paths)
            hint = f"; closest keys: {', '.join(map(repr, near))}" if near else ""
            raise KeyNotFoundError(f"{self.path}: no key {key!r}{hint}")
        return entry

    def _included(self, select: Selector) -> Any:
        """The key paths (leaves and containers) that ``select`` picks (:func:`.select.resolve`)."""
        return resolve(select, self._layout.leaf_paths, self._layout.container_paths, self.path)

    def selected_keys(self, select: Selector = None) -> list[str]:
        """The leaf key paths that ``select`` picks, in saved order (see ``Store.load``)."""
        included = self._included(select)
        return [p for p in self._layout.leaf_paths if p in included]

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata given to save (a copy)."""
        return dict(self._layout.metadata)


class Listing(LayoutView):
    """The keys, entries, metadata and sizes of a parsed layout: the part of a store that
    needs no tensors. A :class:`.store.Store` is one; :meth:`open` makes one of a local
    format-2 or 3 file alone (for listings: no torch is imported)."""

    _layout: Layout

    @classmethod
    def open(cls, path: str) -> Listing | None:
        """The listing of the local file ``path`` when it is a tensorstore_h5 file of format 2
        or 3, else None (format 1 and foreign HDF5 files are listed through libhdf5, by a
        store). Raises what :class:`.store.Store` raises for a missing or damaged file."""
        raw = files.RawFile(path)
        try:
            head = raw.head(fmt.HEADER_SIZE)
            if head[:8] != fmt.MAGIC:
                raw.close()
                return None
            self = cls.__new__(cls)
            self.path = path
            self._raw = raw
            self._layout = layout_v2(raw, path, head)
            return self
        except BaseException:
            raw.close()
            raise

    @property
    def format_version(self) -> int | None:
        """The tensorstore_h5 format version, or None for a foreign HDF5 file."""
        return self._layout.version

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor and array data (aliased tensors counted once)."""
        return sum(data_bytes(e) for e in self._layout.leaves)

    def nbytes_of(self, select: Selector = None) -> int:
        """Bytes of tensor and array data that ``select`` picks (tied tensors counted once)."""
        return sum(data_bytes(e) for e in self._layout.select(self._included(select)) if not isinstance(e, Container))

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw._fd is None

    def __enter__(self) -> Listing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        from ..display import human_bytes

        n_t = sum(1 for e in self._layout.leaves if isinstance(e, TensorEntry))
        version = f"v{self._layout.version}" if self._layout.version else "foreign HDF5"
        state = ", closed" if self.closed else ""
        return (f"<tensorstore_h5.{type(self).__name__} {self.path!r} ({version}, {len(self)} keys, {n_t} tensors, "
                f"{human_bytes(self.nbytes)}{state})>")
