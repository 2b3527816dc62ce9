"""Writing files: the streaming, atomic :class:`Writer` and :func:`save` (format 2).

A save writes ``<dir>/.<name>.<uuid>.partial`` beside the target, holding an exclusive
``flock`` on it for its whole life, then writes the layout, the header, and renames the file
over the target. A save that fails or is killed leaves any earlier file untouched; a later
save of the same target removes the temporaries that no live process holds any more.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import glob
import math
import os
import shutil
import tempfile
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import h5py
import numpy as np
import torch

from ..codecs import presets
from ..codecs.presets import Compression, resolve_compression
from ..display import Progress
from ..errors import TensorStoreError, UnsupportedTypeError, WriteError
from ..format import checksum, hdf5meta, tree
from ..format import layout as fmt
from ..format.dtypes import bits_view, spec_for_torch
from ..format.layout import ArrayEntry, Chunked, Container, Contiguous, Entry, TensorEntry, ValueEntry
from ..format.slicing import has_gaps
from ..format.tree import Leaf
from ..storage import files, libhdf5, memory, remote

__all__ = ["Writer", "save", "sweep_partials"]

PathLike = str | os.PathLike[str]

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


GATHER_BYTES = 64 * 1024
"""With :data:`ENCODE_METADATA`, the data of contiguous tensors under this many bytes is
gathered in memory and written 1 MiB at a time (one ``pwrite`` per tensor was a sixth of the
time of saving 6,000 small tensors)."""

ENCODE_METADATA = True
"""Files without compression get their HDF5 metadata from :mod:`tensorstore_h5.format.hdf5meta`,
written after the data (2,000 groups and 6,000 small datasets: ~25 ms instead of libhdf5's
~250-300 ms). False: libhdf5 writes it, as it does for files with compressed datasets."""

ENCODED_LINKS = hdf5meta.MAX_DENSE_LINKS
"""The most links (2**24) of one group in a file whose HDF5 metadata hdf5meta encodes: it
indexes a group of more than :data:`hdf5meta.DENSE_LINKS` links by a B-tree of name hashes
(as many levels of 512-byte nodes as libhdf5 would make) over a fractal heap, as libhdf5
does. :func:`save` of a tree with a bigger group lets libhdf5 write the metadata instead;
:class:`Writer` used key by key keeps such a group's links in its header."""


def _lcpl() -> h5py.h5p.PropLCID:
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
    return lcpl


MAX_DIMS = 32
"""The most dimensions a stored tensor or array has: HDF5's own limit (``H5S_MAX_RANK``); no
HDF5 reader opens a dataspace of more."""


def _too_many_dims(ndim: int, what: str, path: str) -> None:
    if ndim > MAX_DIMS:
        raise UnsupportedTypeError(
            f"{what} at key path {path!r} has {ndim} dimensions; HDF5 datasets have at most {MAX_DIMS} (no HDF5 "
            "reader would open the file): reshape it before saving and back after loading"
        )


def _plain(t: torch.Tensor, path: str) -> torch.Tensor:
    """``t`` as a plain strided tensor with data, or UnsupportedTypeError naming the key.

    ``nn.Parameter`` and subclasses whose data is an ordinary storage are stored as their
    plain data (the subclass is not kept); wrapper subclasses (no storage of their own, such
    as DTensor or FakeTensor), zero tensors, meta, nested, sparse and quantized tensors are
    refused.
    """
    kind = type(t).__name__
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        dispatch = getattr(type(t), "__torch_dispatch__", None)
        if dispatch is not None and dispatch is not torch.Tensor.__torch_dispatch__:
            raise UnsupportedTypeError(
                f"tensor at key path {path!r} is a {kind}, a tensor subclass that wraps other data; store its plain "
                "data instead (for a DTensor, .full_tensor())"
            )
    if t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"tensor at key path {path!r} has layout {t.layout}; only dense tensors are stored: call .to_dense() first"
        )
    if t.is_quantized:
        raise UnsupportedTypeError(f"quantized tensor at key path {path!r} cannot be stored; call .dequantize() first")
    if t.is_meta or getattr(t, "is_nested", False):
        raise UnsupportedTypeError(f"tensor at key path {path!r} ({kind}) has no data (a meta or nested tensor)")
    if t._is_zerotensor():
        raise UnsupportedTypeError(f"tensor at key path {path!r} is a zero tensor (no storage); store torch.zeros(...) instead")
    _too_many_dims(t.dim(), "tensor", path)
    spec_for_torch(t.dtype, path)
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError) as e:
        raise UnsupportedTypeError(f"tensor at key path {path!r} ({kind}) has no storage to save ({e})") from None
    return t


