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

import functools
import sys
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedTypeError
from .record import record

if TYPE_CHECKING:
    import h5py  # imported where HDF5 types are made: a format-2 file is read without h5py
    import numpy as np  # imported where an array or a numpy type is made: the command line lists a file without it
    import torch  # imported where a tensor is made: a layout is listed without torch

    REGISTRY: dict[torch.dtype, DtypeSpec]

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


@record
class DtypeSpec:
    """How one torch dtype is stored.

    Attributes:
        name: its name in files (``"bfloat16"``), ``str(torch_dtype)`` without ``torch.``.
        itemsize: bytes per element.
        storage: ``"native"``, ``"float"`` or ``"raw"`` (see the module docstring).
        numpy_dtype: the numpy dtype with the same bytes and meaning, or None (numpy is
            imported on first use of this attribute: the command line lists a file without it).
        torch_dtype: the torch dtype (torch is imported on first use of this attribute: a
            layout is read, and listed by the command line, without torch).
    """

    name: str
    itemsize: int
    storage: str
    _numpy: Any = None
    """What ``numpy.dtype`` makes :attr:`numpy_dtype` of (``"<f4"``), or None."""

    def __init__(self, name: str, itemsize: int, storage: str, numpy: Any = None) -> None:
        self.__dict__.update(name=name, itemsize=itemsize, storage=storage, _numpy=numpy)

    @cached_property
    def numpy_dtype(self) -> np.dtype | None:
        import numpy as np

        return None if self._numpy is None else np.dtype(self._numpy)

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.name, None)
        if not isinstance(dtype, torch.dtype):  # pragma: no cover - spec_for_name checks where torch is loaded
            raise UnsupportedTypeError(f"dtype {self.name} is not one this torch ({torch.__version__}) has")
        return dtype

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
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
    "int64": "<i8", "uint64": "<u8", "float16": "<f2", "float32": "<f4", "float64": "<f8", "complex64": "<c8",
    "complex128": "<c16",
}
_FLOAT = {"bfloat16": 2, "float8_e5m2": 1, "complex32": 4}
_RAW = {
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
                     "bits8", "bits1x8", "bits2x4", "bits4x2"), 1),
    "bits16": 2,
    **{f"int{n}": 1 for n in range(1, 8)}, **{f"uint{n}": 1 for n in range(1, 8)},
}
"""Names and element sizes of the dtypes stored as raw bits (torch's own sizes: a table here,
so that files are read without importing torch)."""


def _by_name() -> dict[str, DtypeSpec]:
    table = {name: DtypeSpec(name, int(code[2:]), "native", code) for name, code in _NATIVE.items()}  # "<f4": 4 bytes
    for name, size in _FLOAT.items():
        table[name] = DtypeSpec(name, size, "float", [("r", "<f2"), ("i", "<f2")] if name == "complex32" else None)
    for name, size in _RAW.items():
        table[name] = DtypeSpec(name, size, "raw", None)
    return table


_BY_NAME: dict[str, DtypeSpec] = _by_name()


@functools.cache
def _by_numpy() -> dict[np.dtype, DtypeSpec]:
    return {spec.numpy_dtype: spec for spec in _BY_NAME.values() if spec.storage == "native"}


def _registry() -> dict[torch.dtype, DtypeSpec]:
    """Every spec of a dtype this torch has, keyed by dtype (made on first use: it imports torch)."""
    import torch

    table = {}
    for name, spec in _BY_NAME.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert dtype.itemsize == spec.itemsize, name
            table[dtype] = spec
    return table


def __getattr__(name: str) -> Any:
    if name == "REGISTRY":  # every storable torch dtype, keyed by dtype (imports torch)
        value = globals()["REGISTRY"] = _registry()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def spec_for_torch(dtype: torch.dtype, key: str = "") -> DtypeSpec:
    """The spec of a torch dtype. Raises UnsupportedTypeError (naming ``key``) if it cannot be stored."""
    spec = _BY_NAME.get(str(dtype).removeprefix("torch."))
    if spec is not None and spec.torch_dtype is dtype:
        return spec
    where = f" at key {key!r}" if key else ""
    raise UnsupportedTypeError(
        f"tensor dtype {dtype}{where} cannot be stored (quantized tensors need a quantizer); "
        "dequantize it or convert it to a plain dtype first"
    )


_WITH_TORCH: dict[str, DtypeSpec | None] = {}
"""spec_for_name's answers once torch is loaded (at most one a known name)."""
_UNSEEN = object()


def spec_for_name(name: str) -> DtypeSpec | None:
    """The spec whose file name is ``name`` (``"bfloat16"``), or None if unknown (also where
    torch is loaded and has no such dtype: an older torch than the file's writer)."""
    spec = _WITH_TORCH.get(name, _UNSEEN)  # (an entry's dtype, asked for thousands of times a layout)
    if spec is not _UNSEEN:
        return spec  # type: ignore[return-value]
    spec = _BY_NAME.get(name)
    torch = sys.modules.get("torch")
    if spec is not None and torch is not None:
        if not isinstance(getattr(torch, name, None), torch.dtype):
            spec = None
        _WITH_TORCH[name] = spec
    return spec


def spec_for_numpy(dtype: np.dtype) -> DtypeSpec | None:
    """The spec of a numpy dtype (any byte order), or None if torch has no such dtype."""
    import numpy as np

    dtype = np.dtype(dtype)
    if dtype.byteorder not in ("=", "|", "<", ">"):
        return None
    try:
        return _by_numpy().get(dtype.newbyteorder("<"))
    except (TypeError, ValueError):
        return None


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as an integer dtype of the same element size (same shape and strides).

    Copies of such views work for every dtype, also those without copy kernels (uint4, ...).
    complex128 (16 bytes) has no such integer type and is returned as it is.
    """
    bits = _bits_dtypes().get(t.element_size())
    return t if bits is None or t.dtype == bits else t.view(bits)


@functools.cache
def _bits_dtypes() -> dict[int, torch.dtype]:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
