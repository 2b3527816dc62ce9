"""Progress bars (tqdm.auto: a widget in notebooks, text in a terminal) and rich display helpers."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["AUTO_PROGRESS_BYTES", "Progress", "interactive", "human_bytes", "tree_html"]

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
        wanted = self._enabled if self._enabled is not None else (nbytes > AUTO_PROGRESS_BYTES and interactive())
        if wanted and self._bar is None:
            self._start(nbytes)

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


_STYLE = ("<style>.th5 {font-family: var(--jp-code-font-family, monospace); font-size: 12px; color: inherit}"
          ".th5 details > summary {cursor: pointer} .th5 .k {opacity: .65} .th5 td {padding: 0 .6em 0 0}</style>")


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"12 B"``, ``"1.5 KiB"`` ... ``"TiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def tree_html(title: str, rows: list[tuple[str, str, str]], open_limit: int = 50, group_limit: int = 200) -> str:
    """A collapsible tree of key paths: ``rows`` are ``(key path, description, size)``.

    Groups with more than ``open_limit`` rows start collapsed; a group lists at most
    ``group_limit`` rows and says how many it left out, so 10,000-key files stay fast.
    Colours are inherited, so it reads in light and dark themes.
    """
    import html

    groups: dict[str, list[tuple[str, str, str]]] = {}
    for key, desc, size in rows:
        head, _, rest = key.partition("/")
        groups.setdefault(head if rest else "", []).append((rest or head, desc, size))
    parts = [_STYLE, f'<div class="th5"><b>{html.escape(title)}</b>']
    for group, items in groups.items():
        body = "".join(f"<tr><td>{html.escape(k)}</td><td class='k'>{html.escape(d)}</td><td>{html.escape(s)}</td></tr>"
                       for k, d, s in items[:group_limit])
        if len(items) > group_limit:
            body += f"<tr><td class='k'>… {len(items) - group_limit} more</td></tr>"
        table = f"<table>{body}</table>"
        if group:
            state = "" if len(items) > open_limit else " open"
            parts.append(f"<details{state}><summary>{html.escape(group)}/ <span class='k'>({len(items)} keys)</span>"
                         f"</summary>{table}</details>")
        else:
            parts.append(table)
    parts.append("</div>")
    return "".join(parts)
