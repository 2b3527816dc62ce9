"""The torch <-> HDF5 type registry: one table, used by the writer and the reader alike.

Each torch dtype is stored in one of three ways (``DtypeSpec.storage``):

- ``"native"``: HDF5 has the type and numpy names it (float32, int64, bool, complex64, ...).
- ``"float"``: no numpy type, but HDF5 can describe the bits as an IEEE-like float
  (bfloat16, float8_e5m2; complex32 as a compound of two float16). Other HDF5 tools read
  real numbers (h5py shows bfloat16 as float32, float8_e5m2 as float16).
- ``"raw"``: the bits are stored as unsigned integers of the same size and the torch dtype
  is recorded in the layout (float8 variants whose special values do not follow IEEE
  rules, float4, sub-byte integer and ``bits`` dtypes).

Quantized dtypes (``qint8``, ...) need a quantizer and are not supported.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import UnsupportedTypeError
from .record import record

if TYPE_CHECKING:
    import h5py  # imported where HDF5 types are made: a format-2 file is read without h5py

__all__ = ["DtypeSpec", "REGISTRY", "spec_for_torch", "spec_for_name", "spec_for_numpy", "bits_view"]


def _ieee_like(size: int, sign_pos: int, exp_pos: int, exp_size: int, mant_size: int, bias: int) -> h5py.h5t.TypeFloatID:
    """An HDF5 little-endian float type with the given bit fields."""
    import h5py

    tid = h5py.h5t.IEEE_F32LE.copy()
    tid.set_fields(sign_pos, exp_pos, exp_size, 0, mant_size)
    tid.set_offset(0)
    tid.set_precision(size * 8)
    tid.set_size(size)
    tid.set_ebias(bias)
    return tid


def _complex32() -> h5py.h5t.TypeCompoundID:
    """Compound {r, i} of two float16, the layout h5py uses for complex numbers."""
    import h5py

    tid = h5py.h5t.create(h5py.h5t.COMPOUND, 4)
    tid.insert(b"r", 0, h5py.h5t.IEEE_F16LE)
    tid.insert(b"i", 2, h5py.h5t.IEEE_F16LE)
    return tid


_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@record
class DtypeSpec:
    """How one torch dtype is stored.

    Attributes:
        torch_dtype: the torch dtype.
        name: its name in files (``"bfloat16"``), ``str(torch_dtype)`` without ``torch.``.
        itemsize: bytes per element.
        storage: ``"native"``, ``"float"`` or ``"raw"`` (see the module docstring).
        numpy_dtype: the numpy dtype with the same bytes and meaning, or None.
    """

    torch_dtype: torch.dtype
    name: str
    itemsize: int
    storage: str
    numpy_dtype: np.dtype | None

    @cached_property
    def h5_type(self) -> h5py.h5t.TypeID:
        """The HDF5 type used in files and as the memory type of raw reads and writes."""
        import h5py

        if self.storage == "native":
            assert self.numpy_dtype is not None
            return h5py.h5t.py_create(self.numpy_dtype)
        if self.storage == "raw":
            return {1: h5py.h5t.STD_U8LE, 2: h5py.h5t.STD_U16LE, 4: h5py.h5t.STD_U32LE, 8: h5py.h5t.STD_U64LE}[self.itemsize]
        return _FLOAT_TYPES[self.name]()


_FLOAT_TYPES = {
    "bfloat16": lambda: _ieee_like(2, 15, 7, 8, 7, 127),
    "float8_e5m2": lambda: _ieee_like(1, 7, 2, 5, 2, 15),
    "complex32": _complex32,
}

_NATIVE = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.uint16: np.uint16,
    torch.int32: np.int32,
    torch.uint32: np.uint32,
    torch.int64: np.int64,
    torch.uint64: np.uint64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
_FLOAT = (torch.bfloat16, torch.float8_e5m2, torch.complex32)
_RAW_NAMES = (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    *(f"int{n}" for n in range(1, 8)), *(f"uint{n}" for n in range(1, 8)),
)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _build() -> dict[torch.dtype, DtypeSpec]:
    table: dict[torch.dtype, DtypeSpec] = {}
    for dt, npdt in _NATIVE.items():
        table[dt] = DtypeSpec(dt, _name(dt), dt.itemsize, "native", np.dtype(npdt).newbyteorder("<"))
    for dt in _FLOAT:
        npdt = np.dtype([("r", "<f2"), ("i", "<f2")]) if dt is torch.complex32 else None
        table[dt] = DtypeSpec(dt, _name(dt), dt.itemsize, "float", npdt)
    for name in _RAW_NAMES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            table[dt] = DtypeSpec(dt, name, dt.itemsize, "raw", None)
    return table


REGISTRY: dict[torch.dtype, DtypeSpec] = _build()
"""Every storable torch dtype, keyed by dtype."""

_BY_NAME: dict[str, DtypeSpec] = {spec.name: spec for spec in REGISTRY.values()}
_BY_NUMPY: dict[np.dtype, DtypeSpec] = {
    spec.numpy_dtype: spec for spec in REGISTRY.values() if spec.storage == "native" and spec.numpy_dtype is not None
}


def spec_for_torch(dtype: torch.dtype, key: str = "") -> DtypeSpec:
    """The spec of a torch dtype. Raises UnsupportedTypeError (naming ``key``) if it cannot be stored."""
    try:
        return REGISTRY[dtype]
    except KeyError:
        where = f" at key {key!r}" if key else ""
        raise UnsupportedTypeError(
            f"tensor dtype {dtype}{where} cannot be stored (quantized tensors need a quantizer); "
            "dequantize it or convert it to a plain dtype first"
        ) from None


def spec_for_name(name: str) -> DtypeSpec | None:
    """The spec whose file name is ``name`` (``"bfloat16"``), or None if unknown."""
    return _BY_NAME.get(name)


def spec_for_numpy(dtype: np.dtype) -> DtypeSpec | None:
    """The spec of a numpy dtype (any byte order), or None if torch has no such dtype."""
    dtype = np.dtype(dtype)
    if dtype.byteorder not in ("=", "|", "<", ">"):
        return None
    try:
        return _BY_NUMPY.get(dtype.newbyteorder("<"))
    except (TypeError, ValueError):
        return None


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as an integer dtype of the same element size (same shape and strides).

    Copies of such views work for every dtype, also those without copy kernels (uint4, ...).
    complex128 (16 bytes) has no such integer type and is returned as it is.
    """
    bits = _BITS_DTYPES.get(t.element_size())
    return t if bits is None or t.dtype == bits else t.view(bits)
