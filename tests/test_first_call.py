"""The first call in a fresh process imports only what its path needs (issue #29): a format-2
file is opened, listed, sliced and loaded without h5py, hdf5plugin, fsspec, the writer, the
sharded or the distributed code; the bench's first-call group measures it in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.bench import firstcall
from tensorstore_h5.bench.contenders import CONTENDERS, Ctx

_HEAVY = ("h5py", "hdf5plugin", "fsspec", "tensorstore_h5.writing", "tensorstore_h5.sharded",
          "tensorstore_h5.distributed", "tensorstore_h5.codecs.presets", "tensorstore_h5.format.hdf5meta",
          # what only URLs, compressed chunks and the HTML view need (each ~0.5-2 ms of a fresh open)
          "tensorstore_h5.storage.remote", "tensorstore_h5.storage.httpranges", "tensorstore_h5.codecs.decoders",
          "isal", "html", "shlex",
          # libhdf5's wrappers, the old module paths, the HTML views
          "tensorstore_h5.storage.libhdf5", "tensorstore_h5._moved", "tensorstore_h5.display.views")


def _imported_after(code: str) -> list[str]:
    script = f"import json, sys\nimport torch\n{code}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reading_a_format_2_file_imports_no_hdf5_writer_or_remote_code(tmp_path) -> None:
    path = tmp_path / "f.h5"
    th5.save({"model": {"w": torch.randn(64, 8), "b": torch.zeros(8)}, "step": 3}, path)
    mods = _imported_after(
        "import tensorstore_h5 as th5\n"
        f"s = th5.open({str(path)!r}); s.keys(); s['model/w'][:4]; s.close()\n"
        f"th5.load({str(path)!r}); th5.load({str(path)!r}, mmap=True)\n")
    loaded = [m for m in mods if m.split(".")[0] in _HEAVY or m.startswith(_HEAVY)]
    assert loaded == [], loaded
    assert "tensorstore_h5.reading.store" in mods  # (the probe did run)


def test_opening_and_listing_imports_no_read_planner(tmp_path) -> None:
    """``th5.open`` + ``keys()`` (what ``ls`` and a notebook's first look do) makes no reader:
    the read planner, the device wing and the I/O threads are imported by the first read."""
    path = tmp_path / "f.h5"
    th5.save({"model": {"w": torch.randn(64, 8)}, "step": 3}, path)
    planner = ("tensorstore_h5.reading.many", "tensorstore_h5.reading.tensors", "tensorstore_h5.storage.parallel")
    mods = _imported_after(f"import tensorstore_h5 as th5\ns = th5.open({str(path)!r}); s.keys(); 'step' in s; len(s)\n"
                           "s.close(); assert s.closed\n")
    assert "tensorstore_h5.reading.store" in mods and not [m for m in mods if m in planner]
    mods = _imported_after(f"import tensorstore_h5 as th5\nwith th5.open({str(path)!r}) as s: s['model/w'][:2]\n")
    assert all(m in mods for m in planner)


def test_a_slice_imports_no_display_or_codecs_module(tmp_path) -> None:
    """A slice of a local format-2 file shows nothing and decodes nothing: ``display`` (sizes
    in reprs and messages, progress bars of loads) and the ``codecs`` package (``DecodeError``
    lives in ``errors``) are not imported (~0.2-0.3 ms each of a fresh process); a repr and a
    load import ``display``."""
    path = tmp_path / "f.h5"
    th5.save({"model": {"w": torch.randn(64, 8)}, "step": 3}, path)
    lazy = ("tensorstore_h5.display", "tensorstore_h5.codecs", "tensorstore_h5.api")
    code = f"import tensorstore_h5 as th5\nwith th5.open({str(path)!r}) as s: s['model/w'][:2]; s['model/w'][3]\n"
    mods = _imported_after(code)
    assert "tensorstore_h5.reading.tensors" in mods and [m for m in mods if m in lazy] == []
    mods = _imported_after(code + f"repr(th5.open({str(path)!r})); th5.load({str(path)!r})\n")
    assert "tensorstore_h5.display" in mods and "tensorstore_h5.api" in mods


def test_open_lives_in_the_package_and_imports_no_api_module(tmp_path) -> None:
    """``th5.open`` is the package's own function (api.py, ~0.5-0.8 ms of a fresh process, is
    ``load``'s and ``load_into``'s): a file opens as a Store and a directory as a ShardedStore
    without it, the stores' modules bound as lazy names; ``load_into`` opens the same way."""
    path = tmp_path / "f.h5"
    th5.save({"w": torch.arange(6.0)}, path)
    code = (f"import tensorstore_h5 as th5\ns = th5.open({str(path)!r})\n"
            "assert type(s).__name__ == 'Store' and s['w'][1:3].tolist() == [1.0, 2.0]\n"
            "assert th5.open.__module__ == 'tensorstore_h5' and 'Store' in vars(th5)\n")
    mods = _imported_after(code)
    assert "tensorstore_h5.reading.store" in mods and "tensorstore_h5.api" not in mods
    assert "tensorstore_h5.sharded" not in mods
    assert th5.open.__module__ == "tensorstore_h5" and th5.open.__doc__.startswith("Open ``path`` read-only")


