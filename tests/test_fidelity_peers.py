"""What the peers' suites expect of a checkpoint library, and HDF5's own limits (#32 items 3
and 5): tied weights saved once, every missing key reported, empty index lists, tensors with
Python attributes, more than 32 dimensions, very long keys, big-endian arrays."""

from __future__ import annotations

import subprocess
import shutil

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format.tree import MAX_NAME_BYTES
from tensorstore_h5.writing.writer import MAX_DIMS


class TiedLM(torch.nn.Module):
    """A language model head tied to its embedding (transformers' ``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.embed.weight


def _tied_file(tmp_path, drop: str) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    sd = {k: v.clone() for k, v in TiedLM().state_dict().items() if k != drop}
    path = str(tmp_path / "tied.h5")
    th5.save(sd, path)
    return path, sd


@pytest.mark.parametrize("drop", ["lm_head.weight", "embed.weight"])
def test_a_file_with_one_name_of_a_tied_pair_loads_strictly(tmp_path, drop) -> None:
    path, sd = _tied_file(tmp_path, drop)
    model = TiedLM()
    assert th5.load_into(model, path) == ([], [])
    kept = "embed.weight" if drop == "lm_head.weight" else "lm_head.weight"
    assert torch.equal(model.embed.weight, sd[kept]) and model.lm_head.weight is model.embed.weight


def test_a_tied_pair_loads_strictly_with_assign_onto_meta(tmp_path) -> None:
    path, sd = _tied_file(tmp_path, "lm_head.weight")
    with torch.device("meta"):
        model = TiedLM()
    assert th5.load_into(model, path, assign=True) == ([], [])
    assert torch.equal(model.lm_head.weight, sd["embed.weight"])
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()  # still one memory


def test_a_tied_pair_of_a_dict_target(tmp_path) -> None:
    th5.save({"a": torch.arange(6.0)}, tmp_path / "f.h5")
    shared = torch.zeros(6)
    assert th5.load_into({"a": shared, "b": shared}, tmp_path / "f.h5") == ([], [])
    assert torch.equal(shared, torch.arange(6.0))
    target = {"a": shared, "b": shared}
    assert th5.load_into(target, tmp_path / "f.h5", assign=True) == ([], [])
    assert target["a"] is target["b"]
    other = {"a": torch.zeros(6), "b": torch.zeros(6)}  # two tensors: b is missing
    with pytest.raises(th5.MismatchError, match="missing keys: 'b'"):
        th5.load_into(other, tmp_path / "f.h5")


def test_missing_keys_lists_what_a_module_loader_filled_itself(tmp_path) -> None:
    """BatchNorm's loader fills num_batches_tracked when a file has no module versions (as
    torch does); the value stays, and missing_keys says the file lacked it."""
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    sd = {k: v for k, v in net().state_dict().items() if "num_batches" not in k}
    th5.save(sd, tmp_path / "f.h5")
    model = net()
    model[1].num_batches_tracked.fill_(7)
    result = th5.load_into(model, tmp_path / "f.h5", strict=False)
    assert result.missing_keys == ["1.num_batches_tracked"] and result.unexpected_keys == []
    assert int(model[1].num_batches_tracked) == 7
    assert th5.load_into(net(), tmp_path / "f.h5").missing_keys == ["1.num_batches_tracked"]  # strict accepts it, as torch
    assert th5.load_into(net(), tmp_path / "f.h5", strict=False, select="0.*").missing_keys == [
        "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]


class _Renamed(torch.nn.Module):
    """Version 2 calls its buffer ``scale``; version 1 called it ``old_scale``."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        if (local_metadata.get("version") or 0) < 2 and prefix + "old_scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict.pop(prefix + "old_scale")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_key_a_module_loader_made_from_other_keys_is_not_missing(tmp_path) -> None:
    th5.save({"old_scale": torch.full((3,), 4.0)}, tmp_path / "v1.h5")
    model = _Renamed()
    assert th5.load_into(model, tmp_path / "v1.h5", strict=False) == ([], [])
    assert torch.equal(model.scale, torch.full((3,), 4.0))


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_an_empty_index_list_is_the_empty_selection(tmp_path, compression) -> None:
    t = torch.arange(60.0).reshape(10, 6)
    th5.save({"t": t}, tmp_path / "f.h5", compression=compression)
    with th5.open(tmp_path / "f.h5") as s:
        h = s["t"]
        for index in ([], torch.tensor([], dtype=torch.long), np.array([], dtype=np.int64), (slice(None), [])):
            got, want = h[index], t[index]
            assert got.shape == want.shape and got.dtype == want.dtype, index
        with pytest.raises(IndexError, match="unsupported index"):
            h[[1, 2]]
        with pytest.raises(IndexError, match="unsupported index"):
            h[torch.tensor([], dtype=torch.float32)]


