"""``tensorstore-h5 bench``: tensorstore_h5 against the machine's limits and every peer, in one run.

Each contender runs in a fresh subprocess (``python -m tensorstore_h5.bench worker NAME DIR``),
best and median of ``--repeat`` runs, taken in rounds over all contenders (so a slow spell of a
shared machine lands on every contender, not on one); a contender that reads a file in the page
cache reads it once, untimed, before its timed run (:func:`_warm`), so the figures are memory
and page-cache speeds. GB/s are 10**9 bytes of tensor data per second. ``peak`` is the growth
of peak RSS during the timed operation (MiB), measured by resetting the kernel's high-water
mark (``/proc/self/clear_refs``) just before it. A full garbage collection runs before each
timed operation: in a fresh process that has imported torch, the first full collection costs
~80 ms (measured) and would otherwise land in whichever short operation happens to trigger it.
Writers start with their output removed (see bench/README.md); the ``replace`` group measures
saving over a file that still exists. On a virtual machine that reports free memory to its
hypervisor (:func:`reports_free_pages`), every read that faults in fresh memory and every
writer starts ``--settle`` seconds (default 3) after memory was last freed (the previous
worker's exit, its own set-up's removing a file), so that none of them gets memory the host has
not yet taken back while another does; writers also start with the page cache flushed (see
bench/README.md). ``--profile`` shows where each contender's time goes.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pickle  # noqa: S403 - only the peer "pickle header + raw storages" contender uses it
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["main", "CONTENDERS"]


# ---------------------------------------------------------------------------- worker side


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class Ctx:
    dir: str
    size: int
    keys: int

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def state(self) -> dict[str, torch.Tensor]:
        from .synthetic import bench_state_dict

        return bench_state_dict(self.size, self.keys)

    def nbytes(self, sd: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in sd.values()}.values())


Timed = tuple[Callable[[], Any], int]  # (the operation, bytes it moves)
CONTENDERS: dict[str, tuple[str, Callable[[Ctx], Timed]]] = {}
READS: dict[str, tuple[str, ...]] = {}
"""The files (names in the bench directory) that a contender of a warm group reads: its worker
reads them once, untimed, before the timed run (:func:`_warm`)."""

WARM_GROUPS = ("read", "mmap", "prealloc", "stream", "partial", "touched", "keys", "small-read", "gpu", "gpu-limit")
"""Groups whose contenders read files in the page cache. The bench's files (about ten of 2 GB
each, rewritten every round by the writers) do not all fit this machine's page cache beside
the readers' memory, so without :func:`_warm` a "warm" read found its file partly evicted in
some rounds and not in others."""


class Skip(Exception):
    """A contender that cannot run here (a peer not installed, no root for a cold cache)."""


def _peer(module: str, extra: str) -> Any:
    """Import an optional peer, or skip its contender saying what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise Skip(f"{module} is not installed (pip install {extra})") from None


def contender(name: str, group: str, reads: tuple[str, ...] = ()
              ) -> Callable[[Callable[[Ctx], Timed]], Callable[[Ctx], Timed]]:
    """Register a contender of ``group``; ``reads``: the files it reads (see :data:`READS`)."""
    def register(fn: Callable[[Ctx], Timed]) -> Callable[[Ctx], Timed]:
        CONTENDERS[name] = (group, fn)
        READS[name] = reads
        return fn
    return register


def _warm(paths: list[str]) -> None:
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


_last_free = 0.0  # time.time() of the last unlink in this worker's set-up (its pages were freed then)


def _fresh(path: str) -> str:
    """``path`` with any earlier file there removed (untimed), so that every writer starts alike."""
    global _last_free
    try:
        os.unlink(path)
        _last_free = time.time()
    except FileNotFoundError:
        pass
    return path


