"""Writing files: the streaming, atomic :class:`Writer` and :func:`save`."""

from __future__ import annotations

import os
import stat
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np
import torch

from . import format as fmt
from . import io, tree
from .compression import Compression, resolve_compression
from .display import Progress
from .dtypes import bits_view, spec_for_name, spec_for_torch
from .errors import UnsupportedTypeError
from .format import ArrayEntry, Container, Entry, TensorEntry, ValueEntry
from .tree import Leaf

__all__ = ["Writer", "save"]

PathLike = str | os.PathLike[str]

PACK_MAX_BYTES = 256
"""Tensors of at most this many bytes (0-d ``step`` counters, tiny buffers) are packed back
to back into one dataset per dtype under ``%packed/`` instead of a dataset each: an HDF5
dataset costs about 100 us to create, a packed tensor about 1 us."""


RELEASE_REPLACED = True
"""Saving over an existing file drops that file's pages from the page cache as the new file
grows (``posix_fadvise(DONTNEED)`` on the old file, in step with the bytes written; the old
file itself is untouched until the rename, and stays intact if the save fails). The new
file's pages then come from memory just freed. Measured on the 2-core VM: writing 2 GB beside
a cached 2 GB file took 5.9-7.6 s into memory the guest had handed back to its hypervisor
(free page reporting), 0.41-0.51 s after dropping the old file's pages (0.08-0.10 s to drop).
Pages still dirty or mapped are not dropped (the kernel only starts their writeback)."""

RELEASE_ALIGN = 2 << 20
"""Released ranges end on multiples of this many bytes: the kernel keeps a cached large folio
(up to 2 MiB on x86-64) that a range covers only in part, so 1 MiB steps dropped nothing."""


def _lcpl() -> h5py.h5p.PropLCID:
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
    return lcpl


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"tensor at key path {path!r} has layout {t.layout}; only dense tensors are stored: call .to_dense() first"
        )
    if t.is_quantized:
        raise UnsupportedTypeError(f"quantized tensor at key path {path!r} cannot be stored; call .dequantize() first")
    if t.is_meta or getattr(t, "is_nested", False):
        raise UnsupportedTypeError(f"tensor at key path {path!r} has no data (meta or nested tensor)")
    spec_for_torch(t.dtype, path)


def _check_array(a: np.ndarray, path: str) -> None:
    if a.dtype.kind not in "biufc" or a.dtype.fields is not None or a.dtype in (np.longdouble, np.clongdouble):
        raise UnsupportedTypeError(
            f"numpy array at key path {path!r} has dtype {a.dtype}; only bool, integer, float and complex arrays are stored"
        )


def prepare(obj: Any, file: str, root: str = "", key: Any = None) -> list[Container | Leaf]:
    """Flatten ``obj`` and check every leaf before anything is written.

    Raises UnsupportedTypeError naming ``file``, the key path and the type.
    """
    try:
        nodes = tree.flatten(obj, root, key)
        for node in nodes:
            if isinstance(node, Leaf):
                if isinstance(node.value, torch.Tensor):
                    _check_tensor(node.value, node.path)
                elif isinstance(node.value, np.ndarray):
                    _check_array(node.value, node.path)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"{file}: {e}; nothing was written") from None
    return nodes


