"""Rebuild a format-2 file from its HDF5 part after another HDF5 tool changed it:
``th5.reindex(path)``, ``tensorstore-h5 reindex FILE``.

A format-2 file is read from its header and layout, which h5py and h5repack do not update:
after an edit the library refuses the file (docs/FORMAT.md, "Files changed by other HDF5
tools"). Reindexing adopts the edit: every dataset is read as HDF5 now holds it (through
libhdf5's metadata, with the checks of foreign files: hard links only, no virtual or
external storage, data inside the file; compressed chunks decoded by this library's own
decoders) and the whole file is written anew beside ``path``, with a new layout and new
checksums, then renamed over it, as a save is (a failure leaves the file as it was).

What only the layout knew is kept where it still applies: the user metadata; plain values
(``epoch``) and containers of values only, unless the group that held them is gone; the
container types (``OrderedDict`` with its ``_metadata``, lists, tuples; a list or tuple whose
items are no longer ``0 .. n-1`` becomes a dict of the names left), non-``str`` dict keys and
the order of every container that is still a group (new links come after the old ones, in
HDF5's name order); ``nn.Parameter`` and ``requires_grad`` of a tensor still at its
path with the same shape and dtype; numpy arrays. What the HDF5 attributes say is kept
with the dataset wherever it moved: the ``torch_dtype`` (bfloat16, float8, ...) of a dataset
whose HDF5 type is still the one that dtype is stored as, and its ``stride``. Datasets linked
at several paths come back as one tensor (tied). Datasets of types torch has none for,
soft and external links are refused, naming the key: delete them with h5py first.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import h5py
import numpy as np
import torch

from ..codecs.decoders import ChunkReader
from ..codecs.presets import PRESETS
from ..errors import FormatError, TensorStoreError
from ..format import checksum, tree
from ..format import layout as fmt
from ..format.dtypes import DtypeSpec, spec_for_name, spec_for_numpy, spec_for_torch
from ..format.layout import ArrayEntry, Chunked, Container, Contiguous, Layout, TensorEntry
from ..format.slicing import has_gaps, stride_span
from ..format.tree import Leaf
from ..storage import files, libhdf5, memory, remote
from .writer import PathLike, Writer, few_links

__all__ = ["reindex", "Reindexed", "KEEP"]

KEEP = "keep"
"""``compression=`` of :func:`reindex`: each dataset compressed with a filter of the format
is compressed again with that filter and its settings (HDF5's shuffle + deflate: the
``"gzip"`` preset, where there is one); any other is stored uncompressed."""


class Reindexed(NamedTuple):
    """What :func:`reindex` did: the file's key paths now, those that are new since the
    layout was written (added or renamed with h5py) and those that are gone (deleted or
    renamed), each in saved order."""

    keys: list[str]
    added: list[str]
    removed: list[str]


@dataclass
class _Dataset:
    """A dataset of the file as HDF5 holds it now."""

    h5path: str
    spec: DtypeSpec
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None
    address: int
    links: int
    filter: Any = None


@dataclass
class _Group:
    h5path: str
    names: list[str] = field(default_factory=list)  # link names, in HDF5's (name) order


class _Filter(h5py.filters.FilterRefBase):
    """A format filter with the settings a dataset was written with (see :data:`KEEP`)."""

    def __init__(self, filter_id: int, options: tuple[int, ...]) -> None:
        self.filter_id = filter_id
        self.filter_options = options


def reindex(path: PathLike, *, compression: Any = KEEP, progress: bool | None = None, sync: bool = False) -> Reindexed:
    """Rebuild the file at ``path`` from what HDF5 holds now, after an edit with h5py (values
    written, datasets renamed, added or deleted) or an ``h5repack``: afterwards ``th5.load``
    returns what h5py reads, with new checksums. The file is rewritten beside itself and
    renamed over ``path`` (atomic: a failure leaves it as it was).

    Args:
        path: a local format-2 file (one whose header says tensorstore_h5).
        compression: :data:`KEEP` (default: each dataset as it was), or what ``th5.save``
            takes (None: all uncompressed).
        progress: a progress bar by bytes (see :func:`tensorstore_h5.save`).
        sync: ``fsync`` the new file and its directory before returning.

    Returns:
        :class:`Reindexed`: the key paths now, and those added and removed.

    Raises:
        FormatError: not a tensorstore_h5 format-2 file, an HDF5 part libhdf5 cannot read, or a
            dataset that cannot be stored (a type torch has none for, a soft or external link,
            virtual or external storage), naming the key; nothing changes.
        WriteError: the new file cannot be written; nothing changes.
    """
    local = remote.local_path(path)
    if local is None:
        raise TypeError(f"reindex rewrites a local file; got {path!r}")
    raw = files.RawFile(local)
    try:
        head = raw.head(fmt.HEADER_SIZE)
        if head[:8] != fmt.MAGIC:
            kind = "an HDF5 file without a tensorstore_h5 header (format 1, or not written by tensorstore_h5)" \
                if head[:8] == fmt.HDF5_SIGNATURE else "not an HDF5 file"
            raise FormatError(f"{local}: not a tensorstore_h5 format-2 file ({kind}); `tensorstore-h5 convert` "
                              "writes one from it")
        f = libhdf5.open_file(local, raw.identity)
        try:
            old = _old_layout(raw, head, local, f)
            return _rewrite(local, raw, f, old, compression, progress, sync)
        finally:
            f.close()
    finally:
        raw.close()


def _old_layout(raw: files.RawFile, head: bytes, path: str, f: h5py.File) -> Layout | None:
    """The layout the header describes, as written, or None where it cannot be read any more.
    It is read where the header says, or, where that no longer holds it (h5repack moves data;
    the header, HDF5's user block, is copied as it was), from the ``%layout`` dataset, which
    holds the same text: its checksum must be the header's either way."""
    recorded = struct.unpack_from("<Q", head, 16)[0] if len(head) >= 24 else 0
    try:
        header = fmt.parse_header(head, path, recorded)
    except FormatError:
        return None
    text = None
    if header.layout_offset + header.layout_length <= raw.size:
        try:
            text = raw.read(header.layout_offset, header.layout_length)
        except (OSError, EOFError):
            text = None
    if text is None or checksum.digest(text) != header.layout_hash:
        text = _layout_dataset(f, raw, path, header.layout_length)
    if text is None or checksum.digest(text) != header.layout_hash:
        return None
    try:
        layout = fmt.parse_layout_v2(text, path, recorded)
        layout.entries  # every entry parsed now: a damaged one drops the layout, not the reindex
        return layout
    except (FormatError, ValueError):
        return None


def _layout_dataset(f: h5py.File, raw: files.RawFile, path: str, length: int) -> bytes | None:
    """The bytes of the root's ``%layout`` dataset where it has ``length`` of them, read with
    the checks of a foreign file's dataset."""
    d = _Dataset(fmt.LAYOUT_DATASET, spec_for_torch(torch.uint8), (length,), None, 0, 1)
    try:
        return bytes(memory.tensor_bytes(_read(f, raw, path, d)))
    except (FormatError, *libhdf5.H5_ERRORS):
        return None


# ---------------------------------------------------------------------------- what HDF5 holds


def _hdf5_tree(f: h5py.File, path: str) -> tuple[dict[str, _Group], dict[str, _Dataset]]:
    """Every group and dataset reachable through hard links, by HDF5 path, without reading data."""
    groups: dict[str, _Group] = {"": _Group("")}
    datasets: dict[str, _Dataset] = {}
    addresses = {h5py.h5o.get_info(f["/"].id).addr: ""}  # group -> its path (one each)
    stack = [""]
    while stack:
        gpath = stack.pop()
        group = f[gpath] if gpath else f
        try:
            names = list(group.keys())
        except libhdf5.H5_ERRORS as e:
            raise FormatError(f"{path}: cannot list the HDF5 group {gpath or '/'!r} ({libhdf5._short(e)})") from e
        for name in names:
            child = f"{gpath}/{name}" if gpath else name
            if gpath == "" and name == fmt.LAYOUT_DATASET:
                continue
            link = group.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
                raise FormatError(f"{path}: {child!r} is {kind}; tensorstore_h5 stores only what hard links hold: "
                                  "delete the link with h5py, or copy what it points to in its place")
            groups[gpath].names.append(name)
            obj = group[name]
            if isinstance(obj, h5py.Group):
                at = h5py.h5o.get_info(obj.id).addr
                if at in addresses:
                    raise FormatError(f"{path}: the HDF5 group {addresses[at] or '/'!r} is also linked as {child!r}; "
                                      "tensorstore_h5 stores a tree: delete one of the links with h5py")
                addresses[at] = child
                groups[child] = _Group(child)
                stack.append(child)
            elif isinstance(obj, h5py.Dataset):
                datasets[child] = _dataset(child, obj, path)
            else:
                raise FormatError(f"{path}: {child!r} is an HDF5 {type(obj).__name__}, not a dataset or group; "
                                  "delete it with h5py")
    return groups, datasets


def _dataset(h5path: str, ds: h5py.Dataset, path: str) -> _Dataset:
    try:
        ftype = ds.id.get_type()
        shape = tuple(int(n) for n in ds.shape) if ds.shape is not None else None
        attrs = ds.attrs
        named = attrs.get(fmt.ATTR_TORCH_DTYPE) if fmt.ATTR_TORCH_DTYPE in attrs else None
        stride = attrs.get(fmt.ATTR_STRIDE) if fmt.ATTR_STRIDE in attrs else None
        info = h5py.h5o.get_info(ds.id)
        dcpl = ds.id.get_create_plist()
        filters = [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())] \
            if dcpl.get_layout() == h5py.h5d.CHUNKED else []
        dtype = ds.dtype
    except libhdf5.H5_ERRORS as e:
        raise FormatError(f"{path}: key {h5path!r}: unreadable dataset header ({libhdf5._short(e)})") from e
    if shape is None:
        raise FormatError(f"{path}: key {h5path!r}: an empty (null dataspace) dataset; delete it with h5py")
    spec = None
    if isinstance(named, (bytes, np.bytes_, str)):  # the dtype the HDF5 type stands for, while it still does
        name = named.decode("ascii", "replace") if isinstance(named, bytes) else str(named)
        spec = spec_for_name(name)
        if spec is not None and spec.h5_type != ftype:
            spec = None
    if spec is None:
        spec = spec_for_numpy(dtype)
    if spec is None:
        raise FormatError(f"{path}: key {h5path!r}: HDF5 type {dtype} has no torch dtype; tensorstore_h5 cannot "
                          "store it (delete the dataset with h5py, or convert its values)")
    strides = None
    if stride is not None:
        strides = tuple(int(s) for s in np.asarray(stride).reshape(-1))
        if len(strides) != len(shape) or any(s < 0 for s in strides) or has_gaps(shape, strides) \
                or stride_span(shape, strides) > max(1, int(np.prod(shape, dtype=np.int64))):
            strides = None  # not the stride of these values any more: row-major
    kept: Any = None
    if len(filters) == 1 and int(filters[0][0]) in fmt.FILTERS:
        fid, values = int(filters[0][0]), tuple(int(v) for v in filters[0][2])
        kept = _Filter(fid, values[3:] if fid == fmt.BITSHUFFLE_ID else (0, 0, 0, 0, *values[4:7]))
    elif [int(fid) for fid, _, _ in filters] == [2, 1] and "gzip" in PRESETS:  # HDF5's shuffle + deflate
        kept = "gzip"
    return _Dataset(h5path, spec, shape, strides, int(info.addr), int(info.rc), kept)


