"""Writes tests/data/v1.h5, the golden format-v1 file. Run only when adding a new golden file:
the committed v1.h5 must keep loading with every later version of the library."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

import tensorstore_h5 as th5


def golden() -> dict:
    """The object stored in v1.h5 (deterministic)."""
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(16, 8, generator=g)  # over 256 bytes: a dataset of its own (smaller tensors are packed)
    return {
        "model": OrderedDict([
            ("embed.weight", emb),
            ("enc.0.weight", torch.randn(8, 12, generator=g).t()),
            ("enc.0.gate", torch.randn(3, 4, generator=g).t()),  # small and strided: packed
            ("enc.0.bias", torch.zeros(3, dtype=torch.bfloat16)),
            ("head.weight", emb),
            ("mask", torch.tensor([True, False, True])),
            ("scale", torch.tensor(0.5, dtype=torch.float16)),
            ("fp8", torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn)),
        ]),
        "optim": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(16, 8)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "keys": {"a/b": 1, "": 2, "..": 3, "é": 4},
        "values": [None, True, 2**70, float("inf"), 1 - 1j, b"\x00\x01", "text", torch.float16, torch.Size([2]),
                   np.float32(1.25)],
        "array": np.arange(4, dtype=np.uint16),
    }


if __name__ == "__main__":
    th5.save(golden(), Path(__file__).with_name("v1.h5"), metadata={"note": "golden v1"})
