"""Saving while training goes on: :func:`save_async`.

The caller waits only while the state is copied into host buffers (kept between saves, so
the next save of a state of the same shapes reuses them: no fresh memory to fault in); a
background thread writes the file, atomically, as :func:`tensorstore_h5.save` does. One save
runs at a time: a save waits for the one before it to finish, so at most one copy of the
state is held.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..codecs.presets import Compression
from ..format.dtypes import bits_view
from ..format.slicing import contiguous_stride, has_gaps, stride_span
from ..format.tree import Container, Leaf
from .writer import PathLike, Writer, few_links_in, prepare

__all__ = ["save_async", "SaveFuture"]

SaveFuture = Future
"""A ``concurrent.futures.Future`` of a background save: ``result()`` waits for the file to be
in place and raises what the save raised (the earlier file at the path is then intact)."""

_executor: ThreadPoolExecutor | None = None
_save_lock = threading.Lock()  # one save_async call at a time
_pool_lock = threading.Lock()  # the buffer pool, shared with the writing thread
_last: Future[None] | None = None
_pool: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # snapshot buffers of the last save, by layout


def _forget_after_fork() -> None:
    """In a forked child: the parent's writing thread and its saves do not exist there (a
    child's ``save_async`` starts its own), and the parent's locks may have been held."""
    global _executor, _save_lock, _pool_lock, _last
    _executor, _last = None, None
    _save_lock, _pool_lock = threading.Lock(), threading.Lock()
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _snapshot(t: torch.Tensor, used: dict[tuple[Any, ...], list[torch.Tensor]]) -> torch.Tensor:
    """A host copy of ``t`` with its shape, dtype and stride (views with gaps become
    contiguous, as the writer stores them), in a buffer reused from the last save when one
    of that size is free."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    if t.numel() == 0 or has_gaps(shape, stride):
        stride = contiguous_stride(shape)
        source = bits_view(t).contiguous()
    else:  # the storage the view spans (expanded dimensions stay expanded)
        source = bits_view(t.as_strided((stride_span(shape, stride),), (1,)))
    span = stride_span(shape, stride)
    key = (span, t.dtype, t.is_cuda)
    with _pool_lock:
        free = _pool.get(key)
        buf = free.pop() if free else None
    if buf is None:
        buf = torch.empty(span, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    used.setdefault(key, []).append(buf)
    with torch.no_grad():  # as bits: every dtype has a copy kernel then
        bits_view(buf).copy_(source.reshape(-1), non_blocking=t.is_cuda)
    return buf.as_strided(shape, stride)


def save_async(
    obj: Any,
    path: PathLike,
    *,
    compression: Compression = None,
    metadata: Mapping[str, Any] | None = None,
    chunk_bytes: int | None = None,
    sync: bool = False,
    direct: bool | None = None,
) -> SaveFuture:
    """Save ``obj`` to ``path`` in the background; returns once its tensors are copied.

    Everything :func:`tensorstore_h5.save` checks is checked before this returns
    (``UnsupportedTypeError`` is raised here); the copy then belongs to the save, so the
    caller may change its tensors at once. Tensors that are one view of one storage stay
    one; ``nn.Parameter``, ``requires_grad`` and state-dict ``_metadata`` are kept. Device
    tensors are copied into pinned host buffers.

    Example::

        future = th5.save_async({"model": model.state_dict(), "step": step}, "ckpt.h5")
        ...                      # train on
        future.result()          # raises what the save raised; the old file is intact then

    ``compression``, ``metadata``, ``chunk_bytes``, ``sync`` and ``direct`` are those of
    :func:`tensorstore_h5.save`.

    Returns:
        A ``concurrent.futures.Future``; ``result()`` is None once the file is in place.

    Raises:
        UnsupportedTypeError: for a value that cannot be stored (nothing is written).
    """
    global _executor, _last
    path = os.fspath(path)
    nodes = prepare(obj, path)
    with _save_lock:
        if _last is not None:
            _last.exception()  # one save at a time: its errors belong to its own future
        used: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        snap: list[Container | Leaf] = []
        cuda = False
        for node in nodes:
            value = node.value if isinstance(node, Leaf) else None
            if isinstance(value, torch.Tensor):
                ident = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                         tuple(value.stride()), value.dtype, value.is_conj(), value.is_neg()) if value.numel() else None
                copy = copies.get(ident) if ident is not None else None
                if copy is None:
                    copy = _snapshot(value.resolve_conj().resolve_neg() if value.is_conj() or value.is_neg() else value, used)
                    if ident is not None:
                        copies[ident] = copy
                cuda = cuda or value.is_cuda
                if isinstance(value, torch.nn.Parameter):
                    copy = torch.nn.Parameter(copy, requires_grad=value.requires_grad)
                elif value.requires_grad:
                    copy = copy.detach().requires_grad_(True)
                snap.append(Leaf(node.path, node.key, copy))
            elif isinstance(value, np.ndarray):
                snap.append(Leaf(node.path, node.key, value.copy()))
            else:
                snap.append(node)
        if cuda:
            torch.cuda.synchronize()
        with _pool_lock:
            _pool.clear()  # buffers of the last save that this one did not reuse
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorstore_h5-save")

        def write() -> None:
            try:
                with Writer(path, compression=compression, metadata=metadata, progress=False, chunk_bytes=chunk_bytes,
                            sync=sync, direct=direct, _encode=few_links_in(snap)) as w:
                    w._write_root(snap)
            finally:
                snap.clear()
                with _pool_lock:  # the buffers serve the next save
                    for key, bufs in used.items():
                        _pool.setdefault(key, []).extend(bufs)

        _last = _executor.submit(write)
        return _last
