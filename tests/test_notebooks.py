"""The notebooks are committed executed, so that they show their figures on the repository, and
stay fresh: their cells are those notebooks/make_notebooks.py writes, their outputs were made by
those very cells (a hash of the code cells, stored at execution), and executed anew they run top
to bottom and show what they promise: a cell tagged ``figure`` a PNG, one tagged ``html`` a table,
each the same kinds of output as committed. While they run, every figure is checked as it is
rendered: each plotted sample inside its axes, every label inside the figure and clear of the
lines and of the axes' frame, a title."""

from __future__ import annotations

import base64
import copy
import importlib.util
import inspect
import json
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a test extra: a bare GPU machine runs `-m cuda` without it

HERE = Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))
MAX_BYTES = 350_000
"""The most bytes one committed notebook may hold (its figures are PNGs at 100 dpi; the largest,
02, holds about 270 kB)."""


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", HERE / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str, list[str]]]:
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def missing_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """What an executed notebook fails to show: errors, ``figure`` cells without a PNG,
    ``html`` cells without a table."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        problems += [f"cell {i}: {o['ename']}: {o['evalue']}" for o in outputs if o.get("output_type") == "error"]
        tags = cell.metadata.get("tags", [])
        pngs = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
        if "figure" in tags and not any(p.startswith(b"\x89PNG\r\n\x1a\n") and len(p) > 5000 for p in pngs):
            problems.append(f"cell {i} promises a figure and shows no image/png")
        htmls = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
        if "html" in tags and not any("<table" in h for h in htmls):
            problems.append(f"cell {i} promises a table and shows no text/html table")
    return problems


def output_kinds(nb: nbformat.NotebookNode) -> list[set[tuple[str, ...]]]:
    """Per code cell, the kinds of its outputs: ``("stream", "stdout")``, ``("display_data",
    "image/png", "text/plain")``... (what an execution anew must show again; the numbers in
    them move with the machine and the timings). Warnings (stderr) are left out: they depend on
    what else is installed (tqdm warns without ipywidgets); committed notebooks show none."""
    def kind(o):
        if o["output_type"] == "stream":
            return o["output_type"], o["name"]
        return o["output_type"], *sorted(o.get("data", {}))

    return [{kind(o) for o in c.get("outputs", []) if o.get("name") != "stderr"}
            for c in nb.cells if c.cell_type == "code"]


def figure_problems(fig) -> list[str]:
    """What ``fig`` hides or cuts: plotted samples outside their axes, text outside the figure or
    across an axes' frame, text or a legend over a line of data, no title. Runs in the kernel
    (tests/test_notebooks.py sends its source), on each figure as Jupyter renders it."""
    from matplotlib.lines import Line2D

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    name = suptitle or " / ".join(ax.get_title() for ax in axes)
    problems = []

    def inside(box, outer, tol=1.0):
        return box.x0 >= outer.x0 - tol and box.y0 >= outer.y0 - tol and box.x1 <= outer.x1 + tol and \
            box.y1 <= outer.y1 + tol

    def shown(t):
        return t.get_visible() and t.get_text().strip()

    def data_lines(ax):
        return [ln for ln in ax.lines
                if ln.get_visible() and ln.get_transform() is ax.transData and len(ln.get_xydata())]

    def covers(box, line):
        """Whether ``line`` (in display space) passes under ``box``."""
        shrunk = box.expanded(0.95, 0.9)
        if line.get_linestyle() in ("None", "", " "):
            xy = line.get_transform().transform(line.get_xydata())
            return bool(((xy[:, 0] > shrunk.x0) & (xy[:, 0] < shrunk.x1) & (xy[:, 1] > shrunk.y0) &
                         (xy[:, 1] < shrunk.y1)).any())
        return line.get_transform().transform_path(line.get_path()).intersects_bbox(shrunk, filled=False)

    def labels_a_point(t, ax):
        """Whether ``t`` is an annotation of a point of one of the lines of ``ax``."""
        return getattr(t, "xycoords", None) == "data" and any(
            (ln.get_xydata() == t.xy).all(axis=1).any() for ln in data_lines(ax))

    if not suptitle and not all(any(ax.get_title(loc=loc) for loc in ("left", "center", "right")) for ax in axes):
        problems.append(f"{name!r}: neither the figure nor each of its axes has a title")
    texts = [t for t in fig.texts if shown(t)] + ([fig._suptitle] if suptitle else [])
    for legend in fig.legends + [ax.get_legend() for ax in axes if ax.get_legend() is not None]:
        box = legend.get_window_extent(renderer)
        if not inside(box, fig.bbox):
            problems.append(f"{name!r}: the legend reaches outside the figure")
        for ax in axes:
            for line in data_lines(ax):
                if covers(box, line):
                    problems.append(f"{name!r}: the legend covers the line {line.get_label()!r}")
    for ax in axes:
        for axis in (ax.xaxis, ax.yaxis):
            box = axis.get_tightbbox(renderer)
            if box is not None and not inside(box, fig.bbox):
                problems.append(f"{name!r}: the {axis.axis_name} axis of {ax.get_title()!r} (its label, its ticks) "
                                f"reaches outside the figure")
        texts += [t for t in (ax.title, ax._left_title, ax._right_title) if shown(t)]
        for line in ax.lines:
            if not line.get_visible() or not len(line.get_xydata()):
                continue
            xy = line.get_transform().transform(line.get_xydata())
            xy = xy[~(xy != xy).any(axis=1)]  # drop nan (gaps, and values a log scale cannot show)
            out = int((~((xy[:, 0] >= ax.bbox.x0 - 1) & (xy[:, 0] <= ax.bbox.x1 + 1) & (xy[:, 1] >= ax.bbox.y0 - 1) &
                         (xy[:, 1] <= ax.bbox.y1 + 1))).sum())
            if out:
                (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
                problems.append(f"{name!r}: {out} of {len(xy)} points of the line {line.get_label()!r} lie outside "
                                f"the axes (x {x0:.4g} to {x1:.4g}, y {y0:.4g} to {y1:.4g})")
        for t in ax.texts:
            if not shown(t):
                continue
            box = t.get_window_extent(renderer)
            if not inside(box, fig.bbox):
                problems.append(f"{name!r}: the label {t.get_text()!r} reaches outside the figure")
            if box.overlaps(ax.bbox) and not inside(box, ax.bbox, tol=0):
                problems.append(f"{name!r}: the label {t.get_text()!r} lies across the frame of its axes")
            if labels_a_point(t, ax):
                continue  # where a label of a measured point falls against the other lines moves with the timings
            for line in ax.lines:
                if line.get_visible() and covers(box, line):
                    problems.append(f"{name!r}: the label {t.get_text()!r} lies over the line {line.get_label()!r}")
    for t in texts:
        if not inside(t.get_window_extent(renderer), fig.bbox):
            problems.append(f"{name!r}: the text {t.get_text()!r} reaches outside the figure")
    return problems


CHECK_FIGURES = inspect.getsource(figure_problems) + """
import matplotlib.backend_bases as _backend_bases
_figure_checks = []
_print_figure = _backend_bases.FigureCanvasBase.print_figure

