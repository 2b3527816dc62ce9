"""Hostile and damaged files through every public read path: a TensorStoreError naming the
file, or exactly what was saved (or, for damaged tensor bytes read unchecked, the file's own
bytes from where the layout says). Never bytes from elsewhere, a crash, or a bare error."""

from __future__ import annotations

import contextlib
import io as stdio
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import cli
from tensorstore_h5.format import layout as fmt

from helpers import assert_same, assert_same_tensor, bits
from hostile.hostile_files import CASES, CHECKED, DATA_DAMAGE, HARMLESS, READ_PATHS, SECRET, expected_part, read_layout


def _file_bytes_match(path, key: str, value: torch.Tensor) -> bool:
    """True when ``value`` holds the file's bytes at the range the layout names for ``key``
    (its first bytes, for a slice of leading rows)."""
    head, entries = read_layout(path)
    e = entries[head["paths"].index(key)]
    if "at" not in e:
        return False
    got = bytes(bits(value.contiguous()).numpy())
    return got == path.read_bytes()[e["at"]:e["at"] + len(got)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return {case.name: (case, *case.make(d)) for case in CASES}


@pytest.mark.parametrize("read", sorted(READ_PATHS))
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_read_path_refuses_or_returns_what_was_saved(made, name, read) -> None:
    case, path, original = made[name]
    try:
        got = READ_PATHS[read](path, original)
    except th5.TensorStoreError as e:
        assert path.name in str(e), f"{read}: the error does not name the file: {e}"
        return
    for value in got.values():
        if isinstance(value, torch.Tensor):
            assert SECRET[:16] not in bytes(bits(value.contiguous()).numpy()), f"{read} returned bytes of another file"
    ref = expected_part(original, got, read)
    if case.kind == DATA_DAMAGE and read not in CHECKED:
        for k, v in got.items():
            if isinstance(v, torch.Tensor) and not torch.equal(bits(v), bits(ref[k])):
                if k.endswith(("lz4", "zstd")):
                    continue  # a decoded damaged chunk: its shape and dtype are all there is to check
                assert _file_bytes_match(path, k, v), f"{read}: {k} is not the file's bytes"
        return
    if read in ("slices", "load_into"):  # values, in the target's own layout
        assert list(got) == list(ref)
        for k in got:
            assert_same_tensor(got[k], ref[k], layout=False)
    else:
        assert_same(got, ref)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_full_load_and_verify_refuse(made, name) -> None:
    case, path, original = made[name]
    if case.kind == "refuse":
        for verify in (False, True):
            with pytest.raises(th5.TensorStoreError, match=path.name):
                th5.load(path, verify=verify)
    out, err = stdio.StringIO(), stdio.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["verify", str(path)])
    if case.kind == HARMLESS:
        assert status == 0 and "OK" in out.getvalue(), err.getvalue()
    else:
        assert status == 1 and path.name in err.getvalue(), (status, err.getvalue())


@pytest.mark.parametrize("command", ["ls", "info"])
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_cli_inspects_or_names_the_file(made, name, command) -> None:
    case, path, original = made[name]
    out, err = stdio.StringIO(), stdio.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([command, str(path)])
    assert status in (0, 1) and (status == 0 or path.name in err.getvalue()), err.getvalue()


def test_every_case_is_a_different_file(made) -> None:
    assert len({bytes(p.read_bytes()) for _, p, _ in made.values()}) == len(made)
    assert all(p.read_bytes()[:8] in (fmt.MAGIC, fmt.HDF5_SIGNATURE) for _, p, _ in made.values())
