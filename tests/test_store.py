from __future__ import annotations

import gc
import weakref

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tensorstore_h5 as th5

from helpers import assert_same_tensor


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    obj = {
        "model": {f"layers.{i}.weight": torch.randn(8, 6) for i in range(3)} | {"embed": torch.randn(10, 4)},
        "buffers": [torch.arange(5), torch.ones(2, 2, dtype=torch.bfloat16)],
        "epoch": 7,
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
    }
    path = tmp_path / "ckpt.h5"
    th5.save(obj, path)
    return path, obj


def test_keys_and_handles(ckpt) -> None:
    path, obj = ckpt
    with th5.open(path) as s:
        assert s.keys() == ["model/layers.0.weight", "model/layers.1.weight", "model/layers.2.weight", "model/embed",
                            "buffers/0", "buffers/1", "epoch", "arr"]
        h = s["model/embed"]
        assert isinstance(h, th5.TensorHandle)
        assert (h.shape, h.dtype, h.nbytes, h.ndim, len(h), h.numel()) == (torch.Size([10, 4]), torch.float32, 160, 2, 10, 40)
        assert s["epoch"] == 7 and s["arr"].dtype == np.int16
        assert "epoch" in s and "model" not in s and len(s) == 8
        assert "model/embed" in repr(h) and "8 keys" in repr(s)
        assert h.compression is None


def test_slices_read_only_what_they_select(ckpt) -> None:
    path, obj = ckpt
    ref = obj["model"]["embed"]
    with th5.open(path) as s:
        h = s["model/embed"]
        for index in [slice(2, 5), (slice(None), slice(1, 3)), (3,), (-1, 2), Ellipsis, (Ellipsis, 1), slice(1, 9, 3),
                      slice(20, 30), (slice(None), slice(None, None, 2))]:
            assert_same_tensor(h[index], ref[index], layout=False)
        with pytest.raises(IndexError):
            h[10]
        with pytest.raises(IndexError, match="negative"):
            h[::-1]
        with pytest.raises(IndexError):
            h[0, 0, 0]


@given(st.data())
def test_random_slices_match_torch_indexing(tmp_path_factory, data) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    t = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    path = tmp_path_factory.mktemp("sl") / "f.h5"
    th5.save({"t": t}, path)
    index = []
    for n in shape:
        if data.draw(st.booleans()):
            index.append(data.draw(st.integers(-n, n - 1)))
        else:
            a, b = data.draw(st.integers(-n - 2, n + 2)), data.draw(st.integers(-n - 2, n + 2))
            index.append(slice(a, b, data.draw(st.integers(1, 3))))
    with th5.open(path) as s:
        assert torch.equal(s["t"][tuple(index)], t[tuple(index)])


def test_read_into_preallocated_out(ckpt) -> None:
    path, obj = ckpt
    with th5.open(path) as s:
        out = torch.empty(10, 4)
        ptr = out.data_ptr()
        assert s["model/embed"].read(out=out) is out and out.data_ptr() == ptr
        assert torch.equal(out, obj["model"]["embed"])
        big = torch.zeros(20, 4)
        s["model/embed"].read(out=big[5:8], index=slice(0, 3))
        assert torch.equal(big[5:8], obj["model"]["embed"][:3]) and big[:5].eq(0).all()
        strided = torch.zeros(4, 10).t()
        s["model/embed"].read(out=strided)
        assert torch.equal(strided, obj["model"]["embed"])


def test_out_mismatch_is_refused_before_any_io(ckpt) -> None:
    path, _ = ckpt
    with th5.open(path) as s:
        out = torch.full((10, 4), 5.0, dtype=torch.float64)
        with pytest.raises(th5.MismatchError, match="model/embed"):
            s["model/embed"].read(out=out)
        with pytest.raises(ValueError):
            s["model/embed"].read(out=torch.zeros(3, 4))
        assert out.eq(5).all()


def test_items_streams_one_tensor_at_a_time(tmp_path) -> None:
    path = tmp_path / "s.h5"
    th5.save({f"t{i}": torch.randn(100) for i in range(6)}, path)
    refs = []
    with th5.open(path) as s:
        for key, t in s.items():
            refs.append(weakref.ref(t))
            del t
            gc.collect()
            assert all(r() is None for r in refs), key  # nothing in the store keeps a reference
        assert len(refs) == 6


def test_select_glob_list_callable_and_containers(ckpt) -> None:
    path, obj = ckpt
    out = th5.load(path, select="model/layers.*")
    assert list(out) == ["model"] and list(out["model"]) == ["layers.0.weight", "layers.1.weight", "layers.2.weight"]
    out = th5.load(path, select=["epoch", "buffers/1"])
    assert out["epoch"] == 7 and len(out["buffers"]) == 1 and out["buffers"][0].dtype == torch.bfloat16
    out = th5.load(path, select=lambda k: k.endswith("embed"))
    assert list(out) == ["model"] and list(out["model"]) == ["embed"]
    out = th5.load(path, select="buffers")
    assert len(out["buffers"]) == 2
    with th5.open(path) as s:
        assert s.selected_keys("*.1.*") == ["model/layers.1.weight"]
        assert s.selected_keys([]) == []


def test_missing_exact_key_names_closest(ckpt) -> None:
    path, _ = ckpt
    with pytest.raises(KeyError, match=r"layers\.1\.wieght.*closest keys: 'model/layers\.1\.weight'"):
        th5.load(path, select=["model/layers.1.wieght"])
    with th5.open(path) as s:
        with pytest.raises(th5.KeyNotFoundError, match="ckpt.h5"):
            s["nope"]
        with pytest.raises(KeyError, match="container"):
            s["model"]


def test_closed_store_refuses_reads(ckpt) -> None:
    path, _ = ckpt
    s = th5.open(path)
    h = s["model/embed"]
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        h.read()


def test_foreign_hdf5_file_loads_as_tensors(tmp_path) -> None:
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(6, dtype=">i4").reshape(2, 3)
        f["grp/y"] = np.linspace(0, 1, 5, dtype=np.float16)
        f["grp/flag"] = np.array([True, False])
        f["s"] = 3.5
        f["names"] = np.array([b"a", b"bc"])
        f["cplx"] = np.array([1 + 2j], dtype=np.complex64)
    with th5.open(path) as s:
        assert s.format_version is None
        assert set(s.keys()) == {"x", "grp/y", "grp/flag", "s", "names", "cplx"}
        x = s["x"].read()
        assert x.dtype == torch.int32 and x.tolist() == [[0, 1, 2], [3, 4, 5]]
        assert s["x"][1].tolist() == [3, 4, 5]
        assert s["s"].read().item() == 3.5 and s["grp/flag"].read().tolist() == [True, False]
        assert s["cplx"].read().tolist() == [1 + 2j]
        with pytest.raises(th5.FormatError, match="names.*no torch dtype"):
            s["names"]
        out = s.load(select="grp/*")
        assert torch.equal(out["grp"]["y"], torch.from_numpy(np.linspace(0, 1, 5, dtype=np.float16)))
