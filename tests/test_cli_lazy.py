"""The command line answers --help and usage errors without importing torch (about 2 s), and
the lazy package still behaves as the eager one did. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs the command as `python -m tensorstore_h5 ARGS` would, then reports at exit whether torch
# was imported (atexit runs after the command's sys.exit).
_RUN = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nTORCH_IMPORTED=%s\\n" % ("torch" in sys.modules)))
sys.argv = ["tensorstore-h5", *sys.argv[1:]]
runpy.run_module("tensorstore_h5", run_name="__main__")
"""


def run_command(*args: str) -> tuple[subprocess.CompletedProcess, bool]:
    r = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=120)
    marker = r.stderr.rstrip().rsplit("\n", 1)[-1]
    assert marker.startswith("TORCH_IMPORTED="), r.stderr
    return r, marker == "TORCH_IMPORTED=True"


def python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("args", [("--help",), ("ls", "--help"), ("info", "--help"), ("convert", "--help"),
                                  ("verify", "--help"), ("demo", "--help")])
def test_help_does_not_import_torch(args) -> None:
    r, torch_imported = run_command(*args)
    assert r.returncode == 0 and r.stdout.startswith("usage: tensorstore-h5"), r.stderr
    assert not torch_imported


def test_help_lists_the_commands_and_the_constants_of_the_format() -> None:
    r, _ = run_command("--help")
    assert all(c in r.stdout for c in ("demo", "ls", "info", "convert", "bench", "verify"))
    from tensorstore_h5.format.constants import FORMAT_VERSION

    assert f"format v{FORMAT_VERSION}" in r.stdout
    r, _ = run_command("convert", "--help")
    assert "{best,gzip,lz4,zstd}" in r.stdout and "--progress, --no-progress" in r.stdout


@pytest.mark.parametrize("args", [("frobnicate",), ("ls",), ("demo", "--layers", "0"), ("demo", "--width", "x"),
                                  ("convert", "a.h5", "b.h5", "--compression", "nope"),
                                  ("convert", "a.h5", "b.safetensors", "--compression", "lz4"),
                                  ("convert", "a.pt", "b.h5", "--select", "model/*")])
def test_usage_errors_do_not_import_torch(args) -> None:
    r, torch_imported = run_command(*args)
    assert r.returncode == 2 and "usage: tensorstore-h5" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not torch_imported


def test_commands_that_read_tensors_do_import_torch(tmp_path) -> None:
    r, torch_imported = run_command("verify", str(tmp_path / "missing.h5"))  # (ls and info list without it)
    assert r.returncode == 1 and "missing.h5" in r.stderr and torch_imported


def test_bench_arguments_are_added_when_the_command_is_used() -> None:
    r, _ = run_command("bench", "--help")  # bench's arguments live in tensorstore_h5.bench, which imports torch
    assert r.returncode == 0 and "--size-gb" in r.stdout and "--settle" in r.stdout, r.stderr
    r, _ = run_command("bench", "--size-gb", "x")
    assert r.returncode == 2 and "--size-gb" in r.stderr


def test_building_the_parser_imports_no_torch() -> None:
    out = python("import sys, tensorstore_h5.cli as cli; cli.build_parser(); print('torch' in sys.modules)")
    assert out.strip() == "False"


def test_parser_constants_agree_with_the_library() -> None:
    from tensorstore_h5 import cli
    from tensorstore_h5.codecs.presets import PRESETS
    from tensorstore_h5.format.constants import FORMAT_VERSION

    assert cli.FORMAT_VERSION == FORMAT_VERSION
    assert cli.PRESET_NAMES == tuple(sorted(PRESETS))


def test_lazy_package_behaves_as_the_eager_one(tmp_path) -> None:
    code = f"""
import json, sys
import tensorstore_h5 as th5
import tensorstore_h5.convert                      # the submodule must not shadow th5.convert
out = {{"torch_after_import": "torch" in sys.modules, "dir_has_all": set(th5.__all__) <= set(dir(th5)),
       "convert_is_function": callable(th5.convert)}}
import torch
th5.save({{"w": torch.arange(6.0).reshape(2, 3), "n": 5}}, {str(tmp_path / "f.h5")!r})
out["load"] = th5.load({str(tmp_path / "f.h5")!r})["w"].tolist()
out["version"] = th5.FORMAT_VERSION
out["presets"] = sorted(th5.PRESETS)
out["transfer"] = hasattr(th5.transfer, "GDS")   # submodules are still attributes
from tensorstore_h5 import *
out["star"] = all(name in globals() for name in th5.__all__)
try:
    th5.no_such_name
except AttributeError as e:
    out["missing"] = str(e)
print(json.dumps(out))
"""
    out = json.loads(python(code))
    assert out == {"torch_after_import": False, "dir_has_all": True, "convert_is_function": True,
                   "load": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "version": 2, "presets": ["best", "gzip", "lz4", "zstd"],
                   "transfer": True, "star": True, "missing": "module 'tensorstore_h5' has no attribute 'no_such_name'"}


