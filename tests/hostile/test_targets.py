"""The atheris targets (tests/hostile/atheris_harness.py) on random and mutated bytes: each
accepts any input or raises the error its caller turns into a FormatError."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorstore_h5 as th5

from hostile import atheris_harness as harness


@pytest.mark.parametrize("name", sorted(harness.TARGETS))
@settings(max_examples=300)
@given(data=st.binary(max_size=4096))
def test_targets_accept_any_bytes(name, data) -> None:
    harness.TARGETS[name](data)


@pytest.mark.parametrize("name, preset", [("bitshuffle", "lz4"), ("blosc2", "zstd")])
def test_decoders_accept_mutations_of_real_chunks(tmp_path, name, preset) -> None:
    """Random flips of a real chunk of the harness's shape: decoded exactly or refused."""
    t = torch.randn(256, 16) * 0.02
    th5.save({"t": t}, tmp_path / "c.h5", compression=preset, chunk_bytes=64 * 16 * 4)
    with th5.open(tmp_path / "c.h5") as s:
        off, size, _ = s._reader.chunked(s["t"]._entry).chunks[1]
    chunk = (tmp_path / "c.h5").read_bytes()[off:off + size]
    harness.TARGETS[name](chunk)
    rng = random.Random(7)
    for _ in range(400):
        data = bytearray(chunk)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(min(len(data), 96)) if rng.random() < 0.5 else rng.randrange(len(data))
            data[i] = rng.randrange(256)
        harness.TARGETS[name](bytes(data[: rng.choice([len(data), rng.randrange(len(data))])]))
