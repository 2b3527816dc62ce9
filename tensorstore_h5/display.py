"""Progress bars (tqdm.auto: a widget in notebooks, text in a terminal) and rich display helpers."""

from __future__ import annotations

import html
import sys
from typing import Any, Iterable, NamedTuple

__all__ = ["AUTO_PROGRESS_BYTES", "Progress", "interactive", "human_bytes", "TreeRow", "tree_html"]

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


# -- the HTML tree of keys (Store._repr_html_, TensorHandle._repr_html_) ---------------------

class TreeRow(NamedTuple):
    """One key of :func:`tree_html`."""

    path: str
    """The key path (``"model/layers.0.attn.qkv.weight"``)."""
    desc: str
    """What it is: dtype, shape, layout, compression, or a plain value."""
    nbytes: int | None = None
    """Bytes of tensor or array data; None for plain values (no size, not counted as a tensor)."""
    counted: bool = True
    """False for aliases (``same as``): shown with their size, left out of the byte totals."""


FLATTEN_MAX = 5
"""A dotted module with at most this many keys and no submodules (``qkv.weight``, ``qkv.bias``)
is shown as rows of its parent instead of as a group of its own."""

MAX_DEPTH = 32
"""Key paths nest at most this deep for display; the rest of a deeper path is one row name."""

# Scoped to the view's class, and specific enough to win over JupyterLab's
# `.jp-RenderedHTMLCommon td/tr` rules (right-aligned, zebra-striped, padded). Colours are
# inherited; lines and highlights are translucent grey, so light and dark themes both read.
_STYLE = (
    "<style>"
    ".th5{font-family:var(--jp-code-font-family,var(--vscode-editor-font-family,ui-monospace,SFMono-Regular,Menlo,"
    "Consolas,monospace));font-size:12px;line-height:1.5;color:inherit;text-align:left}"
    ".th5 .h{font-weight:600}"
    ".th5 summary>span{opacity:.6}"
    ".th5 details{margin:0;padding:0}"
    ".th5 details>summary{cursor:pointer;padding:0;margin:0;white-space:nowrap}"
    ".th5 details>summary:hover{background:rgba(127,127,127,.14)}"
    ".th5 details>div{margin:0 0 0 .3em;padding:0 0 0 1em;border-left:1px solid rgba(127,127,127,.35)}"
    ".th5 details.m>summary{font-style:italic}"
    "div.th5 table.t{border-collapse:collapse;border-spacing:0;border:0;margin:0;padding:0;width:auto;"
    "table-layout:auto;color:inherit;font:inherit;background:transparent}"
    ".th5 .t tr:nth-child(n){background:transparent;border:0}"
    ".th5 .t tr:nth-child(n):hover{background:rgba(127,127,127,.14)}"
    ".th5 .t td:nth-child(n){text-align:left;vertical-align:top;padding:0 1.5em 0 0;border:0;line-height:inherit;"
    "white-space:nowrap;max-width:none;font:inherit;color:inherit}"
    ".th5 .t td:nth-child(1){min-width:12ch}"
    ".th5 .t td:nth-child(2){opacity:.7;min-width:18ch}"
    ".th5 .t td:nth-child(3){text-align:right;padding-right:0}"
    "</style>"
)


class _Group:
    __slots__ = ("name", "sep", "items", "sub", "keys", "tensors", "nbytes")

    def __init__(self, name: str, sep: str) -> None:
        self.name = name
        self.sep = sep  # "/" for a container of the file, "." for a dotted state-dict prefix
        self.items: list[_Group | tuple[str, TreeRow]] = []
        self.sub: dict[tuple[str, str], _Group] = {}
        self.keys = self.tensors = self.nbytes = 0


def _segments(path: str) -> tuple[list[tuple[str, str]], str]:
    """``"model/layers.0.w"`` -> ``([("model", "/"), ("layers", "."), ("0", ".")], "w")``.
    A name is split at its dots only when no part is empty (``"a..b"``, ``".x"`` stay whole)."""
    *dirs, last = path.split("/")
    segs = [(d, "/") for d in dirs]
    dotted = last.split(".")
    if len(dotted) > 1 and all(dotted):
        segs += [(d, ".") for d in dotted[:-1]]
        last = dotted[-1]
    if len(segs) > MAX_DEPTH:
        last = "".join(n + s for n, s in segs[MAX_DEPTH:]) + last
        segs = segs[:MAX_DEPTH]
    return segs, last


def _build(rows: Iterable[TreeRow | tuple[Any, ...]], nest: bool) -> _Group:
    root = _Group("", "")
    for row in rows:
        row = row if isinstance(row, TreeRow) else TreeRow(*row)
        segs, name = _segments(row.path) if nest else ([], row.path)
        tensor = row.nbytes is not None
        size = row.nbytes if tensor and row.counted else 0
        node = root
        node.keys += 1
        node.tensors += tensor
        node.nbytes += size
        for seg in segs:
            child = node.sub.get(seg)
            if child is None:
                child = node.sub[seg] = _Group(*seg)
                node.items.append(child)
            node = child
            node.keys += 1
            node.tensors += tensor
            node.nbytes += size
        node.items.append((name, row))
    _simplify(root)
    return root


