"""The mutation fuzzer (tests/hostile/fuzz.py) for a bounded time, and every file it or the
red-team pass ever found (tests/hostile/regressions/), through every read path."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hostile import fuzz

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.h5"))


@pytest.mark.slow
def test_fuzz_for_a_bounded_time(tmp_path) -> None:
    seconds = float(os.environ.get("TH5_FUZZ_SECONDS", "60"))
    seed = int(os.environ.get("TH5_FUZZ_SEED", "0")) or int(time.time())
    findings = fuzz.run(seconds, tmp_path / "findings", seed)
    report = "\n".join(f"{name}: {'; '.join(problems[:3])}" for name, problems in findings[:10])
    assert not findings, f"fuzz seed {seed} ({len(findings)} findings, files in {tmp_path / 'findings'}):\n{report}"


def test_regression_files_read_safely() -> None:
    assert len(REGRESSIONS) >= 6
    worker = fuzz.Worker()
    try:
        for path in REGRESSIONS:
            assert worker.run(path, "none", "regression") == [], path.name
    finally:
        worker.stop()
