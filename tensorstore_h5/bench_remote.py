"""``tensorstore-h5 bench --remote``: loading over HTTP (a loopback server with byte ranges, with
and without added latency) against the raw limit and safetensors read the same way.

For each latency: a full load, a 1 % select (1 % of the keys) and a 1 % row slice of every
tensor through ``th5.load(url)`` / ``th5.open(url)``; the raw limit (every byte range of the
tensors' data fetched by concurrent range GETs of 8 MiB, as fsspec issues them); and
safetensors, which reads a URL only whole (``safe_open`` takes no file object): download +
``safetensors.torch.load``. Best of ``repeat``, in this process; bytes moved as the server
counted them.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run"]


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(size_gb: float = 0.5, keys: int = 100, repeat: int = 3, latencies: tuple[float, ...] = (0.0, 0.02),
        echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure; print the table and ratios; return the rows."""
    import fsspec
    from safetensors.torch import load as st_load
    from safetensors.torch import save_file

    import tensorstore_h5 as th5
    from .loopback import RangeServer
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
        server = RangeServer(tmp)
        try:
            url, st_url = server.url("ckpt.h5"), server.url("ckpt.safetensors")
            with th5.open(url) as s:
                ranges = [(e.offset, e.nbytes) for e in (s._entry(k).extent for k in names)]
            echo(f"{'latency':>8} {'operation':<44} {'time s':>8} {'GB/s':>7} {'MB moved':>9} {'requests':>8}")
            for latency in latencies:
                server.behaviour.latency = latency
                fs = fsspec.filesystem("http", skip_instance_cache=True)
                piece = 8 << 20

                def raw() -> None:
                    starts = [o + a for o, n in ranges for a in range(0, n, piece)]
                    ends = [min(o + n, s + piece) for o, n in ranges for s in range(o, o + n, piece)]
                    fs.cat_ranges([url] * len(starts), starts, ends)

                def load() -> None:
                    th5.load(url, storage_options={"skip_instance_cache": True})

                def select() -> None:
                    th5.load(url, select=picked)

                def slices() -> None:
                    with th5.open(url) as s:
                        s.read_many({k: slice(0, max(1, len(s[k]) // 100)) for k in names})

                def st_whole() -> None:
                    st_load(fs.cat_file(st_url))

                for label, fn, moved in (("raw limit: concurrent range GETs of the data", raw, nbytes),
                                         ("tensorstore_h5 load(url)", load, nbytes),
                                         ("safetensors: download + load", st_whole, nbytes),
                                         ("tensorstore_h5 select 1% of keys", select, picked_bytes),
                                         ("tensorstore_h5 1% row slice of every tensor (read_many)", slices, slice_bytes)):
                    server.reset()
                    server.behaviour.latency = latency
                    seconds = _best(fn, repeat)
                    sent = server.bytes_sent / repeat
                    requests = len(server.requests) / repeat
                    row = {"latency_ms": latency * 1e3, "name": label, "seconds": seconds, "bytes": moved,
                           "gbps": moved / seconds / 1e9, "moved_mb": sent / 1e6, "requests": requests}
                    rows.append(row)
                    echo(f"{latency * 1e3:6.0f}ms {label:<44} {seconds:8.3f} {row['gbps']:7.2f} {sent / 1e6:9.1f} "
                         f"{requests:8.0f}")
        finally:
            server.stop()
    by = {(r["latency_ms"], r["name"]): r for r in rows}
    echo("\nratios (> 1: tensorstore_h5 faster; 'time': share of the full load's time)")
    for latency in latencies:
        ms = latency * 1e3
        get = lambda name: by[(ms, name)]["seconds"]  # noqa: E731
        full = get("tensorstore_h5 load(url)")
        echo(f"  {ms:.0f} ms: full load / raw limit (>= 0.8)                   {get('raw limit: concurrent range GETs of the data') / full:6.2f}")
        echo(f"  {ms:.0f} ms: full load vs safetensors download + load         {get('safetensors: download + load') / full:6.2f}")
        echo(f"  {ms:.0f} ms: time: select 1% / full load ({picked_bytes / nbytes:.1%} of the bytes) "
             f"{get('tensorstore_h5 select 1% of keys') / full:6.3f}")
        echo(f"  {ms:.0f} ms: time: 1% row slices / full load ({slice_bytes / nbytes:.1%} of the bytes) "
             f"{get('tensorstore_h5 1% row slice of every tensor (read_many)') / full:6.3f}")
    return rows
