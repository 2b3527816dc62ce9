"""The HTML tree of keys that the Jupyter views share (``Store``, ``TensorHandle``, the diff and
stats tables) and bar charts as inline SVG (no matplotlib)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from . import human_bytes

__all__ = ["TreeRow", "Column", "Html", "tree_html", "bar_svg", "bar_chart_svg"]


# -- the HTML tree of keys (Store._repr_html_, TensorHandle._repr_html_, the diff and stats views) -

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


class Column(NamedTuple):
    """A column of :func:`tree_html` after the key names."""

    heading: str = ""
    align: str = "left"
    """``"left"`` or ``"right"``."""
    dim: bool = False
    """Shown dimmed (a description beside the figures)."""


class Html(str):
    """A cell of :func:`tree_html` that is markup already (an inline SVG), ``width`` characters wide."""

    width: float

    def __new__(cls, markup: str, width: float) -> Html:
        cell = super().__new__(cls, markup)
        cell.width = width
        return cell


class _StoreTotals:
    """A group's totals in the store view: tensors and bytes (aliases counted once)."""

    __slots__ = ("tensors", "nbytes")

    def __init__(self) -> None:
        self.tensors = self.nbytes = 0

    def add(self, row: TreeRow) -> None:
        if row.nbytes is not None:
            self.tensors += 1
            self.nbytes += row.nbytes if row.counted else 0

    def text(self, keys: int) -> str:
        if not self.tensors:
            return f"{keys:,} key{'s' * (keys != 1)}"
        tensors = f"{self.tensors:,} tensor{'s' * (self.tensors != 1)}, {human_bytes(self.nbytes)}"
        return tensors if keys == self.tensors else f"{keys:,} keys, {tensors}"


def _store_cells(row: TreeRow) -> tuple[str, ...]:
    return row.desc, "" if row.nbytes is None else human_bytes(row.nbytes)


_STORE_COLUMNS = (Column(dim=True), Column(align="right"))

FLATTEN_MAX = 5
"""A dotted module with at most this many keys and no submodules (``qkv.weight``, ``qkv.bias``)
is shown as rows of its parent instead of as a group of its own."""

MAX_DEPTH = 32
"""Key paths nest at most this deep for display; the rest of a deeper path is one row name."""

INDENT_CH = 2
"""Characters (``ch``) that each level of nesting indents: the columns after the names line up
across levels because every name column ends at the same place (see :func:`tree_html`)."""

# Scoped to the view's class, and specific enough to win over JupyterLab's
# `.jp-RenderedHTMLCommon td/tr` rules (right-aligned, zebra-striped, padded). Colours are
# inherited; lines and highlights are translucent grey, so light and dark themes both read.
# Widths are in ch of the monospace font: a level indents INDENT_CH (the line beside it is a
# shadow, which takes no room), so each view's own rules (_columns_css) can line its columns up.
_STYLE = (
    "<style>"
    ".th5{font-family:var(--jp-code-font-family,var(--vscode-editor-font-family,ui-monospace,SFMono-Regular,Menlo,"
    "Consolas,monospace));font-size:12px;line-height:1.5;color:inherit;text-align:left}"
    ".th5 .h{font-weight:600}"
    ".th5 summary>span{opacity:.6}"
    ".th5 details{margin:0;padding:0}"
    ".th5 details>summary{cursor:pointer;padding:0;margin:0;white-space:nowrap}"
    ".th5 details>summary:hover{background:rgba(127,127,127,.14)}"
    ".th5 details>div{margin:0 0 0 .5ch;padding:0 0 0 1.5ch;border:0;box-shadow:inset 1px 0 rgba(127,127,127,.35)}"
    ".th5 details.m>summary{font-style:italic}"
    "div.th5 table.t{border-collapse:collapse;border-spacing:0;border:0;margin:0;padding:0;width:auto;"
    "table-layout:auto;color:inherit;font:inherit;background:transparent}"
    ".th5 .t tr:nth-child(n){background:transparent;border:0}"
    ".th5 .t tr:nth-child(n):hover{background:rgba(127,127,127,.14)}"
    ".th5 .t td:nth-child(n){text-align:left;vertical-align:top;padding:0 2ch 0 0;border:0;line-height:inherit;"
    "white-space:nowrap;max-width:none;min-width:0;box-sizing:content-box;font:inherit;color:inherit}"
    ".th5 .t td:last-child{padding-right:0}"
    ".th5 .t.hd td{opacity:.6;font-style:italic}"
    ".th5 svg{display:block}"
    ".th5 td svg{display:inline-block;vertical-align:middle}"
    "</style>"
)


