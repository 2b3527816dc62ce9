"""What a user sees from the command line on awkward input: every leaf kind listed, closed
pipes, directories, files of other formats, patterns that match nothing, bad arguments.
Run as a user would: in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import tensorstore_h5 as th5


def run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorstore_h5", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def assert_error(r: subprocess.CompletedProcess, *words: str, status: int = 1) -> None:
    """Exit ``status``, no traceback, one error line naming each of ``words``."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert r.stderr.startswith("tensorstore-h5: error:" if status == 1 else "usage: tensorstore-h5"), r.stderr
    for word in words:
        assert word in r.stderr, (word, r.stderr)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> str:
    """A plain HDF5 file with a leaf of every kind a foreign file has."""
    path = str(tmp_path_factory.mktemp("foreign") / "plain.h5")
    with h5py.File(path, "w") as f:
        f["s"] = "hello"
        f["x"] = np.arange(6).reshape(2, 3)
        f.create_dataset("names", data=np.array([b"a", b"bc"], dtype=h5py.string_dtype()))
        f["pairs"] = np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])
    return path


def test_ls_lists_every_kind_of_leaf_in_text_and_json(tmp_path, foreign) -> None:
    th5.save({"t": torch.zeros(2, 3), "alias": None, "a": np.arange(4, dtype=np.int16), "n": 7, "s": "x" * 100},
             tmp_path / "ours.h5")
    r = run("ls", foreign)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert set(lines) == {"s", "x", "names", "pairs"}
    assert lines["x"].split()[1:4] == ["int64", "[2,", "3]"] and "48 B" in lines["x"]
    assert lines["s"].split()[1] == "string" and "not loadable" in lines["s"]
    assert lines["names"].split()[1:3] == ["string", "[2]"] and lines["pairs"].split()[1] == "compound"
    rows = {row["key"]: row for row in json.loads(run("ls", foreign, "--json").stdout)}
    assert rows["s"] == {"key": "s", "kind": "unsupported", "shape": [], "dtype": "string",
                         "reason": rows["s"]["reason"]} and "no torch dtype" in rows["s"]["reason"]
    assert rows["x"] == {"key": "x", "kind": "tensor", "shape": [2, 3], "dtype": "int64", "nbytes": 48}
    r = run("ls", str(tmp_path / "ours.h5"))
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert "(numpy array)" in lines["a"] and "int16" in lines["a"] and lines["alias"].split()[1:] == ["NoneType", "None"]
    assert lines["s"].endswith("…") and len(lines["s"].split()[2]) == 60
    rows = {row["key"]: row for row in json.loads(run("ls", str(tmp_path / "ours.h5"), "--json").stdout)}
    assert rows["a"]["kind"] == "ndarray" and rows["n"] == {"key": "n", "kind": "value", "type": "int", "value": "7"}


def test_info_and_verify_on_a_foreign_file(foreign) -> None:
    info = json.loads(run("info", foreign, "--json").stdout)
    assert info["keys"] == 4 and info["tensors"] == 1 and info["unsupported"] == 3
    r = run("verify", foreign)
    assert r.returncode == 0 and "OK, 1 keys" in r.stdout and "3 dataset(s)" in r.stdout and "'names'" in r.stdout