class Writer:
    """Streams values into a new file, atomically.

    Data goes to ``<dir>/.<name>.<uuid>.partial`` beside ``path``; :meth:`close` (or leaving
    the ``with`` block normally) writes the layout and renames the file over ``path``. An
    exception inside the ``with`` block, or :meth:`abort`, removes the partial file and
    leaves any earlier file at ``path`` untouched.

    Example::

        with th5.Writer("ckpt.h5", compression="lz4") as w:
            w["model"] = model.state_dict()
            w["epoch"] = 3

    Args:
        path: the file to create or replace.
        compression: None (contiguous, uncompressed), a preset name, an hdf5plugin filter,
            or a callable ``(key_path, tensor) -> preset | filter | None``.
        metadata: JSON-serialisable ``str`` -> value mapping, read back as ``Store.metadata``.
        progress: show a progress bar (None: automatic, see :func:`tensorstore_h5.save`).
        chunk_bytes: target chunk size in bytes of compressed datasets.

    Raises:
        UnsupportedTypeError: for a value that cannot be stored (nothing of it is written).
        ValueError: for a malformed or repeated key path.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        compression: Compression = None,
        metadata: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._compression = resolve_compression(compression, chunk_bytes)
        self._metadata = dict(metadata or {})
        fmt.check_metadata(self._metadata)
        head, name = os.path.split(os.path.abspath(self.path))
        self._tmp = os.path.join(head, f".{name}.{uuid.uuid4().hex}.partial")
        self._replaced = _Replaced(self.path)
        try:
            self._file = h5py.File(self._tmp, "w")
        except BaseException:
            self._replaced.close()
            raise
        self._finalizer = weakref.finalize(self, _discard, self._file, self._tmp, self._replaced)
        self._entries: list[Entry] = [Container("", None, "dict")]
        self._index: dict[str, Entry] = {"": self._entries[0]}
        self._aliases: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], str]] = {}
        self._lcpl = _lcpl()
        self._packs: dict[str, list[bytes]] = {}
        self._pack_sizes: dict[str, int] = {}
        self._progress = Progress(progress, desc=f"saving {name}")

    # -- public --------------------------------------------------------------------------

    def __setitem__(self, key: str, value: Any) -> None:
        self.write(key, value)

    def write(self, key: str, value: Any) -> None:
        """Write ``value`` (a tensor, array, plain value, or nested container) at key path
        ``key`` (escaped link names joined by ``/``, as ``Store.keys()`` shows them).
        Missing parent containers are created as dicts."""
        self._check_open()
        names = tree.split(key)
        if not names:
            raise ValueError(f"{self.path}: the key path must not be empty (use th5.save for a whole object)")
        try:
            keys = [tree.unescape(n) for n in names]
        except ValueError as e:
            raise ValueError(f"{self.path}: invalid key path {key!r}: {e}; escape '/' and '%' in keys with th5.escape") from e
        if key in self._index:
            raise ValueError(f"{self.path}: key path {key!r} was already written")
        nodes = prepare(value, self.path, key, keys[-1])
        self._make_parents(names[:-1], keys[:-1], key)
        self._write_nodes(nodes)

    def close(self) -> None:
        """Write the layout, close the file, and move it into place (idempotent)."""
        if self._file is None:
            return
        try:
            self._write_packs()
            fmt.write_layout(self._file, self._entries, self._metadata)
            self._file.close()
            _replace(self._tmp, self.path, self._replaced)
        except BaseException:
            self.abort()
            raise
        self._file = None
        self._finalizer.detach()
        self._progress.close()

    def abort(self) -> None:
        """Discard everything written; any earlier file at ``path`` is left as it was."""
        if self._file is not None:
            self._file = None
            self._finalizer()
            self._progress.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = "closed" if self._file is None else f"{len(self._entries) - 1} entries"
        return f"<tensorstore_h5.Writer {self.path!r} ({state})>"

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: the writer is closed")

    def _make_parents(self, names: list[str], keys: list[str], key: str) -> None:
        path = ""
        for name, k in zip(names, keys):
            path = tree.join(path, name)
            entry = self._index.get(path)
            if entry is None:
                self._add(Container(path, k, "dict"))
            elif not (isinstance(entry, Container) and entry.type in ("dict", "OrderedDict")):
                raise ValueError(f"{self.path}: cannot write {key!r}: {path!r} is not a dict")

    def write_root(self, obj: Any) -> None:
        """Write ``obj`` as the whole file (what :func:`save` does); only before any other write."""
        self._write_root(prepare(obj, self.path))

    def _write_root(self, nodes: list[Container | Leaf]) -> None:
        self._check_open()
        if len(self._entries) > 1:
            raise ValueError(f"{self.path}: write_root must come before any other write")
        self._progress.total(sum(_nbytes(n.value) for n in nodes if isinstance(n, Leaf)))
        self._entries.clear()
        self._index.clear()
        self._write_nodes(nodes)

    def _add(self, entry: Entry) -> None:
        self._entries.append(entry)
        self._index[entry.path] = entry

    def _write_nodes(self, nodes: list[Container | Leaf]) -> None:
        for node in nodes:
            if isinstance(node, Container):
                self._add(node)
            elif isinstance(node.value, torch.Tensor):
                self._add(self._write_tensor(node.path, node.key, node.value))
            elif isinstance(node.value, np.ndarray):
                self._add(self._write_array(node.path, node.key, node.value))
            else:
                self._add(ValueEntry(node.path, node.key, node.value))

    def _write_tensor(self, path: str, key: Any, value: torch.Tensor) -> TensorEntry:
        t = value.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        spec = spec_for_torch(t.dtype, path)
        shape = tuple(t.shape)
        stride = None if t.is_contiguous() else tuple(t.stride())
        requires_grad = value.requires_grad if isinstance(value, torch.nn.Parameter) else None
        dataset = path or fmt.ROOT_DATASET
        alias_key = self._alias_key(t)
        if alias_key is not None:
            hit = self._aliases.get(alias_key)
            if hit is not None and hit[0]() is not None:
                orig = self._index[hit[1]]
                assert isinstance(orig, TensorEntry)
                if orig.packed is not None:
                    return TensorEntry(path, key, spec, shape, orig.dataset, stride, orig.path, requires_grad, packed=orig.packed)
                self._file[dataset] = self._file[orig.dataset]  # hard link: one copy of the data
                return TensorEntry(path, key, spec, shape, dataset, stride, orig.path, requires_grad)
            self._aliases[alias_key] = (weakref.ref(value), path)
        nbytes = t.numel() * spec.itemsize
        if nbytes <= PACK_MAX_BYTES:
            return self._pack(path, key, t, spec, shape, stride, requires_grad)
        entry = TensorEntry(path, key, spec, shape, dataset, stride, None, requires_grad)
        space = h5py.h5s.create(h5py.h5s.SCALAR) if not shape else h5py.h5s.create_simple(shape)
        dcpl = self._compression.dcpl(path, t, spec)
        dsid = h5py.h5d.create(self._file.id, dataset.encode("utf-8"), spec.h5_type, space, dcpl=dcpl, lcpl=self._lcpl)
        self._replaced.release(nbytes)
        io.write_tensor(dsid, spec.h5_type, t)
        fmt.write_tensor_attrs(dsid, entry)
        self._progress.update(entry.nbytes)
        return entry

    def _pack(self, path: str, key: Any, t: torch.Tensor, spec: Any, shape: tuple[int, ...],
              stride: tuple[int, ...] | None, requires_grad: bool | None) -> TensorEntry:
        """Append a small tensor's logical bytes to its dtype's pack (written at close)."""
        data = bytes(io.tensor_bytes(bits_view(t).contiguous().cpu())) if t.numel() else b""
        used = self._pack_sizes.get(spec.name, 0)
        self._packs.setdefault(spec.name, []).append(data)
        self._pack_sizes[spec.name] = used + len(data)
        self._progress.update(len(data))
        dataset = f"{fmt.PACK_GROUP}/{spec.name}"
        return TensorEntry(path, key, spec, shape, dataset, stride, None, requires_grad, packed=used // spec.itemsize)

    def _write_packs(self) -> None:
        for name, chunks in self._packs.items():
            spec = spec_for_name(name)
            assert spec is not None
            data = b"".join(chunks)
            values = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            space = h5py.h5s.create_simple((len(data) // spec.itemsize,))
            dsid = h5py.h5d.create(self._file.id, f"{fmt.PACK_GROUP}/{name}".encode(), spec.h5_type, space,
                                   dcpl=dcpl, lcpl=self._lcpl)
            io.write_hdf5(dsid, spec.h5_type, values)
            fmt.write_pack_attrs(dsid, spec)
        self._packs.clear()

    def _write_array(self, path: str, key: Any, value: np.ndarray) -> ArrayEntry:
        dataset = path or fmt.ROOT_DATASET
        self._replaced.release(value.nbytes)
        self._file.create_dataset(dataset, data=value)
        self._progress.update(value.nbytes)
        return ArrayEntry(path, key, value.dtype, tuple(value.shape), dataset)

    @staticmethod
    def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
        if t.numel() == 0:
            return None
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    return 0


class _Replaced:
    """The file a save will replace: held open from the start, released from the page cache
    as the new file grows (:data:`RELEASE_REPLACED`), closed off the caller's thread after the
    rename (dropping the last reference to a large cached file frees its pages, which costs
    about as much as writing it)."""

    def __init__(self, path: str) -> None:
        self.released = 0  # bytes of the old file dropped from the cache (a multiple of RELEASE_ALIGN)
        self.wanted = 0    # bytes of the new file written so far
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.fd = None
            return
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            self.close()

    def release(self, nbytes: int) -> None:
        """Drop as much of the old file from the page cache as the new one is about to take:
        ``nbytes`` more, rounded up to :data:`RELEASE_ALIGN` (best effort)."""
        if self.fd is None or not RELEASE_REPLACED or nbytes <= 0 or not hasattr(os, "posix_fadvise"):
            return
        self.wanted += nbytes
        end = -(-self.wanted // RELEASE_ALIGN) * RELEASE_ALIGN
        if end <= self.released:
            return
        try:
            os.posix_fadvise(self.fd, self.released, end - self.released, os.POSIX_FADV_DONTNEED)
        except OSError:
            return
        self.released = end

    def close(self, background: bool = False) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if background:
            threading.Thread(target=os.close, args=(fd,), name="tensorstore_h5-release", daemon=True).start()
        else:
            os.close(fd)


def _replace(tmp: str, path: str, replaced: _Replaced) -> None:
    """``os.replace(tmp, path)``, then let go of the old file off the caller's thread."""
    try:
        os.replace(tmp, path)
    finally:
        replaced.close(background=True)


def _discard(f: h5py.File, tmp: str, replaced: _Replaced) -> None:
    try:
        f.close()
    finally:
        replaced.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def save(
    obj: Any,
    path: PathLike,
    *,
    compression: Compression = None,
    metadata: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Save a tensor or a nested dict/list/tuple of tensors and plain values to ``path``.

    The file is written beside ``path`` and renamed over it at the end: a failure leaves
    any earlier file intact. Tensors that are the same view of one storage are stored once.

    Example::

        th5.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, "ckpt.h5")

    Args:
        obj: what to save.
        path: destination file.
        compression: see :class:`Writer`.
        metadata: JSON-serialisable ``str`` -> value mapping (``Store.metadata``).
        progress: True/False force a progress bar by bytes; None shows one when the
            tensors total over 256 MiB and the output is interactive.
        chunk_bytes: target chunk size in bytes of compressed datasets.

    Raises:
        UnsupportedTypeError: (a TypeError) naming the key path and type of a value that
            cannot be stored without pickle; nothing is written.
    """
    nodes = prepare(obj, os.fspath(path))
    with Writer(path, compression=compression, metadata=metadata, progress=progress, chunk_bytes=chunk_bytes) as w:
        w._write_root(nodes)
