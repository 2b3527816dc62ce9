"""Writes tests/data/v3.h5, the golden format-3 file (format 2 plus HDF5's shuffle + deflate
chunks, the "gzip" preset). Run only when adding a new golden file: the committed v3.h5 must
keep loading with every later version of the library."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

import tensorstore_h5 as th5


def golden() -> dict:
    """The object stored in v3.h5 (deterministic): "gzip" tensors of several element sizes
    (a padded last chunk, a strided tensor, a chunk stored unfiltered because deflate does not
    shrink it), beside a Bitshuffle tensor, an uncompressed one and a plain value."""
    g = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 256, (16400,), dtype=torch.uint8, generator=g)
    return {
        "gzip": OrderedDict([
            ("f32", (torch.arange(6000, dtype=torch.float32) % 97 - 48).reshape(100, 60) / 8),  # 6 chunks, the last padded
            ("bf16_t", (torch.arange(9000) % 13).to(torch.bfloat16).reshape(90, 100).t()),       # strided: stride restored
            ("c64", torch.complex(torch.arange(2100.0) % 7, -(torch.arange(2100.0) % 5))),      # 8-byte elements
            ("i16", (torch.arange(10000, dtype=torch.int16) % 300).reshape(100, 100)),
            ("noise", noise),                                                                  # chunks stored raw
        ]),
        "lz4": (torch.arange(6000, dtype=torch.float32) % 31).reshape(60, 100),
        "small": torch.tensor([1.5, -2.0], dtype=torch.float16),  # under 16 KiB: never compressed
        "step": 7,
    }


def compression(key: str, t: torch.Tensor) -> str | None:
    """The per-key compression of the golden file."""
    return "gzip" if key.startswith("gzip/") else "lz4" if key == "lz4" else None


if __name__ == "__main__":
    th5.save(golden(), Path(__file__).with_name("v3.h5"), metadata={"note": "golden v3"}, compression=compression,
             chunk_bytes=4096)
