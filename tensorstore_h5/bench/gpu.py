"""The GPU group (G., ``tensorstore-h5 bench --gpu``; ``bench/gpu_check.sh`` runs it on a lent
GPU): loads to CUDA against their limits and their peers. Each run is a fresh worker process
that makes CUDA's context before the clock, so every figure is the first load in a process
(what a script gets).

Two checkpoints, each with its raw bytes for the limits: the default (``ckpt.*``, ``raw.bin``:
2 GB in 296 tensors) and an optimizer state of 6,000 tensors (``optim.*``, ``optim.bin``: 2,000
parameters' ``step``, ``exp_avg`` and ``exp_avg_sq``, ~0.2x the default's bytes, a third of the
tensors 0-d; made by :func:`prepare_gpu_files`). The limit of a load is the slower of reading
the file into pinned memory with the library's I/O threads and the pinned host-to-device copy.

Peers: ``torch.load(map_location=cuda)``, safetensors ``load_file(device=cuda)``, fastsafetensors'
``fastsafe_open`` with GDS off (``nogds=True``: its bounce-buffer path; the lent machines are VMs
without the nvidia-fs driver; each tensor is a view of one device buffer holding the file), and
kvikio's ``CuFile.read`` in compatibility mode (POSIX reads by its thread pool, as many threads
as the library's, into one CUDA buffer: the file's bytes, no tensors). Partial loads to the GPU:
1 % of the keys (every 100th in saved order, the same keys for all) and a 1 % row slice of every
tensor.

``TH5_BENCH_DEVICE=cpu`` runs the contenders' code on the CPU (plain buffers for pinned ones):
what the tests check without a GPU. Its figures mean nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .contenders import Ctx, Timed, contender
from .measure import Skip, peer

__all__ = ["GPU_ORDER", "DEVICE_ENV", "OPTIM", "prepare_gpu_files", "gpu_ratios"]

DEVICE_ENV = "TH5_BENCH_DEVICE"
"""Environment variable: ``cpu`` runs the G. contenders on the CPU (tests only)."""

OPTIM = "(6,000 tensors)"
"""The suffix of the contenders that read the optimizer-state checkpoint."""

_FILES = {"": ("ckpt", "raw.bin"), OPTIM: ("optim", "optim.bin")}  # suffix -> (stem of the checkpoints, raw bytes)


def _device() -> torch.device:
    """The device the contenders load to; CUDA's context is made here, before the clock."""
    if os.environ.get(DEVICE_ENV) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device (the G. contenders need one: bench/gpu_check.sh on a GPU machine)")
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    return torch.device("cuda")


def _where(dev: torch.device) -> str:
    """``dev`` as the peers' device strings spell it (``cuda:0``, ``cpu``)."""
    return f"cuda:{torch.cuda.current_device()}" if dev.type == "cuda" else "cpu"


def _host(n: int) -> torch.Tensor:
    """``n`` bytes of host memory, touched, pinned where CUDA is."""
    buf = torch.zeros(n, dtype=torch.uint8)
    return buf.pin_memory() if torch.cuda.is_available() else buf