def _read(f: h5py.File, raw: files.RawFile, path: str, d: _Dataset) -> torch.Tensor:
    """The dataset's values as HDF5 holds them, checked as a foreign file's are."""
    entry = TensorEntry(d.h5path, None, d.spec, d.shape, d.h5path, foreign=True)
    where = libhdf5.locate(f, entry, path, raw.size, {})
    t = torch.empty(d.shape, dtype=d.spec.torch_dtype)
    if t.numel():
        try:
            if isinstance(where, libhdf5.HDF5Read):
                libhdf5.read_hdf5(where.dsid, d.spec.h5_type, t)
            elif isinstance(where, Contiguous):
                raw.pread(where.offset, memoryview(memory.tensor_bytes(t)))
            elif isinstance(where, Chunked):
                ChunkReader(where, raw.pread).read(0, memory.tensor_bytes(t))
        except (*libhdf5.H5_ERRORS, EOFError) as e:
            raise FormatError(f"{path}: key {d.h5path!r}: cannot read the data ({e})") from e
        except Exception as e:  # a chunk that does not decode
            if isinstance(e, TensorStoreError):
                raise
            raise FormatError(f"{path}: key {d.h5path!r}: cannot read the data ({e})") from e
    if d.stride is not None and d.stride != tuple(t.stride()):
        t = _restride(t, d.stride)
    return t


