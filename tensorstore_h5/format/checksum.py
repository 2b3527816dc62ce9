"""Checksums of stored bytes: XXH3 (64-bit, seed 0), in blocks (see docs/FORMAT.md).

xxhash releases the GIL, so the I/O threads hash the blocks they have just read (about
9 GB/s a core on this project's machine, against 4 GB/s for ``zlib.crc32``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

__all__ = ["HASH_BLOCK", "digest", "stream", "to_hex", "from_hex", "block_hashes", "block_ends", "BlockHasher", "ChecksumError"]

HASH_BLOCK = 8 * 2**20
"""Bytes per checksum block of contiguous data written by this library (one read piece)."""


class ChecksumError(Exception):
    """Stored bytes whose hash differs from the recorded one (callers name the file and key)."""


def digest(data: Any) -> int:
    """XXH3-64 of a bytes-like object (any buffer, no copy)."""
    return xxhash.xxh3_64_intdigest(data)


def stream() -> Any:
    """A new XXH3-64 hasher (``update(buffer)``, ``intdigest()``) for data read in pieces."""
    return xxhash.xxh3_64()


def to_hex(h: int) -> str:
    """A hash as 16 lower-case hex digits."""
    return f"{h:016x}"


def from_hex(text: Any) -> int:
    """Parse 16 lower-case hex digits. Raises ValueError for anything else."""
    if type(text) is not str or len(text) != 16 or text.strip("0123456789abcdef"):
        raise ValueError(f"invalid hash {text!r}")
    return int(text, 16)


def block_hashes(data: Any, block: int) -> list[int]:
    """Hashes of consecutive ``block``-byte blocks of a buffer (the last one shorter)."""
    view = memoryview(data)
    if view.nbytes <= block:  # one block (most tensors of a state with many small ones): no slicing
        return [digest(view)] if view.nbytes else []
    view = view.cast("B")
    return [digest(view[i:i + block]) for i in range(0, len(view), block)]


class BlockHasher:
    """Hashes a stream of byte pieces cut at given boundaries.

    ``ends`` are the increasing end offsets of the blocks; pieces fed in order through
    :meth:`update` are hashed block by block, whatever their own sizes.
    """

    def __init__(self, ends: Sequence[int]) -> None:
        self._ends = list(ends)
        self._pos = 0
        self._block = 0
        self._state = xxhash.xxh3_64()
        self.hashes: list[int] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if self._block >= len(self._ends):
                raise ValueError("more bytes than the blocks hold")
            take = min(len(view), self._ends[self._block] - self._pos)
            self._state.update(view[:take])
            self._pos += take
            view = view[take:]
            if self._pos == self._ends[self._block]:
                self.hashes.append(self._state.intdigest())
                self._state.reset()
                self._block += 1

    def finish(self) -> list[int]:
        """The block hashes; raises ValueError unless exactly every block was fed."""
        if self._block != len(self._ends):
            raise ValueError(f"{self._pos} bytes fed, the blocks hold {self._ends[-1] if self._ends else 0}")
        return self.hashes


def block_ends(nbytes: int, block: int) -> list[int]:
    """End offsets of consecutive ``block``-byte blocks of ``nbytes`` bytes."""
    return [min(nbytes, s + block) for s in range(0, nbytes, block)]
