"""The contenders of ``tensorstore-h5 bench``: each registers (:func:`contender`) a function
that, given the bench directory (:class:`Ctx`), sets up untimed and returns the operation to
time and the bytes it moves. Groups by the letter before the first dot: L. the machine's
limits, W. writers, R. readers, C. a cold page cache, M. merges, S./K. small objects and many
keys (G., the GPU: :mod:`.gpu`). :mod:`.runner` runs them, each in a fresh process.
"""

from __future__ import annotations

import os
import pickle  # noqa: S403 - only the peer "pickle header + raw storages" contender uses it
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .measure import drop_caches, fresh, peer, read_file

__all__ = ["CONTENDERS", "READS", "Ctx", "Timed", "contender", "prepare_keys_files"]


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
reads them once, untimed, before the timed run (:func:`warm`)."""


def contender(name: str, group: str, reads: tuple[str, ...] = ()
              ) -> Callable[[Callable[[Ctx], Timed]], Callable[[Ctx], Timed]]:
    """Register a contender of ``group``; ``reads``: the files it reads (see :data:`READS`)."""
    def register(fn: Callable[[Ctx], Timed]) -> Callable[[Ctx], Timed]:
        CONTENDERS[name] = (group, fn)
        READS[name] = reads
        return fn
    return register


def _touch_all(tensors: Any) -> None:
    for t in tensors:
        if t.numel():
            t.view(torch.uint8).sum() if t.element_size() == 1 else t.view(-1)[:: max(1, 4096 // t.element_size())].sum()


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
    path = fresh(ctx.path("raw.bin"))
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
    from ..storage import memory

    n = os.path.getsize(ctx.path("raw.bin"))
    return (lambda: _preadv_all(ctx.path("raw.bin"), [memory.empty((n,), torch.uint8)], 2)), n


@contender("L.readinto fresh, 2 threads + huge pages", "read", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    from ..storage import memory

    memory.HUGEPAGES = True
    n = os.path.getsize(ctx.path("raw.bin"))
    return (lambda: _preadv_all(ctx.path("raw.bin"), [memory.empty((n,), torch.uint8)], 2)), n


@contender("L.readinto touched, 2 threads", "touched", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    n = os.path.getsize(ctx.path("raw.bin"))
    buf = torch.zeros(n, dtype=torch.uint8)
    return (lambda: _preadv_all(ctx.path("raw.bin"), [buf], 2)), n


# -- tensorstore_h5


@contender("W.tensorstore_h5 save", "write")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    path = fresh(ctx.path("ckpt.h5"))
    sd = ctx.state()
    return (lambda: th5.save(sd, path)), ctx.nbytes(sd)


@contender("W.tensorstore_h5 save(direct=True)", "write")
def _(ctx: Ctx) -> Timed:
    """O_DIRECT writes of the tensor data (files.DirectWrites): no fresh page-cache memory."""
    import tensorstore_h5 as th5

    path = fresh(ctx.path("ckpt-direct.h5"))
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


@contender("R.tensorstore_h5 load(verify=False)", "read", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    return (lambda: th5.load(ctx.path("ckpt.h5"), verify=False)), _file_data(ctx)


@contender("W.tensorstore_h5 save_async: the caller's stall", "write")
def _(ctx: Ctx) -> Timed:
    from ..writing.background import save_async

    path = fresh(ctx.path("async.h5"))
    sd = ctx.state()
    save_async(sd, path).result()  # untimed: the first save makes the buffers that later saves reuse
    fresh(path)
    return (lambda: save_async(sd, path)), ctx.nbytes(sd)


@contender("W.tensorstore_h5 save_async: until written", "write")
def _(ctx: Ctx) -> Timed:
    from ..writing.background import save_async

    path = fresh(ctx.path("async.h5"))
    sd = ctx.state()
    save_async(sd, path).result()
    fresh(path)
    return (lambda: save_async(sd, path).result()), ctx.nbytes(sd)


@contender("R.tensorstore_h5 load (memory.HUGEPAGES = True)", "read", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5
    from tensorstore_h5.storage import memory

    memory.HUGEPAGES = True
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


@contender("R.tensorstore_h5 load_into(verify=False) (touched targets)", "prealloc", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    target = _shapes(ctx)
    return (lambda: th5.load_into(target, ctx.path("ckpt.h5"), verify=False)), _file_data(ctx)


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
    path = fresh(ctx.path("ckpt.pt"))
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

    path = fresh(ctx.path("ckpt.safetensors"))
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

    src, out = ctx.path("ckpt.h5"), fresh(ctx.path("merged.h5"))

    def op() -> None:  # the same file as all three inputs: the memory is what is measured
        with th5.open(src) as a, th5.open(src) as b, th5.open(src) as c, th5.Writer(out) as w:
            for (k, x), (_, y), (_, z) in zip(a.items(), b.items(), c.items()):
                w[k] = 0.5 * x + 0.3 * y + 0.2 * z
    return op, _file_data(ctx)


@contender("M.safetensors merge 3 checkpoints (safe_open + save_file)", "stream", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = ctx.path("ckpt.safetensors"), fresh(ctx.path("merged.safetensors"))

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
    tensorizer = peer("tensorizer", "tensorizer")
    path = fresh(ctx.path("ckpt.tensors"))
    sd = ctx.state()

    def op() -> None:
        s = tensorizer.TensorSerializer(path)
        s.write_state_dict(sd)
        s.close()
    return op, ctx.nbytes(sd)


def _tensorizer_load(path: str) -> dict[str, torch.Tensor]:
    tensorizer = peer("tensorizer", "tensorizer")
    d = tensorizer.TensorDeserializer(path, device="cpu")
    out = dict(d.items())
    d.close()
    return out


@contender("R.tensorizer TensorDeserializer", "read", reads=("ckpt.tensors",))
def _(ctx: Ctx) -> Timed:
    peer("tensorizer", "tensorizer")
    return (lambda: _tensorizer_load(ctx.path("ckpt.tensors"))), _file_data(ctx)


def _runai_load(path: str) -> dict[str, torch.Tensor]:
    runai = peer("runai_model_streamer", "runai-model-streamer")
    with runai.SafetensorsStreamer() as st:
        st.stream_file(path)
        return {k: t.clone() for k, t in st.get_tensors()}  # its tensors live in the streamer's buffer


@contender("R.runai-model-streamer SafetensorsStreamer + clone", "read", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    peer("runai_model_streamer", "runai-model-streamer")
    return (lambda: _runai_load(ctx.path("ckpt.safetensors"))), _file_data(ctx)


# -- cold page cache (--cold; root drops the cache before each timed read)


def _cold(op: Callable[[], Any]) -> Callable[[], Any]:
    drop_caches()
    return op


@contender("C.L.O_DIRECT reads of the file, 2 threads (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    path = ctx.path("ckpt.h5")
    return _cold(lambda: read_file(path, True)), os.path.getsize(path)


@contender("C.L.buffered reads of the file, 2 threads (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    path = ctx.path("ckpt.h5")
    return _cold(lambda: read_file(path, False)), os.path.getsize(path)


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
    peer("tensorizer", "tensorizer")
    nbytes = _file_data(ctx)
    return _cold(lambda: _tensorizer_load(ctx.path("ckpt.tensors"))), nbytes


@contender("C.runai-model-streamer + clone (cold)", "cold")
def _(ctx: Ctx) -> Timed:
    peer("runai_model_streamer", "runai-model-streamer")
    nbytes = _file_data(ctx)
    return _cold(lambda: _runai_load(ctx.path("ckpt.safetensors"))), nbytes


# -- the hand-rolled pickle-header stream and naive h5py


@contender("W.pickle header + raw storages", "write")
def _(ctx: Ctx) -> Timed:
    path = fresh(ctx.path("ckpt.raw"))
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

    path = fresh(ctx.path("naive.h5"))
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


@contender("S.libhdf5 metadata: tensorstore_h5 save small objects", "small-write")
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5
    from ..writing import writer

    writer.ENCODE_METADATA = False  # what format/hdf5meta.py replaces: libhdf5 creates the groups and datasets
    obj = _small_objects()
    return (lambda: th5.save(obj, ctx.path("small-libhdf5.h5"))), 2000 * (4 + 128)


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


def prepare_keys_files(ctx: Ctx) -> None:
    """The 10,000-key files for the K. contenders (not timed)."""
    import tensorstore_h5 as th5
    from safetensors.torch import save_file

    sd = {f"blocks.{i // 10}.param{i % 10}": torch.full((4,), float(i)) for i in range(10_000)}
    th5.save(sd, ctx.path("many.h5"))
    save_file(sd, ctx.path("many.safetensors"))

