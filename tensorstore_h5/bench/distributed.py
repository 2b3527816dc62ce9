"""``tensorstore-h5 bench --distributed`` (importing this module imports no torch): DCP save and load through
:class:`~tensorstore_h5.distributed.H5StorageWriter` / ``H5StorageReader`` against DCP's own
``FileSystemWriter`` / ``FileSystemReader``, on the same state dict, with 1 and 2 ranks (gloo on
127.0.0.1), in the same run.

The state dict is ``size`` bytes of global tensors (float32 and bfloat16 matrices, like a
transformer's), held as DTensors sharded by rows (``Shard(0)``) over the ranks. Each round, for
each backend (in alternating order): rank 0 empties the checkpoint directory, every rank waits
``settle`` seconds (this VM gives freed memory back to its hypervisor, see bench/README.md),
then ``dcp.save`` is timed between two barriers; then ``dcp.load`` into preallocated DTensors of
the same placement (files in the page cache: a warm load), then into ``Shard(1)`` DTensors (a
resharding load). Both writers run with ``sync_files=False`` (page cache, no fsync) and one
thread per rank, or with ``sync_files=True`` (DCP's default: every file fsynced; tensorstore_h5
then writes tensor data with ``O_DIRECT``, which leaves none of it in the page cache). Before
every load, rank 0 reads each file of the checkpoint once, untimed, so both backends load warm
(``cold_loads``: it drops the page cache instead, root). GB/s = global bytes / slowest rank's
time.

    python -m tensorstore_h5.bench.distributed --size-gb 1.07 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["run", "main", "add_arguments"]

BACKENDS = ("tensorstore_h5", "FileSystemWriter/Reader")
RESHARD = "resharded load"


def _tensors(size: int, keys: int) -> dict[str, torch.Tensor]:
    """``keys`` matrices of about ``size`` bytes in all, half float32 and half bfloat16, rows of
    4 KiB (float32) / 2 KiB (bfloat16), deterministic contents."""
    import torch

    width = 1024
    per = max(1, size // keys)
    out = {}
    g = torch.Generator().manual_seed(0)
    for i in range(keys):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(2, per // (width * dtype.itemsize))
        out[f"layers.{i // 2}.{'w' if i % 2 == 0 else 'v'}"] = torch.randn(rows, width, generator=g).to(dtype)
    return out


def _worker(rank: int, world: int, port: int, size: int, keys: int, repeat: int, root: str, settle: float,
            result: str, sync_files: bool = False, cold_loads: bool = False) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..distributed import H5StorageReader, H5StorageWriter

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = _tensors(size, keys)
        nbytes = sum(t.nbytes for t in full.values())
        state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}}
        del full
        same = {"model": {k: distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(0)])
                          for k, v in state["model"].items()}}
        other = {"model": {k: distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(1)])
                           for k, v in state["model"].items()}}
        times: dict[str, dict[str, list[float]]] = {b: {"save": [], "load": [], RESHARD: []} for b in BACKENDS}

        def before_load(rank: int, path: str) -> None:
            """Both backends' loads start alike: from a dropped page cache (cold_loads) or with
            every file of the checkpoint read once, untimed (an O_DIRECT save leaves none of its
            bytes cached, FileSystemWriter's all of them)."""
            if rank == 0:
                if cold_loads:
                    _drop_page_cache()
                else:
                    _read_directory(path)
            dist.barrier()

        def timed(fn: Callable[[], Any]) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        for r in range(repeat):
            for backend in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                path = os.path.join(root, f"{'th5' if backend == BACKENDS[0] else 'fs'}{world}")
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    os.makedirs(path)
                dist.barrier()
                time.sleep(settle)
                if backend == BACKENDS[0]:
                    def writer() -> Any:
                        return H5StorageWriter(path, sync_files=sync_files)

                    def reader() -> Any:
                        return H5StorageReader(path)
                else:
                    def writer() -> Any:
                        return dcp.FileSystemWriter(path, sync_files=sync_files)

                    def reader() -> Any:
                        return dcp.FileSystemReader(path)
                times[backend]["save"].append(timed(lambda: dcp.save(state, storage_writer=writer())))
                before_load(rank, path)
                times[backend]["load"].append(timed(lambda: dcp.load(same, storage_reader=reader())))
                before_load(rank, path)
                times[backend][RESHARD].append(timed(lambda: dcp.load(other, storage_reader=reader())))
                if r == 0:  # the loads are right
                    for k, v in state["model"].items():
                        assert torch.equal(same["model"][k].to_local(), v.to_local()), (backend, k)
                        assert torch.equal(other["model"][k].full_tensor(), v.full_tensor()), (backend, k)
                for t in (*same["model"].values(), *other["model"].values()):
                    t.to_local().zero_()
        if rank == 0:
            with open(result, "w") as f:
                json.dump({"bytes": nbytes, "times": times}, f)
    finally:
        dist.destroy_process_group()


def _read_directory(path: str) -> None:
    """Read every file of ``path`` once (into the page cache)."""
    from .measure import read_file

    for name in sorted(os.listdir(path)):
        read_file(os.path.join(path, name), direct=False)


def _drop_page_cache() -> None:
    """Write back and drop the page cache (root); otherwise say so on stderr and go on."""
    from .measure import Skip, drop_caches

    try:
        drop_caches()
    except Skip as e:
        print(f"bench --distributed: {e}; loads are warm for FileSystemReader", file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size_gb: float = 2**30 / 1e9, keys: int = 64, repeat: int = 3, ranks: Sequence[int] = (1, 2),
        directory: str | None = None, settle: float | None = None,
        echo: Callable[[str], None] = print, sync_files: bool = False, cold_loads: bool = False
        ) -> list[dict[str, Any]]:
    """Run the benchmark and print its table; returns one row per (ranks, backend, operation)
    with ``best_gbps``, ``median_gbps`` and the ``seconds`` of every round."""
    import torch
    import torch.multiprocessing as mp

    if settle is None:
        try:
            from .measure import settle_seconds

            settle = settle_seconds()
        except ImportError:
            settle = 0.0
    size = int(size_gb * 1e9)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="th5-bench-dcp-") as root:
        echo(f"DCP save/load of {size / 1e9:.2f} GB in {keys} tensors (DTensor Shard(0)), {repeat} round(s), "
             f"sync_files={sync_files}, loads {'cold' if cold_loads else 'warm'}, settle {settle:g} s; {os.cpu_count()} "
             f"cores, torch {torch.__version__}")
        for world in ranks:
            result = os.path.join(root, f"result{world}.json")
            mp.spawn(_worker, args=(world, _free_port(), size, keys, repeat, root, settle, result, sync_files, cold_loads),
                     nprocs=world, join=True)
            with open(result) as f:
                data = json.load(f)
            for backend in BACKENDS:
                for op, ts in data["times"][backend].items():
                    rows.append({"ranks": world, "backend": backend, "op": op, "bytes": data["bytes"],
                                 "best_gbps": data["bytes"] / min(ts) / 1e9,
                                 "median_gbps": data["bytes"] / statistics.median(ts) / 1e9, "seconds": ts})
            shutil.rmtree(os.path.join(root, f"th5{world}"), ignore_errors=True)
            shutil.rmtree(os.path.join(root, f"fs{world}"), ignore_errors=True)
    echo(_table(rows))
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'ranks':>5}  {'operation':<16} {'tensorstore_h5 GB/s':>20} {'FileSystem GB/s':>17} {'ratio':>12}",
             f"{'':>5}  {'':<16} {'best / median':>20} {'best / median':>17} {'best / med':>12}"]
    by = {(r["ranks"], r["backend"], r["op"]): r for r in rows}
    for world in sorted({r["ranks"] for r in rows}):
        for op in ("save", "load", RESHARD):
            a, b = by.get((world, BACKENDS[0], op)), by.get((world, BACKENDS[1], op))
            if a is None or b is None:
                continue
            lines.append(f"{world:>5}  {op:<16} {a['best_gbps']:>9.2f} / {a['median_gbps']:<8.2f} "
                         f"{b['best_gbps']:>7.2f} / {b['median_gbps']:<7.2f} "
                         f"{a['best_gbps'] / b['best_gbps']:>5.2f} / {a['median_gbps'] / b['median_gbps']:<5.2f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=2**30 / 1e9, help="global state dict size in GB (default 1 GiB)")
    p.add_argument("--keys", type=int, default=64, help="number of tensors")
    p.add_argument("--repeat", type=int, default=3, help="rounds (best and median are reported)")
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes")
    p.add_argument("--dir", help="where to put the checkpoints (default: the temp dir)")
    p.add_argument("--settle", type=float, default=None, help="seconds to wait after emptying a directory")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--sync-files", action="store_true", help="both writers fsync every file (DCP's default)")
    p.add_argument("--cold-loads", action="store_true", help="drop the page cache before every load (root)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorstore_h5.bench.distributed", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    rows = run(a.size_gb, a.keys, a.repeat, tuple(int(r) for r in a.ranks.split(",")), a.dir, a.settle,
               sync_files=a.sync_files, cold_loads=a.cold_loads)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