def test_convert_stays_the_function_whatever_imports_its_module_first() -> None:
    """``th5.convert`` is the function even after something imports the submodule of the same
    name (the command line, ``from tensorstore_h5.convert import ...``), which sets the
    package's attribute to the module: so it is bound when the package is imported, not lazily."""
    code = ("import tensorstore_h5.convert, tensorstore_h5 as th5, types\n"
            "assert callable(th5.convert) and not isinstance(th5.convert, types.ModuleType), th5.convert\n"
            "from tensorstore_h5 import convert\nassert callable(convert)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_reads_into_cpu_memory_import_no_device_wing(tmp_path) -> None:
    """Slices, ``out=`` reads, loads (mapped or not), streams and ``load_into`` of CPU targets
    never import ``transfer`` (staging buffers, pinned memory, GPUDirect Storage: ~0.3 ms of a
    fresh process); naming a device does."""
    path = tmp_path / "f.h5"
    th5.save({"model": {"w": torch.randn(64, 8), "b": torch.zeros(8)}, "step": 3}, path)
    cpu_reads = (f"import torch, tensorstore_h5 as th5\np = {str(path)!r}\n"
                 "with th5.open(p) as s:\n"
                 "    s['model/w'][:2]; s['model/w'].read(out=torch.empty(64, 8)); list(s.items())\n"
                 "th5.load(p); th5.load(p, mmap=True); th5.load(p, select='model/*')\n"
                 "m = torch.nn.ParameterDict({'w': torch.empty(64, 8), 'b': torch.empty(8)})\n"
                 "assert th5.load_into(m, p, prefix='model/') == ([], []) and m['b'].sum() == 0\n")
    mods = _imported_after(cpu_reads)
    assert "tensorstore_h5.reading.many" in mods and "tensorstore_h5.transfer" not in mods
    mods = _imported_after(cpu_reads + "th5.load(p, device='cpu')\n")
    assert "tensorstore_h5.transfer" in mods


def test_a_store_closed_before_any_read_reads_nothing(tmp_path) -> None:
    path = tmp_path / "f.h5"
    th5.save({"w": torch.arange(6.0)}, path)
    s = th5.open(path)
    handle = s["w"]
    assert not s.closed
    s.close()
    s.close()  # idempotent
    assert s.closed
    try:
        handle[:2]
    except ValueError as e:
        assert "closed" in str(e) and str(path) in str(e)
    else:
        raise AssertionError("a closed store read")
    with th5.open(path) as s:
        assert torch.equal(s["w"][:2], torch.arange(2.0))
    assert s.closed


def test_the_format_records_are_not_dataclasses() -> None:
    """dataclass compiles each record's methods at import (~0.5 ms a class, ~6 ms of the first
    open); the format's records are built by format.record instead, with the same behaviour."""
    from tensorstore_h5.format import layout, record, slicing, tree

    sel = slicing.select((slice(1, 3), 0), (4, 5))
    assert sel == slicing.Selection((4, 5), (1, 0), (2, 1), (1, 1), (2,)) and hash(sel) == hash(slicing.select((slice(1, 3), 0), (4, 5)))
    assert repr(sel) == "Selection(source=(4, 5), start=(1, 0), count=(2, 1), step=(1, 1), shape=(2,))"
    assert sel != slicing.select(slice(0, 3), (4, 5)) and sel.__eq__(object()) is NotImplemented
    for attempt in (lambda: setattr(sel, "shape", (1,)), lambda: delattr(sel, "shape")):
        try:
            attempt()
        except record.FrozenError as e:
            assert isinstance(e, AttributeError) and "frozen Selection" in str(e)
        else:
            raise AssertionError("a record accepted an assignment")
    with_defaults = layout.Header(2, 10, 4, 5, 6)
    assert with_defaults.layout_hash == 6 and layout.Header(2, 10, 4, 5, layout_hash=6) == with_defaults
    for bad in (lambda: layout.Header(2, 10), lambda: layout.Header(1, 2, 3, 4, 5, 6), lambda: layout.Header(2, 1, 2, 3, 4, x=1)):
        try:
            bad()
        except TypeError:
            pass
        else:
            raise AssertionError("a record took wrong arguments")
    assert layout.Contiguous(64, 8) == layout.Contiguous(64, 8, None) and layout.Contiguous(64, 8).block > 0
    leaf = tree.Leaf("a/b", "b", 3)
    assert leaf.__match_args__ == ("path", "key", "value") and leaf == tree.Leaf("a/b", "b", 3)
    assert "_geometry" not in repr(layout.Chunked((4, 4), 4, (2, 4), 1, (4,), ((0, 1, False), (1, 1, False))))
    for cls in (layout.Header, layout.Contiguous, layout.Chunked, layout.TensorEntry, layout.ArrayEntry,
                layout.ValueEntry, layout.ForeignEntry, tree.Container, tree.Leaf, slicing.Selection):
        assert not hasattr(cls, "__dataclass_fields__"), cls


def test_format_1_and_saving_still_import_what_they_need(tmp_path) -> None:
    path = tmp_path / "f.h5"
    mods = _imported_after(f"import tensorstore_h5 as th5\nimport torch\nth5.save({{'w': torch.ones(3)}}, {str(path)!r})\n")
    assert "h5py" in mods and "tensorstore_h5.writing.writer" in mods


def test_the_first_call_group_times_a_fresh_process(tmp_path) -> None:
    """One first-call contender, run: its child imports the library inside its own clock and
    reports the seconds, which the runner takes instead of the child's start."""
    from safetensors.torch import save_file

    sd = {f"k{i}": torch.full((4,), float(i)) for i in range(100)}
    th5.save(sd, tmp_path / "many.h5")
    save_file(sd, str(tmp_path / "many.safetensors"))
    ctx = Ctx(str(tmp_path), 0, 0)
    for name in ("F.tensorstore_h5 open + keys() (10,000 keys), fresh process",
                 "F.safetensors safe_open + keys() (10,000 keys), fresh process"):
        op, _ = CONTENDERS[name][1](ctx)
        seconds = op()
        assert isinstance(seconds, firstcall.Measured) and 0 < float(seconds) < 30


def test_the_first_call_full_loads_check_checksums_by_default_and_not_without(tmp_path) -> None:
    """The two fresh-process full loads differ in the checksums only: with one data byte
    changed, the default load's child fails naming a checksum and the ``verify=False`` one
    loads (what checking costs a first load is their ratio in the table)."""
    path = tmp_path / "ckpt.h5"
    th5.save({"w": torch.arange(4096.0), "b": torch.ones(64)}, path)
    with th5.open(path) as s:
        at = s._layout.entry("w").extent.offset
    with open(path, "r+b") as f:
        f.seek(at + 100)
        byte = f.read(1)
        f.seek(at + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    ctx = Ctx(str(tmp_path), 0, 0)
    unchecked, _ = CONTENDERS["F.tensorstore_h5 load(verify=False), fresh process"][1](ctx)
    assert isinstance(unchecked(), firstcall.Measured)
    try:
        CONTENDERS["F.tensorstore_h5 load, fresh process"][1](ctx)
    except RuntimeError as e:
        assert "checksum" in str(e).lower() and "'w'" in str(e), e
    else:
        raise AssertionError("the default load read a changed byte without noticing")


def test_a_foreign_file_closed_before_any_read_is_closed_in_libhdf5_too(tmp_path) -> None:
    """A store of a file only libhdf5 reads keeps its h5py file for the reader made on the first
    read; closed before any read, it closes that file as well (libhdf5's count of open files)."""
    import h5py
    import numpy as np

    def open_files() -> int:
        return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)

    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.arange(6, dtype=np.float32)
    before = open_files()
    s = th5.open(path)
    assert s.keys() == ["w"] and open_files() == before + 1
    s.close()
    assert s.closed and open_files() == before
    with th5.open(path) as s:
        assert s["w"][:2].tolist() == [0.0, 1.0]
    assert open_files() == before


def _minimal_experiment():
    """bench/first_call_minimal.py, the experiment that README's first-call bounds quote."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "first_call_minimal.py"
    spec = importlib.util.spec_from_file_location("first_call_minimal", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_minimal_reader_experiment_runs_and_reads_what_the_library_reads(tmp_path, capsys) -> None:
    """The experiment checks that its minimal reader's slices equal the library's before it times
    anything, then prints each contender's figures and the ratios."""
    experiment = _minimal_experiment()
    assert experiment.main(["--rounds", "1", "--dir", str(tmp_path), "--size-gb", "0.003"]) == 0
    out = capsys.readouterr().out
    assert "tensors: the minimal reader's slices equal the library's" in out
    for name in ("minimal", "tensorstore_h5", "safetensors"):
        assert f"  {name}" in out and "best" in out
    assert out.count("\n") >= 8


def test_the_minimal_reader_experiment_notices_a_reader_that_reads_wrong(tmp_path) -> None:
    """A minimal reader that returned other bytes would make the experiment's figures meaningless:
    its check refuses it (here, the minimal reader's slices read one byte later)."""
    experiment = _minimal_experiment()
    (tmp_path / "th5_minimal.py").write_text(experiment.MINIMAL)
    h5, _ = experiment._files(str(tmp_path), 0.003)
    assert experiment.check_same(str(tmp_path), h5) > 0
    wrong = experiment.MINIMAL.replace("self.at + start * row", "self.at + start * row + 1")
    assert wrong != experiment.MINIMAL
    (tmp_path / "th5_minimal.py").write_text(wrong)
    with pytest.raises(AssertionError, match="the slices differ"):
        experiment.check_same(str(tmp_path), h5)
