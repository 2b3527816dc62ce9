"""Writes tests/data/v2.h5, the golden format-2 file. Run only when adding a new golden file:
the committed v2.h5 must keep loading with every later version of the library."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

import tensorstore_h5 as th5


def golden() -> dict:
    """The object stored in v2.h5 (deterministic): every kind of entry format 2 writes."""
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(16, 8, generator=g)
    model = OrderedDict([
        ("embed.weight", emb),
        ("enc.0.weight", torch.randn(8, 12, generator=g).t()),  # a dataset with a stride
        ("enc.0.bias", torch.zeros(3, dtype=torch.bfloat16)),   # small tensors have datasets of their own too
        ("head.weight", emb),                                   # tied: one dataset, hard-linked
        ("mask", torch.tensor([True, False, True])),
        ("scale", torch.tensor(0.5, dtype=torch.float16)),
        ("fp8", torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn)),
        ("pos", torch.arange(4.0).reshape(1, 4).expand(3, 4)),  # stride 0
        ("empty", torch.empty(0, 5)),
    ])
    model._metadata = OrderedDict([("", {"version": 1}), ("enc.0", {"version": 2})])  # type: ignore[attr-defined]
    return {
        "model": model,
        "optim": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(16, 8)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "grad": torch.linspace(-1, 1, 5).requires_grad_(True),
        "param": torch.nn.Parameter(torch.linspace(0, 1, 3), requires_grad=False),
        "big": {"lz4": (torch.arange(6000, dtype=torch.float32) % 97).reshape(100, 60),
                "zstd": (torch.arange(9000, dtype=torch.int64) % 13).to(torch.bfloat16).reshape(90, 100)},
        "keys": {"a/b": 1, "": 2, "..": 3, "é": 4, 5: "int key"},
        "values": [None, True, 2**70, float("inf"), 1 - 1j, b"\x00\x01", "text", torch.float16, torch.Size([2]),
                   np.float32(1.25)],
        "array": np.arange(4, dtype=">u2"),
    }


def compression(key: str, t: torch.Tensor) -> str | None:
    """The per-key compression of the golden file."""
    return {"big/lz4": "lz4", "big/zstd": "zstd"}.get(key)


if __name__ == "__main__":
    th5.save(golden(), Path(__file__).with_name("v2.h5"), metadata={"note": "golden v2"}, compression=compression,
            chunk_bytes=8192)