def _synced(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` timed until the device has finished what it queued."""
    def op() -> Any:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return result
    return op


def _data(ctx: Ctx, stem: str) -> int:
    import tensorstore_h5 as th5

    with th5.open(ctx.path(f"{stem}.h5")) as s:
        return s.nbytes


def _peer_safetensors() -> Any:
    return peer("safetensors.torch", "safetensors")


def _fastsafetensors(direct: bool = False) -> Any:
    """The fastsafetensors module, reading through the page cache as every contender does
    (``direct``: with O_DIRECT, its default on local file systems, from the disk past the
    cached pages). The setting is read from the environment on each open: this worker's only."""
    fst = peer("fastsafetensors", "fastsafetensors")
    os.environ["FASTSAFETENSORS_ODIRECT"] = "1" if direct else "0"
    return fst


def prepare_gpu_files(ctx: Ctx) -> None:
    """The optimizer-state checkpoint of the ``(6,000 tensors)`` contenders in each format,
    and its raw bytes (untimed): about a fifth of ``ctx.size``."""
    import tensorstore_h5 as th5
    from safetensors.torch import save_file

    from .synthetic import bench_optimizer_state

    sd = bench_optimizer_state(ctx.size // 4)
    th5.save(sd, ctx.path("optim.h5"))
    save_file(sd, ctx.path("optim.safetensors"))
    torch.save(sd, ctx.path("optim.pt"))
    with open(ctx.path("optim.bin"), "wb") as f:
        for t in sd.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


# -- the limits: the file into pinned memory, and the copy to the device


def _limits(suffix: str) -> None:
    raw = _FILES[suffix][1]
    tail = f" {suffix}" if suffix else ""

    @contender(f"G.L.file read into pinned memory, I/O threads{tail}", "gpu-limit", reads=(raw,))
    def _(ctx: Ctx) -> Timed:
        """As many reading threads as tensorstore_h5 uses (parallel.IO_THREADS: 8 on a machine of
        8 or more cores), so the limit is not set by fewer threads than the load it bounds."""
        from ..storage import parallel
        from .contenders import _preadv_all

        _device()
        n = os.path.getsize(ctx.path(raw))
        buf = _host(n)
        return (lambda: _preadv_all(ctx.path(raw), [buf], parallel.IO_THREADS)), n

    @contender(f"G.L.pinned host-to-device copy{tail}", "gpu-limit", reads=(raw,))
    def _(ctx: Ctx) -> Timed:
        dev = _device()
        n = os.path.getsize(ctx.path(raw))
        src = _host(n)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        return _synced(lambda: dst.copy_(src, non_blocking=True)), n


_limits("")
_limits(OPTIM)


# -- whole checkpoints to the device


def _loads(suffix: str) -> None:
    stem = _FILES[suffix][0]
    tail = f" {suffix}" if suffix else ""
    h5, pt, st = f"{stem}.h5", f"{stem}.pt", f"{stem}.safetensors"

    @contender(f"G.tensorstore_h5 load(device=cuda){tail}", "gpu", reads=(h5,))
    def _(ctx: Ctx) -> Timed:
        import tensorstore_h5 as th5

        dev = _device()
        return _synced(lambda: th5.load(ctx.path(h5), device=dev)), _data(ctx, stem)

    @contender(f"G.tensorstore_h5 load(device=cuda, verify=False){tail}", "gpu", reads=(h5,))
    def _(ctx: Ctx) -> Timed:
        """The same load without checking the stored checksums (the default checks each block in
        the staging buffer that holds it): what checking costs a load to the GPU."""
        import tensorstore_h5 as th5

        dev = _device()
        return _synced(lambda: th5.load(ctx.path(h5), device=dev, verify=False)), _data(ctx, stem)

    @contender(f"G.tensorstore_h5 load_into (CUDA targets){tail}", "gpu", reads=(h5,))
    def _(ctx: Ctx) -> Timed:
        import tensorstore_h5 as th5

        dev = _device()
        with th5.open(ctx.path(h5)) as s:
            target = {k: torch.empty(s[k].shape, dtype=s[k].dtype, device=dev) for k in s.keys()}

        def op() -> dict[str, torch.Tensor]:
            th5.load_into(target, ctx.path(h5))
            return target
        return _synced(op), _data(ctx, stem)

    @contender(f"G.torch.load(map_location=cuda){tail}", "gpu", reads=(pt,))
    def _(ctx: Ctx) -> Timed:
        dev = _device()
        return _synced(lambda: torch.load(ctx.path(pt), weights_only=True, map_location=dev)), _data(ctx, stem)

    @contender(f"G.safetensors load_file(device=cuda){tail}", "gpu", reads=(st,))
    def _(ctx: Ctx) -> Timed:
        load_file = _peer_safetensors().load_file
        dev = _device()
        return _synced(lambda: load_file(ctx.path(st), device=_where(dev))), _data(ctx, stem)

    for direct, mode in ((False, ""), (True, ", its default O_DIRECT reads")):
        if direct and suffix:
            continue  # its default, for the 2 GB checkpoint only: the other row is the like-for-like one

        @contender(f"G.fastsafetensors fastsafe_open(nogds) + get_tensor{mode}{tail}", "gpu", reads=(st,))
        def _(ctx: Ctx, direct: bool = direct) -> Timed:
            """Its own recommended use without GDS: ``fastsafe_open(..., nogds=True)`` (its
            default 16 MiB bounce buffers and 16 copy threads), then ``get_tensor`` of every key;
            through the page cache, or with ``direct`` as by default (see :func:`_fastsafetensors`)."""
            fst = _fastsafetensors(direct)
            dev = _device()
            where = _where(dev)

            def op() -> dict[str, torch.Tensor]:
                with fst.fastsafe_open(filenames=[ctx.path(st)], nogds=True, device=where) as f:
                    return {k: f.get_tensor(k) for k in f.keys()}
            return _synced(op), _data(ctx, stem)


_loads("")
_loads(OPTIM)


@contender("G.kvikio CuFile.read, compatibility mode (the file's bytes, one buffer)", "gpu", reads=("raw.bin",))
def _(ctx: Ctx) -> Timed:
    """The raw tensor bytes (``raw.bin``) read into one new CUDA buffer by kvikio without GDS
    (``compat_mode`` ON: POSIX reads by its thread pool through its bounce buffers), with as
    many threads as the library's I/O threads and through the page cache (``auto_direct_io_read``
    off, as the files of every contender are cached); its other settings its defaults."""
    try:
        import kvikio
        import kvikio.defaults
    except (ImportError, OSError) as e:  # a wheel that finds no CUDA libraries raises OSError
        raise Skip(f"kvikio cannot be imported ({e}; pip install kvikio-cu12 or kvikio-cu13)") from None
    from ..storage import parallel

    dev = _device()  # (kvikio reads into host memory too: on the CPU, for the tests)
    settings = {"compat_mode": kvikio.CompatMode.ON, "num_threads": parallel.IO_THREADS}
    try:  # its reads through the page cache, as every other contender's (O_DIRECT would go to the disk)
        kvikio.defaults.set({**settings, "auto_direct_io_read": False})
    except (KeyError, ValueError):  # a kvikio without that setting reads through the cache anyway
        kvikio.defaults.set(settings)
    path = ctx.path("raw.bin")
    n = os.path.getsize(path)

    def op() -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
        with kvikio.CuFile(path, "r") as f:
            got = f.read(buf)
        if got != n:
            raise RuntimeError(f"kvikio read {got} of {n} bytes")
        return buf
    return _synced(op), n


# -- parts of the default checkpoint to the device


def _keys_and_rows(ctx: Ctx) -> tuple[list[str], dict[str, int], int, int]:
    """Every 100th key in saved order, the rows of each tensor's 1 % slice, and the bytes of
    each partial load (keys, slices)."""
    import tensorstore_h5 as th5

    with th5.open(ctx.path("ckpt.h5")) as s:
        keys = s.keys()[::100]
        rows = {k: max(1, len(s[k]) // 100) for k in s.keys()}
        key_bytes = sum(s[k].nbytes for k in keys)
        row_bytes = sum(s[k].nbytes // len(s[k]) * rows[k] for k in s.keys())
    return keys, rows, key_bytes, row_bytes


@contender("G.tensorstore_h5 load 1% of keys (cuda)", "gpu-partial", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    keys, _, nbytes, _ = _keys_and_rows(ctx)
    dev = _device()
    return _synced(lambda: th5.load(ctx.path("ckpt.h5"), select=keys, device=dev)), nbytes


@contender("G.safetensors safe_open(device=cuda) 1% of keys", "gpu-partial", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    safe_open = peer("safetensors", "safetensors").safe_open
    keys, _, nbytes, _ = _keys_and_rows(ctx)
    dev = _device()

    def op() -> dict[str, torch.Tensor]:
        with safe_open(ctx.path("ckpt.safetensors"), "pt", device=_where(dev)) as f:
            return {k: f.get_tensor(k) for k in keys}
    return _synced(op), nbytes


@contender("G.fastsafetensors 1% of keys (set_tensor_filter)", "gpu-partial", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    """Its loader with a tensor filter: its nogds copier reads only the kept tensors' bytes."""
    fst = _fastsafetensors()
    keys, _, nbytes, _ = _keys_and_rows(ctx)
    wanted = frozenset(keys)
    dev = _device()
    where = _where(dev)

    def op() -> dict[str, torch.Tensor]:
        loader = fst.SafeTensorsFileLoader(None, where, nogds=True)
        try:
            loader.set_tensor_filter(wanted.__contains__)
            loader.add_filenames({0: [ctx.path("ckpt.safetensors")]})
            buffers = loader.copy_files_to_device()
            try:
                return {k: buffers.get_tensor(k) for k in keys}
            finally:
                buffers.close()
        finally:
            loader.close()
    return _synced(op), nbytes


@contender("G.tensorstore_h5 1% row slice of every tensor (cuda)", "gpu-partial", reads=("ckpt.h5",))
def _(ctx: Ctx) -> Timed:
    """``TensorHandle.read(out=..., index=...)`` into a new CUDA tensor per slice: the rows go
    through the staging buffers, no CPU tensor is made."""
    import tensorstore_h5 as th5

    _, rows, _, nbytes = _keys_and_rows(ctx)
    dev = _device()

    def op() -> dict[str, torch.Tensor]:
        out = {}
        with th5.open(ctx.path("ckpt.h5")) as s:
            for k, n in rows.items():
                h = s[k]
                out[k] = h.read(torch.empty((n, *h.shape[1:]), dtype=h.dtype, device=dev), index=slice(0, n))
        return out
    return _synced(op), nbytes


@contender("G.safetensors get_slice 1% rows of every tensor (cuda)", "gpu-partial", reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    safe_open = peer("safetensors", "safetensors").safe_open
    _, rows, _, nbytes = _keys_and_rows(ctx)
    dev = _device()

    def op() -> dict[str, torch.Tensor]:
        with safe_open(ctx.path("ckpt.safetensors"), "pt", device=_where(dev)) as f:
            return {k: f.get_slice(k)[:n].to(dev) for k, n in rows.items()}
    return _synced(op), nbytes


@contender("G.fastsafetensors 1% row slices (the whole file to the GPU, sliced)", "gpu-partial",
           reads=("ckpt.safetensors",))
def _(ctx: Ctx) -> Timed:
    """It has no partial read of rows: the file goes to the device, each slice is cloned out
    of it and the file's buffer freed."""
    fst = _fastsafetensors()
    _, rows, _, nbytes = _keys_and_rows(ctx)
    dev = _device()
    where = _where(dev)

    def op() -> dict[str, torch.Tensor]:
        with fst.fastsafe_open(filenames=[ctx.path("ckpt.safetensors")], nogds=True, device=where) as f:
            return {k: f.get_tensor(k)[:n].clone() for k, n in rows.items()}
    return _synced(op), nbytes


GPU_ORDER = [
    "G.L.file read into pinned memory, I/O threads", "G.L.pinned host-to-device copy", "G.tensorstore_h5 load(device=cuda)",
    "G.tensorstore_h5 load(device=cuda, verify=False)",
    "G.tensorstore_h5 load_into (CUDA targets)", "G.torch.load(map_location=cuda)",
    "G.safetensors load_file(device=cuda)", "G.fastsafetensors fastsafe_open(nogds) + get_tensor",
    "G.fastsafetensors fastsafe_open(nogds) + get_tensor, its default O_DIRECT reads",
    "G.kvikio CuFile.read, compatibility mode (the file's bytes, one buffer)",
    f"G.L.file read into pinned memory, I/O threads {OPTIM}", f"G.L.pinned host-to-device copy {OPTIM}",
    f"G.tensorstore_h5 load(device=cuda) {OPTIM}", f"G.tensorstore_h5 load(device=cuda, verify=False) {OPTIM}",
    f"G.tensorstore_h5 load_into (CUDA targets) {OPTIM}",
    f"G.torch.load(map_location=cuda) {OPTIM}", f"G.safetensors load_file(device=cuda) {OPTIM}",
    f"G.fastsafetensors fastsafe_open(nogds) + get_tensor {OPTIM}",
    "G.tensorstore_h5 load 1% of keys (cuda)", "G.safetensors safe_open(device=cuda) 1% of keys",
    "G.fastsafetensors 1% of keys (set_tensor_filter)",
    "G.tensorstore_h5 1% row slice of every tensor (cuda)", "G.safetensors get_slice 1% rows of every tensor (cuda)",
    "G.fastsafetensors 1% row slices (the whole file to the GPU, sliced)",
]
"""The GPU group in the table's order (``tensorstore-h5 bench --gpu``)."""


def gpu_ratios(by: dict[str, dict[str, Any]], ratio: Callable[..., None], echo: Callable[[str], None]) -> None:
    """The GPU group's lines of the ratio table (``ratio(a, b, label, time_ratio=False)`` prints
    one; ``by``: rows by name, to which the limit rows ``G.L.min(...)`` are added)."""
    for suffix in ("", OPTIM):
        tail = f" {suffix}" if suffix else ""
        of = f" of {suffix[1:-1]}" if suffix else ""
        limits = [by.get(f"G.L.file read into pinned memory, I/O threads{tail}"), by.get(f"G.L.pinned host-to-device copy{tail}")]
        ours = f"G.tensorstore_h5 load(device=cuda){tail}"
        if all(limits):  # the slower of the two stages bounds a load to the GPU
            limit = f"G.L.min(read pinned, H2D){tail}"
            by[limit] = {k: max(r[k] for r in limits if r) for k in ("best_s", "median_s")}
            ratio(ours, limit, f"GPU load{of} / min(read pinned, H2D) (>= 0.85)")
            ratio(f"G.tensorstore_h5 load_into (CUDA targets){tail}", limit, f"load_into CUDA targets{of} / min(read pinned, H2D) (>= 0.85)")
            ratio(f"G.tensorstore_h5 load(device=cuda, verify=False){tail}", limit,
                  f"GPU load{of}, verify=False / min(read pinned, H2D)")
        ratio(ours, f"G.fastsafetensors fastsafe_open(nogds) + get_tensor{tail}", f"GPU load{of} vs fastsafetensors (>= 1)")
        if not suffix:
            ratio(ours, "G.fastsafetensors fastsafe_open(nogds) + get_tensor, its default O_DIRECT reads",
                  "GPU load vs fastsafetensors, its default O_DIRECT reads")
        if not suffix:
            ratio(ours, "G.kvikio CuFile.read, compatibility mode (the file's bytes, one buffer)",
                  "GPU load vs kvikio compat-mode read of the bytes (>= 1)")
        ratio(ours, f"G.torch.load(map_location=cuda){tail}", f"GPU load{of} vs torch.load(map_location=cuda)")
        ratio(ours, f"G.safetensors load_file(device=cuda){tail}", f"GPU load{of} vs safetensors load_file(cuda)")
        if ours in by:
            echo(f"  {f'GPU load{of}: peak host RSS growth (MiB; <= 256)':<70} {by[ours]['peak_mib']:6.0f}")
    for ours, label, peers in (
            ("G.tensorstore_h5 load 1% of keys (cuda)", "1% of keys to the GPU",
             ("G.safetensors safe_open(device=cuda) 1% of keys", "G.fastsafetensors 1% of keys (set_tensor_filter)")),
            ("G.tensorstore_h5 1% row slice of every tensor (cuda)", "1% row slices to the GPU",
             ("G.safetensors get_slice 1% rows of every tensor (cuda)",
              "G.fastsafetensors 1% row slices (the whole file to the GPU, sliced)"))):
        for other in peers:
            ratio(ours, other, f"{label} vs {other[2:].split(' ')[0]}")