def _check_array(a: np.ndarray, path: str) -> None:
    _too_many_dims(a.ndim, "numpy array", path)
    if a.dtype.kind not in "biufc" or a.dtype.fields is not None or a.dtype in (np.longdouble, np.clongdouble):
        raise UnsupportedTypeError(
            f"numpy array at key path {path!r} has dtype {a.dtype}; only bool, integer, float and complex arrays are stored"
        )


_TORCH_MARKS = frozenset({"persistent", "_is_buffer", "_is_param"})  # torch's own marks (Buffer; Parameter of a subclass)


def _python_attributes(t: torch.Tensor, path: str) -> None:
    """Refuse a tensor that carries Python attributes (``t.foo = ...``, which ``torch.save``
    keeps): the format stores tensors' values, and dropping the attributes without a word
    would lose what the caller put there."""
    names = t.__dict__.keys() - _TORCH_MARKS  # torch.nn.Buffer(t) returns a plain tensor marked so
    if names:
        shown = ", ".join(sorted(map(repr, names))[:5]) + (", ..." if len(names) > 5 else "")
        raise UnsupportedTypeError(
            f"tensor at key path {path!r} has Python attributes ({shown}), which tensorstore_h5 does not store; "
            "save t.detach() (a tensor without them, as model.state_dict() gives) and keep the attributes "
            "elsewhere, e.g. as plain values beside it"
        )


def _check_leaf(value: Any, path: str) -> None:
    """Raise UnsupportedTypeError naming ``path`` unless ``value`` is a storable leaf."""
    if isinstance(value, torch.Tensor):
        _plain(value, path)
        if value.__dict__:
            _python_attributes(value, path)
    elif isinstance(value, np.ndarray):
        _check_array(value, path)
    else:
        tree.encode_value(value, path)  # containers are not values: refused here too


def prepare(obj: Any, file: str, root: str = "", key: Any = None) -> list[Container | Leaf]:
    """Flatten ``obj`` and check every leaf before anything is written.

    Raises UnsupportedTypeError naming ``file``, the key path and the type.
    """
    try:
        nodes = tree.flatten(obj, root, key)  # checks plain values
        for node in nodes:
            if isinstance(node, Leaf) and isinstance(node.value, (torch.Tensor, np.ndarray)):
                _check_leaf(node.value, node.path)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"{file}: {e}; nothing was written") from None
    return nodes


