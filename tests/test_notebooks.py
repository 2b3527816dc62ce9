"""The notebooks run top to bottom, so they cannot rot, and show what they promise: a cell tagged
``figure`` by notebooks/make_notebooks.py must output a PNG, one tagged ``html`` a table."""

from __future__ import annotations

import base64
import importlib.util
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a test extra: a bare GPU machine runs `-m cuda` without it

HERE = Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))


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


def test_there_are_seven_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_partial_loading.ipynb", "03_compression.ipynb",
                                           "04_gpu_loading.ipynb", "05_sharded_checkpoints.ipynb",
                                           "06_remote_checkpoints.ipynb", "07_compare.ipynb"]


def test_notebooks_are_what_the_generator_writes() -> None:
    gen = _generator()
    assert sorted(gen.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        on_disk = nbformat.read(path, as_version=4)
        assert _cells(on_disk) == _cells(gen.notebook(gen.NOTEBOOKS[path.name])), \
            f"{path.name} differs from notebooks/make_notebooks.py: run it"
        assert not any(c.get("outputs") for c in on_disk.cells), f"{path.name} is stored with outputs"


def test_each_notebook_promises_figures() -> None:
    figures = {p.name: sum("figure" in c.metadata.get("tags", []) for c in nbformat.read(p, as_version=4).cells)
               for p in NOTEBOOKS}
    # 02: time against bytes selected, memory while streaming; 03: ratio and speeds per preset; 07: the layers a
    # fine-tuning moved, the statistics of one layer
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
    fig.outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[]))
    assert missing_outputs(nb) == ["cell 0: ValueError: bad"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_shows_its_figures(path: Path, tmp_path) -> None:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    elapsed = time.perf_counter() - t0
    assert missing_outputs(nb) == []
    assert elapsed < 120, f"{path.name} took {elapsed:.0f} s; keep each notebook well under a minute"