def test_ls_and_info_of_a_format_2_or_3_file_do_not_import_torch(tmp_path) -> None:
    """ls and info list a local format-2/3 file from its layout alone (reading.listing): the
    same rows as through a Store, without torch's import (~1.5 s of the command); other files
    (format 1, foreign HDF5, URLs, directories) still go through the store."""
    import numpy as np
    import torch

    import tensorstore_h5 as th5

    state = {"model": {"w": torch.randn(8, 4, dtype=torch.bfloat16), "b": torch.zeros(4), "t": None},
             "step": 3, "lr": 1e-3, "arr": np.arange(5), "tied": {"x": (x := torch.ones(3)), "y": x}}
    for name, compression in (("v2.h5", None), ("v3.h5", "gzip")):
        path = tmp_path / name
        th5.save(state, path, compression=compression)
        for args in (("ls", str(path)), ("ls", str(path), "--json"), ("info", str(path)), ("ls", str(path), "model/*")):
            r, torch_imported = run_command(*args)
            assert r.returncode == 0, r.stderr
            assert not torch_imported, args
            from tensorstore_h5 import cli

            with cli._open(str(path)) as store, cli._open(str(path), listing=True) as listing:
                assert type(store).__name__ == "Store" and type(listing).__name__ == "Listing"
                assert listing.keys() == store.keys() and listing.nbytes == store.nbytes
                assert [cli._leaf_info(listing, k) for k in listing.keys()] == [cli._leaf_info(store, k) for k in store.keys()]
        r, _ = run_command("ls", str(path))
        assert "bfloat16" in r.stdout and "(same as tied/x)" in r.stdout and "(numpy array)" in r.stdout
    th5.save({"shape": torch.Size([2, 3]), "w": torch.ones(2)}, tmp_path / "values.h5")
    r, torch_imported = run_command("ls", str(tmp_path / "values.h5"))  # a value of torch's type: shown as such
    assert r.returncode == 0 and "torch.Size([2, 3])" in r.stdout and torch_imported
    r, torch_imported = run_command("ls", str(tmp_path / "missing.h5"))
    assert r.returncode == 1 and "missing.h5" in r.stderr and not torch_imported


def test_ls_and_info_of_tensors_and_values_do_not_import_numpy(tmp_path) -> None:
    """numpy's import (~60-80 ms, a quarter of ``ls`` of 10,000 keys) waits for something of
    numpy's: the format's types, values and attributes import it where they make one. A file
    holding an array or a numpy scalar still lists it, with numpy imported then."""
    import numpy as np
    import torch

    import tensorstore_h5 as th5

    th5.save({"model": {"w": torch.randn(8, 4, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.int8)},
              "step": 3, "name": "run-1", "tied": {"x": (x := torch.ones(3)), "y": x}}, tmp_path / "plain.h5")
    th5.save({"arr": np.arange(5, dtype=np.int16), "scale": np.float32(0.5), "w": torch.ones(2)}, tmp_path / "np.h5")
    script = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: sys.stderr.write('\\nNUMPY=%s\\n' % ('numpy' in sys.modules)))\n"
              "sys.argv = ['tensorstore-h5', *sys.argv[1:]]\n"
              "runpy.run_module('tensorstore_h5', run_name='__main__')\n")

    def run(*args: str) -> tuple[str, bool]:
        r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr.rstrip().endswith("NUMPY=True")

    for args in (("ls", str(tmp_path / "plain.h5")), ("info", str(tmp_path / "plain.h5")),
                 ("ls", "--json", str(tmp_path / "plain.h5"))):
        out, numpy_imported = run(*args)
        assert ("model/w" in out or "4 tensors" in out) and not numpy_imported, args
    out, _ = run("ls", str(tmp_path / "plain.h5"))
    assert "bfloat16" in out and "int8" in out and "(same as tied/x)" in out and "run-1" in out
    out, numpy_imported = run("ls", str(tmp_path / "np.h5"))
    assert "(numpy array)" in out and "int16" in out and "0.5" in out and numpy_imported
