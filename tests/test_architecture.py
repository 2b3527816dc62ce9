"""The import graph of the package, read from its source (docs/ARCHITECTURE.md): every import of
a module of the package, at the top of a module or inside a function, goes to a module of the
same wing or of a wing below it; no wing imports the benchmark but the command line; no
cycle, within a wing or across; ``pickle`` only in the benchmark; no class over ~500 lines."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "tensorstore_h5"
PACKAGE = "tensorstore_h5"

LEVELS = {
    "errors": 0, "display": 0, "_moved": 0,
    "format": 1,
    "storage": 2,
    "codecs": 3, "transfer": 3,
    "reading": 4, "writing": 4,
    "sharded": 5,
    "distributed": 6,
    "api": 7, "convert": 7,
    "__init__": 8, "bench": 8,
    "cli": 9,
    "__main__": 10,
}
"""Each wing's floor: imports go to the same wing or to a lower floor (docs/ARCHITECTURE.md)."""

MAX_CLASS_LINES = 550
"""About 500: the largest class, ``Writer``, has 527 lines."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package's modules that ``node`` in module ``importer`` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        base = importer if _is_package(importer) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if not target.startswith(PACKAGE):
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return [m for m in out if m in MODULES]


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(m for m in _resolve(name, node) if m != name)
        graph[name] = found
    return graph


GRAPH = _imports()


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_wing() -> None:
    assert {_wing(m) for m in MODULES} <= set(LEVELS), {_wing(m) for m in MODULES} - set(LEVELS)


def test_imports_go_down_the_wings() -> None:
    wrong = []
    for importer, targets in GRAPH.items():
        for target in targets:
            if target == PACKAGE and _wing(importer) in ("cli", "bench"):
                continue  # the command line and the benchmark use the public API (import tensorstore_h5 as th5)
            a, b = _wing(importer), _wing(target)
            if a != b and LEVELS[b] >= LEVELS[a]:
                wrong.append(f"{importer} -> {target}")
    assert not wrong, "imports up or across the wings:\n" + "\n".join(sorted(wrong))


def test_only_the_command_line_starts_the_benchmark() -> None:
    users = {m for m, targets in GRAPH.items() if _wing(m) != "bench" and any(_wing(t) == "bench" for t in targets)}
    assert users == {f"{PACKAGE}.cli"}


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if t == PACKAGE:
                continue  # the package's __init__ is lazy: it imports its API modules on first use only
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_checker_sees_what_it_checks() -> None:
    """The graph is read right: known edges are there, including imports inside functions."""
    assert "tensorstore_h5.reading.tensors" in GRAPH["tensorstore_h5.reading.many"]
    assert "tensorstore_h5.format.layout" in GRAPH["tensorstore_h5.reading.store"]
    assert "tensorstore_h5.bench.runner" in GRAPH["tensorstore_h5.cli"]  # imported inside cmd_bench
    assert "tensorstore_h5.storage.parallel" in GRAPH["tensorstore_h5.codecs.decoders"]


def test_pickle_only_in_the_benchmark() -> None:
    users = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "pickle" or n.startswith("pickle.") for n in names):
                users.add(name)
    assert users and all(_wing(m) == "bench" for m in users), users


def test_no_class_is_a_whole_wing() -> None:
    big = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big


OLD_PATHS = ["store", "writer", "remote", "httpranges", "hdf5source", "compression", "tree", "dtypes", "checksum",
             "slicing", "select", "constants", "hdf5meta", "background", "synthetic", "loopback", "realweights",
             "distributed.simulate"]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_the_flat_module_paths_still_import(old: str) -> None:
    from tensorstore_h5 import _moved

    module = importlib.import_module(f"{PACKAGE}.{old}")
    assert module is importlib.import_module(_moved.MOVED[f"{PACKAGE}.{old}"])  # the same object: same settings
    assert module.__spec__.name == module.__name__  # its own spec: its relative imports still resolve, unwarned


def test_the_split_io_module_reads_and_sets_its_names_where_they_live(monkeypatch) -> None:
    from tensorstore_h5 import io
    from tensorstore_h5.storage import files, memory, parallel

    assert io.RawFile is files.RawFile and io.empty is memory.empty and io.ReadPlan is parallel.ReadPlan
    monkeypatch.setattr(io, "HUGEPAGES", True)  # what users were told to set
    assert memory.HUGEPAGES is True
    monkeypatch.setattr(io, "IO_THREADS", 3)
    assert parallel.IO_THREADS == 3
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        io.nothing  # noqa: B018


def test_the_former_module_names_of_format_and_codecs_are_found_on_their_packages() -> None:
    from tensorstore_h5 import codecs, format
    from tensorstore_h5.codecs.decoders import ChunkReader
    from tensorstore_h5.format.layout import TensorEntry

    assert format.TensorEntry is TensorEntry and codecs.ChunkReader is ChunkReader
    with pytest.raises(AttributeError):
        format.no_such_name  # noqa: B018


def test_importing_the_package_imports_no_wing() -> None:
    code = ("import sys, tensorstore_h5; "
            "print(sorted(m for m in sys.modules if m.startswith('tensorstore_h5.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["tensorstore_h5.convert", "tensorstore_h5.errors"]  # noqa: S307
