from __future__ import annotations

import importlib.util
import shutil
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.display import human_bytes
from tensorstore_h5.display.views import MAX_DEPTH, TreeRow, tree_html
from tensorstore_h5.reading.many import Reader

# -- reading the view back: what a person clicking through it can reach ----------------------


@dataclass
class Group:
    summary: str = ""
    open: bool = False
    more: bool = False  # a block holding the rest of a long level
    rows: list[list[str]] = field(default_factory=list)  # [name, description, size]
    groups: list[Group] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.summary.split(" (")[0]

    def group(self, name: str) -> Group:
        found = [g for g in self.groups if g.name == name]
        assert len(found) == 1, (name, [g.summary for g in self.groups])
        return found[0]

    def names(self) -> list[str]:
        return [r[0] for r in self.rows]

    def all_rows(self, prefix: str = "") -> list[tuple[str, list[str]]]:
        """Every row below, with the key path its groups spell (``more`` blocks add nothing)."""
        out = [(prefix + r[0], r) for r in self.rows]
        for g in self.groups:
            out += g.all_rows(prefix if g.more else prefix + g.name)
        return out


class _Outline(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Group()
        self.stack = [self.root]
        self.title = ""
        self._text: list[str] | None = None
        self._in = ""

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "details":
            g = Group(open="open" in dict(attrs), more=dict(attrs).get("class") == "m")
            self.stack[-1].groups.append(g)
            self.stack.append(g)
        elif tag == "summary":
            self._text, self._in = [], "summary"
        elif tag == "tr":
            self.stack[-1].rows.append([])
        elif tag == "td":
            self._text, self._in = [], "td"
        elif tag == "div" and ("class", "h") in attrs:
            self._text, self._in = [], "title"

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.stack.pop()
        elif tag == "summary" and self._in == "summary":
            self.stack[-1].summary = "".join(self._text).strip()
            self._text = None
        elif tag == "td" and self._in == "td":
            self.stack[-1].rows[-1].append("".join(self._text))
            self._text = None
        elif tag == "div" and self._in == "title":
            self.title = "".join(self._text)
            self._text, self._in = None, ""

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


def outline(html: str) -> tuple[str, Group]:
    """(title, root group) of a view, its text unescaped as a browser shows it."""
    p = _Outline()
    p.feed(html)
    p.close()
    assert p.stack == [p.root], "unbalanced <details>"
    return p.title, p.root


# -- the view of a store ---------------------------------------------------------------------


def test_store_and_handle_html(tmp_path) -> None:
    th5.save({"model": {"w<b>": torch.zeros(3, 300), "t": torch.zeros(4, 2).t()}, "epoch": 3}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        title, root = outline(s._repr_html_())
        assert title == repr(s)
        model = root.group("model/")
        assert model.open and model.summary == f"model/ (2 tensors, {human_bytes(3 * 300 * 4 + 8 * 4)})"
        assert model.rows == [["w<b>", "float32 [3, 300]", "3.5 KiB"], ["t", "float32 [2, 4] stride [1, 2]", "32 B"]]
        assert root.rows == [["epoch", "int = 3", ""]]
        handle_title, handle = outline(s["model/w<b>"]._repr_html_())
        assert handle_title == repr(s["model/w<b>"])
        assert handle.rows == [["model/w<b>", "float32 [3, 300] row-major, contiguous", "3.5 KiB"]]


def test_dotted_names_nest_with_totals(tmp_path) -> None:
    from tensorstore_h5.bench.synthetic import checkpoint

    ckpt = checkpoint(layers=12, width=16)
    th5.save(ckpt, tmp_path / "c.h5")
    with th5.open(tmp_path / "c.h5") as s:
        keys = s.keys()
        _, root = outline(s._repr_html_())
    model = root.group("model/")
    assert [g.name for g in root.groups] == ["model/", "optimizer/", "config/"]
    assert model.names() == ["embed.weight", "norm.weight", "head.weight"]
    layers = model.group("layers.")
    assert [g.name for g in layers.groups] == [f"{i}." for i in range(12)] and not layers.rows
    layer3 = layers.group("3.")
    assert [g.name for g in layer3.groups] == ["attn.", "mlp."] and layer3.names() == ["norm1.weight", "norm2.weight"]
    assert layer3.group("attn.").names() == ["qkv.weight", "qkv.bias", "out.weight", "mask"]  # leaf modules stay rows
    assert layer3.group("mlp.").names() == ["up.weight", "down.weight"]
    # every key is one row, and the groups above it spell its path
    assert sorted(path for path, _ in root.all_rows()) == sorted(keys)

    sd = ckpt["model"]
    layer_bytes = sum(v.nbytes for k, v in sd.items() if k.startswith("layers.3."))
    assert layer3.summary == f"3. (8 tensors, {human_bytes(layer_bytes)})"
    unique = sum(v.nbytes for k, v in sd.items() if k != "head.weight")  # tied to embed.weight: counted once
    assert model.summary == f"model/ (99 tensors, {human_bytes(unique)})"
    assert model.rows[2][1].endswith("(same as model/embed.weight)")
    assert root.group("config/").summary == "config/ (5 keys)"  # plain values: keys, no tensors
    state = [v for st in ckpt["optimizer"]["state"].values() for v in st.values()]
    n_opt = sum(1 for k in keys if k.startswith("optimizer/"))
    assert n_opt > len(state) > 0
    assert root.group("optimizer/").summary == \
        f"optimizer/ ({n_opt} keys, {len(state)} tensors, {human_bytes(sum(v.nbytes for v in state))})"


def test_groups_start_open_while_they_stay_small(tmp_path) -> None:
    from tensorstore_h5.bench.synthetic import transformer_state_dict

    ckpt = {"small": {"a.x": torch.zeros(1)}, "model": transformer_state_dict(12, 8), "tail": {"b": 1}}
    th5.save(ckpt, tmp_path / "o.h5")
    with th5.open(tmp_path / "o.h5") as s:
        _, root = outline(s._repr_html_())
    assert [(g.name, g.open) for g in root.groups] == [("small/", True), ("model/", False), ("tail/", True)]
    layers = root.group("model/").group("layers.")
    assert not layers.open
    # inside, groups open in saved order while the keys they unfold add up to at most 50
    assert [g.open for g in layers.groups] == [True] * 6 + [False] * 6
    assert all(g.open for g in layers.group("0.").groups)


def test_every_row_of_a_10000_key_file_is_reachable_fast_and_reads_no_data(tmp_path, monkeypatch) -> None:
    th5.save({"layers": {f"p{i}": torch.zeros(2) for i in range(10_000)}}, tmp_path / "big.h5")
    with th5.open(tmp_path / "big.h5") as s:
        monkeypatch.setattr(Reader, "read_tensor", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
        s._repr_html_()  # the first call parses the layout entries
        t0 = time.perf_counter()
        html = s._repr_html_()
        elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"{elapsed:.2f} s"  # ~0.1 s on a 2-core machine
    assert len(html) < 800_000, len(html)  # ~550 kB
    _, root = outline(html)
    layers = root.group("layers/")
    assert not layers.open and layers.summary == "layers/ (10,000 tensors, 78.1 KiB)"
    assert layers.names() == [f"p{i}" for i in range(200)]
    assert [(g.summary, g.open) for g in layers.groups][:2] == [("201–1,200 of 10,000: p200 … p1199", False),
                                                                ("1,201–2,200 of 10,000: p1200 … p2199", False)]
    assert len(layers.groups) == 10 and layers.groups[-1].summary == "9,201–10,000 of 10,000: p9200 … p9999"
    assert [path for path, _ in root.all_rows()] == [f"layers/p{i}" for i in range(10_000)]


def test_rest_blocks_hold_groups_too() -> None:
    rows = [TreeRow(f"m/{i}.{j}.w", "x", 4) for i in range(7) for j in range(7)]  # 7 groups of 7 groups
    _, root = outline(tree_html("t", rows, group_limit=3, block_rows=2))
    m = root.group("m/")
    assert [g.name for g in m.groups[:3]] == ["0.", "1.", "2."]
    assert [g.summary for g in m.groups[3:]] == ["4–5 of 7: 3. … 4.", "6–7 of 7: 5. … 6."]
    assert [g.name for g in m.groups[3].groups] == ["3.", "4."]
    assert sorted(p for p, _ in root.all_rows()) == sorted(r.path for r in rows)


def test_odd_key_names_are_escaped_and_kept_whole(tmp_path) -> None:
    odd = ["<script>alert(1)</script>", 'a"b\'c', "x&amp;y", "</td></tr></table></details>", "a..b", ".x", "y.",
           "<img src=x onerror=alert(1)>.weight", "ünï.cødé", " ", "%", "a/b"]
    th5.save({"m": {k: torch.zeros(1) for k in odd}, "<b onclick=x>v": "<i>x</i>"}, tmp_path / "<odd>.h5")
    with th5.open(tmp_path / "<odd>.h5") as s:
        keys = s.keys()
        html = s._repr_html_()
    for raw in ("<script", "<img", "<b onclick", "<i>x", "</td></tr></table></details>", "<odd>"):
        assert raw not in html
    title, root = outline(html)
    assert "<odd>.h5" in title
    assert sorted(p for p, _ in root.all_rows()) == sorted(keys)
    m = root.group("m/")
    assert {"a..b", ".x", "y.", "<img src=x onerror=alert(1)>.weight", "a%2Fb"} <= set(m.names())
    assert not m.groups  # names with empty dotted parts stay whole; one-key modules are rows
    assert ["<b onclick=x>v", "str = '<i>x</i>'", ""] in root.rows


def test_html_shows_compression_ratio(tmp_path) -> None:
    t = torch.zeros(512, 64)
    th5.save({"w": t, "plain": t.clone()}, tmp_path / "c.h5", compression=lambda k, _t: "lz4" if k == "w" else None)
    with th5.open(tmp_path / "c.h5") as s:
        _, root = outline(s._repr_html_())
    rows = {r[0]: r[1] for r in root.rows}
    assert rows["w"].startswith("float32 [512, 64], compressed to 0.0") and rows["plain"] == "float32 [512, 64]"


def test_dotted_groups_flatten_only_small_leaf_modules() -> None:
    rows = [TreeRow(f"emb.p{i}", "", 1) for i in range(8)] + [TreeRow("lin.weight", "", 1), TreeRow("lin.bias", "", 1)]
    _, root = outline(tree_html("t", rows))
    assert root.group("emb.").names() == [f"p{i}" for i in range(8)]  # 8 keys: a group of its own
    assert root.names() == ["lin.weight", "lin.bias"]
    _, chain = outline(tree_html("t", [TreeRow("encoder.layer.0.attn.q.weight", "", 1),
                                       TreeRow("encoder.layer.1.attn.q.weight", "", 1)]))
    assert [g.name for g in chain.groups] == ["encoder.layer."]  # single groups merge


def test_deep_paths_do_not_recurse() -> None:
    deep = ".".join(f"n{i}" for i in range(3000))
    _, root = outline(tree_html("t", [TreeRow(deep, "d", 8), TreeRow("/".join(["g"] * 3000) + "/leaf", "d", 8)]))
    assert sorted(p for p, _ in root.all_rows()) == sorted([deep, "/".join(["g"] * 3000) + "/leaf"])
    depth, g = 0, root
    while g.groups:
        g, depth = g.groups[0], depth + 1
    assert depth <= MAX_DEPTH


def test_progress_bars_by_bytes(tmp_path, capsys) -> None:
    sd = {f"w{i}": torch.zeros(256, 256) for i in range(4)}
    th5.save(sd, tmp_path / "p.h5", progress=True)
    th5.load(tmp_path / "p.h5", progress=True)
    th5.load_into({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "p.h5", progress=True)
    err = capsys.readouterr().err
    assert "saving p.h5" in err and "loading p.h5" in err and "1.00M" in err  # 4 x 256 KiB, counted in bytes
    th5.save(sd, tmp_path / "q.h5", progress=False)
    th5.load(tmp_path / "q.h5")  # small and not interactive: no bar
    assert capsys.readouterr().err == ""


# -- the view in a real browser ---------------------------------------------------------------

SCRIPT = Path(__file__).parents[1] / "docs" / "make_screenshots.py"


def _screenshots():
    spec = importlib.util.spec_from_file_location("make_screenshots", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome",
                                                        "google-chrome-stable")), reason="needs Chromium")
def test_screenshots_in_a_real_browser(tmp_path) -> None:
    pytest.importorskip("nbconvert")
    from PIL import Image

    shots = _screenshots()
    made = shots.make(tmp_path)
    assert sorted(made) == sorted(shots.PAGES)
    for name, png in made.items():
        with Image.open(png) as im:
            gray = im.convert("L")
            assert im.size == (900, 760)
            hist = gray.histogram()
            dark_page = name.endswith("dark")
            background = sum(hist[:64]) if dark_page else sum(hist[192:])
            text = sum(hist[160:]) if dark_page else sum(hist[:96])
            assert background > 0.6 * im.size[0] * im.size[1], name  # the page's own background
            assert text > 2000, name  # and text drawn in a contrasting colour on it
        probe = shots.check_styles(tmp_path / f"{name}.html")
        assert probe["view_color"] == probe["host_color"]  # colours inherited from the page or theme
        for row in probe["rows"]:
            assert row["background"] == "rgba(0, 0, 0, 0)", (name, row)  # no zebra stripes
            assert [c["align"] for c in row["cells"]] == ["left", "left", "right"], (name, row)
            assert {c["color"] for c in row["cells"]} == {probe["view_color"]}
        assert len(set(probe["name_text_lefts"])) == 1, (name, probe)  # key names start in one column
        assert probe["table_margin_left"] == "0px"


def test_the_views_names_are_still_found_on_the_display_package() -> None:
    """``display.py`` became ``display/`` (the views in ``display/views.py``, imported when a view
    is shown): the old names still import, and the package alone imports no view."""
    import subprocess
    import sys

    from tensorstore_h5 import display
    from tensorstore_h5.display import views

    assert display.tree_html is views.tree_html and display.TreeRow is views.TreeRow
    try:
        display.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name was found")
    out = subprocess.run([sys.executable, "-c", "import sys, tensorstore_h5.display as d; d.human_bytes(3); "
                          "print('tensorstore_h5.display.views' in sys.modules)"], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
