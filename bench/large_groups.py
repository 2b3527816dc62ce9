"""How fast libhdf5 (through h5py) reads a flat group of many links written by tensorstore_h5's
own HDF5 metadata encoder (tensorstore_h5/format/hdf5meta.py) against the same group written by
h5py itself (issue #32 item 5). Not a test: it prints figures.

    python bench/large_groups.py                 # 50,000 keys
    python bench/large_groups.py --keys 120000 --nodes 512,4096 --old /tmp/old/hdf5meta_old.py

For each file: its size, the time to list every name (``list(group)``), to look up 1,000
random names (``name in group``: the name index only) and to open 1,000 random datasets by
name and read their value (``group[name][()]``); each file is opened afresh (libhdf5's
metadata cache empty, the file in the page cache), best of ``--repeat``. ``--old FILE``
adds the file written by another copy of hdf5meta.py (e.g. the module before a change, copied
out of git), put in place of the package's for that write; ``--all`` also reads every value
by name (slow for a group of links kept in its object header: libhdf5 scans it linearly).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import tempfile
import time

import h5py
import numpy as np
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format import hdf5meta
from tensorstore_h5.writing import writer


def _keys(n: int) -> list[str]:
    return [f"layers.{i}.weight" for i in range(n)]


def write_library(path: str, n: int, node: int | None = None, module=None) -> None:
    """The group written by th5.Writer (key by key), with the package's encoder or ``module``."""
    saved = writer.hdf5meta, hdf5meta.NAME_NODE
    if module is not None:
        writer.hdf5meta = module
    if node is not None:
        hdf5meta.NAME_NODE = node
    try:
        with th5.Writer(path) as w:
            for i, key in enumerate(_keys(n)):
                w[key] = torch.full((1,), float(i))
    finally:
        writer.hdf5meta, hdf5meta.NAME_NODE = saved


def write_h5py(path: str, n: int, libver: str | None) -> None:
    with h5py.File(path, "w", libver=libver) as f:
        for i, key in enumerate(_keys(n)):
            f.create_dataset(key, data=np.full((1,), float(i), dtype=np.float32))


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(path: str, n: int, repeat: int, every: bool) -> dict[str, float]:
    rng = random.Random(0)
    keys = _keys(n)
    sample = rng.sample(range(n), 1000)

    def names() -> None:
        with h5py.File(path, "r") as f:
            assert len(list(f)) >= n

    def exists() -> None:
        with h5py.File(path, "r") as f:
            assert all(keys[i] in f for i in sample)

    def values() -> None:
        with h5py.File(path, "r") as f:
            assert all(f[keys[i]][0] == i for i in sample)

    def all_values() -> None:
        with h5py.File(path, "r") as f:
            assert all(f[k][0] == i for i, k in enumerate(keys))

    out = {"MB": os.path.getsize(path) / 1e6, "names": _best(names, repeat), "1000 in": _best(exists, repeat),
           "1000 values": _best(values, repeat)}
    if every:
        out["all values"] = _best(all_values, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--nodes", default="", help="name-index node sizes to try besides the default (comma-separated)")
    ap.add_argument("--old", help="another hdf5meta.py to compare with (e.g. the module before a change)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--all", action="store_true", help="also read every value by name")
    args = ap.parse_args()
    n = args.keys
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, str] = {}

        def timed_write(label: str, fn, *a) -> None:
            path = os.path.join(tmp, f"{len(files)}.h5")
            t = time.perf_counter()
            fn(path, n, *a)
            print(f"wrote {label}: {time.perf_counter() - t:.2f} s", flush=True)
            files[label] = path

        timed_write(f"tensorstore_h5 (nodes of {hdf5meta.NAME_NODE} B)", write_library)
        for node in filter(None, args.nodes.split(",")):
            if int(node) != hdf5meta.NAME_NODE:
                timed_write(f"tensorstore_h5 (nodes of {int(node)} B)", write_library, int(node))
        if args.old:
            spec = importlib.util.spec_from_file_location("hdf5meta_old", args.old)
            old = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = old  # (its dataclasses look their module up)
            spec.loader.exec_module(old)
            timed_write(f"tensorstore_h5 ({os.path.basename(args.old)})", write_library, None, old)
        timed_write("h5py, libver='latest'", write_h5py, "latest")
        timed_write("h5py, default libver", write_h5py, None)
        print(f"\n{n:,} keys in one group, h5py {h5py.__version__} / HDF5 {h5py.version.hdf5_version}, best of {args.repeat}")
        head = f"{'file':44} {'MB':>6} {'list names':>11} {'1000 in':>9} {'1000 values':>12}"
        print(head + (f" {'all values':>11}" if args.all else ""))
        for label, path in files.items():
            r = measure(path, n, args.repeat, args.all)
            line = (f"{label:44} {r['MB']:6.1f} {r['names'] * 1e3:8.1f} ms {r['1000 in'] * 1e3:6.1f} ms"
                    f" {r['1000 values'] * 1e3:9.1f} ms")
            print(line + (f" {r['all values']:9.2f} s" if args.all else ""), flush=True)


if __name__ == "__main__":
    main()