class _Group:
    __slots__ = ("name", "sep", "items", "sub", "keys", "totals")

    def __init__(self, name: str, sep: str, totals: Any) -> None:
        self.name = name
        self.sep = sep  # "/" for a container of the file, "." for a dotted state-dict prefix
        self.items: list[_Group | tuple[str, Any]] = []
        self.sub: dict[tuple[str, str], _Group] = {}
        self.keys = 0
        self.totals = totals


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


def _build(rows: Iterable[Any], nest: bool, totals: Callable[[], Any]) -> _Group:
    root = _Group("", "", totals())
    for row in rows:
        segs, name = _segments(row.path) if nest else ([], row.path)
        node = root
        node.keys += 1
        node.totals.add(row)
        for seg in segs:
            child = node.sub.get(seg)
            if child is None:
                child = node.sub[seg] = _Group(*seg, totals())
                node.items.append(child)
            node = child
            node.keys += 1
            node.totals.add(row)
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
        items: list[_Group | tuple[str, Any]] = []
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


def _item_name(item: _Group | tuple[str, Any]) -> str:
    return item.name + item.sep if isinstance(item, _Group) else item[0]


def _columns_css(view: str, name_end: int, depths: Iterable[int], widths: list[float],
                 columns: tuple[Column, ...]) -> str:
    """The rules of one view (class ``view``) that line its columns up across levels: the name
    column of a table at depth ``d`` is ``name_end - d * INDENT_CH`` characters wide, so every
    later column starts at the same place, and each later column is as wide as its widest cell."""
    scope = f".th5.{view} .t"
    rules = [f"{scope}.d{d} td:nth-child(1){{width:{name_end - d * INDENT_CH}ch}}" for d in sorted(depths)]
    for i, (col, width) in enumerate(zip(columns, widths), start=2):
        extra = ";opacity:.7" if col.dim else ""
        rules.append(f"{scope} td:nth-child({i}){{width:{width:g}ch;text-align:{col.align}{extra}}}")
    return "<style>" + "".join(rules) + "</style>"