def _touch_all(tensors: Any) -> None:
    for t in tensors:
        if t.numel():
            t.view(torch.uint8).sum() if t.element_size() == 1 else t.view(-1)[:: max(1, 4096 // t.element_size())].sum()


def _prealloc(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    for t in out.values():
        t.zero_()  # touched: what a model's existing parameters look like
    return out


def _shapes(ctx: Ctx) -> dict[str, torch.Tensor]:
    import tensorstore_h5 as th5

    with th5.open(ctx.path("ckpt.h5")) as s:
        return {k: torch.zeros(s[k].shape, dtype=s[k].dtype) for k in s.keys()}


def _preadv_all(path: str, bufs: list[torch.Tensor], threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    fd = os.open(path, os.O_RDONLY)
    try:
        piece = 8 << 20
        jobs = []
        off = 0
        for b in bufs:
            mv = memoryview(b.numpy()).cast("B")
            for s in range(0, len(mv), piece):
                jobs.append((off + s, mv[s:s + piece]))
            off += len(mv)

        def run(job: tuple[int, memoryview]) -> None:
            o, m = job
            done = 0
            while done < len(m):
                done += os.preadv(fd, [m[done:]], o + done)

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(run, jobs))
    finally:
        os.close(fd)


# -- limits


@contender("L.write raw bytes", "write")
def _(ctx: Ctx) -> Timed:
    path = _fresh(ctx.path("raw.bin"))
    sd = ctx.state()

    def op() -> None:
        _write_raw(sd, path)
    return op, ctx.nbytes(sd)


def _write_raw(sd: dict[str, torch.Tensor], path: str) -> None:
    with open(path, "wb") as f:
        for t in sd.values():
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))


def _replaced(path: str, write: Callable[[str], Any]) -> str:
    """``path`` holding the file a ``replace`` contender writes over (untimed): written and
    flushed to disk, as an earlier checkpoint would be by the time the next one is saved."""
    if not os.path.exists(path):
        write(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


@contender("L.write raw bytes over an existing file (in place)", "replace")
def _(ctx: Ctx) -> Timed:
    sd = ctx.state()
    path = _replaced(ctx.path("raw-replaced.bin"), lambda p: _write_raw(sd, p))
    return (lambda: _write_raw(sd, path)), ctx.nbytes(sd)


@contender("L.memcpy 1 thread (touched)", "touched")
def _(ctx: Ctx) -> Timed:
    n = ctx.size
    a, b = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    torch.set_num_threads(1)
    return (lambda: b.copy_(a)), n


@contender("L.readinto fresh, 2 threads", "read", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    from . import io

    n = os.path.getsize(ctx.path("raw.bin"))
    return (lambda: _preadv_all(ctx.path("raw.bin"), [io.empty((n,), torch.uint8)], 2)), n


@contender("L.readinto fresh, 2 threads + huge pages", "read", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    from . import io

    io.HUGEPAGES = True
    n = os.path.getsize(ctx.path("raw.bin"))
    return (lambda: _preadv_all(ctx.path("raw.bin"), [io.empty((n,), torch.uint8)], 2)), n


@contender("L.readinto touched, 2 threads", "touched", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    n = os.path.getsize(ctx.path("raw.bin"))
    buf = torch.zeros(n, dtype=torch.uint8)
    return (lambda: _preadv_all(ctx.path("raw.bin"), [buf], 2)), n


# -- tensorstore_h5


@contender("W.tensorstore_h5 save", "write")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    path = _fresh(ctx.path("ckpt.h5"))
    sd = ctx.state()
    return (lambda: th5.save(sd, path)), ctx.nbytes(sd)


@contender("W.tensorstore_h5 save(direct=True)", "write")
def _(ctx: Ctx) -> Timed:
    """O_DIRECT writes of the tensor data (io.DirectWrites): no fresh page-cache memory."""
    import tensorstore_h5 as th5

    path = _fresh(ctx.path("ckpt-direct.h5"))
    sd = ctx.state()
    return (lambda: th5.save(sd, path, direct=True)), ctx.nbytes(sd)


@contender("W.tensorstore_h5 save over an existing file", "replace")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    sd = ctx.state()
    path = _replaced(ctx.path("replaced.h5"), lambda p: th5.save(sd, p))
    return (lambda: th5.save(sd, path)), ctx.nbytes(sd)


@contender("R.tensorstore_h5 load", "read", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: th5.load(ctx.path("ckpt.h5"))), _file_data(ctx)


@contender("R.tensorstore_h5 load(verify=True)", "read", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: th5.load(ctx.path("ckpt.h5"), verify=True)), _file_data(ctx)


@contender("W.tensorstore_h5 save_async: the caller's stall", "write")
def _(ctx: Ctx) -> Timed:
    from .background import save_async

    path = _fresh(ctx.path("async.h5"))
    sd = ctx.state()
    save_async(sd, path).result()  # untimed: the first save makes the buffers that later saves reuse
    _fresh(path)
    return (lambda: save_async(sd, path)), ctx.nbytes(sd)


@contender("W.tensorstore_h5 save_async: until written", "write")
def _(ctx: Ctx) -> Timed:
    from .background import save_async

    path = _fresh(ctx.path("async.h5"))
    sd = ctx.state()
    save_async(sd, path).result()
    _fresh(path)
    return (lambda: save_async(sd, path).result()), ctx.nbytes(sd)


@contender("R.tensorstore_h5 load (io.HUGEPAGES = True)", "read", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5
    from tensorstore_h5 import io

    io.HUGEPAGES = True
    return (lambda: th5.load(ctx.path("ckpt.h5"))), _file_data(ctx)


@contender("R.tensorstore_h5 load(mmap) + touch", "mmap", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: _touch_all(th5.load(ctx.path("ckpt.h5"), mmap=True).values())), _file_data(ctx)


@contender("R.tensorstore_h5 load_into (touched targets)", "prealloc", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    target = _shapes(ctx)
    return (lambda: th5.load_into(target, ctx.path("ckpt.h5"))), _file_data(ctx)


@contender("R.tensorstore_h5 items() streaming", "stream", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    def op() -> None:
        with th5.open(ctx.path("ckpt.h5")) as s:
            for _k, t in s.items():
                del t
    return op, _file_data(ctx)


@contender("R.tensorstore_h5 select 1% of keys", "partial", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    with th5.open(ctx.path("ckpt.h5")) as s:
        keys = s.keys()[:: 100]
        nbytes = sum(s[k].nbytes for k in keys)
    return (lambda: th5.load(ctx.path("ckpt.h5"), select=keys)), nbytes


@contender("R.tensorstore_h5 1% row slice of every tensor", "partial", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    def op() -> None:
        with th5.open(ctx.path("ckpt.h5")) as s:
            for k in s.keys():
                h = s[k]
                h[: max(1, len(h) // 100)]
    with th5.open(ctx.path("ckpt.h5")) as s:
        nbytes = sum(s[k].nbytes // max(1, len(s[k])) * max(1, len(s[k]) // 100) for k in s.keys())
    return op, nbytes


def _file_data(ctx: Ctx) -> int:
    import tensorstore_h5 as th5

    with th5.open(ctx.path("ckpt.h5")) as s:
        return s.nbytes


# -- torch


@contender("W.torch.save", "write")
def _(ctx: Ctx) -> Timed:
    path = _fresh(ctx.path("ckpt.pt"))
    sd = ctx.state()
    return (lambda: torch.save(sd, path)), ctx.nbytes(sd)


@contender("W.torch.save over an existing file", "replace")
def _(ctx: Ctx) -> Timed:
    sd = ctx.state()
    path = _replaced(ctx.path("replaced.pt"), lambda p: torch.save(sd, p))
    return (lambda: torch.save(sd, path)), ctx.nbytes(sd)  # truncates in place: not atomic


@contender("R.torch.load(weights_only)", "read", reads=("ckpt.pt",))
def _(ctx: Ctx) -> Timed:
    return (lambda: torch.load(ctx.path("ckpt.pt"), weights_only=True)), _file_data(ctx)


@contender("R.torch.load(mmap) + touch", "mmap", reads=("ckpt.pt",))
def _(ctx: Ctx) -> Timed:
    return (lambda: _touch_all(torch.load(ctx.path("ckpt.pt"), weights_only=True, mmap=True).values())), _file_data(ctx)


# -- safetensors


@contender("W.safetensors save_file", "write")
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import save_file

    path = _fresh(ctx.path("ckpt.safetensors"))
    sd = ctx.state()
    return (lambda: save_file(sd, path)), ctx.nbytes(sd)


@contender("R.safetensors load_file + clone", "read", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    return (lambda: [t.clone() for t in load_file(ctx.path("ckpt.safetensors")).values()]), _file_data(ctx)


@contender("R.safetensors load_file + touch", "mmap", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    return (lambda: _touch_all(load_file(ctx.path("ckpt.safetensors")).values())), _file_data(ctx)


@contender("R.safetensors safe_open get_tensor + copy_ (touched targets)", "prealloc", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open

    target = _shapes(ctx)

    def op() -> None:
        with safe_open(ctx.path("ckpt.safetensors"), "pt") as f:
            for k in f.keys():
                target[k].copy_(f.get_tensor(k))
    return op, _file_data(ctx)


@contender("R.safetensors safe_open streaming", "stream", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open

    def op() -> None:
        with safe_open(ctx.path("ckpt.safetensors"), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k).clone()
                del t
    return op, _file_data(ctx)


@contender("M.tensorstore_h5 merge 3 checkpoints key by key (items + Writer)", "stream", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    src, out = ctx.path("ckpt.h5"), _fresh(ctx.path("merged.h5"))

    def op() -> None:  # the same file as all three inputs: the memory is what is measured
        with th5.open(src) as a, th5.open(src) as b, th5.open(src) as c, th5.Writer(out) as w:
            for (k, x), (_, y), (_, z) in zip(a.items(), b.items(), c.items()):
                w[k] = 0.5 * x + 0.3 * y + 0.2 * z
    return op, _file_data(ctx)


@contender("M.safetensors merge 3 checkpoints (safe_open + save_file)", "stream", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = ctx.path("ckpt.safetensors"), _fresh(ctx.path("merged.safetensors"))

    def op() -> None:  # save_file takes the whole dict: the merged tensors are all held
        with safe_open(src, "pt") as a, safe_open(src, "pt") as b, safe_open(src, "pt") as c:
            merged = {k: 0.5 * a.get_tensor(k) + 0.3 * b.get_tensor(k) + 0.2 * c.get_tensor(k) for k in a.keys()}
        save_file(merged, out)
    return op, _file_data(ctx)


@contender("R.safetensors get_slice 1% rows of every tensor", "partial", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open

    def op() -> None:
        with safe_open(ctx.path("ckpt.safetensors"), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n = sl.get_shape()[0]
                sl[: max(1, n // 100)].clone()
    return op, max(1, _file_data(ctx) // 100)


# -- tensorizer and runai-model-streamer (optional: pip install "tensorstore_h5[bench]")


@contender("W.tensorizer TensorSerializer", "write")
def _(ctx: Ctx) -> Timed:
    tensorizer = _peer("tensorizer", "tensorizer")
    path = _fresh(ctx.path("ckpt.tensors"))
    sd = ctx.state()

    def op() -> None:
        s = tensorizer.TensorSerializer(path)
        s.write_state_dict(sd)
        s.close()
    return op, ctx.nbytes(sd)


def _tensorizer_load(path: str) -> dict[str, torch.Tensor]:
    tensorizer = _peer("tensorizer", "tensorizer")
    d = tensorizer.TensorDeserializer(path, device="cpu")
    out = dict(d.items())
    d.close()
    return out


@contender("R.tensorizer TensorDeserializer", "read", reads=("ckpt.tensors",))
def _(ctx: Ctx) -> Timed:
    _peer("tensorizer", "tensorizer")
    return (lambda: _tensorizer_load(ctx.path("ckpt.tensors"))), _file_data(ctx)


def _runai_load(path: str) -> dict[str, torch.Tensor]:
    runai = _peer("runai_model_streamer", "runai-model-streamer")
    with runai.SafetensorsStreamer() as st:
        st.stream_file(path)
        return {k: t.clone() for k, t in st.get_tensors()}  # its tensors live in the streamer's buffer


@contender("R.runai-model-streamer SafetensorsStreamer + clone", "read", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    _peer("runai_model_streamer", "runai-model-streamer")
    return (lambda: _runai_load(ctx.path("ckpt.safetensors"))), _file_data(ctx)


# -- cold page cache (--cold; root drops the cache before each timed read)


def _drop_caches() -> None:
    """Write back and drop the page cache (untimed), or skip the contender."""
    global _last_free
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        raise Skip(f"cannot drop the page cache ({e}); run as root") from None
    _last_free = time.time()  # the cache's memory was freed: settle like any fresh-memory read


def _cold(op: Callable[[], Any]) -> Callable[[], Any]:
    _drop_caches()
    return op


def _read_file(path: str, direct: bool, threads: int = 2, piece: int = 8 << 20) -> int:
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


@contender("C.L.O_DIRECT reads of the file, 2 threads (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    path = ctx.path("ckpt.h5")
    return _cold(lambda: _read_file(path, True)), os.path.getsize(path)


@contender("C.L.buffered reads of the file, 2 threads (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    path = ctx.path("ckpt.h5")
    return _cold(lambda: _read_file(path, False)), os.path.getsize(path)


@contender("C.tensorstore_h5 load (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    nbytes = _file_data(ctx)
    return _cold(lambda: th5.load(ctx.path("ckpt.h5"))), nbytes


@contender("C.tensorstore_h5 load(mmap) + touch (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    nbytes = _file_data(ctx)
    return _cold(lambda: _touch_all(th5.load(ctx.path("ckpt.h5"), mmap=True).values())), nbytes


@contender("C.torch.load(mmap) + touch (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    nbytes = _file_data(ctx)
    return _cold(lambda: _touch_all(torch.load(ctx.path("ckpt.pt"), weights_only=True, mmap=True).values())), nbytes


@contender("C.safetensors load_file + touch (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    nbytes = _file_data(ctx)
    return _cold(lambda: _touch_all(load_file(ctx.path("ckpt.safetensors")).values())), nbytes


@contender("C.safetensors load_file + clone (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    nbytes = _file_data(ctx)
    return _cold(lambda: [t.clone() for t in load_file(ctx.path("ckpt.safetensors")).values()]), nbytes


@contender("C.tensorizer TensorDeserializer (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    _peer("tensorizer", "tensorizer")
    nbytes = _file_data(ctx)
    return _cold(lambda: _tensorizer_load(ctx.path("ckpt.tensors"))), nbytes


@contender("C.runai-model-streamer + clone (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    _peer("runai_model_streamer", "runai-model-streamer")
    nbytes = _file_data(ctx)
    return _cold(lambda: _runai_load(ctx.path("ckpt.safetensors"))), nbytes


# -- the hand-rolled pickle-header stream and naive h5py


@contender("W.pickle header + raw storages", "write")
def _(ctx: Ctx) -> Timed:
    path = _fresh(ctx.path("ckpt.raw"))
    sd = ctx.state()

    def op() -> None:
        spec = [(k, str(t.dtype), tuple(t.shape), tuple(t.stride()), t.numel() * t.element_size()) for k, t in sd.items()]
        with open(path, "wb") as f:
            header = pickle.dumps(spec)
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for t in sd.values():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return op, ctx.nbytes(sd)


@contender("R.pickle header + raw storages (frombuffer)", "read", reads=("ckpt.raw",))
def _(ctx: Ctx) -> Timed:
    def op() -> dict[str, torch.Tensor]:
        with open(ctx.path("ckpt.raw"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            spec = pickle.loads(f.read(n))  # noqa: S301 - the peer format under test; our own file
            buf = bytearray(os.path.getsize(ctx.path("ckpt.raw")) - 8 - n)
            f.readinto(buf)
        out, off = {}, 0
        for k, dt, shape, stride, nb in spec:
            dtype = getattr(torch, dt.removeprefix("torch."))
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=nb, offset=off) if nb else torch.empty(0, dtype=torch.uint8)
            out[k] = flat.view(dtype).as_strided(shape, stride)
            off += nb
        return out
    return op, _file_data(ctx)


@contender("W.naive h5py create_dataset(data=t.numpy())", "write")
def _(ctx: Ctx) -> Timed:
    import h5py

    path = _fresh(ctx.path("naive.h5"))
    sd = ctx.state()

    def op() -> None:
        with h5py.File(path, "w") as f:
            for k, t in sd.items():
                f.create_dataset(k, data=(t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())
    return op, ctx.nbytes(sd)


@contender("R.naive h5py ds[()] + from_numpy", "read", reads=("naive.h5",))
def _(ctx: Ctx) -> Timed:
    import h5py

    def op() -> None:
        with h5py.File(ctx.path("naive.h5"), "r") as f:
            {k: torch.from_numpy(f[k][()]) for k in f}
    return op, _file_data(ctx)


# -- many keys, many small objects


@contender("K.tensorstore_h5 open + keys() (10,000 keys)", "keys", reads=("many.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    def op() -> None:
        with th5.open(ctx.path("many.h5")) as s:
            s.keys()
    return op, 0


@contender("K.safetensors safe_open + keys() (10,000 keys)", "keys", reads=("many.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open

    def op() -> None:
        with safe_open(ctx.path("many.safetensors"), "pt") as f:
            f.keys()
    return op, 0


@contender("K.tensorstore_h5 load (10,000 keys)", "keys", reads=("many.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: th5.load(ctx.path("many.h5"))), 10_000 * 16


@contender("K.safetensors load_file (10,000 keys)", "keys", reads=("many.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    return (lambda: load_file(ctx.path("many.safetensors"))), 10_000 * 16


def _small_objects() -> dict[str, Any]:
    """An optimizer-like state: thousands of 0-d step tensors, small buffers and scalars."""
    g = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(16, generator=g), "exp_avg_sq": torch.rand(16, generator=g)}
             for i in range(2000)}
    return {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(2000))}]}


@contender("S.tensorstore_h5 save small objects", "small-write")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    obj = _small_objects()
    return (lambda: th5.save(obj, ctx.path("small.h5"))), 2000 * (4 + 128)


@contender("S.torch.save small objects", "small-write")
def _(ctx: Ctx) -> Timed:
    obj = _small_objects()
    return (lambda: torch.save(obj, ctx.path("small.pt"))), 2000 * (4 + 128)


@contender("S.tensorstore_h5 load small objects", "small-read", reads=("small.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: th5.load(ctx.path("small.h5"))), 2000 * (4 + 128)


@contender("S.torch.load small objects", "small-read", reads=("small.pt",))
def _(ctx: Ctx) -> Timed:
    return (lambda: torch.load(ctx.path("small.pt"), weights_only=True)), 2000 * (4 + 128)


# -- GPU (--gpu; need CUDA): where the weights end up


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the G. contenders need a CUDA device")
    torch.empty(1, device="cuda")  # create the context before the clock starts
    torch.cuda.synchronize()
    return torch.device("cuda")


def _synced(fn: Callable[[], Any]) -> Callable[[], Any]:
    def op() -> Any:
        result = fn()
        torch.cuda.synchronize()
        return result
    return op


@contender("G.L.file read into pinned memory, 2 threads", "gpu-limit", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    _cuda()
    n = os.path.getsize(ctx.path("raw.bin"))
    buf = torch.zeros(n, dtype=torch.uint8).pin_memory()
    return (lambda: _preadv_all(ctx.path("raw.bin"), [buf], 2)), n


@contender("G.L.file read into pinned memory, I/O threads", "gpu-limit", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    """As many reading threads as tensorstore_h5 uses (io.IO_THREADS: 8 on a machine of 8 or
    more cores), so the limit is not set by fewer threads than the load it bounds."""
    from . import io

    _cuda()
    n = os.path.getsize(ctx.path("raw.bin"))
    buf = torch.zeros(n, dtype=torch.uint8).pin_memory()
    return (lambda: _preadv_all(ctx.path("raw.bin"), [buf], io.IO_THREADS)), n


@contender("G.L.pinned host-to-device copy", "gpu-limit", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    dev = _cuda()
    n = os.path.getsize(ctx.path("raw.bin"))
    src = torch.zeros(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    return _synced(lambda: dst.copy_(src, non_blocking=True)), n


@contender("G.tensorstore_h5 load(device=cuda)", "gpu", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    _cuda()
    return _synced(lambda: th5.load(ctx.path("ckpt.h5"), device="cuda")), _file_data(ctx)


@contender("G.tensorstore_h5 load_into (CUDA targets)", "gpu", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    dev = _cuda()
    target = {k: v.to(dev) for k, v in _shapes(ctx).items()}
    return _synced(lambda: th5.load_into(target, ctx.path("ckpt.h5"))), _file_data(ctx)


@contender("G.torch.load(map_location=cuda)", "gpu", reads=("ckpt.pt",))
def _(ctx: Ctx) -> Timed:
    _cuda()
    return _synced(lambda: torch.load(ctx.path("ckpt.pt"), weights_only=True, map_location="cuda")), _file_data(ctx)


@contender("G.safetensors load_file(device=cuda)", "gpu", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors.torch import load_file

    _cuda()
    return _synced(lambda: load_file(ctx.path("ckpt.safetensors"), device="cuda")), _file_data(ctx)


def prepare_keys_files(ctx: Ctx) -> None:
    """The 10,000-key files for the K. contenders (not timed)."""
    import tensorstore_h5 as th5
    from safetensors.torch import save_file

    sd = {f"blocks.{i // 10}.param{i % 10}": torch.full((4,), float(i)) for i in range(10_000)}
    th5.save(sd, ctx.path("many.h5"))
    save_file(sd, ctx.path("many.safetensors"))


SETTLED_GROUPS = ("read", "gpu", "write", "replace", "cold")
"""Contenders whose operation faults in fresh memory (new tensors, or a new file's page cache):
on a machine that reports free pages to its hypervisor they start ``--settle`` seconds after
the previous worker exited and after their own set-up last removed a file, so every one of them
writes into memory the host has taken back, none into memory just freed."""


SYNCED_GROUPS = ("write", "replace")
"""Writers start with no dirty page cache from an earlier contender (``os.sync()``, untimed):
measured back to back, each 2 GB writer inherited the previous one's ~2 GB of dirty pages and
ran 1.4-6.1 s as the kernel throttled it behind their writeback."""


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


def worker(name: str, ctx: Ctx, not_before: float = 0.0, settle: float = 0.0, profile: int = 0) -> dict[str, Any]:
    """Run one contender once, its timed operation starting no earlier than ``not_before``
    (``time.time()``) nor, in :data:`SETTLED_GROUPS`, ``settle`` seconds after its set-up last
    removed a file; returns seconds, bytes and peak RSS growth. With ``profile``, the operation
    runs under cProfile and the result's ``"profile"`` holds its ``profile`` costliest functions
    by own time (then the seconds are the profiled ones)."""
    global _last_free
    _last_free = 0.0
    import tensorstore_h5

    tensorstore_h5._import_all()  # the package's public API resolves lazily: import it here, untimed, as peers are
    try:
        op, nbytes = CONTENDERS[name][1](ctx)
    except Skip as e:
        return {"name": name, "skip": str(e)}
    group = CONTENDERS[name][0]
    if group in WARM_GROUPS:
        _warm([ctx.path(f) for f in READS.get(name, ())])
    gc.collect()  # start every contender with the same collector state, as timeit does (see module doc)
    if group in SYNCED_GROUPS:
        os.sync()
    if group in SETTLED_GROUPS and _last_free:
        not_before = max(not_before, _last_free + settle)
    wait = not_before - time.time()
    if wait > 0:
        time.sleep(wait)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        op = functools.partial(profiler.runcall, op)
    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    result = op()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - rss0
    del result
    out = {"name": name, "seconds": seconds, "bytes": nbytes, "peak_bytes": max(0, peak)}
    if profiler is not None:
        out["profile"] = _profile_text(profiler, profile)
    return out


def _profile_text(profiler: Any, top: int) -> str:
    """The ``top`` functions of ``profiler`` by own time: own and cumulative milliseconds,
    calls, and where. h5py's compiled calls count in the time of their Python caller."""
    import pstats

    stats = pstats.Stats(profiler).stats  # {(file, line, function): (prim calls, calls, own s, cum s, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    total = sum(v[2] for v in stats.values())
    lines = [f"  {'own ms':>8} {'cum ms':>8} {'calls':>7}  function   (own time of all functions: {total * 1e3:.1f} ms)"]
    for (file, line, func), (_, calls, own, cum, _) in rows:
        where = f"{os.path.basename(file)}:{line}({func})" if line else func
        lines.append(f"  {own * 1e3:8.2f} {cum * 1e3:8.2f} {calls:7d}  {where}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- parent side


ORDER = [
    "L.write raw bytes", "W.tensorstore_h5 save", "W.tensorstore_h5 save(direct=True)", "W.torch.save",
    "W.safetensors save_file",
    "W.pickle header + raw storages", "W.naive h5py create_dataset(data=t.numpy())",
    "L.write raw bytes over an existing file (in place)", "W.tensorstore_h5 save over an existing file",
    "W.torch.save over an existing file",
    "W.tensorstore_h5 save_async: the caller's stall", "W.tensorstore_h5 save_async: until written",
    "W.tensorizer TensorSerializer",
    "L.memcpy 1 thread (touched)", "L.readinto fresh, 2 threads", "L.readinto fresh, 2 threads + huge pages",
    "L.readinto touched, 2 threads", "R.tensorstore_h5 load", "R.tensorstore_h5 load (io.HUGEPAGES = True)",
    "R.tensorstore_h5 load(verify=True)",
    "R.torch.load(weights_only)", "R.safetensors load_file + clone", "R.tensorizer TensorDeserializer",
    "R.runai-model-streamer SafetensorsStreamer + clone",
    "R.pickle header + raw storages (frombuffer)", "R.naive h5py ds[()] + from_numpy",
    "R.tensorstore_h5 load(mmap) + touch", "R.torch.load(mmap) + touch", "R.safetensors load_file + touch",
    "R.tensorstore_h5 load_into (touched targets)", "R.safetensors safe_open get_tensor + copy_ (touched targets)",
    "R.tensorstore_h5 items() streaming", "R.safetensors safe_open streaming",
    "M.tensorstore_h5 merge 3 checkpoints key by key (items + Writer)",
    "M.safetensors merge 3 checkpoints (safe_open + save_file)",
    "R.tensorstore_h5 select 1% of keys", "R.tensorstore_h5 1% row slice of every tensor",
    "R.safetensors get_slice 1% rows of every tensor",
    "K.tensorstore_h5 open + keys() (10,000 keys)", "K.safetensors safe_open + keys() (10,000 keys)",
    "K.tensorstore_h5 load (10,000 keys)", "K.safetensors load_file (10,000 keys)",
    "S.tensorstore_h5 save small objects", "S.torch.save small objects",
    "S.tensorstore_h5 load small objects", "S.torch.load small objects",
]
GPU_ORDER = [
    "G.L.file read into pinned memory, I/O threads", "G.L.pinned host-to-device copy",
    "G.L.file read into pinned memory, 2 threads", "G.tensorstore_h5 load(device=cuda)", "G.tensorstore_h5 load_into (CUDA targets)",
    "G.torch.load(map_location=cuda)", "G.safetensors load_file(device=cuda)",
]
"""Run with ``--gpu`` (they need CUDA)."""
COLD_ORDER = [
    "C.L.O_DIRECT reads of the file, 2 threads (cold)", "C.L.buffered reads of the file, 2 threads (cold)",
    "C.tensorstore_h5 load (cold)", "C.tensorstore_h5 load(mmap) + touch (cold)", "C.torch.load(mmap) + touch (cold)",
    "C.safetensors load_file + touch (cold)", "C.safetensors load_file + clone (cold)",
    "C.tensorizer TensorDeserializer (cold)", "C.runai-model-streamer + clone (cold)",
]
"""Run with ``--cold`` (root: each drops the page cache first)."""


def _run_worker(name: str, ctx: Ctx, not_before: float = 0.0, settle: float = 0.0, profile: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tensorstore_h5.bench", "worker", name, ctx.dir, str(ctx.size), str(ctx.keys),
           repr(not_before), repr(settle), str(profile)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"contender {name!r} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(size_gb: float = 2.0, keys: int = 300, repeat: int = 3, only: str | None = None,
        workdir: str | None = None, out: str | None = None, echo: Callable[[str], None] = print,
        gpu: bool = False, settle: float | None = None, profile: int = 0, cold: bool = False) -> list[dict[str, Any]]:
    """Run the contenders (``only``: a substring filter; ``gpu``: add the CUDA ones) and print
    the table; returns the rows. ``settle``: seconds between a worker's exit (or its set-up's
    removing a file) and the timed operation of a contender in :data:`SETTLED_GROUPS` (None:
    :func:`settle_seconds`). ``profile``: run every operation under cProfile and print, after
    the table, the ``profile`` costliest functions of each contender's fastest run (the
    table's times then include the profiler's overhead). ``cold``: add the cold-cache group.
    Contenders that cannot run here (a peer not installed, no root to drop the cache) are
    listed as skipped, with the reason."""
    order = ORDER + (GPU_ORDER if gpu else []) + (COLD_ORDER if cold else [])
    names = [n for n in order if only is None or any(o in n for o in only.split(","))]
    tmp = tempfile.mkdtemp(prefix="th5-bench-", dir=workdir)
    ctx = Ctx(tmp, int(size_gb * 1e9), keys)
    rows: list[dict[str, Any]] = []
    try:
        needs = set(names)
        if any(n.startswith(("R.", "L.", "G.", "C.")) for n in needs):
            for w in ("L.write raw bytes", "W.tensorstore_h5 save", "W.torch.save", "W.safetensors save_file",
                      "W.pickle header + raw storages", "W.naive h5py create_dataset(data=t.numpy())",
                      "W.tensorizer TensorSerializer"):
                if w not in needs:
                    _run_worker(w, ctx)  # produce the files the read contenders need
        if any(n.startswith("K.") for n in needs):
            prepare_keys_files(ctx)
        if any(n.startswith("S.") and "load" in n for n in needs):
            for w in ("S.tensorstore_h5 save small objects", "S.torch.save small objects"):
                if w not in needs:
                    _run_worker(w, ctx)
        settle = settle_seconds() if settle is None else settle
        if settle:
            echo(f"reads and writes start {settle:g} s after memory was last freed (--settle; see bench/README.md)")
        last_exit = time.time()
        bar = _contender_bar(len(names) * repeat)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(repeat):  # rounds over every contender: a slow spell of the machine hits all alike
            if bar is None and r:
                print(f"tensorstore-h5 bench: round {r + 1} of {repeat}", file=sys.stderr)
            for name in names:
                if results[name] and "skip" in results[name][0]:
                    continue
                not_before = last_exit + settle if CONTENDERS[name][0] in SETTLED_GROUPS else 0.0
                results[name].append(_run_worker(name, ctx, not_before, settle, profile))
                last_exit = time.time()
                if bar is None and "seconds" in results[name][-1]:  # a log: a run cut short still shows its figures
                    print(f"tensorstore-h5 bench: round {r + 1}: {name}: {results[name][-1]['seconds'] * 1e3:.1f} ms",
                          file=sys.stderr)
                if CONTENDERS[name][0] == "replace":  # only these read them: give the page cache back
                    for leftover in ("raw-replaced.bin", "replaced.h5", "replaced.pt"):
                        _fresh(ctx.path(leftover))
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        skipped = {name: res[0]["skip"] for name, res in results.items() if res and "skip" in res[0]}
        for name in names:
            if name in skipped:
                echo(f"{name:<62} skipped: {skipped[name]}")
                continue
            secs = [r["seconds"] for r in results[name]]
            row = {"name": name, "group": CONTENDERS[name][0], "bytes": results[name][0]["bytes"], "best_s": min(secs),
                   "median_s": statistics.median(secs), "peak_mib": max(r["peak_bytes"] for r in results[name]) / 2**20}
            row["best_gbps"] = row["bytes"] / row["best_s"] / 1e9 if row["bytes"] else None
            row["median_gbps"] = row["bytes"] / row["median_s"] / 1e9 if row["bytes"] else None
            rows.append(row)
            echo(_format(row))
        _ratios(rows, echo)
        if profile:
            for name in names:
                if name in skipped:
                    continue
                fastest = min(results[name], key=lambda r: r["seconds"])
                echo(f"\nprofile of {name} (its fastest run, {fastest['seconds'] * 1e3:.1f} ms under cProfile):")
                echo(fastest["profile"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if out:
        with open(out, "w") as f:
            json.dump({"size_gb": size_gb, "keys": keys, "repeat": repeat, "settle_s": settle, "machine": _machine(),
                       "rows": rows}, f, indent=1)
    return rows


def _contender_bar(total: int) -> Any:
    """A progress bar over contender runs in interactive output (None otherwise)."""
    from .display import interactive

    if not interactive():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", leave=False)


def _machine() -> str:
    return f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, torch {torch.__version__}"


def _format(row: dict[str, Any]) -> str:
    big = row["bytes"] >= 10**8  # GB/s of a few hundred kB would read 0.00
    speed = f"best {row['best_gbps']:7.2f} GB/s  med {row['median_gbps']:6.2f}" if big else \
        f"best {row['best_s'] * 1e3:7.1f} ms    med {row['median_s'] * 1e3:6.1f} ms"
    return f"{row['name']:<62} {speed}  peak {row['peak_mib']:7.0f} MiB"


def _ratios(rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    by = {r["name"]: r for r in rows}

    def ratio(a: str, b: str, label: str, time_ratio: bool = False) -> None:
        if a in by and b in by:
            ra, rb = by[a], by[b]
            values = []
            for key in ("best_s", "median_s"):
                if key in ra and key in rb:
                    values.append(ra[key] / rb[key] if time_ratio else rb[key] / ra[key])
            echo(f"  {label:<70} " + " ".join(f"{v:6.2f}" for v in values))

    echo("\nratios of best times, then of medians (> 1 means tensorstore_h5 is faster, except where it says 'time')")
    fresh = [by[n] for n in ("L.readinto fresh, 2 threads", "L.readinto fresh, 2 threads + huge pages") if n in by]
    if fresh:  # the better of the two fresh-memory limits, against the better of the two loads
        by["L.readinto fresh, best"] = min(fresh, key=lambda r: r["best_s"])
        loads = [by[n] for n in ("R.tensorstore_h5 load", "R.tensorstore_h5 load (io.HUGEPAGES = True)") if n in by]
        if loads:
            by["R.tensorstore_h5 load, best"] = min(loads, key=lambda r: r["best_s"])
        ratio("R.tensorstore_h5 load", "L.readinto fresh, best", "load (default) / best raw readinto fresh (target >= 0.9)")
        ratio("R.tensorstore_h5 load, best", "L.readinto fresh, best", "load (better of 4 KiB / huge pages) / best raw readinto fresh")
    ratio("R.tensorstore_h5 load", "R.torch.load(weights_only)", "load vs torch.load")
    ratio("R.tensorstore_h5 load", "R.safetensors load_file + clone", "load vs safetensors load_file + clone (>= 1)")
    ratio("R.tensorstore_h5 load", "R.tensorizer TensorDeserializer", "load vs tensorizer (>= 1)")
    ratio("R.tensorstore_h5 load", "R.runai-model-streamer SafetensorsStreamer + clone", "load vs runai-model-streamer (>= 1)")
    ratio("R.tensorstore_h5 load(verify=True)", "R.tensorstore_h5 load", "time: load(verify=True) / load (the cost of checking)",
          True)
    ratio("R.tensorstore_h5 load(mmap) + touch", "R.torch.load(mmap) + touch", "load(mmap)+touch vs torch.load(mmap)+touch (>= 1)")
    ratio("R.tensorstore_h5 load(mmap) + touch", "R.safetensors load_file + touch", "load(mmap)+touch vs safetensors+touch (>= 1)")
    ratio("R.tensorstore_h5 load_into (touched targets)", "L.readinto touched, 2 threads", "load_into / raw readinto touched (>= 0.9)")
    ratio("R.tensorstore_h5 load_into (touched targets)", "R.safetensors safe_open get_tensor + copy_ (touched targets)",
          "load_into vs safe_open + copy_")
    ratio("W.tensorstore_h5 save", "L.write raw bytes", "save / raw write (>= 0.8)")
    ratio("W.tensorstore_h5 save", "W.safetensors save_file", "save vs safetensors save_file")
    ratio("W.tensorstore_h5 save", "W.torch.save", "save vs torch.save")
    ratio("W.tensorstore_h5 save(direct=True)", "W.torch.save", "save(direct=True) vs torch.save")
    ratio("W.tensorstore_h5 save(direct=True)", "W.tensorstore_h5 save", "save(direct=True) vs save")
    ratio("W.tensorstore_h5 save_async: the caller's stall", "W.torch.save", "time: save_async stall / torch.save (<= 0.3)", True)
    ratio("W.tensorstore_h5 save_async: until written", "W.tensorstore_h5 save", "time: save_async until written / save", True)
    ratio("W.tensorstore_h5 save over an existing file", "L.write raw bytes over an existing file (in place)",
          "save over a file / raw write over it in place")
    ratio("W.tensorstore_h5 save over an existing file", "W.torch.save over an existing file",
          "save over a file vs torch.save over it")
    for part, label in (("R.tensorstore_h5 select 1% of keys", "select 1% of keys"),
                        ("R.tensorstore_h5 1% row slice of every tensor", "1% row slices")):
        if part in by and "R.tensorstore_h5 load" in by and by["R.tensorstore_h5 load"]["bytes"]:
            share = by[part]["bytes"] / by["R.tensorstore_h5 load"]["bytes"]
            target = "0.02" if "keys" in label else "0.05"
            ratio(part, "R.tensorstore_h5 load", f"time: {label} / full load (<= {target}; {share:.1%} of the bytes)", True)
    ratio("R.tensorstore_h5 1% row slice of every tensor", "R.safetensors get_slice 1% rows of every tensor",
          "time: 1% row slices / safetensors get_slice (<= 1.2)", True)
    ratio("K.tensorstore_h5 open + keys() (10,000 keys)", "K.safetensors safe_open + keys() (10,000 keys)",
          "time: open+keys 10k / safetensors (<= 1)", True)
    ratio("K.tensorstore_h5 load (10,000 keys)", "K.safetensors load_file (10,000 keys)",
          "load of 10k small tensors vs safetensors load_file")
    ratio("S.tensorstore_h5 save small objects", "S.torch.save small objects", "small objects save vs torch.save (>= 1)")
    ratio("S.tensorstore_h5 load small objects", "S.torch.load small objects", "small objects load vs torch.load (>= 1)")
    limits = [by[n] for n in GPU_ORDER[:2] if n in by]  # reading with io.IO_THREADS threads, and the copy
    if len(limits) == 2:  # the slower of the two stages bounds a load to the GPU
        by["G.L.min(read pinned, H2D)"] = {k: max(r[k] for r in limits) for k in ("best_s", "median_s") if all(k in r for r in limits)}
        for name in ("G.tensorstore_h5 load(device=cuda)", "G.tensorstore_h5 load_into (CUDA targets)"):
            ratio(name, "G.L.min(read pinned, H2D)", name[2:] + " / min(read pinned, H2D) (>= 0.85)")
        ratio("G.tensorstore_h5 load(device=cuda)", "G.torch.load(map_location=cuda)", "GPU load vs torch.load(map_location=cuda)")
        ratio("G.tensorstore_h5 load(device=cuda)", "G.safetensors load_file(device=cuda)", "GPU load vs safetensors load_file(cuda)")
        if "G.tensorstore_h5 load(device=cuda)" in by:
            echo(f"  {'GPU load peak host RSS growth (MiB; <= staging 128 + 256)':<70} "
                 f"{by['G.tensorstore_h5 load(device=cuda)']['peak_mib']:6.0f}")
    peers = [by[n] for n in COLD_ORDER[4:] if n in by]
    if peers and "C.tensorstore_h5 load (cold)" in by:
        by["C.best peer (cold)"] = min(peers, key=lambda r: r["best_s"])
        ratio("C.tensorstore_h5 load (cold)", "C.best peer (cold)", f"cold load vs the best cold peer ({by['C.best peer (cold)']['name'][2:]}; >= 1)")
        ratio("C.tensorstore_h5 load (cold)", "C.L.O_DIRECT reads of the file, 2 threads (cold)", "cold load / O_DIRECT disk limit (>= 0.9)")
        ratio("C.tensorstore_h5 load (cold)", "C.L.buffered reads of the file, 2 threads (cold)", "cold load / buffered disk limit")
    if "R.tensorstore_h5 items() streaming" in by and "R.safetensors safe_open streaming" in by:
        echo(f"  {'streaming peak RSS growth (MiB), tensorstore_h5 vs safetensors':<70} "
             f"{by['R.tensorstore_h5 items() streaming']['peak_mib']:6.0f} vs "
             f"{by['R.safetensors safe_open streaming']['peak_mib']:.0f}")
    merge = [by.get(n) for n in ("M.tensorstore_h5 merge 3 checkpoints key by key (items + Writer)",
                                 "M.safetensors merge 3 checkpoints (safe_open + save_file)")]
    if merge[0]:
        peer = f", safetensors {merge[1]['peak_mib']:.0f}" if merge[1] else ""
        echo(f"  {'merge of 3 checkpoints: peak RSS growth (MiB) / one input (MiB)':<70} "
             f"{merge[0]['peak_mib']:6.0f} / {merge[0]['bytes'] / 2**20:.0f}{peer}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "worker":
        name, d, size, keys = args[1], args[2], int(args[3]), int(args[4])
        not_before = float(args[5]) if len(args) > 5 else 0.0
        settle = float(args[6]) if len(args) > 6 else 0.0
        profile = int(args[7]) if len(args) > 7 else 0
        print(json.dumps(worker(name, Ctx(d, size, keys), not_before, settle, profile)))
        return 0
    import argparse

    from .bench_args import add_arguments

    p = argparse.ArgumentParser(prog="tensorstore-h5 bench")
    add_arguments(p)
    return run_args(p.parse_args(args))


def run_args(a: Any) -> int:
    """Run what the options of :func:`add_arguments` ask for (parsed into ``a``); returns the
    exit status. Shared by ``python -m tensorstore_h5.bench`` and ``tensorstore-h5 bench``."""
    if a.distributed:
        from .bench_distributed import run as run_distributed

        rows = run_distributed(2**30 / 1e9 if a.size_gb == 2.0 else a.size_gb, 64 if a.keys == 300 else a.keys, a.repeat,
                               tuple(int(r) for r in a.ranks.split(",")), a.dir, a.settle, sync_files=a.sync_files,
                               cold_loads=a.cold_loads)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.past_ram:
        from .bench_past_ram import run as run_past_ram

        rows = run_past_ram(28.0 if a.size_gb == 2.0 else a.size_gb, a.keys, a.dir)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.remote:
        from .bench_remote import run as run_remote

        rows = run_remote(min(a.size_gb, 0.5) if a.size_gb == 2.0 else a.size_gb, min(a.keys, 100), a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.compression:
        from .bench_compression import run as run_compression

        rows = run_compression(a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.gpu and not torch.cuda.is_available():
        print("tensorstore-h5 bench --gpu: CUDA is not available on this machine", file=sys.stderr)
        return 1
    run(a.size_gb, a.keys, a.repeat, a.only, a.dir, a.json, gpu=a.gpu, settle=a.settle, profile=a.profile, cold=a.cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