def sweep_partials(path: PathLike) -> list[str]:
    """Remove the temporaries that earlier saves of ``path`` left behind (killed or crashed
    processes) and that no live process holds; returns the names removed.

    A save holds an exclusive ``flock`` on its temporary from creation to rename, and the
    kernel releases it when the process dies, so a temporary whose lock can be taken is stale.
    Only regular files are looked at: a FIFO, device, socket, directory or symlink named like
    a temporary is never opened (``lstat``, then :func:`storage.files.open_regular`, whose
    open cannot block), so none of them can hold up a save.
    """
    head, name = os.path.split(os.path.abspath(os.fspath(path)))
    removed = []
    for stale in glob.glob(os.path.join(glob.escape(head), f".{glob.escape(name)}.*.partial")):
        try:
            if not stat.S_ISREG(os.lstat(stale).st_mode):
                continue  # not a temporary of ours
            fd = files.open_regular(stale, "temporary file")
        except (OSError, TensorStoreError):  # gone meanwhile, not permitted, or swapped for something else
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(stale, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(stale)
                removed.append(stale)
        except OSError:
            pass  # held by a live save, or gone meanwhile
        finally:
            os.close(fd)
    return removed


def _create_partial(path: str, hdf5: bool = True) -> tuple[str, int, h5py.File | None]:
    """A new temporary beside ``path``, created and locked: ``(name, descriptor, file)``, the
    file an h5py File when ``hdf5`` (libhdf5 writes the metadata), else None (an empty file,
    its metadata encoded by :mod:`tensorstore_h5.format.hdf5meta`).

    HDF5 creates the file itself: handing it an existing (even empty) file to truncate makes
    ext4 flush the whole file when HDF5 closes it (its auto_da_alloc heuristic for files
    replaced by truncation: 0.5 s for 2 GB here). A sweep may remove the new file before it
    is locked; then another name is tried.
    """
    head, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(head):
        raise FileNotFoundError(f"{path}: the directory {head!r} does not exist")
    for _ in range(5):
        tmp = os.path.join(head, f".{name}.{uuid.uuid4().hex}.partial")
        try:
            if hdf5:
                f = _h5_create(tmp)
            else:
                f = None
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))
        except PermissionError as e:
            raise PermissionError(f"{path}: cannot create a file in {head!r} (permission denied); nothing was written") from e
        except OSError as e:
            if e.errno == errno.EROFS or "Read-only file system" in str(e):
                raise PermissionError(f"{path}: {head!r} is on a read-only file system; nothing was written") from e
            if e.errno in (errno.EACCES, errno.EPERM) or "Permission denied" in str(e):
                raise PermissionError(f"{path}: cannot create a file in {head!r} (permission denied); nothing was written") from e
            raise
        try:
            fd = os.open(tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep looks at it
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd, f
            os.close(fd)
        except FileNotFoundError:
            pass
        if f is not None:
            f.close()  # swept between creation and lock: take another name
    raise WriteError(f"{path}: could not create a temporary file beside it")


def _h5_create(tmp: str) -> h5py.File:
    """The HDF5 part of a format-2 file: 4096-byte user block, library-version bounds 1.10
    (checksummed metadata), 64-byte alignment of every allocation, no HDF5 file locking (the
    writer holds its own lock), and file space allocated by HDF5's aggregators alone.

    Without a free-space manager, the gaps that aligning each small dataset leaves are not
    tracked (nothing is freed in a file written once): creating 2,000 groups and 6,000 small
    datasets took 230-250 ms instead of 450-530 ms, the file 448 bytes longer."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_userblock(fmt.USERBLOCK)
    fcpl.set_file_space_strategy(h5py.h5f.FSPACE_STRATEGY_AGGR, False, 1)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_V110)
    fapl.set_alignment(1, fmt.ALIGNMENT)
    fapl.set_file_locking(False, True)
    fapl.set_fclose_degree(h5py.h5f.CLOSE_STRONG)
    return h5py.File(h5py.h5f.create(tmp.encode(), h5py.h5f.ACC_EXCL, fcpl=fcpl, fapl=fapl))


class Writer:
    """Streams values into a new file, atomically.

    Data goes to ``<dir>/.<name>.<uuid>.partial`` beside ``path``; :meth:`close` (or leaving
    the ``with`` block normally) writes the layout and header and renames the file over
    ``path``. Without compression, the data of each tensor is written at the next 64-byte
    boundary and the HDF5 metadata, encoded by :mod:`tensorstore_h5.format.hdf5meta`, after it all
    at close; with compression (and for :func:`save` of a tree with a group of more than
    :data:`ENCODED_LINKS` keys), libhdf5 creates each dataset as it is written. An exception
    inside the ``with`` block, or :meth:`abort`, removes the partial file and leaves any
    earlier file at ``path`` untouched. Temporaries of ``path`` left by killed saves are
    removed when the writer starts (see :func:`sweep_partials`).

    Example::

        with th5.Writer("ckpt.h5", compression="lz4") as w:
            w["model"] = model.state_dict()
            w["epoch"] = 3

    Args:
        path: the file to create or replace.
        compression: None (contiguous, uncompressed), a preset name, an hdf5plugin
            ``Bitshuffle`` or ``Blosc2`` filter, or a callable ``(key_path, tensor) ->
            preset | filter | None``.
        metadata: JSON-serialisable ``str`` -> value mapping, read back as ``Store.metadata``.
        progress: show a progress bar (None: automatic, see :func:`tensorstore_h5.save`).
        chunk_bytes: target chunk size in bytes of compressed datasets.
        sync: ``fsync`` the file before the rename and its directory after it.
        storage_options: for a URL target, passed to fsspec.
        direct: write the data of tensors of 1 MiB or more with ``O_DIRECT``, bypassing the
            page cache (:class:`tensorstore_h5.storage.files.DirectWrites`): faster where fresh page-cache
            memory is slow to come by (VMs) and leaves the cache to the training job, slower
            where the disk is slower than memory. None (default): when ``sync`` is set (the bytes
            must reach the disk before the save returns anyway). Where the file system refuses
            ``O_DIRECT`` the writes are buffered.

    A URL or a file object as ``path``: the file is written in a temporary directory and
    uploaded (copied) whole when the writer closes; object stores show the object only once
    its upload completes, and other file systems get it under a temporary name renamed into
    place, so a failed save leaves nothing at the URL.

    Raises:
        UnsupportedTypeError: for a value that cannot be stored (nothing of it is written).
        ValueError: for a malformed or repeated key path.
        WriteError: the file cannot be written (disk full, I/O error); nothing changes at ``path``.
        PermissionError / FileNotFoundError: the directory cannot be written / does not exist.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        compression: Compression = None,
        metadata: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        chunk_bytes: int | None = None,
        sync: bool = False,
        storage_options: dict[str, Any] | None = None,
        direct: bool | None = None,
        _encode: bool = True,  # False: libhdf5 writes the HDF5 metadata (see few_links)
    ) -> None:
        local = remote.local_path(path)
        self._upload: tuple[Any, dict[str, Any] | None] | None = None
        self._staging: str | None = None
        if local is None:  # a URL or a file object: written here first, uploaded whole at the end
            if not (remote.is_url(path) or remote.is_fileobj(path)):
                raise TypeError(f"expected a path, a URL or a writable binary file object, got {type(path).__name__}")
            self.path = path if isinstance(path, str) else remote.FileObjSource.name_of(path)
            self._staging = tempfile.mkdtemp(prefix="tensorstore_h5-upload-")
            weakref.finalize(self, shutil.rmtree, self._staging, True)
            self._upload = (path, storage_options)
            local = os.path.join(self._staging, "checkpoint.h5")
        else:
            self.path = local
        self._target = local
        self._compression = resolve_compression(compression, chunk_bytes)
        self._metadata = dict(metadata or {})
        fmt.check_metadata(self._metadata)
        self._sync = sync
        sweep_partials(self._target)
        # Uncompressed files get their HDF5 metadata from hdf5meta, written after the data;
        # compressed datasets need libhdf5 (chunk indexes).
        encode = _encode and ENCODE_METADATA and self._compression.choice is None
        self._meta = hdf5meta.Builder(fmt.USERBLOCK) if encode else None
        self._eof = fmt.USERBLOCK + fmt.ALIGNMENT  # the superblock, then data on ALIGNMENT boundaries
        self._gathered = bytearray()  # small tensors' data, to be written at self._gathered_at
        self._gathered_at = 0
        try:
            self._tmp, self._fd, file = _create_partial(self._target, hdf5=self._meta is None)
        except (PermissionError, FileNotFoundError, WriteError):
            raise
        except OSError as e:
            raise self._failed("", e) from e
        self._file: h5py.File | None = file
        self._open = True
        self._replaced = _Replaced(self._target)
        self._direct: files.DirectWrites | None = None
        self._finalizer = weakref.finalize(self, _discard, self._file, self._tmp, self._fd, self._replaced)
        if (sync if direct is None else direct):  # O_DIRECT by default only where the bytes must reach the disk
            self._direct = files.DirectWrites.open(self._tmp, self._fd)
        self._entries: list[Entry] = [Container("", None, "dict")]
        self._index: dict[str, Entry] = {"": self._entries[0]}
        self._aliases: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], str]] = {}
        self._lcpl = _lcpl()
        self._plain = hdf5meta.contiguous_dcpl()
        self._spaces: dict[tuple[int, ...], Any] = {}
        self._progress = Progress(progress, desc=f"saving {os.path.basename(self.path)}")

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
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            memory.streamed(value.nbytes)  # what the caller freed since the last one goes back (see memory.streamed)
        nodes = prepare(value, self.path, key, keys[-1])
        self._make_parents(names[:-1], keys[:-1], key)
        self._write_nodes(nodes)

    def close(self) -> None:
        """Write the layout and header, close the file, and move it into place (idempotent)."""
        if not self._open:
            return
        if self._direct is not None:
            self._direct.close()
        try:
            try:
                with memory.gc_paused():
                    text = fmt.layout_text(self._entries, self._metadata)
                if self._meta is not None:
                    with memory.gc_paused():
                        offset = self._finish_metadata(text)
                else:
                    assert self._file is not None
                    fmt.write_root_attrs(self._file, fmt.version_for(self._entries))
                    dsid = h5py.h5d.create(self._file.id, fmt.LAYOUT_DATASET.encode(), h5py.h5t.STD_U8LE,
                                           h5py.h5s.create_simple((len(text),)), dcpl=hdf5meta.contiguous_dcpl())
                    dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.frombuffer(text, dtype=np.uint8))
                    offset = dsid.get_offset()
                    del dsid
                    self._file.close()
            except OSError as e:
                raise self._failed("", e) from e
            size = os.fstat(self._fd).st_size
            header = fmt.Header(fmt.version_for(self._entries), size, offset, len(text), checksum.digest(text))
            os.pwrite(self._fd, fmt.pack_header(header), 0)
            if self._sync:
                os.fsync(self._fd)
            _replace(self._tmp, self._target, self._replaced, self._sync)
        except BaseException:
            self.abort()
            raise
        self._file = None
        self._open = False
        self._finalizer.detach()
        os.close(self._fd)
        self._progress.close()
        if self._upload is not None:
            target, options = self._upload
            try:
                remote.upload(self._target, target, options)
            finally:
                self._clean_staging()

    def _clean_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def abort(self) -> None:
        """Discard everything written; any earlier file at ``path`` is left as it was."""
        if self._open:
            self._file = None
            self._open = False
            if self._direct is not None:
                self._direct.close()
            self._finalizer()
            self._progress.close()
        self._clean_staging()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = "closed" if not self._open else f"{len(self._entries) - 1} entries"
        return f"<tensorstore_h5.Writer {self.path!r} ({state})>"

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._open:
            raise ValueError(f"{self.path}: the writer is closed")

    def _finish_metadata(self, text: bytes) -> int:
        """Write the layout text, then the HDF5 metadata (:mod:`hdf5meta`) after it and the
        superblock at the end of the user block; returns the layout's offset."""
        assert self._meta is not None
        self._flush_gathered()
        at = _aligned(self._eof)
        files.pwrite_all(self._fd, text, at)
        self._meta.dataset(fmt.LAYOUT_DATASET, h5py.h5t.STD_U8LE, (len(text),), at, len(text))
        self._meta.root_attrs(fmt.root_attrs())
        start = _aligned(at + len(text))
        blob, root = self._meta.encode(start)
        files.pwrite_all(self._fd, blob, start)
        files.pwrite_all(self._fd, self._meta.superblock(root, start + len(blob)), fmt.USERBLOCK)
        return at

    def _failed(self, key: str, e: OSError) -> WriteError:
        """The error for an I/O failure while writing ``key`` (the save is abandoned)."""
        head = os.path.dirname(os.path.abspath(self._target))
        reason = str(e).split(" (", 1)[0] or type(e).__name__
        try:
            st = os.statvfs(head)
            if st.f_bavail * st.f_frsize < 2**20 or getattr(e, "errno", None) == errno.ENOSPC:
                reason = "no space left on the device"
        except OSError:
            pass
        where = f" key {key!r}" if key else ""
        return WriteError(f"{self.path}: cannot write{where} ({reason}); the save was abandoned and nothing "
                          f"at {self.path!r} was changed")

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

    def expect_bytes(self, nbytes: int) -> None:
        """Announce how many bytes of tensor data the writes will bring (the progress bar's total)."""
        self._progress.total(nbytes)

    def write_tree(self, nodes: Iterable[Container | Leaf]) -> None:
        """Write a whole tree given as its containers and leaves in pre-order (root first, as
        ``tree.flatten`` makes them), consuming them one at a time: a tree streamed from
        another file is never held in memory whole. Only before any other write.

        Raises UnsupportedTypeError for a leaf that cannot be stored (then nothing of this
        writer's file is kept: abort it)."""
        self._check_open()
        if len(self._entries) > 1:
            raise ValueError(f"{self.path}: write_tree must come before any other write")
        self._entries.clear()
        self._index.clear()
        for node in nodes:
            if isinstance(node, Leaf):
                try:
                    _check_leaf(node.value, node.path)
                except UnsupportedTypeError as e:
                    raise UnsupportedTypeError(f"{self.path}: {e}") from None
            self._write_nodes([node])
            del node  # not held while the next one is read

    def _write_root(self, nodes: list[Container | Leaf]) -> None:
        self._check_open()
        if len(self._entries) > 1:
            raise ValueError(f"{self.path}: write_root must come before any other write")
        if self._progress.may_show:  # counting tied tensors once costs a lookup per tensor
            self._progress.total(_unique_nbytes(n.value for n in nodes if isinstance(n, Leaf)))
        self._entries.clear()
        self._index.clear()
        self._write_nodes(nodes)

    def _add(self, entry: Entry) -> None:
        self._entries.append(entry)
        self._index[entry.path] = entry

    def _write_nodes(self, nodes: list[Container | Leaf]) -> None:
        with memory.gc_paused():  # thousands of entries form no cycle: 6,000 small tensors saved 25% faster
            self._write_each(nodes)

    def _write_each(self, nodes: list[Container | Leaf]) -> None:
        small = self._meta is not None  # small plain tensors may take _write_small
        for node in nodes:
            try:
                if isinstance(node, Container):
                    self._add(node)
                elif isinstance(node.value, torch.Tensor):
                    entry = self._write_small(node.path, node.key, node.value) if small else None
                    self._add(entry or self._write_tensor(node.path, node.key, node.value))
                elif isinstance(node.value, np.ndarray):
                    self._add(self._write_array(node.path, node.key, node.value))
                else:
                    self._add(ValueEntry(node.path, node.key, node.value))
            except OSError as e:
                raise self._failed(node.path, e) from e

    def _write_small(self, path: str, key: Any, t: torch.Tensor) -> TensorEntry | None:
        """:meth:`_write_tensor` of a small contiguous plain CPU tensor that needs no grad, when
        hdf5meta writes the metadata: its bytes copied into the gathered writes and hashed as one
        block, with a quarter of the general path's checks and calls (most of a checkpoint of
        many small tensors, such as an optimizer's steps); None for any other tensor."""
        if type(t) is not torch.Tensor or t.requires_grad or not t.is_cpu:
            return None
        nbytes = t.nbytes
        if not 0 < nbytes < GATHER_BYTES or nbytes > checksum.HASH_BLOCK or not t.is_contiguous() or t.is_conj() \
                or t.is_neg():
            return None
        alias_key = self._alias_key(t)
        if alias_key in self._aliases:
            return None  # maybe another name of a tensor written before: the general path links it
        self._aliases[alias_key] = (weakref.ref(t), path)
        spec = spec_for_torch(t.dtype, path)
        shape = tuple(t.shape)
        data = ctypes.string_at(t.data_ptr(), nbytes)
        at = _aligned(self._eof)
        self._replaced.release(nbytes)
        self._gather(data, at)
        self._eof = at + nbytes
        dataset = path or fmt.ROOT_DATASET
        entry = TensorEntry(path, key, spec, shape, dataset, extent=Contiguous(at, nbytes, (checksum.digest(data),)))
        self._meta.dataset(dataset, spec.h5_type, shape, at, nbytes, fmt.dataset_attrs(entry))  # type: ignore[union-attr]
        self._progress.update(nbytes)
        return entry

    def _write_tensor(self, path: str, key: Any, value: torch.Tensor) -> TensorEntry:
        t = value if type(value) is torch.Tensor and not value.requires_grad else value.detach()
        if type(t) is not torch.Tensor:
            t = t.as_subclass(torch.Tensor)
        alias_key = self._alias_key(t)  # of the tensor itself: resolving conj/neg below makes a temporary copy
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        spec = spec_for_torch(t.dtype, path)
        shape = tuple(t.shape)
        stride = None if t.is_contiguous() or has_gaps(shape, tuple(t.stride())) else tuple(t.stride())
        parameter = type(value) is not torch.Tensor and isinstance(value, torch.nn.Parameter)
        requires_grad = bool(value.requires_grad)
        dataset = path or fmt.ROOT_DATASET
        if alias_key is not None:
            hit = self._aliases.get(alias_key)
            if hit is not None and hit[0]() is not None:
                orig = self._index[hit[1]]
                assert isinstance(orig, TensorEntry)
                if self._meta is not None:
                    self._meta.hard_link(dataset, orig.dataset)
                else:  # hard link: one copy of the data
                    self._file[dataset] = self._file[orig.dataset]  # type: ignore[index]
                return TensorEntry(path, key, spec, shape, orig.dataset, stride, orig.path, parameter, requires_grad,
                                   extent=orig.extent)
            self._aliases[alias_key] = (weakref.ref(value), path)
        dcpl = self._compression.dcpl(path, t, spec) or self._plain
        dsid, extent = self._write_data(dataset, spec.h5_type, shape, t, spec.itemsize, dcpl)
        entry = TensorEntry(path, key, spec, shape, dataset, stride, None, parameter, requires_grad, extent=extent)
        if self._meta is not None:
            attrs = fmt.dataset_attrs(entry)
            if attrs:
                self._meta.attrs(dataset, attrs)
        else:
            fmt.write_dataset_attrs(dsid, entry)
        self._progress.update(entry.nbytes)
        return entry

    def _write_array(self, path: str, key: Any, value: np.ndarray) -> ArrayEntry:
        dataset = path or fmt.ROOT_DATASET
        data = np.ascontiguousarray(value)
        bits = torch.from_numpy(data.reshape(-1).view(np.uint8)) if data.size else torch.empty(0, dtype=torch.uint8,
                                                                                                 device="cpu")
        shape = tuple(value.shape)
        _, extent = self._write_data(dataset, h5py.h5t.py_create(value.dtype), shape, bits, value.dtype.itemsize,
                                     self._plain)
        self._progress.update(value.nbytes)
        return ArrayEntry(path, key, value.dtype, shape, dataset, extent)

    def _write_data(self, dataset: str, h5type: Any, shape: tuple[int, ...], t: torch.Tensor, itemsize: int,
                    dcpl: h5py.h5p.PropDCID) -> tuple[h5py.h5d.DatasetID | None, fmt.Extent | None]:
        """Create ``dataset`` and write the logical bytes of ``t`` (a tensor of ``shape``, or
        the raw bytes of an array) into it; returns it (None when hdf5meta writes the metadata)
        and where its bytes went, with their hashes (None when it has none)."""
        nbytes = t.numel() * t.element_size()
        if self._meta is not None:  # the data at the next aligned offset; the metadata at close
            at = _aligned(self._eof)
            extent = None
            if nbytes:
                self._replaced.release(nbytes)
                extent = Contiguous(at, nbytes, self._write_bytes(t, at, nbytes))
                self._eof = at + nbytes
            self._meta.dataset(dataset, h5type, shape, at, nbytes)
            return None, extent
        assert self._file is not None
        space = self._space(shape)
        chunked = dcpl is not self._plain and dcpl.get_layout() == h5py.h5d.CHUNKED
        dapl = None
        if chunked:
            dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
            dapl.set_chunk_cache(0, 0, 1.0)  # chunks go to the file as they are written: their offsets are final
        dsid = h5py.h5d.create(self._file.id, dataset.encode("utf-8"), h5type, space, dcpl=dcpl, lcpl=self._lcpl,
                               dapl=dapl)
        if nbytes == 0:
            return dsid, None
        self._replaced.release(nbytes)
        if not chunked:
            offset = dsid.get_offset()  # allocated when created (ALLOC_TIME_EARLY, see hdf5meta.contiguous_dcpl)
            if offset is None:
                raise OSError("HDF5 did not allocate the dataset's data")
            if t.is_cpu and t.is_contiguous():  # the common case: one pwrite from its memory
                data = memory.tensor_buffer(t)
                self._pwrite(data, offset)
                hashes = tuple(checksum.block_hashes(data, checksum.HASH_BLOCK))
            else:
                hasher = checksum.BlockHasher(checksum.block_ends(nbytes, checksum.HASH_BLOCK))
                libhdf5.write_tensor(dsid, h5type, t, on_bytes=hasher.update)
                hashes = tuple(hasher.finish())
            return dsid, Contiguous(offset, nbytes, hashes)
        chunk = tuple(int(c) for c in dcpl.get_chunk())
        level = presets.gzip_pipeline(dcpl)
        if level is not None:  # HDF5's shuffle + deflate: encoded on the I/O threads (zlib releases the GIL)
            hashes = presets.write_gzip_chunks(dsid, t, chunk, itemsize, level)
        else:
            probe = Chunked(shape, itemsize, chunk, fmt.BLOSC2_ID, (), ())  # geometry only
            ends, acc = [], 0
            grid = math.prod(-(-n // c) for n, c in zip(shape, chunk))
            for k in range(grid):
                acc += probe.span(k)[1]
                ends.append(acc)
            hasher = checksum.BlockHasher(ends)
            libhdf5.write_tensor(dsid, h5type, t, on_bytes=hasher.update)
            hashes = tuple(hasher.finish())
        dsid.flush()
        found: dict[int, tuple[int, int, bool]] = {}
        strides = [1] * len(shape)
        grid_shape = [-(-n // c) for n, c in zip(shape, chunk)]
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * grid_shape[i + 1]

        def visit(info: Any) -> None:
            k = sum(o // c * s for o, c, s in zip(info.chunk_offset, chunk, strides))
            found[k] = (int(info.byte_offset), int(info.size), info.filter_mask != 0)

        dsid.chunk_iter(visit)
        code, values = presets.layout_filter(dsid.get_create_plist())  # after HDF5's set_local filled in the values
        extent = Chunked(shape, itemsize, chunk, code, values, tuple(found[k] for k in sorted(found)), hashes)
        fmt.check_chunked(extent, None, version=fmt.DEFLATE_VERSION)
        return dsid, extent

    def _write_bytes(self, t: torch.Tensor, at: int, nbytes: int) -> tuple[int, ...]:
        """Write the logical (row-major) bytes of ``t`` at file offset ``at``; their block hashes.
        A contiguous CPU tensor is written from its own memory, others in row blocks made
        contiguous (and moved to the CPU) one at a time."""
        if t.is_cpu and t.is_contiguous():
            data = memory.tensor_buffer(t)
            if nbytes < GATHER_BYTES and nbytes <= checksum.HASH_BLOCK:
                self._gather(data, at)
                return (checksum.digest(data),)  # one hash block
            self._pwrite(data, at)
            return tuple(checksum.block_hashes(data, checksum.HASH_BLOCK))
        hasher = checksum.BlockHasher(checksum.block_ends(nbytes, checksum.HASH_BLOCK))
        bits, shape = bits_view(t), tuple(t.shape)
        for first, stop in libhdf5.row_blocks(shape, t.element_size(), libhdf5.BLOCK_BYTES):
            block = (bits[first:stop] if shape else bits).contiguous().cpu()
            data = memory.tensor_buffer(block)
            self._pwrite(data, at)
            hasher.update(data)
            at += block.numel() * block.element_size()
        return tuple(hasher.finish())

    def _pwrite(self, data: memoryview, at: int) -> None:
        """Write ``data`` at ``at``: through :class:`files.DirectWrites` when it is on."""
        if self._direct is not None:
            self._direct.pwrite(data, at)
        else:
            files.pwrite_all(self._fd, data, at)

    def _gather(self, data: memoryview, at: int) -> None:
        """Add ``data``, bound for offset ``at``, to the gathered bytes (the gap that alignment
        leaves before it as zeros); written once they reach 1 MiB."""
        end = self._gathered_at + len(self._gathered)
        if self._gathered and 0 <= at - end < fmt.ALIGNMENT:
            self._gathered += bytes(at - end)
        else:
            self._flush_gathered()
            self._gathered_at = at
        self._gathered += data
        if len(self._gathered) >= 2**20:
            self._flush_gathered()

    def _flush_gathered(self) -> None:
        if self._gathered:
            files.pwrite_all(self._fd, self._gathered, self._gathered_at)
            self._gathered = bytearray()

    def _space(self, shape: tuple[int, ...]) -> Any:
        """The HDF5 dataspace of ``shape`` (made once per shape: small tensors repeat shapes)."""
        space = self._spaces.get(shape)
        if space is None:
            space = h5py.h5s.create(h5py.h5s.SCALAR) if not shape else h5py.h5s.create_simple(shape)
            if len(self._spaces) < 1024:
                self._spaces[shape] = space
        return space

    @staticmethod
    def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
        """What makes two tensors the same view of the same memory with the same values:
        conjugate and negative views differ from their base, and a tensor changed in place
        since it was written (its version counter moved) is written again."""
        if t.numel() == 0:
            return None
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                t.is_conj(), t.is_neg(), t._version)


def few_links(paths: list[str]) -> bool:
    """Whether no group of a file holding these key paths gets more than :data:`ENCODED_LINKS`
    links (the ``_encode`` argument of :class:`Writer`)."""
    if len(paths) <= ENCODED_LINKS:
        return True
    counts = collections.Counter(p.rpartition("/")[0] for p in paths if p)
    return max(counts.values()) <= ENCODED_LINKS


def few_links_in(nodes: list[Container | Leaf]) -> bool:
    """:func:`few_links` of a flattened tree (:func:`prepare`'s nodes)."""
    return len(nodes) <= ENCODED_LINKS or few_links([n.path for n in nodes])


def _aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of :data:`format.ALIGNMENT`."""
    return -(-offset // fmt.ALIGNMENT) * fmt.ALIGNMENT


def _unique_nbytes(values: Iterable[Any]) -> int:
    """Bytes of tensor and array data among ``values``, tensors that are one view counted once."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            key = Writer._alias_key(value.detach())
            if key is None or key not in seen:
                total += value.numel() * value.element_size()
                if key is not None:
                    seen.add(key)
        elif isinstance(value, np.ndarray):
            total += value.nbytes
    return total


class _Replaced:
    """The file a save will replace: held open from the start, released from the page cache
    as the new file grows (:data:`RELEASE_REPLACED`), closed off the caller's thread after the
    rename (dropping the last reference to a large cached file frees its pages, which costs
    about as much as writing it)."""

    def __init__(self, path: str) -> None:
        self.released = 0  # bytes of the old file dropped from the cache (a multiple of RELEASE_ALIGN)
        self.wanted = 0    # bytes of the new file written so far
        try:  # a regular file only: opening a FIFO in its place would block the save
            self.fd: int | None = files.open_regular(path, "file to replace")
        except (OSError, TensorStoreError):
            self.fd = None

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


def _replace(tmp: str, path: str, replaced: _Replaced, sync: bool) -> None:
    """``os.replace(tmp, path)``, then let go of the old file off the caller's thread."""
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a directory; choose a file name")
        os.replace(tmp, path)
        if sync:
            dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    finally:
        replaced.close(background=True)


def _discard(f: h5py.File | None, tmp: str, fd: int, replaced: _Replaced) -> None:
    """Close and remove an abandoned temporary (errors closing it do not matter: it is gone)."""
    try:
        if f is not None:
            f.close()
    except (OSError, RuntimeError, ValueError):
        pass
    finally:
        replaced.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        try:
            os.close(fd)
        except OSError:
            pass


def save(
    obj: Any,
    path: PathLike,
    *,
    compression: Compression = None,
    metadata: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    chunk_bytes: int | None = None,
    sync: bool = False,
    storage_options: dict[str, Any] | None = None,
    direct: bool | None = None,
) -> None:
    """Save a tensor or a nested dict/list/tuple of tensors and plain values to ``path``: a
    local path, an fsspec URL (``s3://``, ...; ``storage_options`` go to fsspec) or a
    writable binary file object.

    The file is written beside ``path`` and renamed over it at the end: a failure leaves
    any earlier file intact. Tensors that are the same view of one storage are stored once.
    A state dict's ``_metadata`` (module versions) is kept.

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
        sync: ``fsync`` the file and its directory (durable once ``save`` returns).
        storage_options: for a URL, passed to fsspec (credentials, endpoint).
        direct: write large tensors' data with ``O_DIRECT`` (see :class:`Writer`); None: when
            ``sync`` is set.

    Raises:
        UnsupportedTypeError: (a TypeError) naming the key path and type of a value that
            cannot be stored without pickle; nothing is written.
        WriteError: (an OSError) the file cannot be written (disk full, I/O error); nothing changes.
    """
    with memory.gc_paused():
        nodes = prepare(obj, path if isinstance(path, str) else os.fspath(path) if isinstance(path, os.PathLike)
                        else remote.FileObjSource.name_of(path))
    with Writer(path, compression=compression, metadata=metadata, progress=progress, chunk_bytes=chunk_bytes,
                sync=sync, storage_options=storage_options, direct=direct,
                _encode=few_links_in(nodes)) as w:
        w._write_root(nodes)
