"""``tensorstore-h5 bench --remote``: loading over HTTP (a loopback server with byte ranges, in a
process of its own, with and without added latency) against the raw limit and safetensors read
the same way.

For each latency: a full load, a 1 % select (1 % of the keys) and a 1 % row slice of every
tensor through ``th5.load(url)`` / ``th5.open(url)``; the same full load through fsspec's
aiohttp session (``remote.PLAIN_HTTP = False``: what the library's own HTTP client replaces);
the raw limit, every byte range of the tensors' data fetched by concurrent range GETs of 8 MiB three ways: as fsspec issues them
(bytes objects), and by plain sockets from :data:`remote.CONNECTIONS` threads into one buffer
reused from round to round (no page faults: the floor of moving the bytes here) or into fresh
memory (what any loader that makes new tensors pays); the fsspec raw limit plus what a loader
through it adds (new tensors, the bytes copied into them); and safetensors, which reads a URL
only whole (``safe_open`` takes no file object): download + ``safetensors.torch.load``. Best
and median of ``repeat``, taken in rounds over the operations, in this process, each
operation's result freed after its clock stops; bytes moved as the server counted them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..storage import memory, remote
from ..storage.httpranges import RangeClient
from ..storage.memory import tensor_buffer

__all__ = ["run"]

SOCKETS = "raw limit: plain sockets, one reused buffer"
SOCKETS_FRESH = "raw limit: plain sockets, fresh memory"
FSSPEC_LOAD = "tensorstore_h5 load(url), fsspec client"


def run(size_gb: float = 0.5, keys: int = 100, repeat: int = 3, latencies: tuple[float, ...] = (0.0, 0.02),
        echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure; print the table and ratios; return the rows."""
    import fsspec
    from safetensors.torch import load as st_load
    from safetensors.torch import save_file

    import tensorstore_h5 as th5
    from .loopback import ServerProcess
    from .synthetic import bench_state_dict

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="th5-bench-remote-") as tmp:
        sd = bench_state_dict(int(size_gb * 1e9), keys)
        th5.save(sd, os.path.join(tmp, "ckpt.h5"))
        save_file(sd, os.path.join(tmp, "ckpt.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        names = list(sd)
        picked = names[:: 100]
        picked_bytes = sum(sd[k].numel() * sd[k].element_size() for k in picked)
        slice_bytes = sum(sd[k][: max(1, len(sd[k]) // 100)].numel() * sd[k].element_size() for k in names)
        del sd
        server = ServerProcess(tmp)  # not in this process: it would share the client's interpreter lock
        try:
            url, st_url = server.url("ckpt.h5"), server.url("ckpt.safetensors")
            with th5.open(url) as s:
                ranges = [(e.offset, e.nbytes) for e in (s._entry(k).extent for k in names)]
            echo(f"{'latency':>8} {'operation':<44} {'best s':>8} {'median s':>8} {'GB/s':>7} {'MB moved':>9} "
                 f"{'requests':>8}")
            for latency in latencies:
                server.control(latency=latency)
                fs = fsspec.filesystem("http", skip_instance_cache=True)
                piece = 8 << 20

                def raw() -> list[bytes]:
                    starts = [o + a for o, n in ranges for a in range(0, n, piece)]
                    ends = [min(o + n, s + piece) for o, n in ranges for s in range(o, o + n, piece)]
                    return fs.cat_ranges([url] * len(starts), starts, ends)

                client = RangeClient(url)
                pool = ThreadPoolExecutor(remote.CONNECTIONS)
                reused = torch.empty(nbytes, dtype=torch.uint8)
                reused.fill_(0)

                def sockets_into(memory: Callable[[int], memoryview]) -> list[memoryview]:
                    jobs, views = [], []
                    for o, n in ranges:
                        views.append(memory(n))
                        jobs += [pool.submit(client.get_into, o + a, views[-1][a:a + piece]) for a in range(0, n, piece)]
                    for j in jobs:
                        j.result()
                    return views

                def raw_sockets() -> list[memoryview]:
                    at = [0]

                    def memory(n: int) -> memoryview:
                        at[0] += n
                        return tensor_buffer(reused[at[0] - n:at[0]])
                    return sockets_into(memory)

                def raw_sockets_fresh() -> list[memoryview]:
                    return sockets_into(lambda n: memory.tensor_buffer(memory.empty((n,), torch.uint8)))

                def raw_fill() -> list[torch.Tensor]:  # what a loader adds: new tensors, the bytes copied in
                    pieces, out = iter(raw()), []
                    for _, n in ranges:
                        t = torch.empty(n, dtype=torch.uint8)
                        view = t.numpy()
                        for a in range(0, n, piece):
                            data = next(pieces)
                            view[a:a + len(data)] = np.frombuffer(data, dtype=np.uint8)
                        out.append(t)
                    return out

                def load() -> Any:
                    return th5.load(url, storage_options={"skip_instance_cache": True})

                def load_fsspec() -> Any:  # the same load through fsspec's aiohttp session
                    plain, remote.PLAIN_HTTP = remote.PLAIN_HTTP, False
                    try:
                        return th5.load(url, storage_options={"skip_instance_cache": True})
                    finally:
                        remote.PLAIN_HTTP = plain

                def select() -> Any:
                    return th5.load(url, select=picked)

                def slices() -> Any:
                    with th5.open(url) as s:
                        return s.read_many({k: slice(0, max(1, len(s[k]) // 100)) for k in names})

                def st_whole() -> Any:
                    return st_load(fs.cat_file(st_url))

                ops = (("raw limit: concurrent range GETs of the data", raw, nbytes),
                       (SOCKETS, raw_sockets, nbytes),
                       (SOCKETS_FRESH, raw_sockets_fresh, nbytes),
                       ("raw limit + copy into new tensors", raw_fill, nbytes),
                       ("tensorstore_h5 load(url)", load, nbytes),
                       (FSSPEC_LOAD, load_fsspec, nbytes),
                       ("safetensors: download + load", st_whole, nbytes),
                       ("tensorstore_h5 select 1% of keys", select, picked_bytes),
                       ("tensorstore_h5 1% row slice of every tensor (read_many)", slices, slice_bytes))
                times: dict[str, list[float]] = {label: [] for label, _, _ in ops}
                sent: dict[str, int] = dict.fromkeys(times, 0)
                requests: dict[str, int] = dict.fromkeys(times, 0)
                for _ in range(repeat):  # in rounds: a slow spell of the machine hits every operation alike
                    for label, fn, _ in ops:
                        server.control(reset=True, latency=latency)
                        t0 = time.perf_counter()
                        result = fn()  # freed after the clock stops: unmapping 0.5 GB took ~35 ms
                        times[label].append(time.perf_counter() - t0)
                        del result
                        counts = server.control()
                        sent[label] += counts["bytes_sent"]
                        requests[label] += counts["requests"]
                for label, _, moved in ops:
                    seconds = min(times[label])
                    row = {"latency_ms": latency * 1e3, "name": label, "seconds": seconds,
                           "median_seconds": statistics.median(times[label]), "bytes": moved,
                           "gbps": moved / seconds / 1e9, "moved_mb": sent[label] / repeat / 1e6,
                           "requests": requests[label] / repeat}
                    rows.append(row)
                    echo(f"{latency * 1e3:6.0f}ms {label:<44} {seconds:8.3f} {row['median_seconds']:8.3f} "
                         f"{row['gbps']:7.2f} {row['moved_mb']:9.1f} {row['requests']:8.0f}")
                pool.shutdown()
        finally:
            server.stop()
    by = {(r["latency_ms"], r["name"]): r for r in rows}
    echo("\nratios of best times, then of medians (> 1: tensorstore_h5 faster; 'time': share of the full load's time)")
    for latency in latencies:
        ms = latency * 1e3

        def ratio(label: str, a: str, b: str) -> None:
            echo(f"  {ms:.0f} ms: {label:<56} {by[(ms, a)]['seconds'] / by[(ms, b)]['seconds']:6.3f} "
                 f"{by[(ms, a)]['median_seconds'] / by[(ms, b)]['median_seconds']:6.3f}")

        full = "tensorstore_h5 load(url)"
        ratio("full load / raw limit (>= 0.8)", "raw limit: concurrent range GETs of the data", full)
        ratio("full load / raw limit by plain sockets, reused buffer", SOCKETS, full)
        ratio("full load / raw limit by plain sockets, fresh memory", SOCKETS_FRESH, full)
        ratio("full load / raw limit + copy into new tensors", "raw limit + copy into new tensors", full)
        ratio("full load vs safetensors download + load", "safetensors: download + load", full)
        ratio("full load: own HTTP client vs fsspec's (remote.PLAIN_HTTP = False)", FSSPEC_LOAD, full)
        ratio(f"time: select 1% / full load ({picked_bytes / nbytes:.1%} of the bytes)", "tensorstore_h5 select 1% of keys",
              full)
        ratio(f"time: 1% row slices / full load ({slice_bytes / nbytes:.1%} of the bytes)",
              "tensorstore_h5 1% row slice of every tensor (read_many)", full)
    return rows