def test_a_closed_pipe_ends_the_command_quietly(tmp_path) -> None:
    path = tmp_path / "big.h5"
    th5.save({f"layer.{i}.{'x' * 80}": torch.zeros(1) for i in range(1500)}, path)  # ~170 KB listed: over a pipe's buffer
    for extra in ([], ["--json"]):
        with subprocess.Popen([sys.executable, "-m", "tensorstore_h5", "ls", str(path), *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as p:
            assert p.stdout is not None and p.stderr is not None
            first = p.stdout.readline()  # what `| head -1` does: read a line, then go away
            p.stdout.close()
            err = p.stderr.read().decode()
            assert p.wait(timeout=120) == 0 and first and err == "", err  # as `ls | head` ends: no error


def test_a_directory_is_named_as_one(tmp_path) -> None:
    (tmp_path / "ckpt").mkdir()
    th5.save({"w": torch.zeros(1)}, tmp_path / "ckpt" / "model.h5")
    for command in ("ls", "info", "verify"):
        assert_error(run(command, str(tmp_path / "ckpt")), "ckpt: is a directory", "model.h5")
    assert_error(run("ls", str(tmp_path)), "is a directory", "give the path of an .h5 file")
    assert_error(run("convert", str(tmp_path / "ckpt"), str(tmp_path / "x.h5")), "ckpt: is a directory")
    assert_error(run("convert", str(tmp_path / "ckpt" / "model.h5"), str(tmp_path)), f"{tmp_path}: is a directory")


def test_other_formats_are_named_with_the_convert_command(tmp_path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "m.pt")
    for command in ("ls", "info"):
        assert_error(run(command, str(tmp_path / "m.safetensors")), "m.safetensors", "safetensors file",
                     f"tensorstore-h5 convert {tmp_path / 'm.safetensors'} {tmp_path / 'm.h5'}")
        assert_error(run(command, str(tmp_path / "m.pt")), "m.pt", "torch.save", "tensorstore-h5 convert")


def test_converting_into_a_missing_directory_names_it(tmp_path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "m.pt")
    th5.save({"w": torch.zeros(2)}, tmp_path / "m.h5")
    for src, dst in (("m.safetensors", "x.h5"), ("m.pt", "x.h5"), ("m.h5", "x.h5"), ("m.h5", "x.safetensors")):
        r = run("convert", src, os.path.join("nodir", dst), cwd=str(tmp_path))
        assert_error(r, f"nodir/{dst}", "the directory 'nodir' does not exist", "create it")
        assert ".partial" not in r.stderr and ".tmp" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.h5", "m.pt", "m.safetensors"]


def test_missing_files_and_unknown_pairs(tmp_path) -> None:
    assert_error(run("info", str(tmp_path / "missing.h5")), "missing.h5: No such file or directory")
    assert_error(run("convert", str(tmp_path / "missing.h5"), str(tmp_path / "x.safetensors")), "missing.h5: no such file")
    save_file({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert_error(run("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.pt")),
                 "m.safetensors -> ", "m.pt: cannot convert safetensors to torch", "h5->safetensors")
    assert_error(run("convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m")), "no suffix", ".safetensors")


def test_a_pattern_that_matches_nothing_is_an_error(tmp_path) -> None:
    th5.save({"model": {"enc.weight": torch.zeros(2), "enc.bias": torch.zeros(2)}}, tmp_path / "f.h5")
    f = str(tmp_path / "f.h5")
    assert_error(run("ls", f, "nomatch*"), f"{f}: no key matches 'nomatch*'", f"tensorstore-h5 ls {f}")
    assert_error(run("ls", f, "--json", "nomatch*"), "no key matches")
    assert_error(run("ls", f, "model/enc.weigth"), f"{f}: no key 'model/enc.weigth'", "closest keys", "'model/enc.weight'")
    r = run("ls", f, "model")  # a container lists what it holds
    assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()] == ["model/enc.weight", "model/enc.bias"]
    assert_error(run("convert", f, str(tmp_path / "g.h5"), "--select", "nomatch*", "--select", "x?"),
                 "no key matches 'nomatch*' or 'x?'")
    assert not (tmp_path / "g.h5").exists()


def test_bad_arguments_are_usage_errors(tmp_path) -> None:
    assert_error(run("demo", "--layers", "0"), "--layers: must be at least 1, got 0", status=2)
    assert_error(run("demo", "--width", "-1"), "--width: must be at least 1", status=2)
    assert_error(run("convert", "a.h5", "b.safetensors", "--compression", "lz4"),
                 "--compression applies to an .h5 destination only, not b.safetensors", status=2)
    assert_error(run("convert", "a.h5", "b.h5", "--compression", "fast"), "invalid choice: 'fast'", status=2)
    assert_error(run("convert", "a.pt", "b.h5", "--select", "w"), "--select applies to an .h5 or .safetensors source",
                 status=2)


def test_demo_with_one_layer() -> None:
    r = run("demo", "--layers", "1", "--width", "8")
    assert r.returncode == 0 and "streamed 8 tensors of layer 0" in r.stdout and r.stdout.endswith("demo OK\n"), r.stderr