def _simplify(root: _Group) -> None:
    """Show small leaf modules as rows of their parent (``qkv.weight``), then merge chains of
    single groups (``encoder.layer.``); both from the top down, without recursion (paths may
    be deep)."""
    stack = [root]
    while stack:  # a module is a leaf module by what it held as saved, before its children change
        g = stack.pop()
        items: list[_Group | tuple[str, TreeRow]] = []
        for item in g.items:
            if not isinstance(item, _Group):
                items.append(item)
            elif (item.sep == "." and len(item.items) <= FLATTEN_MAX
                  and not any(isinstance(i, _Group) for i in item.items)):
                items.extend((f"{item.name}.{name}", row) for name, row in item.items)  # type: ignore[misc]
            else:
                items.append(item)
                stack.append(item)
        g.items = items
    stack = [root]
    while stack:
        g = stack.pop()
        for item in g.items:
            if isinstance(item, _Group):
                while len(item.items) == 1 and isinstance(item.items[0], _Group):
                    only = item.items[0]
                    item.name, item.sep, item.items = f"{item.name}{item.sep}{only.name}", only.sep, only.items
                stack.append(item)


def _totals(g: _Group) -> str:
    if not g.tensors:
        return f"{g.keys:,} key{'s' * (g.keys != 1)}"
    tensors = f"{g.tensors:,} tensor{'s' * (g.tensors != 1)}, {human_bytes(g.nbytes)}"
    return tensors if g.keys == g.tensors else f"{g.keys:,} keys, {tensors}"


class _Memo(dict):  # type: ignore[type-arg]
    """``f`` with its results kept: ``memo(x)`` is ``f(x)``."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f

    def __call__(self, x: Any) -> str:
        r = self.get(x)
        if r is None:
            r = self[x] = self.f(x)
        return r


def _item_name(item: _Group | tuple[str, TreeRow]) -> str:
    return item.name + item.sep if isinstance(item, _Group) else item[0]


def tree_html(title: str, rows: Iterable[TreeRow | tuple[Any, ...]], open_limit: int = 50, group_limit: int = 200,
              block_rows: int = 1000, nest: bool = True) -> str:
    """A collapsible tree of key paths, each row ``name | description | size``.

    ``rows`` are :class:`TreeRow` (or tuples of its fields), in saved order. Key paths nest at
    ``/`` (the file's containers) and at the dots of state-dict names (``layers.`` -> ``0.``
    -> ``attn.``); small leaf modules stay rows (``qkv.weight``). Each group's summary gives
    its totals (keys, tensors, bytes; aliases counted once). Groups start open in saved order
    while the keys they unfold add up to at most ``open_limit`` per level; the rest start
    collapsed. A level shows its first ``group_limit`` entries and holds the rest in further
    collapsed blocks of ``block_rows``, so every key is reachable and a 10,000-key file stays
    fast. ``nest=False`` lists the paths as they are. Colours are inherited and the styles are
    scoped to the view, so it reads alike in JupyterLab, VS Code and a plain page, light or dark.
    """
    root = _build(rows, nest)
    esc = _Memo(html.escape)  # names and descriptions repeat ("weight", "float32 [768]")
    size_of = _Memo(human_bytes)
    out = [_STYLE, f'<div class="th5"><div class="h">{esc(title)}</div>']
    # An explicit stack instead of recursion (paths may nest deep): ("text", html to emit),
    # ("level", group) or ("items", (entries, keys that may start unfolded)).
    work: list[tuple[str, Any]] = [("level", root)]
    while work:
        kind, payload = work.pop()
        if kind == "text":
            out.append(payload)
            continue
        if kind == "level":
            node = payload
            first, rest = node.items[:group_limit], node.items[group_limit:]
            todo: list[tuple[str, Any]] = [("items", (first, open_limit))]
            total = len(node.items)
            for start in range(0, len(rest), block_rows):
                chunk = rest[start:start + block_rows]
                a, b = group_limit + start + 1, group_limit + start + len(chunk)
                todo.append(("text", f'<details class="m"><summary>{a:,}–{b:,} of {total:,}: '
                                     f'{esc(_item_name(chunk[0]))} … {esc(_item_name(chunk[-1]))}</summary><div>'))
                todo.append(("items", (chunk, 0)))
                todo.append(("text", "</div></details>"))
            work.extend(reversed(todo))
            continue
        items, budget = payload
        todo = []
        table: list[str] = []
        for item in items:
            if isinstance(item, _Group):
                if table:
                    todo.append(("text", f'<table class="t">{"".join(table)}</table>'))
                    table = []
                opened = item.keys <= budget
                budget -= item.keys if opened else 0
                todo.append(("text", f'<details{" open" * opened}><summary><b>{esc(item.name + item.sep)}</b> '
                                     f'<span>({_totals(item)})</span></summary><div>'))
                todo.append(("level", item))
                todo.append(("text", "</div></details>"))
            else:
                name, row = item
                size = "" if row.nbytes is None else size_of(row.nbytes)
                table.append(f"<tr><td>{esc(name)}</td><td>{esc(row.desc)}</td><td>{size}</td></tr>")
        if table:
            todo.append(("text", f'<table class="t">{"".join(table)}</table>'))
        work.extend(reversed(todo))
    out.append("</div>")
    return "".join(out)