def _restride(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` (row-major) in the memory layout ``stride`` (dense; stride-0 dimensions where
    their values agree, else ``t`` as it is)."""
    zero = [d for d, s in enumerate(stride) if s == 0 and t.shape[d] > 1]
    base = t[tuple(slice(0, 1) if d in zero else slice(None) for d in range(t.dim()))]
    if zero and not torch.equal(base.expand(t.shape), t):
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype)
    out.as_strided(base.shape, stride).copy_(base)
    return out


# ---------------------------------------------------------------------------- the new tree


class _Plan:
    """The new file's containers and leaves, in pre-order: the HDF5 tree, ordered and typed
    by the old layout where it still applies (see the module's docstring)."""

    def __init__(self, old: Layout | None, groups: dict[str, _Group]) -> None:
        self.groups = groups
        self.old: dict[str, Any] = {e.path: e for e in old.entries} if old is not None else {}
        self.children: dict[str, list[str]] = {}  # old path -> old child paths, in saved order
        was_group = {""}  # old containers that were HDF5 groups (a dataset below them)
        for p, e in self.old.items():
            if p:
                self.children.setdefault(p.rpartition("/")[0], []).append(p)
            if isinstance(e, (TensorEntry, ArrayEntry)):
                up = p.rpartition("/")[0] if p else ""
                while up not in was_group:
                    was_group.add(up)
                    up = up.rpartition("/")[0]
        self.was_group = was_group

    def was_stored(self, p: str) -> bool:
        """Whether the old entry at ``p`` was an HDF5 object (a dataset, or a group)."""
        e = self.old[p]
        return isinstance(e, (TensorEntry, ArrayEntry)) or (isinstance(e, Container) and p in self.was_group)

    def nodes(self) -> list[tuple[str, str, Any, Any]]:
        """``(kind, th5 path, key, what)`` in pre-order: kind "group" (what: the HDF5 path or
        None for a kept container of values), "dataset" (what: the HDF5 path), "value"."""
        root = self.old.get("")
        if isinstance(root, (TensorEntry, ArrayEntry)) and set(self.groups[""].names) == {fmt.ROOT_DATASET}:
            return [("dataset", "", None, fmt.ROOT_DATASET)]
        out: list[tuple[str, str, Any, Any]] = []
        self._container("", "", None, "", out)
        return out

    def _container(self, path: str, h5path: str | None, key: Any, old_path: str | None,
                   out: list[tuple[str, str, Any, Any]]) -> None:
        old = self.old.get(old_path) if old_path is not None else None
        kind = old.type if isinstance(old, Container) else "dict"
        meta = old.module_metadata if isinstance(old, Container) else None
        kids: list[tuple[str, str | None, str | None]] = []  # (name, HDF5 path, old path)
        names = self.groups[h5path].names if h5path is not None else []
        seen: set[str] = set()
        present = set(names)  # (a list's `in` made this quadratic: 27 s for 50,000 keys)
        for op in self.children.get(old_path, []) if old_path is not None else []:
            name = op.rpartition("/")[2]
            if h5path is not None and name in present:
                kids.append((name, f"{h5path}/{name}" if h5path else name, op))
                seen.add(name)
            elif not self.was_stored(op) and name not in present:
                kids.append((name, None, op))  # a value, or a container of values only: kept
        kids += [(n, f"{h5path}/{n}" if h5path else n, None) for n in names if n not in seen]
        if kind in ("list", "tuple") and [n for n, _, _ in kids] != [str(i) for i in range(len(kids))]:
            kind, meta = "dict", None  # items added or removed: no longer a sequence
        out.append(("group", path, key, (kind, meta)))
        for name, child_h5, op in kids:
            ckey, cname = self._key(name, op, kind)
            cpath = tree.join(path, cname)
            if child_h5 is None:
                e = self.old[op]
                if isinstance(e, Container):
                    self._container(cpath, None, ckey, op, out)
                else:
                    out.append(("value", cpath, ckey, e.value))
            elif child_h5 in self.groups:
                same = op if op is not None and isinstance(self.old.get(op), Container) else None
                self._container(cpath, child_h5, ckey, same, out)
            else:
                out.append(("dataset", cpath, ckey, child_h5))

    def _key(self, name: str, old_path: str | None, kind: str) -> tuple[Any, str]:
        """The key in its parent (a ``kind`` container) and the escaped link name of a child
        linked as ``name``: the old key where the path is old, else the name unescaped (a name
        tensorstore_h5 would escape, such as ``a%b``, is the key itself, escaped anew)."""
        if kind in ("list", "tuple"):
            return None, name
        old = self.old.get(old_path) if old_path is not None else None
        parent = self.old.get(old_path.rpartition("/")[0]) if old_path else None
        if old is not None and isinstance(parent, Container) and parent.type in ("dict", "OrderedDict"):
            return old.key, name  # (an int, float, bool or None key as it was saved)
        try:
            return tree.unescape(name), name
        except ValueError:
            return name, tree.escape(name)


def _rewrite(path: str, raw: files.RawFile, f: h5py.File, old: Layout | None, compression: Any,
             progress: bool | None, sync: bool) -> Reindexed:
    groups, datasets = _hdf5_tree(f, path)
    plan = _Plan(old, groups)
    nodes = plan.nodes()
    keep = compression == KEEP if isinstance(compression, str) else False
    filters = {p: datasets[h].filter for kind, p, _, h in nodes if kind == "dataset" and datasets[h].filter is not None}
    policy: Any = (lambda key, t: filters.get(key)) if keep and filters else (None if keep else compression)
    tied: dict[int, torch.Tensor] = {}  # HDF5 object address -> its tensor, for datasets of several links

    def leaves() -> Iterator[Container | Leaf]:
        for kind, p, key, what in nodes:
            if kind == "group":
                ctype, meta = what
                yield Container(p, key, ctype, meta)
            elif kind == "value":
                yield Leaf(p, key, what)
            else:
                yield Leaf(p, key, _value(what, p))

    def _value(h5path: str, p: str) -> Any:
        d = datasets[h5path]
        t = tied.get(d.address)
        if t is None:
            t = _read(f, raw, path, d)
            e = plan.old.get(p)
            if isinstance(e, ArrayEntry) and tuple(e.shape) == d.shape and spec_for_numpy(e.dtype) is d.spec:
                return t.numpy().astype(e.dtype, copy=False)
            if isinstance(e, TensorEntry) and tuple(e.shape) == d.shape and e.dtype is d.spec:
                if e.parameter:
                    t = torch.nn.Parameter(t, requires_grad=e.requires_grad)
                elif e.requires_grad and t.is_floating_point():
                    t.requires_grad_(True)
            if d.links > 1:
                tied[d.address] = t
        return t

    new_keys = [p for kind, p, _, _ in nodes if kind != "group"]
    with Writer(path, compression=policy, metadata=dict(old.metadata) if old is not None else {}, progress=progress,
                sync=sync, _encode=few_links([p for _, p, _, _ in nodes])) as w:
        w.expect_bytes(sum(datasets[h].spec.itemsize * int(np.prod(datasets[h].shape, dtype=np.int64))
                           for kind, _, _, h in nodes if kind == "dataset"))
        w.write_tree(leaves())
    tied.clear()
    before = [e.path for e in old.leaves] if old is not None else []
    now = set(new_keys)
    was = set(before)
    return Reindexed(new_keys, [k for k in new_keys if k not in was], [k for k in before if k not in now])