def test_tensors_with_python_attributes_are_refused_naming_the_key(tmp_path) -> None:
    path = tmp_path / "f.h5"
    th5.save({"x": torch.ones(2)}, path)
    before = path.read_bytes()
    t = torch.zeros(3)
    t.foo = "foo"
    with pytest.raises(th5.UnsupportedTypeError, match=r"f.h5: tensor at key path 'model/w' has Python attributes \('foo'\)"):
        th5.save({"model": {"w": t}}, path)
    assert path.read_bytes() == before
    p = torch.nn.Parameter(torch.zeros(2))
    p.tensor_model_parallel = True
    with pytest.raises(th5.UnsupportedTypeError, match="'tensor_model_parallel'"):
        th5.save({"p": p}, path)
    with pytest.raises(th5.UnsupportedTypeError, match="'foo'"):
        th5.save_async({"t": t}, path).result()
    th5.save({"t": t.detach(), "p": p.detach(), "b": torch.nn.Buffer(torch.ones(2))}, path)  # Buffer's own marks
    assert torch.equal(th5.load(path)["b"], torch.ones(2))


def test_more_dimensions_than_hdf5_holds_are_refused(tmp_path) -> None:
    path = tmp_path / "f.h5"
    for value, what in ((torch.zeros((1,) * (MAX_DIMS + 1)), "tensor"), (np.zeros((1,) * 40), "numpy array")):
        with pytest.raises(th5.UnsupportedTypeError, match=f"{what} at key path 'x' has {value.ndim} dimensions; HDF5"):
            th5.save({"x": value}, path)
    assert not path.exists()
    t = torch.arange(2.0 ** 5).reshape((2,) * 5 + (1,) * (MAX_DIMS - 5))
    th5.save({"x": t}, path)
    with h5py.File(path, "r") as f:
        assert f["x"].shape == t.shape and np.array_equal(f["x"][()], t.numpy())
    assert torch.equal(th5.load(path)["x"], t)


def test_a_key_longer_than_an_hdf5_link_name_is_refused(tmp_path) -> None:
    path = tmp_path / "f.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=r"f.h5: dict key 'kkkk+'\.\.\. under key path '' is 70,000 characters"):
        th5.save({"k" * 70_000: torch.ones(1)}, path)
    with pytest.raises(th5.UnsupportedTypeError, match="under key path 'model' is 30,000 characters .*90,000 bytes"):
        th5.save({"model": {"€" * 30_000: torch.ones(1)}}, path)  # 3 bytes each in UTF-8
    assert not path.exists()
    longest = "w" * MAX_NAME_BYTES
    th5.save({"model": {longest: torch.arange(3.0), "b": torch.ones(1)}}, path)
    assert torch.equal(th5.load(path)["model"][longest], torch.arange(3.0))
    with h5py.File(path, "r") as f:
        assert np.array_equal(f["model"][longest][()], np.arange(3.0, dtype=np.float32))


@pytest.mark.parametrize("compression", [None, "lz4", "gzip"])
def test_big_endian_arrays_keep_their_byte_order_and_values(tmp_path, compression) -> None:
    """docs/FORMAT.md: an array's bytes are in the byte order of its dtype, and its HDF5
    datatype says which, so h5py reads the same values."""
    a = (np.arange(4000).reshape(40, 100) / 7).astype(">f4")
    b = np.arange(30, dtype=">i8")
    th5.save({"a": a, "b": b, "t": torch.arange(5.0)}, tmp_path / "f.h5", compression=compression)
    got = th5.load(tmp_path / "f.h5")
    assert got["a"].dtype == np.dtype(">f4") and np.array_equal(got["a"], a)
    assert got["b"].dtype == np.dtype(">i8") and np.array_equal(got["b"], b)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["a"].dtype == np.dtype(">f4") and np.array_equal(f["a"][()], a)
        assert f["t"].dtype == np.dtype("<f4")
    with th5.open(tmp_path / "f.h5") as s:
        assert np.array_equal(np.asarray(s["a"][3:5]), a[3:5])


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump is not installed")
def test_h5dump_reads_a_file_at_the_limits(tmp_path) -> None:
    path = tmp_path / "f.h5"
    th5.save({"x": torch.ones((1,) * MAX_DIMS), "be": np.arange(3, dtype=">i4")}, path)
    out = subprocess.run(["h5dump", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "H5T_STD_I32BE" in out.stdout
