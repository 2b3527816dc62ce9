"""Past the size of RAM (``tensorstore-h5 bench --past-ram``; run by hand, not in CI): a
checkpoint larger than this machine's memory is written key by key, then streamed, selected
from, row-sliced and converted to safetensors with a cold page cache, against the disk's own
read limits in the same run.
Each operation runs in a fresh process; the table gives its time, bytes and peak RSS growth
(high-water mark minus the RSS it started from) beside the largest tensor's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run", "OPS"]

OPS = ("write key by key", "disk: buffered reads, 2 threads", "disk: O_DIRECT reads, 2 threads",
       "stream every tensor (items)", "select 1% of the keys", "1% row slice of every tensor",
       "convert to .safetensors")
"""The operations, in the order they run (each after the page cache is dropped)."""


def _child(op: str, path: str, nbytes: int, keys: int) -> dict[str, Any]:
    """Run one operation here (a fresh process) and return its figures."""
    import tensorstore_h5 as th5
    from .measure import read_file, reset_peak, status
    from .synthetic import bench_tensors

    def largest_and_total() -> tuple[int, int]:
        with th5.open(path) as s:
            sizes = [s[k].nbytes for k in s.keys()]
        return max(sizes), sum(sizes)

    moved = written = 0
    if op == OPS[0]:
        reset_peak()  # VmHWM from here: a child's ru_maxrss starts at its parent's RSS when it forked
        base = status("VmRSS")
        t0 = time.perf_counter()
        with th5.Writer(path) as w:
            for k, t in bench_tensors(nbytes, keys):
                w[k] = t
                moved += t.nbytes
                del t
    else:
        largest, total = largest_and_total()
        with th5.open(path) as s:
            names = s.keys()
            picked = names[::100]
            rows = {k: slice(0, max(1, s[k].shape[0] // 100)) for k in names}
        reset_peak()  # VmHWM from here: a child's ru_maxrss starts at its parent's RSS when it forked
        base = status("VmRSS")
        t0 = time.perf_counter()
        if op in (OPS[1], OPS[2]):
            moved = read_file(path, direct=op == OPS[2])
        elif op == OPS[3]:
            with th5.open(path) as s:
                for _k, t in s.items():
                    moved += t.nbytes
                    del t
        elif op == OPS[4]:
            moved = sum(t.nbytes for t in th5.load(path, select=picked).values())
        elif op == OPS[5]:
            with th5.open(path) as s:
                for k, index in rows.items():
                    moved += s[k][index].nbytes
        else:
            out = os.path.join(os.path.dirname(path), "big.safetensors")
            try:
                th5.convert(path, out, progress=False)
                moved, written = total, os.path.getsize(out)
            finally:
                if os.path.exists(out):
                    os.unlink(out)
    seconds = time.perf_counter() - t0
    peak = status("VmHWM") - base
    largest, total = largest_and_total()
    return {"op": op, "seconds": seconds, "bytes": moved, "peak_rss_growth": max(0, peak), "largest": largest,
            "file_data": total, "file_bytes": os.path.getsize(path), "written": written}


def run(size_gb: float = 28.0, keys: int = 300, workdir: str | None = None, settle: float = 3.0,
        echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Write a ``size_gb`` checkpoint into ``workdir`` (default: the temp dir) and measure every
    operation of :data:`OPS` on it, cold, each ``settle`` seconds after the cache was dropped;
    print the table; return the rows. Needs root (to drop the page cache) and twice ``size_gb``
    of free disk (the conversion writes a copy); the files are removed at the end. Raises
    RuntimeError naming a failed operation."""
    from .measure import drop_caches

    with open("/proc/meminfo") as f:
        ram = int(f.readline().split()[1]) * 1024
    echo(f"checkpoint {size_gb:g} GB, RAM {ram / 2**30:.1f} GiB ({size_gb * 1e9 / ram:.2f}x); "
         "every operation in a fresh process after the page cache is dropped")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="th5-past-ram-", dir=workdir) as tmp:
        path = os.path.join(tmp, "big.h5")
        for op in OPS:
            drop_caches()
            time.sleep(settle)  # as the main bench settles (bench/README.md)
            cmd = [sys.executable, "-m", __name__, op, path, str(int(size_gb * 1e9)), str(keys)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                raise RuntimeError(f"{op}: {out.stderr.strip()[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            if len(rows) == 1:
                echo(f"{row['bytes'] / 1e9:.1f} GB of tensor data in a {row['file_bytes'] / 1e9:.1f} GB file, "
                     f"largest tensor {row['largest'] / 2**20:.0f} MiB\n")
                echo(f"{'operation':<34} {'GB moved':>9} {'time s':>8} {'GB/s':>6} {'share of bytes':>14} "
                     f"{'share of time':>13} {'peak RSS growth MiB':>19}")
            full = next((r for r in rows if r["op"] == OPS[3]), None)
            share_t = f"{row['seconds'] / full['seconds']:.4f}" if full and row["op"] in OPS[4:6] else ""
            share_b = f"{row['bytes'] / row['file_data']:.4f}" if row["op"] in OPS[4:6] else ""
            echo(f"{op:<34} {row['bytes'] / 1e9:9.3f} {row['seconds']:8.2f} {row['bytes'] / row['seconds'] / 1e9:6.2f} "
                 f"{share_b:>14} {share_t:>13} {row['peak_rss_growth'] / 2**20:19.0f}")
    return rows


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