def _checked_print_figure(self, *args, **kwargs):
    _figure_checks.append(figure_problems(self.figure))
    return _print_figure(self, *args, **kwargs)

_backend_bases.FigureCanvasBase.print_figure = _checked_print_figure
"""
"""A first cell for a notebook under test: checks each figure as Jupyter renders it."""

REPORT_FIGURES = "import json as _json\nprint(_json.dumps(_figure_checks))"
"""A last cell: the checks of every figure shown."""


def test_there_are_seven_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_partial_loading.ipynb", "03_compression.ipynb",
                                           "04_gpu_loading.ipynb", "05_sharded_checkpoints.ipynb",
                                           "06_remote_checkpoints.ipynb", "07_compare.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_are_the_generators_executed(path: Path) -> None:
    gen = _generator()
    assert sorted(gen.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    on_disk = nbformat.read(path, as_version=4)
    fresh = gen.notebook(gen.NOTEBOOKS[path.name])
    assert _cells(on_disk) == _cells(fresh), f"{path.name} differs from notebooks/make_notebooks.py: run it"
    code = [c for c in on_disk.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code) and any(c.get("outputs") for c in code), \
        f"{path.name} is committed without outputs: run python notebooks/make_notebooks.py"
    assert on_disk.metadata.get("tensorstore_h5", {}).get("code_sha256") == gen.code_hash(fresh), \
        f"{path.name}: its outputs are those of other code cells: run python notebooks/make_notebooks.py"
    assert missing_outputs(on_disk) == []
    warnings = [o["text"] for c in code for o in c.outputs if o.get("name") == "stderr"]
    assert not warnings, f"{path.name} shows warnings (executed where the notebook extra is missing?): {warnings[0]}"
    assert not any("execution" in c.metadata for c in on_disk.cells), f"{path.name} keeps the timings of its cells"
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"


def test_code_hash_follows_the_code_cells_only() -> None:
    gen = _generator()
    cells = gen.NOTEBOOKS["01_quickstart.ipynb"]
    h = gen.code_hash(gen.notebook(cells))
    assert gen.code_hash(gen.notebook([gen.md("# another title"), *cells[1:]])) == h
    assert gen.code_hash(gen.notebook([*cells[:-1], cells[-1] + "\nprint(1)"])) != h
    assert gen.code_hash(gen.notebook([*cells, gen.figure("plt.plot([1])")])) != h


def test_each_notebook_promises_figures() -> None:
    figures = {p.name: sum("figure" in c.metadata.get("tags", []) for c in nbformat.read(p, as_version=4).cells)
               for p in NOTEBOOKS}
    # 02: time against bytes selected, memory while streaming, memory while merging; 03: ratio and speeds per preset;
    # 05: the pieces each of 3 readers opens; 07: the layers a fine-tuning moved, the statistics of one layer
    assert figures == {"01_quickstart.ipynb": 1, "02_partial_loading.ipynb": 3, "03_compression.ipynb": 1,
                       "04_gpu_loading.ipynb": 1, "05_sharded_checkpoints.ipynb": 1, "06_remote_checkpoints.ipynb": 1,
                       "07_compare.ipynb": 2}
    for p in NOTEBOOKS:
        assert "matplotlib.use(" not in p.read_text(), f"{p.name} sets a backend that shows no figures"


def test_missing_figures_and_tables_are_caught() -> None:
    nb = nbformat.v4.new_notebook()
    fig = nbformat.v4.new_code_cell("plt.plot([1])", metadata={"tags": ["figure"]})
    table = nbformat.v4.new_code_cell("df", metadata={"tags": ["html"]})
    nb.cells = [fig, table]
    fig.outputs = [nbformat.v4.new_output("display_data", {"text/plain": "<Figure size 640x480 with 1 Axes>"})]
    table.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "   a\n0  1"}, execution_count=1)]
    assert missing_outputs(nb) == ["cell 0 promises a figure and shows no image/png",
                                   "cell 1 promises a table and shows no text/html table"]
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(6000)).decode()
    fig.outputs.append(nbformat.v4.new_output("display_data", {"image/png": png}))
    table.outputs[0]["data"]["text/html"] = "<table><tr><td>1</td></tr></table>"
    assert missing_outputs(nb) == []
    assert output_kinds(nb) == [{("display_data", "text/plain"), ("display_data", "image/png")},
                                {("execute_result", "text/html", "text/plain")}]
    fig.outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[]))
    assert missing_outputs(nb) == ["cell 0: ValueError: bad"]


def test_figures_that_hide_or_cut_are_caught() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def fig_with(ylim=None, title="t", label_at=None, legend=None, layout="constrained"):
        fig = Figure(figsize=(4, 3), layout=layout)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.plot(range(100), [-250] * 60 + [5] * 40, label="items()")
        ax.plot(range(100), [2.5 * i for i in range(100)], label="safe_open")
        if ylim:
            ax.set_ylim(*ylim)
        if title:
            ax.set_title(title)
        if label_at:
            ax.annotate("largest tensor", label_at, fontsize=8)
        if legend:
            ax.legend(loc=legend)
        return fig

    assert figure_problems(fig_with()) == []
    assert figure_problems(fig_with(ylim=(-10, 280))) == \
        ["'t': 60 of 100 points of the line 'items()' lie outside the axes (x -4.95 to 104, y -10 to 280)"]
    assert figure_problems(fig_with(title=None)) == ["'': neither the figure nor each of its axes has a title"]
    assert figure_problems(fig_with(label_at=(41.5, 100))) == \
        ["'t': the label 'largest tensor' lies over the line 'safe_open'"]
    assert figure_problems(fig_with(label_at=(40, 100))) == []  # the label of a point of the data
    assert figure_problems(fig_with(label_at=(95, -150))) == \
        ["'t': the label 'largest tensor' lies across the frame of its axes"]
    assert figure_problems(fig_with(label_at=(99, -150), layout=None)) == \
        ["'t': the label 'largest tensor' reaches outside the figure",
         "'t': the label 'largest tensor' lies across the frame of its axes"]
    assert figure_problems(fig_with(legend="upper right")) == ["'t': the legend covers the line 'safe_open'"]
    assert figure_problems(fig_with(legend="lower right")) == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_shows_its_figures(path: Path, tmp_path) -> None:
    committed = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(committed)
    nb.cells = [nbformat.v4.new_code_cell(CHECK_FIGURES), *nb.cells, nbformat.v4.new_code_cell(REPORT_FIGURES)]
    t0 = time.perf_counter()
    _generator().execute(nb, tmp_path)
    elapsed = time.perf_counter() - t0
    check, *nb.cells, report = nb.cells
    assert [o.output_type for o in check.outputs] == []
    figures = json.loads(report.outputs[0]["text"])
    assert missing_outputs(nb) == []
    assert len(figures) == sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert [p for problems in figures for p in problems] == []
    assert output_kinds(nb) == output_kinds(committed), f"{path.name} shows other outputs than committed"
    assert elapsed < 120, f"{path.name} took {elapsed:.0f} s; keep each notebook well under a minute"
