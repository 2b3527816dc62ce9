"""The README's examples run as written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's, run in one process
def test_readme_quick_tour_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(README.read_text())
    assert blocks
    import torch

    namespace: dict = {}  # blocks build on each other, as a reader's session would
    for code in blocks:
        if "cuda" in code and not torch.cuda.is_available():
            continue  # the GPU example needs a GPU (and the tour's files)
        if "://" in code:
            continue  # the remote examples need their servers: tests/test_remote.py runs the same calls
        code = code.replace("        ...\n", "        assert t is not None\n")
        exec(compile(code, "README.md", "exec"), namespace)
    assert sorted(os.listdir(tmp_path)) == ["big.h5", "ckpt.h5", "step1000"]
