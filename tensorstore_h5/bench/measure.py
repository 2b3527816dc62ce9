"""What the benchmark measures with, in the worker processes: peak RSS (``/proc/self/status``,
reset through ``clear_refs``), the page cache dropped or warmed, raw reads of a file, when
memory was last freed (for ``--settle``), and optional peers that skip their contender.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["Skip", "status", "reset_peak", "peer", "fresh", "warm", "drop_caches", "read_file", "reports_free_pages",
           "settle_seconds"]


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Skip(Exception):
    """A contender that cannot run here (a peer not installed, no root for a cold cache)."""


def peer(module: str, extra: str) -> Any:
    """Import an optional peer, or skip its contender saying what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise Skip(f"{module} is not installed (pip install {extra})") from None


def warm(paths: list[str]) -> None:
    """Read each file once through the page cache into one reused buffer (untimed), so that
    the timed run finds it all cached."""
    buf = bytearray(8 << 20)
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            while os.readv(fd, [buf]) == len(buf):
                pass
        finally:
            os.close(fd)


last_free = 0.0  # time.time() of the last unlink in this worker's set-up (its pages were freed then)


def fresh(path: str) -> str:
    """``path`` with any earlier file there removed (untimed), so that every writer starts alike."""
    global last_free
    try:
        os.unlink(path)
        last_free = time.time()
    except FileNotFoundError:
        pass
    return path


def drop_caches() -> None:
    """Write back and drop the page cache (untimed), or skip the contender."""
    global last_free
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        raise Skip(f"cannot drop the page cache ({e}); run as root") from None
    last_free = time.time()  # the cache's memory was freed: settle like any fresh-memory read


def read_file(path: str, direct: bool, threads: int = 2, piece: int = 8 << 20) -> int:
    """Read all of ``path`` in ``piece``-byte reads on ``threads`` threads, with O_DIRECT
    (page-aligned buffers and offsets) or through the page cache; returns the bytes read."""
    import mmap as mm
    from concurrent.futures import ThreadPoolExecutor

    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    size = os.path.getsize(path)
    bufs = [mm.mmap(-1, piece) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
    try:
        def run(k: int) -> int:
            view = memoryview(bufs[k])
            return sum(os.preadv(fd, [view], off) for off in range(k * piece, size, threads * piece))

        with ThreadPoolExecutor(threads) as ex:
            return sum(ex.map(run, range(threads)))
    finally:
        os.close(fd)


def reports_free_pages() -> bool:
    """Whether this machine is a virtual machine that hands free memory back to its hypervisor
    (virtio-balloon free page reporting, feature bit 5). There, memory freed more than ~2 s ago
    is discarded by the host in 2 MiB blocks and costs a host fault when touched again (figures
    in bench/README.md)."""
    import glob

    for features in glob.glob("/sys/bus/virtio/drivers/virtio_balloon/virtio*/features"):
        try:
            with open(features) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > 5 and bits[5] == "1":
            return True
    return False


def settle_seconds() -> float:
    """The default ``--settle``: 3 s where :func:`reports_free_pages`, else 0."""
    return 3.0 if reports_free_pages() else 0.0
