from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format.dtypes import REGISTRY, spec_for_name, spec_for_numpy, spec_for_torch

from helpers import ALL_DTYPES, assert_same_tensor, random_tensor


def test_registry_names_round_trip() -> None:
    for dtype, spec in REGISTRY.items():
        assert spec_for_name(spec.name) is spec and spec.torch_dtype is dtype
        assert spec.h5_type.get_size() == spec.itemsize == dtype.itemsize


def test_a_dtype_name_is_checked_against_the_torch_that_is_loaded() -> None:
    """spec_for_name remembers its answers only once torch is loaded: a file listed before
    torch's import and read after it still meets a torch without the file's dtype (an older
    one: simulated by deleting the attribute), and such a torch's answer stays None."""
    import subprocess
    import sys

    script = """
import sys
from tensorstore_h5.format.dtypes import spec_for_name
assert "torch" not in sys.modules
assert spec_for_name("float8_e5m2").name == "float8_e5m2"
import torch
del torch.float8_e5m2
assert spec_for_name("float8_e5m2") is None and spec_for_name("float8_e5m2") is None
assert spec_for_name("float32").name == "float32" and spec_for_name("float32") is spec_for_name("float32")
assert spec_for_name("float128") is None and spec_for_name("float128") is None
try:
    spec_for_name(["float32"])
except TypeError:
    pass
else:
    raise AssertionError("an unhashable name")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_creatable_dtype_is_covered_or_refused() -> None:
    for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        if dtype.is_quantized if hasattr(dtype, "is_quantized") else str(dtype).startswith("torch.q"):
            with pytest.raises(th5.UnsupportedTypeError):
                spec_for_torch(dtype)
        else:
            assert dtype in REGISTRY, dtype


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 3)])
def test_dtype_round_trip_bitwise(tmp_path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = random_tensor(shape, dtype, seed=len(shape))
    th5.save({"t": t}, tmp_path / "f.h5")
    assert_same_tensor(t, th5.load(tmp_path / "f.h5")["t"])


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if REGISTRY[d].storage == "native"], ids=str)
def test_native_numpy_mapping(dtype: torch.dtype) -> None:
    spec = REGISTRY[dtype]
    assert spec_for_numpy(spec.numpy_dtype) is spec
    assert spec_for_numpy(spec.numpy_dtype.newbyteorder(">")) is spec


def test_bfloat16_and_float8_e5m2_read_as_real_numbers_by_h5py(tmp_path) -> None:
    bf = torch.tensor([1.5, -3.25, 1e30, float("inf"), 2.0**-130] * 60, dtype=torch.bfloat16)  # > 256 B: own dataset
    e5 = torch.tensor([1.5, -3.0, 57344.0, float("-inf")] * 100).to(torch.float8_e5m2)
    th5.save({"bf": bf, "e5": e5, "e4": e5.float().to(torch.float8_e4m3fn)}, tmp_path / "f.h5")
    with h5py.File(tmp_path / "f.h5") as f:
        np.testing.assert_array_equal(f["bf"].astype("f4")[()], bf.float().numpy())
        np.testing.assert_array_equal(f["e5"].astype("f4")[()], e5.float().numpy())
        assert f["e4"].dtype == np.uint8 and f["e4"].attrs["torch_dtype"] == b"float8_e4m3fn"
        assert f["bf"].attrs["torch_dtype"] == b"bfloat16"


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensor_is_refused(tmp_path) -> None:
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(th5.UnsupportedTypeError, match="'q'"):
        th5.save({"q": q}, tmp_path / "f.h5")
    assert not (tmp_path / "f.h5").exists() and not list(tmp_path.iterdir())
