"""Where bytes come from and go: local files (:mod:`.files`: preadv, pwrite, O_DIRECT, mappings),
host memory for tensors (:mod:`.memory`), the I/O threads and read plans (:mod:`.parallel`),
URLs and file objects (:mod:`.remote`, over the client :mod:`.httpranges`), and files that
only libhdf5 reads (:mod:`.libhdf5`). Importing this package imports none of them, nor torch:
what is here, :class:`Deferred` and :func:`gc_paused`, serves the command line's listings too.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import threading
from collections.abc import Iterator
from typing import Any


class Deferred:
    """Stands for a module until its first attribute is asked for: then imports it and puts
    it in place of itself under ``name`` in ``namespace`` (a module's globals), so later uses
    are plain attribute lookups. For modules that most calls of their importer do not need
    (libhdf5 or the remote client when a local format-2 file is read: the first open in a
    fresh process pays for every import)."""

    def __init__(self, module: str, namespace: dict[str, Any], name: str) -> None:
        self.__dict__.update(_module=module, _namespace=namespace, _name=name)

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._module)
        self._namespace[self._name] = module
        return getattr(module, attr)


_gc_lock = threading.Lock()

_gc_paused_by: dict[int, int] = {}  # thread ident -> blocks of that thread now in gc_paused

_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (back as it was when the last of
    the blocks running in any thread ends). Building thousands of objects that form no cycle
    (tensors, entries, index pieces) otherwise runs it again and again over everything the
    process holds: half the time of loading 10,000 small tensors (560 -> 280 ms, as fast as
    safetensors' ``load_file``) and of a rank reading a 512-rank index."""
    global _gc_was_enabled
    me = threading.get_ident()
    with _gc_lock:
        if not _gc_paused_by:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_paused_by[me] = _gc_paused_by.get(me, 0) + 1
    try:
        yield
    finally:
        with _gc_lock:
            left = _gc_paused_by.pop(me) - 1
            if left:
                _gc_paused_by[me] = left
            elif not _gc_paused_by and _gc_was_enabled:
                gc.enable()


def _resume_gc_after_fork() -> None:
    """In a forked child only the forking thread exists: the pauses of the parent's other
    threads never end there, so they are forgotten (and the collector is back on when none is
    left), and the lock is made anew (the parent's may have been held)."""
    global _gc_lock
    _gc_lock = threading.Lock()
    me = threading.get_ident()
    paused, mine = bool(_gc_paused_by), _gc_paused_by.get(me, 0)
    _gc_paused_by.clear()
    if mine:
        _gc_paused_by[me] = mine
    elif paused and _gc_was_enabled:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_resume_gc_after_fork)
