"""What users see besides the data: progress bars (tqdm.auto: a widget in notebooks, text in a
terminal) and byte sizes here, which reads and writes use; the HTML tree of keys that the
Jupyter views share and inline SVG bar charts in :mod:`.views`, imported when a view is shown
(its import is ~0.5 ms of a fresh process's first load, which needs none of it)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["AUTO_PROGRESS_BYTES", "Progress", "interactive", "human_bytes"]

AUTO_PROGRESS_BYTES = 256 * 2**20
"""With ``progress=None``, a bar is shown for work over this many bytes in interactive output."""


def interactive() -> bool:
    """True in a Jupyter kernel or when stderr is a terminal."""
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A byte-counting progress bar that appears only when wanted.

    ``enabled``: True/False force it; None shows it when the total exceeds
    :data:`AUTO_PROGRESS_BYTES` and the output is interactive.
    """

    def __init__(self, enabled: bool | None, desc: str) -> None:
        self._enabled = enabled
        self._desc = desc
        self._bar: Any = None
        self._total: int | None = None

    def _start(self, total: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=self._desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)

    def total(self, nbytes: int) -> None:
        """Announce the total work in bytes (starts the bar if it is wanted)."""
        self._total = nbytes
        wanted = self.may_show and (self._enabled or nbytes > AUTO_PROGRESS_BYTES)
        if wanted and self._bar is None:
            self._start(nbytes)

    @property
    def may_show(self) -> bool:
        """False when no total would show the bar (so the total need not be counted)."""
        return bool(self._enabled) or (self._enabled is None and interactive())

    @property
    def silent(self) -> bool:
        """True when no bar is shown (work can then be batched without progress updates)."""
        return self._bar is None and not self._enabled

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes done."""
        if self._bar is None and self._enabled and self._total is None:
            self._start(None)
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"12 B"``, ``"1.5 KiB"`` ... ``"TiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`.views` (``display.tree_html``, ...), found here as before;
    importing this package still imports none of them."""
    if name.startswith("__") or name == "views":  # (``from . import views`` asks here first)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        return getattr(importlib.import_module(f"{__name__}.views"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