def tree_html(title: str, rows: Iterable[Any], open_limit: int = 50, group_limit: int = 200,
              block_rows: int = 1000, nest: bool = True, *, cells: Callable[[Any], Sequence[str]] | None = None,
              totals: Callable[[], Any] | None = None, columns: Sequence[Column] | None = None,
              head: str = "") -> str:
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
    The columns line up across levels, however deep: each level indents :data:`INDENT_CH`
    characters and the name column of its tables is that much narrower.

    Other views (a diff, statistics) give rows of their own, with a ``path``: ``cells(row)``
    returns the cells after the name (``str`` is text, :class:`Html` markup), ``columns`` says
    how each is shown (with headings, a heading row comes first), ``totals()`` makes the totals
    of a group (``add(row)``; ``text(keys)`` for its summary line; a ``weight`` attribute, when
    it has one, is what the group spends of ``open_limit`` instead of its keys, and a group of
    weight 0 starts collapsed), and ``head`` is markup shown under the title (a figure).
    """
    if cells is None:
        rows = (row if isinstance(row, TreeRow) else TreeRow(*row) for row in rows)
    cells = cells or _store_cells
    columns = tuple(columns or _STORE_COLUMNS)
    root = _build(rows, nest, totals or _StoreTotals)
    import html

    esc = _Memo(html.escape)  # names and descriptions repeat ("weight", "float32 [768]")
    widths = [0.0] * len(columns)
    name_end = 12  # characters from the view's left edge to the end of every name column
    depths: set[int] = set()

    def table(rows_html: list[str], depth: int, kind: str = "") -> str:
        depths.add(depth)
        return f'<table class="t{kind} d{depth}">{"".join(rows_html)}</table>'

    def cell(value: str, i: int) -> str:
        width = value.width if isinstance(value, Html) else len(value)
        if width > widths[i]:
            widths[i] = width
        return value if isinstance(value, Html) else esc(value)

    body: list[str] = []
    if any(c.heading for c in columns):
        headings = "".join(f"<td>{cell(c.heading, i)}</td>" for i, c in enumerate(columns))
        body.append(table([f"<tr><td>key</td>{headings}</tr>"], 0, " hd"))
    # An explicit stack instead of recursion (paths may nest deep): ("text", html to emit),
    # ("level", (group, depth)) or ("items", (entries, keys that may start unfolded, depth)).
    work: list[tuple[str, Any]] = [("level", (root, 0))]
    while work:
        kind, payload = work.pop()
        if kind == "text":
            body.append(payload)
            continue
        if kind == "level":
            node, depth = payload
            first, rest = node.items[:group_limit], node.items[group_limit:]
            todo: list[tuple[str, Any]] = [("items", (first, open_limit, depth))]
            total = len(node.items)
            for start in range(0, len(rest), block_rows):
                chunk = rest[start:start + block_rows]
                a, b = group_limit + start + 1, group_limit + start + len(chunk)
                todo.append(("text", f'<details class="m"><summary>{a:,}–{b:,} of {total:,}: '
                                     f'{esc(_item_name(chunk[0]))} … {esc(_item_name(chunk[-1]))}</summary><div>'))
                todo.append(("items", (chunk, 0, depth + 1)))
                todo.append(("text", "</div></details>"))
            work.extend(reversed(todo))
            continue
        items, budget, depth = payload
        todo = []
        lines: list[str] = []
        for item in items:
            if isinstance(item, _Group):
                if lines:
                    todo.append(("text", table(lines, depth)))
                    lines = []
                weight = getattr(item.totals, "weight", None)  # keys that should show (a diff's: those that differ)
                opened = item.keys <= budget if weight is None else 0 < weight <= budget
                budget -= (item.keys if weight is None else weight) if opened else 0
                todo.append(("text", f'<details{" open" * opened}><summary><b>{esc(item.name + item.sep)}</b> '
                                     f'<span>({esc(item.totals.text(item.keys))})</span></summary><div>'))
                todo.append(("level", (item, depth + 1)))
                todo.append(("text", "</div></details>"))
            else:
                name, row = item
                name_end = max(name_end, len(name) + depth * INDENT_CH)
                tds = "".join(f"<td>{cell(v, i)}</td>" for i, v in enumerate(cells(row)))
                lines.append(f"<tr><td>{esc(name)}</td>{tds}</tr>")
        if lines:
            todo.append(("text", table(lines, depth)))
        work.extend(reversed(todo))
    text = "".join(body)
    if columns == _STORE_COLUMNS:
        widths[0] = max(widths[0], 18)
    view = "v" + hashlib.blake2b(text.encode(), digest_size=5).hexdigest()  # the same view, the same rules
    return (f'{_STYLE}{_columns_css(view, name_end, depths, widths, columns)}<div class="th5 {view}">'
            f'<div class="h">{esc(title)}</div>{head}{text}</div>')


# -- figures without matplotlib: inline SVG ---------------------------------------------------

BAR_COLOR = "#4c78a8"
"""Bars of the SVG charts: a blue that reads on light and dark backgrounds."""

ALERT_COLOR = "#e45756"
"""Bars of values that are not finite (nan, inf)."""


def bar_svg(fraction: float, width: int = 80, height: int = 9, alert: bool = False) -> Html:
    """A small horizontal bar, ``fraction`` (0..1) of ``width`` pixels, for a table cell."""
    w = max(1.0, min(1.0, fraction) * width) if fraction > 0 else 0.0
    color = ALERT_COLOR if alert else BAR_COLOR
    bar = f'<rect width="{w:.1f}" height="{height}" fill="{color}"/>' if w else ""
    return Html(f'<svg width="{width}" height="{height}" aria-hidden="true">{bar}</svg>', width / 7 + 1)


def _decade(e: int) -> str:
    return {0: "1", 1: "10", -1: "0.1"}.get(e, f"1e{e}")


def bar_chart_svg(values: Sequence[float | None], labels: Sequence[str], bands: Sequence[tuple[str, int, int]] = (),
                  sections: Sequence[tuple[str, int, int]] = (), *, title: str = "", width: int = 760,
                  height: int = 170) -> str:
    """A bar chart of ``values`` in order, on a log scale, as inline SVG (no matplotlib).

    A value of None or 0 draws no bar; a value that is not finite draws a full-height bar in
    :data:`ALERT_COLOR`. ``labels`` name each bar (its tooltip); ``bands`` are ``(label, start,
    stop)`` runs of bars (groups of keys) shaded alternately and named under the axis where the
    name fits; ``sections`` are larger runs (a file's top containers), parted by a line and
    named at their top left. More bars than pixels are binned: each bin shows its largest
    value. Text and lines take the page's colour."""
    import html  # (the text views need it; a fresh open of a file does not)

    n = len(values)
    left, right, top, bottom = 46, 8, 18 if title else 6, 30
    pw, ph = width - left - right, height - top - bottom
    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{html.escape(title or "bar chart")}" style="font:10px sans-serif;overflow:visible">']
    if title:
        out.append(f'<text x="{left}" y="11" fill="currentColor">{html.escape(title)}</text>')
    lo = math.floor(math.log10(min(finite))) if finite else -1
    hi = math.ceil(math.log10(max(finite))) if finite else 0
    hi = max(hi, lo + 1)
    for k, (label, a, b) in enumerate(bands):
        x0, x1 = left + pw * a / max(n, 1), left + pw * b / max(n, 1)
        if k % 2:
            out.append(f'<rect x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{ph}" fill="currentColor" '
                       'fill-opacity=".07"/>')
        if (x1 - x0) >= 6 * len(label) + 4:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{top + ph + 12}" text-anchor="middle" fill="currentColor" '
                       f'fill-opacity=".75">{html.escape(label)}</text>')
    for k, (label, a, b) in enumerate(sections):
        x0, x1 = left + pw * a / max(n, 1), left + pw * b / max(n, 1)
        if k:
            out.append(f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{top}" y2="{top + ph + 4}" stroke="currentColor" '
                       'stroke-opacity=".5"/>')
        if (x1 - x0) >= 6 * len(label) + 6:
            out.append(f'<text x="{x0 + 3:.1f}" y="{top + 10}" fill="currentColor" fill-opacity=".75">'
                       f'{html.escape(label)}</text>')
    step = max(1, math.ceil((hi - lo) / 5))
    for e in range(lo, hi + 1, step):
        y = top + ph - ph * (e - lo) / (hi - lo)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="currentColor" '
                   f'stroke-opacity=".15"/><text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" '
                   f'fill="currentColor" fill-opacity=".75">{_decade(e)}</text>')
    bins = min(n, pw)  # more bars than pixels: a bin per pixel, showing its largest value
    for j in range(bins):
        a, b = j * n // bins, (j + 1) * n // bins
        chosen, best = None, -math.inf
        for i in range(a, b):
            v = values[i]
            if v is None or v == 0:
                continue
            score = math.inf if not math.isfinite(v) else v
            if score > best:
                chosen, best = i, score
        if chosen is None:
            continue
        v = values[chosen]
        assert v is not None
        alert = not math.isfinite(v)
        frac = 1.0 if alert else max(0.0, (math.log10(v) - lo) / (hi - lo))
        h = max(1.0, frac * ph)
        x0, bw = left + pw * a / n, max(1.0, pw * (b - a) / n - (1 if pw / n >= 4 else 0))
        tip = f"<title>{html.escape(labels[chosen])}: {v:.3g}</title>" if b - a == 1 else \
            f"<title>{html.escape(labels[chosen])}: {v:.3g} (largest of {b - a})</title>"
        out.append(f'<rect x="{x0:.1f}" y="{top + ph - h:.1f}" width="{bw:.1f}" height="{h:.1f}" '
                   f'fill="{ALERT_COLOR if alert else BAR_COLOR}">{tip}</rect>')
    if not finite and not any(v is not None and not math.isfinite(v) for v in values):
        out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph / 2:.1f}" text-anchor="middle" fill="currentColor" '
                   'fill-opacity=".6">nothing to show: every value is 0</text>')
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="currentColor" '
               'stroke-opacity=".4"/></svg>')
    return "".join(out)
