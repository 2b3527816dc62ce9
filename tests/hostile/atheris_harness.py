"""Coverage-guided fuzzing (atheris) of the parsers and chunk decoders that read file bytes.

    pip install atheris
    python tests/hostile/atheris_harness.py layout -max_total_time=600
    python tests/hostile/atheris_harness.py header|bitshuffle|blosc2 -max_total_time=600

Each target takes arbitrary bytes and must either succeed or raise the error its caller turns
into a FormatError; anything else (another exception, a crash, a hang) is a finding: atheris
writes the input to ``crash-*``; copy it to tests/hostile/regressions/ with a test. The same
targets run on random bytes in the test suite (tests/hostile/test_targets.py), without
coverage guidance.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

from tensorstore_h5.codecs import decoders as codecs
from tensorstore_h5.errors import FormatError
from tensorstore_h5.format import layout as fmt

_CHUNK = (64, 16)  # float32 chunks of 4 KiB


def target_header(data: bytes) -> None:
    try:
        fmt.parse_header(data, "fuzz.h5", len(data) + 4096)
    except FormatError:
        pass


def target_layout(data: bytes) -> None:
    try:
        layout = fmt.parse_layout_v2(data, "fuzz.h5", 1 << 24)
        layout.entries  # noqa: B018 - parses and checks every entry
    except FormatError:
        pass


def _decode(decoder: codecs.Decoder, data: bytes) -> None:
    src = (ctypes.c_char * max(len(data), 1)).from_buffer_copy(data or b"\0")
    dst = (ctypes.c_char * (_CHUNK[0] * _CHUNK[1] * 4))()
    try:
        decoder(src, len(data), ctypes.addressof(dst), len(dst))
    except codecs.DecodeError:
        pass


def _extent(filter_id: int, values: tuple[int, ...]) -> fmt.Chunked:
    return fmt.Chunked((256, 16), 4, _CHUNK, filter_id, values, ((4096, 10, False),) * 4)


def target_bitshuffle(data: bytes) -> None:
    _decode(codecs.decoder_for(_extent(fmt.BITSHUFFLE_ID, (0, 4, 4, 0, 2))), data)


def target_blosc2(data: bytes) -> None:
    _decode(codecs.decoder_for(_extent(fmt.BLOSC2_ID, (1, 0, 4, 4096, 5, 1, 5, 2, *_CHUNK))), data)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "header": target_header, "layout": target_layout, "bitshuffle": target_bitshuffle, "blosc2": target_blosc2,
}


def main() -> None:
    import atheris

    name = sys.argv.pop(1)
    atheris.instrument_all()
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
