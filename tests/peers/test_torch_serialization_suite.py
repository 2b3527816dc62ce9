"""PyTorch's ``test/test_serialization.py`` (repository ``pytorch/pytorch``), translated case by
case to tensorstore_h5's public API.

Each test's docstring starts with the peer test it comes from. Where tensorstore_h5 behaves
differently from ``torch.save``/``torch.load`` on purpose, the test asserts our documented
behaviour and says what differs:

- nothing is ever unpickled: objects that are not tensors, numpy arrays, containers or plain
  values (modules, storages, sets, bytearrays, namedtuples, arbitrary classes, functions) are
  refused at save time with ``UnsupportedTypeError`` naming the key path and type, and
  ``th5.convert`` of a ``torch.save`` file goes through ``torch.load(weights_only=True)``;
- tensors that are the same view of one storage come back as one object, views that only
  overlap are stored separately, views with gaps (``t[::2]``) come back contiguous;
- wrapper subclasses, zero tensors, meta, nested, sparse and quantized tensors are refused;
- files carry no device: ``device=`` (our ``map_location``) picks where tensors go, the CPU
  by default, whatever torch's default device is.

Peer tests translated (peer -> tests here):

  SerializationMixin::test_serialization, ::test_serialization_safe, ::_test_serialization_assert
      -> test_serialization_repeated_tensors_alias, test_serialization_rootview_partial_overlap,
         test_serialization_storages_refused, test_tied_module_weights,
         test_serialization_writer_same_tensor_twice, test_serialization_writer_snapshot_after_inplace
  SerializationMixin::test_serialization_fake_zip -> test_serialization_fake_zip
  SerializationMixin::test_serialization_backwards_compat(_safe) (the OldTensor as_strided part)
      -> test_serialization_backwards_compat_offset_and_stride, test_serialization_strides_kept
  SerializationMixin::test_serialization_save_warnings -> test_serialization_save_warnings
  SerializationMixin::test_serialization_map_location -> test_serialization_map_location_cpu,
      test_serialization_map_location_cuda (CUDA machines only)
  SerializationMixin::test_load_nonexistent_device -> test_load_nonexistent_device,
      test_load_nonexistent_device_torch_file_converts
  SerializationMixin::test_serialization_storage_slice -> test_serialization_storages_refused
  SerializationMixin::test_save_different_dtype_unallocated -> test_save_different_dtype_unallocated,
      test_serialization_empty_and_0d
  SerializationMixin::test_save_different_dtype_error -> test_save_different_dtype_error
  SerializationMixin::test_safe_load_basic_types -> test_safe_load_basic_types
  SerializationMixin::test_serialization_sparse(_safe) -> test_serialization_sparse_refused
  TestBothSerialization::test_serialization_new_format_old_format_compat
      -> test_serialization_new_format_old_format_compat_convert, test_convert_zip_newer_dtypes
  TestOldSerialization::test_serialization_container -> test_serialization_container_module_refused
  TestOldSerialization::test_serialization_offset -> test_serialization_offset_large_ish
  TestSerialization::test_serialization_zipfile -> test_serialization_zipfile_paths
  TestSerialization::test_serialization_zipfile_actually_jit -> test_serialization_zipfile_actually_jit
  TestSerialization::test_serialization_2gb_file, ::test_serialization_4gb_file (scaled down)
      -> test_serialization_offset_large_ish, test_serialization_4gb_file_float8_linear
  TestSerialization::test_pathlike_serialization -> test_serialization_zipfile_paths
  TestSerialization::test_meta_serialization -> test_meta_serialization_refused
  TestSerialization::test_lr_scheduler_serialization -> test_lr_scheduler_serialization
  TestSerialization::test_serialization_python_attr -> test_serialization_python_attr
  TestSerialization::test_serialization_nested_class, ::test_weights_only_assert,
      ::test_weights_only_safe_globals_newobj, ::test_weights_only_safe_globals_build,
      ::test_weights_only_safe_globals_build_with_slots, ::test_weights_only_safe_globals_blocklist,
      ::test_weights_only_blocked_func_error_msg, TestSubclassSerialization::test_sets_are_loadable_with_weights_only
      -> test_weights_only_refused, test_weights_only_assert_convert_never_unpickles
  TestSerialization::test_weights_only_error, TestSubclassSerialization::test_safe_globals_for_weights_only,
      ::test_tensor_subclass_wrapper_serialization, ::test_tensor_subclass_getstate_overwrite,
      TestSerialization::test_serialization_uintx_intx, ::test_skip_data_serialization (saving a
      FakeTensor without skip_data fails), ::test_load_njt_weights_only
      -> test_wrapper_subclasses_refused, test_wrapper_subclass_refusal_names_type,
         test_wrapper_subclass_refusal_advice_exists
  TestSerialization::test_serialization_math_bits -> test_serialization_math_bits,
      test_serialization_math_bits_many_views
  TestSerialization::test_serialization_efficient_zerotensor -> test_serialization_efficient_zerotensor
  TestSerialization::test_serialization_byteorder_mark -> test_serialization_byteorder_mark
  TestSerialization::test_serialization_load_bom_data -> test_serialization_load_bom_data_lstm_metadata,
      test_module_version_conversion, test_module_version_nested_prefix, test_buffers_and_non_persistent_buffers
  TestSerialization::test_serialization_load_bom_data_{double,float,half,long,int,int16,cfloat,cdouble}
      -> test_serialization_load_bom_data_foreign_big_endian
  TestSerialization::test_serialization_load_bom_data_{int8,uint8,bool}
      -> test_serialization_load_bom_data_one_byte
  TestSerialization::test_serialization_mmap_loading_options -> test_serialization_mmap_loading_options
  TestSerialization::test_serialization_mmap_loading (MAP_PRIVATE half)
      -> test_serialization_mmap_loading_copy_on_write, test_serialization_mmap_survives_replacement
  TestSerialization::test_storage_alignment -> test_storage_alignment
  TestSerialization::test_mmap_load_offset_calculation -> test_mmap_load_offset_calculation_meta_assign,
      test_load_under_meta_device_context, test_load_under_default_device
  TestSerialization::test_serialization_dtype -> test_serialization_dtype_views_with_gaps
  TestSerialization::test_serialization_byte_literal -> test_serialization_byte_literal
  TestSerialization::test_crc32_options -> test_crc32_options_checksums, test_crc32_block_offset_in_message
  TestSerialization::test_save_load_preserves_dtype -> test_save_load_preserves_dtype,
      test_every_dtype_bitwise, test_quantized_refused
  TestSerialization::test_has_format_version -> test_has_format_version
  TestSubclassSerialization::test_empty_class_serialization -> test_empty_class_serialization
  TestSerialization::test_serialization_python_attr (its Parameter half) -> test_parameter_and_requires_grad

Peer tests not translated, and why:

  test_serialization_zipfile_utils, test_filewriter_metadata_writing, test_serialization_byteorder_mark's
      zip records: zip internals (we have no zip; the byte order check is translated via HDF5 types).
  test_serialization_filelike, test_serialization_gzip, test_serialization_offset_gzip,
      test_serialization_filelike_api_requirements, test_serialization_filelike_missing_attrs,
      test_serialization_filelike_stress, test_serialization_filelike_uses_readinto,
      test_serialization_filelike_exceptions, test_load_error_msg, test_serialization_offset_filelike,
      test_serialization_with_header, test_serialization_container_filelike: file-like objects and
      several objects concatenated in one stream; tensorstore_h5 reads and writes paths only.
  test_serialization_dill_version_not_supported, test_pickle_module, test_serialization_dill:
      pickle modules; we never pickle.
  test_serialization_sparse_invalid, test_serialization_sparse_invalid_legacy_ctor,
      test_serialization_sparse_{csr,csc,bsr,bsc}_invalid: sparse invariants on load; sparse
      tensors are refused at save (translated as test_serialization_sparse_refused).
  test_serialize_device, test_tensor_subclass_deepcopy, test_cloned_deepcopy: deepcopy, not
      serialization.
  test_serialization_backwards_compat (the downloaded legacy .tar file), test_load_unicode_error_msg,
      test_load_python2_unicode_module: need a download and Python 2 / legacy pickles.
  test_serialization_warning_s390x: big-endian hosts only.
  test_serialization_load_bom_data_bfloat16: numpy/h5py have no bfloat16, so no big-endian bfloat16
      data can be written to read back (our own bfloat16 is covered by test_every_dtype_bitwise).
  test_serialization_mmap_loading_with_map_location, test_tensor_subclass_map_location,
      test_use_pinned_memory_for_d2h: need CUDA / an accelerator (the CPU-side refusal of a
      missing device is translated in test_load_nonexistent_device).
  test_serialization_mmap_loading (MAP_SHARED half), test_serialization_mmap_loading_ctx:
      mmap options; our mappings are always private (copy-on-write).
  test_skip_data_load, test_skip_data_serialization (except its FakeTensor refusal),
      test_skip_data_serialization_preserves_views, test_skip_data_serialization_error_cases:
      torch.serialization.skip_data has no counterpart.
  test_weights_only_env_variables, test_get_unsafe_globals_in_checkpoint,
      test_weights_only_with_zoneinfo_unpickle_registration_success,
      test_safe_globals_context_manager_weights_only: pickle allowlists; nothing is unpickled here.
  test_debug_set_in_ci: CI environment check.
"""

from __future__ import annotations

import collections
import datetime
import gc
import io
import math
import os
import pathlib
import warnings
import zoneinfo
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5

# -- helpers ---------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
ALL_DTYPES = sorted({v for v in vars(torch).values()
                     if isinstance(v, torch.dtype) and str(v).removeprefix("torch.") not in _QUANTIZED}, key=str)
"""Every torch dtype but the quantized ones (which need a quantizer), found independently of
the library's own registry."""

# all_types_and_complex_and(torch.half, torch.bfloat16, torch.bool), as the peer uses
PEER_DTYPES = [torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.complex64, torch.complex128, torch.float16, torch.bfloat16, torch.bool]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (same shape and strides), for bitwise equality."""
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if t.element_size() == 16:  # complex128: pairs of float64
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _assert_bitwise(got, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(_bits(got), _bits(want))


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of random bits of any dtype (NaN payloads and all)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of any dtype (sub-byte, float8 and bits dtypes through integer views)."""
    if t.element_size() == 16:
        return t.contiguous()
    return _bits(t).contiguous().view(t.dtype)


def _items(path, device=None) -> dict:
    with th5.open(path) as store:
        return dict(store.items(device=device))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _offset(path, key: str) -> int:
    """File offset of a contiguous dataset's data, read with h5py (FORMAT.md: plain HDF5)."""
    with h5py.File(path, "r") as f:
        return int(f[key].id.get_offset())


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_bitwise(tmp_path, dtype):
    """pytorch test/test_serialization.py::TestSerialization::test_save_load_preserves_dtype: every
    dtype (bool, ints, uints, float16/32/64, bfloat16, complex, float8 variants, sub-byte and bits
    dtypes) round-trips bitwise, contiguous, transposed, 0-d and empty. The peer covers
    all_types_and_complex_and(half, bfloat16, bool); we take every non-quantized torch dtype, with
    random bits (NaN payloads included) compared through integer views."""
    t = _random((4, 6), dtype, seed=1)
    obj = {"c": t, "t": t.t(), "z": t[1, 2], "e": _random((0, 3), dtype)}
    p = tmp_path / "dtype.h5"
    th5.save(obj, p)
    r = th5.load(p)
    for key in obj:
        _assert_bitwise(r[key], obj[key])
    assert r["t"].stride() == (1, 6)
    assert r["z"].dim() == 0
    with th5.open(p) as store:
        assert store["c"].dtype == dtype
        _assert_bitwise(store["c"][1:3, 2:5], _contiguous(t[1:3, 2:5]))


@pytest.mark.parametrize("dtype", PEER_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_save_load_preserves_dtype(tmp_path, dtype):
    """pytorch test/test_serialization.py::TestSerialization::test_save_load_preserves_dtype: a
    module's state dict with a parameter of each dtype, the tensor itself and a Python scalar
    taken from it come back with dtype, values and the exact Python type of the scalar. As in
    the peer, the state dict's entry is ``t`` detached (same storage, same view), so it loads
    as the same object as ``t``. A ``keep_vars`` state dict of another module keeps the
    Parameter type and requires_grad (True only where the dtype allows it)."""

    class MyModule(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.param = torch.nn.Parameter(t, requires_grad=t.is_floating_point() or t.is_complex())

    t = _random((10,), dtype, seed=2)
    if dtype.is_floating_point or dtype.is_complex:  # random bits may be NaN: make the scalar comparable
        t = torch.nan_to_num(t) if not dtype.is_complex else torch.complex(torch.nan_to_num(t.real),
                                                                           torch.nan_to_num(t.imag))
    item = t[0].item()
    p = tmp_path / "preserve.h5"
    th5.save({"t": t, "sd": MyModule(t).state_dict(), "i": item, "vars": MyModule(t.clone()).state_dict(keep_vars=True)}, p)
    r = th5.load(p)
    _assert_bitwise(r["t"], t)
    _assert_bitwise(r["sd"]["param"], t)
    assert r["sd"]["param"] is r["t"]
    assert type(r["i"]) is type(item) and r["i"] == item
    _assert_bitwise(r["vars"]["param"], t)
    assert type(r["vars"]["param"]) is torch.nn.Parameter
    assert r["vars"]["param"].requires_grad == (dtype.is_floating_point or dtype.is_complex)
    assert not _shares_memory(r["vars"]["param"], r["t"])


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_refused(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_save_load_preserves_dtype
    (quantized dtypes, which the peer's dtype list leaves out): torch.save keeps them with their
    quantizer; we refuse them with UnsupportedTypeError naming the key (FORMAT.md: quantized
    dtypes are not supported), and nothing is written."""
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)
    p = tmp_path / "q.h5"
    with pytest.raises(th5.UnsupportedTypeError, match="'w/q'") as e:
        th5.save({"w": {"q": q}}, p)
    assert str(p) in str(e.value)
    assert not p.exists()


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.complex32,
                                   torch.uint16, torch.uint32, torch.uint64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_serialization_dtype_views_with_gaps(tmp_path, dtype):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_dtype: the newer
    dtypes round-trip, with even/odd strided views of the same tensor. Differs: torch.load
    returns 'even' and 'odd' as views of 'x' (writing to them changes 'x'); views with gaps
    come back contiguous copies with the same values, independent of 'x' (FORMAT.md, stride)."""
    x = torch.arange(0.0, 100.0).to(dtype=dtype)
    p = tmp_path / "views.h5"
    th5.save({"x": x, "even": x[0::2], "odd": x[1::2]}, p)
    y = th5.load(p)
    _assert_bitwise(y["x"], x)
    _assert_bitwise(y["even"], _contiguous(x[0::2]))
    _assert_bitwise(y["odd"], _contiguous(x[1::2]))
    assert y["even"].is_contiguous() and y["odd"].is_contiguous()
    assert not _shares_memory(y["even"], y["x"]) and not _shares_memory(y["odd"], y["x"])
    before = _bits(y["x"]).clone()
    _bits(y["odd"])[0] = 7
    _bits(y["even"])[0] = 9
    assert torch.equal(_bits(y["x"]), before)


# -- views, storage sharing, offsets, strides -------------------------------------------------


@pytest.mark.parametrize("path_kind", ["str", "Path"])
def test_serialization_repeated_tensors_alias(tmp_path, path_kind):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization (with
    _test_serialization_data/_test_serialization_assert): a list holding the same tensors twice
    comes back with the repeats as one object (``is``), so filling one fills the other; exact
    values, dtypes and container types (list, tuple) are kept."""
    torch.manual_seed(0)
    a = [torch.randn(5, 5).float() for _ in range(2)]
    b = [a[i % 2] for i in range(4)] + [torch.arange(1, 11).int(), (a[0], a[0], a[1])]
    p = tmp_path / "serial.h5"
    th5.save(b, str(p) if path_kind == "str" else p)
    c = th5.load(str(p) if path_kind == "str" else p)
    assert type(c) is list and type(c[5]) is tuple and len(c) == 6
    for got, want in zip(c[:5], b[:5]):
        _assert_bitwise(got, want)
    assert c[0] is c[2] and c[1] is c[3] and c[5][0] is c[5][1] is c[0] and c[5][2] is c[1]
    assert c[0] is not c[1]
    c[0].fill_(10)
    assert torch.equal(c[2], torch.full((5, 5), 10.0))
    c[1].fill_(20)
    assert torch.equal(c[3], torch.full((5, 5), 20.0))
    assert c[4].dtype == torch.int32 and torch.equal(c[4], torch.arange(1, 11, dtype=torch.int32))


def test_serialization_rootview_partial_overlap(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::_test_serialization_assert
    (rootview): torch keeps ``a.reshape(-1)[0:2]`` in a's storage (same data_ptr). Differs: a view
    that only overlaps another (other shape, offset or dtype) is stored separately and comes
    back as its own memory with the same values; only identical views are aliased."""
    a = torch.randn(5, 5)
    obj = {"a": a, "root": a.reshape(-1)[0:2], "flat": a.view(-1), "mid": a[1:3], "bits": a.view(torch.int32),
           "same": a.view(5, 5)}
    p = tmp_path / "overlap.h5"
    th5.save(obj, p)
    r = th5.load(p)
    for k in obj:
        _assert_bitwise(r[k], obj[k].clone())
    assert r["same"] is r["a"]  # the same view (storage, offset, shape, stride, dtype) of a different object
    for k in ("root", "flat", "mid", "bits"):
        assert not _shares_memory(r[k], r["a"]), k
    r["a"].zero_()
    assert torch.equal(r["root"], obj["root"]) and torch.equal(r["mid"], obj["mid"])


def test_tied_module_weights(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::_test_serialization_assert (the same
    tensor twice unpickles as one object), on tied module weights: one object after th5.load,
    the tie kept through load_state_dict, and th5.load_into fills the tied target once."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.out = torch.nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

    torch.manual_seed(1)
    m = Tied()
    p = tmp_path / "tied.h5"
    th5.save(m.state_dict(), p)
    r = th5.load(p)
    assert r["emb.weight"] is r["out.weight"]
    m2 = Tied()
    m2.load_state_dict(r)
    assert m2.emb.weight is m2.out.weight and torch.equal(m2.emb.weight, m.emb.weight)
    m3 = Tied()
    assert th5.load_into(m3, p) == th5.LoadResult([], [])
    assert m3.emb.weight is m3.out.weight and torch.equal(m3.out.weight, m.emb.weight)


def test_serialization_writer_same_tensor_twice(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::_test_serialization_assert (the same
    storage view saved twice loads as one object), through the streaming th5.Writer: the same
    tensor written under two keys in separate writes loads as one object with its values."""
    t = torch.arange(6.0).reshape(2, 3)
    p = tmp_path / "twice.h5"
    with th5.Writer(p) as w:
        w["a"] = t
        w["sub/b"] = t
        w["c"] = t.t()
    r = th5.load(p)
    assert r["a"] is r["sub"]["b"]
    assert torch.equal(r["a"], t) and r["c"].stride() == (1, 3) and torch.equal(r["c"], t.t())


def test_serialization_writer_snapshot_after_inplace(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::_test_serialization_assert (the same
    storage view saved twice loads as one object): torch.save takes one snapshot, so repeats
    hold the same values. The streaming th5.Writer can write the same tensor again after it
    changed in place (a snapshot per training step); each write must store the values the
    tensor had when it was written."""
    w_ = torch.zeros(3)
    p = tmp_path / "snapshots.h5"
    with th5.Writer(p) as w:
        for step in range(3):
            w[f"snap/{step}"] = w_
            w_.add_(1)
    r = th5.load(p)["snap"]
    assert [r[str(i)].tolist() for i in range(3)] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_serialization_backwards_compat_offset_and_stride(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_backwards_compat
    (the OldTensor part: ``torch.randn(30).as_strided([2, 3], [9, 3], 2)`` keeps storage, offset,
    size and stride). Differs: a view with gaps and a storage offset comes back as a new
    contiguous tensor (offset 0) with the same values; a gap-free slice with an offset also
    comes back at offset 0, storing only its own elements."""
    base = torch.randn(30)
    x = base.as_strided([2, 3], [9, 3], 2)
    tail = base[7:]
    rows = base.view(5, 6)[1:3]
    p = tmp_path / "offsets.h5"
    th5.save({"x": x, "tail": tail, "rows": rows}, p)
    r = th5.load(p)
    for k, want in (("x", x), ("tail", tail), ("rows", rows)):
        _assert_bitwise(r[k], want.clone())
        assert r[k].storage_offset() == 0 and r[k].is_contiguous(), k
        assert r[k].untyped_storage().nbytes() == want.numel() * 4, k
    assert tail.storage_offset() == 7 and rows.storage_offset() == 6  # the test saves real offsets


@pytest.mark.parametrize("mmap", [False, True])
def test_serialization_strides_kept(tmp_path, mmap):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_backwards_compat
    (``load_x.stride() == x.stride()``): gap-free layouts keep their stride (transposed,
    channels_last, channels_last_3d, expanded with stride 0, a 0-d value expanded to 2-d);
    views with gaps (``t[::2]``, ``t[:, 1::3]``) come back contiguous with the same values.
    Also through mmap=True (strided tensors are read, not mapped)."""
    t = torch.randn(4, 6)
    obj = {
        "t": t.t(),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "cl3": torch.randn(2, 3, 2, 2, 2).to(memory_format=torch.channels_last_3d),
        "ex": torch.randn(3, 1).expand(3, 4),
        "bc": torch.randn(1, 4).expand(3, 4),
        "zx": torch.tensor(5.0).expand(3, 4),
        "step": t[::2],
        "cols": t[:, 1::3],
        "bool_t": (t > 0).t(),
    }
    p = tmp_path / "strides.h5"
    th5.save(obj, p)
    r = th5.load(p, mmap=mmap)
    for k in ("t", "cl", "cl3", "ex", "bc", "zx", "bool_t"):
        _assert_bitwise(r[k], obj[k])
        assert r[k].stride() == obj[k].stride(), (k, r[k].stride(), obj[k].stride())
    for k in ("step", "cols"):
        _assert_bitwise(r[k], obj[k].clone())
        assert r[k].is_contiguous() and r[k].stride() != obj[k].stride(), k
    assert r["ex"].untyped_storage().nbytes() == 3 * 4  # one copy of each expanded value
    with th5.open(p) as store:  # slices read the logical values
        assert torch.equal(store["t"][1:3], obj["t"][1:3])
        assert store["zx"].stride == (0, 0)


def test_save_different_dtype_error(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_save_different_dtype_error:
    torch.save refuses tensors that view the same data as different types ([a, a.imag],
    a float and its bytes). Differs: we store each view's own values separately, so both load
    with their own dtype and values."""
    a = torch.randn(10, dtype=torch.complex128)
    f = torch.randn(10)
    obj = [a, a.imag, a.real, f, f.view(torch.uint8), f.view(torch.int32)]
    p = tmp_path / "difftype.h5"
    th5.save(obj, p)
    r = th5.load(p)
    for got, want in zip(r, obj):
        _assert_bitwise(got, want.clone())
    assert r[1].is_contiguous() and r[1].dtype == torch.float64
    assert not _shares_memory(r[0], r[1]) and not _shares_memory(r[3], r[4])


def test_save_different_dtype_unallocated(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_save_different_dtype_unallocated:
    empty tensors of every pair of dtypes (no storage bytes to share) save and load with their
    own dtype; the storage halves of the peer are refused (see test_serialization_storages_refused)."""
    obj = {}
    for i, dt in enumerate(PEER_DTYPES):
        for j, other in enumerate(PEER_DTYPES):
            obj[f"{i}_{j}"] = [torch.tensor([], dtype=dt), torch.tensor([], dtype=other)]
    p = tmp_path / "empty.h5"
    th5.save(obj, p)
    r = th5.load(p)
    for i, dt in enumerate(PEER_DTYPES):
        for j, other in enumerate(PEER_DTYPES):
            x, y = r[f"{i}_{j}"]
            assert (x.dtype, y.dtype, x.shape, y.shape) == (dt, other, (0,), (0,))


def test_serialization_empty_and_0d(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_save_different_dtype_unallocated
    (tensors without elements) and the 0-d tensors of the peer's data: shapes (0,), (0, 3),
    (2, 0, 4), 0-d values and 0-d Parameters keep shape, dtype and requires_grad."""
    obj = {"e0": torch.empty(0), "e1": torch.empty(0, 3, dtype=torch.int16), "e2": torch.empty(2, 0, 4).permute(2, 0, 1),
           "z": torch.tensor(3.5, dtype=torch.float64), "zb": torch.tensor(True), "zp": torch.nn.Parameter(torch.tensor(-1.0))}
    p = tmp_path / "small.h5"
    th5.save(obj, p)
    for mmap in (False, True):
        r = th5.load(p, mmap=mmap)
        for k, want in obj.items():
            _assert_bitwise(r[k], want)
        assert type(r["zp"]) is torch.nn.Parameter and r["zp"].requires_grad
    with th5.open(p) as store:
        assert store["e2"].shape == (4, 2, 0) and store["e2"].nbytes == 0
        assert store["z"].read().item() == 3.5


# -- large-ish ---------------------------------------------------------------------------------


def test_serialization_offset_large_ish(tmp_path):
    """pytorch test/test_serialization.py::TestOldSerialization::test_serialization_offset and
    TestSerialization::test_serialization_2gb_file (scaled down to fit the suite's time): a small
    tensor, a tensor over 8 MiB (split into several read pieces and checksum blocks), a
    Conv2d state dict and plain values in one file; everything comes back exactly, also with
    verify=True, through mmap, and a row slice reads just those rows."""
    torch.manual_seed(3)
    a = torch.randn(5, 5)
    b = torch.randn(3 * 2**20 + 5)
    conv = torch.nn.Conv2d(20, 32, kernel_size=3)
    p = tmp_path / "large.h5"
    th5.save({"i": 41, "a": a, "j": 43, "b": b, "m": conv.state_dict()}, p)
    for kwargs in ({}, {"verify": True}, {"mmap": True}):
        r = th5.load(p, **kwargs)
        assert (r["i"], r["j"]) == (41, 43)
        _assert_bitwise(r["a"], a)
        _assert_bitwise(r["b"], b)
        m2 = torch.nn.Conv2d(20, 32, kernel_size=3)
        m2.load_state_dict(r["m"])
        assert torch.equal(m2.weight, conv.weight) and m2.kernel_size == conv.kernel_size
    with th5.open(p) as store:
        assert torch.equal(store["b"][2**21 + 3:2**21 + 10], b[2**21 + 3:2**21 + 10])


def test_serialization_4gb_file_float8_linear(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_4gb_file (scaled
    down): a ModuleList of Linear layers, two of them cast to float8_e4m3fn, saved as a state
    dict and loaded back bitwise, with load_into filling the float8 weights in place."""
    ml = torch.nn.ModuleList([torch.nn.Linear(1, 1024, bias=False),
                              torch.nn.Linear(1, 1, bias=False).to(torch.float8_e4m3fn),
                              torch.nn.Linear(1, 2, bias=False).to(torch.float8_e4m3fn)])
    p = tmp_path / "f8.h5"
    th5.save(ml.state_dict(), p)
    r = th5.load(p)
    for k, v in ml.state_dict().items():
        _assert_bitwise(r[k], v)
    target = torch.nn.ModuleList([torch.nn.Linear(1, 1024, bias=False),
                                  torch.nn.Linear(1, 1, bias=False).to(torch.float8_e4m3fn),
                                  torch.nn.Linear(1, 2, bias=False).to(torch.float8_e4m3fn)])
    ptr = target[2].weight.data_ptr()
    th5.load_into(target, p, strict_dtype=True)
    assert target[2].weight.data_ptr() == ptr
    _assert_bitwise(target[2].weight.detach(), ml[2].weight.detach())


# -- paths, basic values, warnings ---------------------------------------------------------


@pytest.mark.parametrize("path_type", [str, pathlib.Path])
def test_serialization_zipfile_paths(tmp_path, path_type):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_zipfile and
    ::test_pathlike_serialization: saving to a str or pathlib.Path, also inside a directory
    with a non-ASCII name, and loading back exactly (a Conv2d state dict)."""
    d = tmp_path / "非ASCIIパス"
    d.mkdir()
    model = torch.nn.Conv2d(20, 32, kernel_size=3)
    for p in (tmp_path / "plain.h5", d / "モデル.h5"):
        th5.save(model.state_dict(), path_type(p))
        r = th5.load(path_type(p))
        assert list(r) == ["weight", "bias"]
        for k, v in model.state_dict().items():
            _assert_bitwise(r[k], v)
        with th5.open(path_type(p)) as store:
            assert store.keys() == ["weight", "bias"]


def test_safe_load_basic_types(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_safe_load_basic_types: int, str,
    float and bool come back with their exact values and types (and so do the other plain
    values FORMAT.md lists: None, big ints, nan/inf, complex, bytes, torch.dtype, torch.Size)."""
    data = {"int": 123, "str": "world", "float": 3.14, "bool": False, "none": None, "big": 2**100,
            "inf": float("-inf"), "cplx": 1.5 - 2j, "bytes": b"\x00\xff", "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]), "nested": {1: [1, 2.5], "t": (True, "x")}}
    p = tmp_path / "basic.h5"
    th5.save(data, p)
    r = th5.load(p)
    assert r == data
    for k in data:
        assert type(r[k]) is type(data[k]), k
    assert type(r["nested"]["t"]) is tuple and list(r["nested"]) == [1, "t"]
    th5.save({"nan": float("nan")}, p)
    assert math.isnan(th5.load(p)["nan"])


@pytest.mark.parametrize("literal", [b"byte", bytearray(b"bytearray")], ids=["bytes", "bytearray"])
def test_serialization_byte_literal(tmp_path, literal):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_byte_literal: bytes
    round-trip. Differs: torch also keeps a bytearray; we store only the plain values FORMAT.md
    lists, so a bytearray is refused with UnsupportedTypeError naming the key and the type."""
    p = tmp_path / "bytes.h5"
    if type(literal) is bytes:
        th5.save({"lit": literal}, p)
        r = th5.load(p)["lit"]
        assert r == literal and type(r) is bytes
    else:
        with pytest.raises(th5.UnsupportedTypeError, match=r"bytearray.*'lit'"):
            th5.save({"lit": literal}, p)
        assert not p.exists()


def test_serialization_save_warnings(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_save_warnings:
    saving (and loading) a Linear's state dict emits no warning at all."""
    gc.collect()  # earlier tests' garbage must not warn inside the block
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = tmp_path / "warn.h5"
        th5.save(torch.nn.Linear(2, 3).state_dict(), p)
        th5.load(p)
        th5.load(p, mmap=True)
    assert [str(w.message) for w in caught] == []


def test_serialization_fake_zip(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_fake_zip: a
    tensor whose bytes look like a file signature (zip's ``PK\\x05\\x06``, HDF5's and our own
    magic) saved as the whole file (root tensor) loads back as that tensor."""
    sigs = list(b"PK\x05\x06") + list(b"\x89HDF\r\n\x1a\n") + list(b"\x89TSH5\r\n\x1a")
    t = torch.tensor(sigs + [0] * 100, dtype=torch.uint8)
    p = tmp_path / "fake.h5"
    th5.save(t, p)
    r = th5.load(p)
    assert type(r) is torch.Tensor
    _assert_bitwise(r, t)
    with th5.open(p) as store:
        assert store.format_version == 2


def test_has_format_version(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_has_format_version: the file
    records its format version (the header and the root attributes) and Store reports it."""
    p = tmp_path / "version.h5"
    th5.save(torch.nn.Linear(2, 3).state_dict(), p)
    with th5.open(p) as store:
        assert store.format_version == th5.FORMAT_VERSION == 2
    head = _read(p)[:16]
    assert head[:8] == b"\x89TSH5\r\n\x1a" and int.from_bytes(head[8:12], "little") == 2
    with h5py.File(p, "r") as f:
        assert int(f.attrs["tensorstore_h5.version"]) == 2


def test_serialization_byteorder_mark(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_byteorder_mark:
    torch records the byte order in a zip record. The format fixes it instead: every dataset
    is little-endian (FORMAT.md, Datasets), which plain h5py shows."""
    lstm = torch.nn.LSTM(3, 3)
    p = tmp_path / "lstm.h5"
    sd = lstm.state_dict()
    sd["f64"] = torch.randn(2, dtype=torch.float64)
    sd["i16"] = torch.arange(3, dtype=torch.int16)
    th5.save(sd, p)
    with h5py.File(p, "r") as f:
        for k in sd:
            assert f[k].dtype.str[0] in "<|", (k, f[k].dtype.str)
        assert f["f64"].dtype.str == "<f8" and f["i16"].dtype.str == "<i2"


@pytest.mark.parametrize("npdtype", ["f8", "f4", "f2", "i8", "i4", "i2", "u2", "c8", "c16"])
def test_serialization_load_bom_data_foreign_big_endian(tmp_path, npdtype):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data_double
    (and _float, _half, _long, _int, _int16, _cfloat, _cdouble; the 1-byte _int8/_uint8/_bool
    cases in test_serialization_load_bom_data_one_byte): data written big-endian loads with
    the same values as the little-endian copy. Our own files are always little-endian, so the
    big-endian data is a plain HDF5 file written by h5py, which th5.load reads too."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2))
    if npdtype.startswith("c"):
        x = x + 1j * x[::-1]
    if npdtype[0] in "iu":
        x = rng.integers(0 if npdtype[0] == "u" else -30000, 30000, (2, 2))
    x = x.astype(npdtype)
    p = tmp_path / "bom.h5"
    with h5py.File(p, "w") as f:
        f["le"] = x.astype(x.dtype.newbyteorder("<"))
        f["be"] = x.astype(x.dtype.newbyteorder(">"))
    r = th5.load(p)
    want = torch.from_numpy(x.astype(x.dtype.newbyteorder("=")))
    _assert_bitwise(r["le"], want)
    _assert_bitwise(r["be"], want)
    with th5.open(p) as store:
        _assert_bitwise(store["be"][1:], want[1:])


def test_serialization_load_bom_data_one_byte(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data_int8
    (and _uint8, _bool): one-byte types read the same whatever the byte order, from a plain
    HDF5 file."""
    rng = np.random.default_rng(1)
    data = {"i1": rng.integers(-128, 128, (4, 4), dtype=np.int8), "u1": rng.integers(0, 256, (4, 4), dtype=np.uint8),
            "b": rng.integers(0, 2, (4, 4)).astype(bool)}
    p = tmp_path / "onebyte.h5"
    with h5py.File(p, "w") as f:
        for k, v in data.items():
            f[k] = v
    r = th5.load(p)
    for k, v in data.items():
        _assert_bitwise(r[k], torch.from_numpy(v))


# -- map_location / device ---------------------------------------------------------------


@pytest.mark.parametrize("device", [
    None, "cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0), {"cuda:0": "cpu"}, {"*": "cpu"},
    {"w*": "cpu:0"}, lambda key: "cpu", lambda key: None, lambda key: torch.device("cpu", 0),
], ids=["None", "cpu", "cpu:0", "device", "device0", "map_loc_glob_nomatch", "map_star", "map_glob", "callable_cpu",
        "callable_none", "callable_device0"])
def test_serialization_map_location_cpu(tmp_path, device):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_map_location:
    every spelling of the CPU as ``device=`` (None, "cpu", "cpu:0", torch.device('cpu'),
    torch.device('cpu', 0), a mapping of key globs, a callable) loads the tensors on the CPU
    with their values and dtype. Differs: torch's mapping keys are saved locations and its
    callable takes (storage, location); ours map key paths, as documented."""
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    p = tmp_path / "map.h5"
    th5.save({"w": t, "b": torch.arange(3, dtype=torch.int16)}, p)
    for kwargs in ({}, {"mmap": True}):
        r = th5.load(p, device=device, **kwargs)
        assert r["w"].device == torch.device("cpu") and r["b"].device == torch.device("cpu")
        _assert_bitwise(r["w"], t)
        assert r["b"].dtype == torch.int16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", [
    "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), {"*": "cuda:0"}, lambda key: "cuda:0",
], ids=["cuda", "cuda:0", "device", "device0", "map_star", "callable"])
def test_serialization_map_location_cuda(tmp_path, device):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_map_location (its
    gpu_0_map_locations): every spelling of the first CUDA device as ``device=`` loads the
    tensors there with their values, tied tensors as one object, strides and Parameters kept."""
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    obj = {"w": t, "w2": t, "wt": t.t(), "p": torch.nn.Parameter(torch.randn(3))}
    p = tmp_path / "map_cuda.h5"
    th5.save(obj, p)
    r = th5.load(p, device=device)
    for k, want in obj.items():
        assert r[k].device == torch.device("cuda", 0), k
        _assert_bitwise(r[k].cpu(), want.detach())
    assert r["w"] is r["w2"] and r["wt"].stride() == (1, 2)
    assert type(r["p"]) is torch.nn.Parameter and r["p"].requires_grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device,key", [
    ("cuda", "w"), ("cuda:0", "w"), (torch.device("cuda", 0), "w"), ({"b": "cuda"}, "b"),
    (lambda key: "cuda:1" if key == "b" else None, "b"),
], ids=["cuda", "cuda:0", "device", "mapping", "callable"])
def test_load_nonexistent_device(tmp_path, device, key):
    """pytorch test/test_serialization.py::SerializationMixin::test_load_nonexistent_device: asking
    for CUDA on a machine without it fails. Ours: TensorStoreError naming the file, the key and
    the device, from load (also with mmap=True) and Store.items."""
    p = tmp_path / "dev.h5"
    th5.save({"w": torch.randn(2), "b": torch.randn(3)}, p)
    for call in (lambda: th5.load(p, device=device), lambda: th5.load(p, device=device, mmap=True),
                 lambda: _items(p, device)):
        with pytest.raises(th5.TensorStoreError) as e:
            call()
        msg = str(e.value)
        assert str(p) in msg and f"key {key!r}" in msg and "cuda" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CUDA-located checkpoint on a machine without CUDA")
def test_load_nonexistent_device_torch_file_converts(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_load_nonexistent_device: a
    torch.save file whose storage is located on 'cuda:0' cannot be torch.load-ed without CUDA.
    Differs: th5.convert maps it to the CPU, and the .h5 file holds no device at all, so it
    loads anywhere."""
    t = torch.tensor([1.5, -2.25])
    buf = io.BytesIO()
    torch.save({"w": t}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    cpu_tag = b"X\x03\x00\x00\x00cpu"  # the location string of the legacy pickle
    if data.count(cpu_tag) != 1:
        pytest.skip("torch's legacy format changed; cannot retarget the storage location")
    src = tmp_path / "cuda.pt"
    src.write_bytes(data.replace(cpu_tag, b"X\x06\x00\x00\x00cuda:0"))
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(src)
    dst = tmp_path / "cuda.h5"
    th5.convert(src, dst)
    r = th5.load(dst)
    assert r["w"].device == torch.device("cpu")
    _assert_bitwise(r["w"], t)


def test_load_under_meta_device_context(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_mmap_load_offset_calculation
    (which builds its models under ``with torch.device('meta')``): loading inside that context
    still puts every tensor on the CPU with its values (load, load with mmap, strided and
    expanded tensors, Parameters, large tensors, Store reads and slices)."""
    obj = {"t": torch.randn(4, 6).t(), "ex": torch.randn(3, 1).expand(3, 4), "p": torch.nn.Parameter(torch.randn(3)),
           "big": torch.randn(300_000), "z": torch.tensor(2), "e": torch.empty(0, 2)}
    p = tmp_path / "meta.h5"
    th5.save(obj, p)
    with torch.device("meta"):
        loads = [th5.load(p), th5.load(p, mmap=True)]
        with th5.open(p) as store:
            loads.append({k: store[k].read() for k in obj})
            loads.append(dict(store.items()))
            rows = store["big"][10:20]
    for r in loads:
        for k, want in obj.items():
            assert r[k].device == torch.device("cpu"), k
            _assert_bitwise(r[k], want)
        assert r["t"].stride() == (1, 6) and r["ex"].stride() == (1, 0)
    assert rows.device == torch.device("cpu") and torch.equal(rows, obj["big"][10:20])


def test_load_under_default_device(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_mmap_load_offset_calculation
    (models made on another default device): with ``torch.set_default_device('meta')`` in
    force, load, load(mmap=True) and load_into still produce CPU tensors with the file's values."""
    torch.manual_seed(4)
    m = torch.nn.Linear(4, 3)
    p = tmp_path / "default.h5"
    th5.save({"m": m.state_dict(), "t": torch.randn(3, 5).t()}, p)
    torch.set_default_device("meta")
    try:
        r = th5.load(p)
        rm = th5.load(p, mmap=True)
        target = torch.nn.Linear(4, 3, device="cpu")
        th5.load_into(target, p, prefix="m/")
        assigned = torch.nn.Linear(4, 3)  # on the meta device
        th5.load_into(assigned, p, prefix="m/", assign=True)
    finally:
        torch.set_default_device(None)
    for res in (r, rm):
        assert res["t"].device == torch.device("cpu") and res["t"].stride() == (1, 5)
        for k, v in m.state_dict().items():
            assert res["m"][k].device == torch.device("cpu")
            _assert_bitwise(res["m"][k], v)
    for mod in (target, assigned):
        assert mod.weight.device == torch.device("cpu") and type(mod.weight) is torch.nn.Parameter
        assert torch.equal(mod.weight, m.weight) and torch.equal(mod.bias, m.bias)


# -- mmap --------------------------------------------------------------------------------------


class _DummyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 1024)
        self.fc2 = torch.nn.Linear(1024, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x))


@pytest.mark.parametrize("path_type", [str, pathlib.Path])
def test_serialization_mmap_loading_options(tmp_path, path_type):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_mmap_loading_options:
    a state dict loaded with mmap=True and without gives models with the same output (str
    and pathlib.Path paths)."""
    torch.manual_seed(5)
    p = path_type(tmp_path / "mmap.h5")
    th5.save(_DummyModel().state_dict(), p)
    result = th5.load(p, mmap=True)
    result_non_mmap = th5.load(p, mmap=False)
    a, b = _DummyModel(), _DummyModel()
    a.load_state_dict(result)
    b.load_state_dict(result_non_mmap)
    x = torch.randn(4, 3)
    assert torch.equal(a(x), b(x.clone()))


def test_serialization_mmap_loading_copy_on_write(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_mmap_loading (the
    MAP_PRIVATE half): writing to mmap-loaded tensors changes neither the file nor a second
    mmap load nor the neighbouring tensors of the same mapping; the tensors are views of one
    mapping of the file (zero-copy), unlike a plain load."""
    torch.manual_seed(6)
    sd = torch.nn.Linear(3, 5).state_dict()
    p = tmp_path / "cow.h5"
    th5.save(sd, p)
    before = _read(p)
    loaded = th5.load(p, mmap=True)
    assert _shares_memory(loaded["weight"], loaded["bias"])  # one mapping
    plain = th5.load(p)
    assert not _shares_memory(plain["weight"], plain["bias"])
    loaded["weight"][0][0] = 0
    loaded["bias"].fill_(7)
    assert _read(p) == before
    again = th5.load(p, mmap=True)
    assert torch.equal(again["weight"], sd["weight"]) and torch.equal(again["bias"], sd["bias"])
    assert torch.equal(loaded["weight"][1:], sd["weight"][1:]) and torch.equal(loaded["weight"][0][1:], sd["weight"][0][1:])
    assert loaded["weight"][0][0].item() == 0 and torch.equal(loaded["bias"], torch.full((5,), 7.0))


def test_serialization_mmap_survives_replacement(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_mmap_loading:
    mapped tensors keep the values they were loaded with when a new save replaces the file
    (saves write a new file and rename it; the mapping holds the old one)."""
    p = tmp_path / "replace.h5"
    first = {"w": torch.arange(12.0).reshape(3, 4)}
    th5.save(first, p)
    mapped = th5.load(p, mmap=True)
    th5.save({"w": torch.full((3, 4), -1.0)}, p)
    assert torch.equal(mapped["w"], first["w"])
    assert torch.equal(th5.load(p)["w"], torch.full((3, 4), -1.0))


@pytest.mark.parametrize("device", [None, "cpu:0", torch.device("cpu", 0)], ids=["None", "cpu:0", "device0"])
def test_storage_alignment(tmp_path, device):
    """pytorch test/test_serialization.py::TestSerialization::test_storage_alignment: torch aligns
    each storage's record in the file. Ours: every dataset starts at a multiple of 64 bytes
    (seen with h5py), so mmap-loaded tensors of every dtype have 64-byte aligned data_ptr,
    whatever spelling of the CPU is asked for."""
    obj = {"w": torch.randn(10, 10), "b": torch.randn(10), "h": torch.randn(7).half(), "c": torch.randn(3, dtype=torch.cdouble),
           "u8": torch.arange(5, dtype=torch.uint8), "z": torch.tensor(1.0)}
    p = tmp_path / "align.h5"
    th5.save(obj, p)
    for k in obj:
        assert _offset(p, k) % 64 == 0, k
    r = th5.load(p, mmap=True, device=device)
    for k, want in obj.items():
        assert r[k].data_ptr() % 64 == 0, k
        _assert_bitwise(r[k], want)
    assert _shares_memory(r["w"], r["u8"])  # mapped, not read


def test_mmap_load_offset_calculation_meta_assign(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_mmap_load_offset_calculation:
    models built under ``torch.device('meta')`` take the weights with
    ``load_state_dict(..., assign=True)`` from an mmap load and from a plain load (and through
    th5.load_into(assign=True)); all give the original model's output."""
    torch.manual_seed(7)
    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    p = tmp_path / "seq.h5"
    th5.save(m.state_dict(), p)
    with torch.device("meta"):
        models = [torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)]) for _ in range(3)]
    models[0].load_state_dict(th5.load(p, mmap=True), assign=True)
    models[1].load_state_dict(th5.load(p), assign=True)
    assert th5.load_into(models[2], p, assign=True) == th5.LoadResult([], [])
    x = torch.randn(4, 4)
    for mod in models:
        assert mod[0].weight.device == torch.device("cpu") and type(mod[0].weight) is torch.nn.Parameter
        assert torch.equal(mod(x), m(x))
    with torch.device("meta"):
        on_meta = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    with pytest.raises(th5.MismatchError, match="meta"):
        th5.load_into(on_meta, p)


# -- module state dicts, versions, buffers, parameters ---------------------------------------------


def test_serialization_load_bom_data_lstm_metadata(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data: an
    LSTM state dict (whose checkpoints carry ``_metadata`` module versions) saved and loaded
    back loads with load_state_dict(strict=True) into a new LSTM that then computes the same;
    the loaded OrderedDict carries the same ``_metadata``."""
    torch.manual_seed(8)
    lstm = torch.nn.LSTM(3, 3)
    sd = lstm.state_dict()
    p = tmp_path / "lstm.h5"
    th5.save(sd, p)
    r = th5.load(p)
    assert type(r) is OrderedDict and list(r) == list(sd)
    assert r._metadata == sd._metadata and type(r._metadata) is OrderedDict
    other = torch.nn.LSTM(3, 3)
    other.load_state_dict(r, strict=True)
    x = torch.randn(5, 1, 3)
    assert torch.equal(other(x)[0], lstm(x)[0])
    into = torch.nn.LSTM(3, 3)
    assert th5.load_into(into, p) == th5.LoadResult([], [])
    assert torch.equal(into(x)[0], lstm(x)[0])


class _Versioned(torch.nn.Module):
    """Version 2 stores ``scale``; version-1 checkpoints stored ``old_scale``, half of it."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.register_buffer("scale", torch.ones(4))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        version = local_metadata.get("version", None)
        if (version is None or version < 2) and prefix + "old_scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict.pop(prefix + "old_scale") * 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


def _version1_checkpoint(module: torch.nn.Module, prefix: str = "") -> OrderedDict:
    sd = module.state_dict()
    old = OrderedDict((k.replace(prefix + "scale", prefix + "old_scale"), v.clone()) for k, v in sd.items())
    old[prefix + "old_scale"] = torch.full((4,), 3.0)
    old._metadata = OrderedDict((k, dict(v)) for k, v in sd._metadata.items())
    old._metadata[prefix.rstrip(".")]["version"] = 1
    return old


def test_module_version_conversion(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data (a
    checkpoint whose ``_metadata`` says version 1, loaded by load_state_dict): a module with
    ``_version = 2`` whose ``_load_from_state_dict`` converts version-1 checkpoints converts the
    same through ``model.load_state_dict(th5.load(p))`` and ``th5.load_into(model, p)`` as
    through torch.load."""
    torch.manual_seed(9)
    old = _version1_checkpoint(_Versioned())
    pt, h5 = tmp_path / "v1.pt", tmp_path / "v1.h5"
    torch.save(old, pt)
    th5.save(old, h5)
    via_torch, via_load, via_into = _Versioned(), _Versioned(), _Versioned()
    via_torch.load_state_dict(torch.load(pt))
    via_load.load_state_dict(th5.load(h5))
    assert th5.load_into(via_into, h5) == th5.LoadResult([], [])
    assert torch.equal(via_torch.scale, torch.full((4,), 6.0))
    for m in (via_load, via_into):
        assert torch.equal(m.scale, via_torch.scale)
        assert torch.equal(m.lin.weight, via_torch.lin.weight) and torch.equal(m.lin.bias, via_torch.lin.bias)
    # a current (version 2) checkpoint is taken as it is
    current = _Versioned()
    current.scale.fill_(5.0)
    th5.save(current.state_dict(), h5)
    fresh = _Versioned()
    th5.load_into(fresh, h5)
    assert torch.equal(fresh.scale, torch.full((4,), 5.0))


def test_module_version_nested_prefix(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data (module
    versions from ``_metadata``), nested: a versioned submodule inside a model saved as
    ``{"model": state_dict, "step": 3}`` converts the same through th5.load(...)["model"],
    th5.load_into(prefix="model/") and torch.load."""

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = _Versioned()
            self.head = torch.nn.Linear(4, 2)

    torch.manual_seed(10)
    old = _version1_checkpoint(Outer(), prefix="sub.")
    pt, h5 = tmp_path / "outer.pt", tmp_path / "outer.h5"
    torch.save({"model": old, "step": 3}, pt)
    th5.save({"model": old, "step": 3}, h5)
    a, b, c = Outer(), Outer(), Outer()
    a.load_state_dict(torch.load(pt)["model"])
    loaded = th5.load(h5)
    assert loaded["step"] == 3 and loaded["model"]._metadata == old._metadata
    b.load_state_dict(loaded["model"])
    th5.load_into(c, h5, prefix="model/")
    assert torch.equal(a.sub.scale, torch.full((4,), 6.0))
    for m in (b, c):
        for (k, v), (_, w) in zip(m.state_dict().items(), a.state_dict().items()):
            assert torch.equal(v, w), k


def test_buffers_and_non_persistent_buffers(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_load_bom_data (a
    module state dict with parameters and buffers): persistent buffers are saved and restored
    (by load_state_dict and load_into, in place); ``persistent=False`` buffers are not in the
    state dict, not in the file, and load_into leaves them as they are."""

    class WithBuffers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("keep", torch.arange(3.0))
            self.register_buffer("tmp", torch.arange(3.0) + 10, persistent=False)

    src = WithBuffers()
    p = tmp_path / "buffers.h5"
    th5.save(src.state_dict(), p)
    with th5.open(p) as store:
        assert store.keys() == list(src.state_dict()) and sorted(store.keys()) == ["keep", "lin.bias", "lin.weight"]
    dst = WithBuffers()
    dst.keep.zero_()
    dst.tmp.fill_(-1)
    ptr = dst.keep.data_ptr()
    assert th5.load_into(dst, p) == th5.LoadResult([], [])
    assert torch.equal(dst.keep, torch.arange(3.0)) and dst.keep.data_ptr() == ptr
    assert torch.equal(dst.tmp, torch.full((3,), -1.0))
    other = WithBuffers()
    other.keep.zero_()
    other.load_state_dict(th5.load(p))
    assert torch.equal(other.keep, torch.arange(3.0))


def test_parameter_and_requires_grad(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_python_attr (which
    saves a tensor and an nn.Parameter): nn.Parameter comes back as nn.Parameter with its
    requires_grad (True or False), a plain tensor that required grad comes back requiring it,
    others not; all are leaves, also through mmap and Store.items."""
    obj = {"p": torch.nn.Parameter(torch.randn(2, 2)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
           "q": torch.randn(3, requires_grad=True), "n": torch.randn(2)}
    p = tmp_path / "grad.h5"
    th5.save(obj, p)
    results = [th5.load(p), th5.load(p, mmap=True), _items(p)]
    for r in results:
        assert type(r["p"]) is torch.nn.Parameter and r["p"].requires_grad
        assert type(r["frozen"]) is torch.nn.Parameter and not r["frozen"].requires_grad
        assert type(r["q"]) is torch.Tensor and r["q"].requires_grad
        assert type(r["n"]) is torch.Tensor and not r["n"].requires_grad
        for k, want in obj.items():
            assert r[k].is_leaf, k
            _assert_bitwise(r[k], want)
    (results[0]["q"] * 2).sum().backward()
    assert torch.equal(results[0]["q"].grad, torch.full((3,), 2.0))


def test_serialization_python_attr(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_python_attr:
    torch pickles Python attributes set on a tensor or Parameter (``t.foo``, ``t.pi``). Differs:
    tensorstore_h5 stores values, never pickled Python state, and would lose the attributes,
    so it refuses the tensor with UnsupportedTypeError naming the key and the attributes
    (nothing written); the tensors without them (``.detach()``) store and load."""
    t = torch.zeros(3, 3)
    t.foo = "foo"
    t.pi = 3.14
    prm = torch.nn.Parameter(torch.ones(2))
    prm.foo = "foo"
    p = tmp_path / "attr.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=r"attr\.h5: tensor at key path 't' has Python attributes \('foo', 'pi'\)"):
        th5.save({"t": t, "p": prm}, p)
    with pytest.raises(th5.UnsupportedTypeError, match=r"key path 'p' has Python attributes \('foo'\)"):
        th5.save({"p": prm}, p)
    assert not p.exists()
    th5.save({"t": t.detach(), "p": torch.nn.Parameter(prm.detach())}, p)
    r = th5.load(p)
    assert torch.equal(r["t"], torch.zeros(3, 3)) and type(r["p"]) is torch.nn.Parameter


def test_lr_scheduler_serialization(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_lr_scheduler_serialization: a
    OneCycleLR state dict (plain values only) round-trips exactly, is small, and loads back
    into a new scheduler; the SGD state dict with its momentum buffers loads back into a new
    optimizer."""
    param = torch.randn(100, 20, requires_grad=True)
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(sgd, 6.0, total_steps=10)
    param.sum().backward()
    sgd.step()
    sched.step()
    p = tmp_path / "sched.h5"
    th5.save({"sched": sched.state_dict(), "opt": sgd.state_dict()}, p)
    assert os.path.getsize(p) < 1024 * 1024
    r = th5.load(p)
    assert r["sched"] == sched.state_dict()
    assert r["sched"]["base_lrs"] == sched.base_lrs and "_anneal_func_type" in r["sched"]
    param2 = torch.randn(100, 20, requires_grad=True)
    sgd2 = torch.optim.SGD([param2], lr=0.1, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(sgd2, 6.0, total_steps=10)
    sgd2.load_state_dict(r["opt"])
    sched2.load_state_dict(r["sched"])
    assert sched2.state_dict() == sched.state_dict()
    assert torch.equal(sgd2.state_dict()["state"][0]["momentum_buffer"], sgd.state_dict()["state"][0]["momentum_buffer"])
    assert sgd2.param_groups[0]["lr"] == sgd.param_groups[0]["lr"]


# -- math bits -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["conj", "neg", "neg_conj"])
def test_serialization_math_bits(tmp_path, kind):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_math_bits: conj,
    neg and neg-of-conj views of a complex tensor save and load with their (resolved) values;
    the loaded tensor is a plain tensor without the lazy bits."""
    t = torch.randn(4, dtype=torch.cfloat)
    view = {"conj": torch.conj(t), "neg": torch._neg_view(t), "neg_conj": torch._neg_view(torch.conj(t))}[kind]
    p = tmp_path / "bits.h5"
    th5.save({"v": view}, p)
    r = th5.load(p)["v"]
    assert not r.is_conj() and not r.is_neg()
    _assert_bitwise(r, view.resolve_conj().resolve_neg())


def test_serialization_math_bits_many_views(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_math_bits, with
    many lazy conj/neg views in one file (as a state dict of conjugated weights would be): each
    loads with its own values, never another's; the same conj view saved twice is one object,
    and a conj view is not confused with its base. (Regression: the Writer once keyed aliases
    on the temporary that resolves a conj/neg view, whose freed memory the next view's
    temporary reused, so later views loaded the first one's values.)"""
    torch.manual_seed(11)
    obj = {}
    for n in (100, 1000, 5000, 5 * 2**20):  # the largest: a temporary the allocator maps at one address
        for i in range(4 if n < 2**20 else 2):
            obj[f"c{n}_{i}"] = torch.randn(n, dtype=torch.cfloat).conj()
            obj[f"n{n}_{i}"] = torch._neg_view(torch.randn(n if n < 2**20 else 8, dtype=torch.cfloat))
    base = torch.randn(6, dtype=torch.cdouble)
    obj.update({"base": base, "bc1": base.conj(), "bc2": base.conj(), "bneg": torch._neg_view(base)})
    p = tmp_path / "manybits.h5"
    th5.save(obj, p)
    r = th5.load(p)
    wrong = [k for k in obj if not torch.equal(r[k], obj[k].resolve_conj().resolve_neg())]
    assert wrong == []
    assert r["bc1"] is r["bc2"]
    assert r["bc1"] is not r["base"] and r["bneg"] is not r["base"]
    assert not r["bc1"].is_conj() and not r["bneg"].is_neg()


# -- refusals: subclasses, zero, meta, nested, sparse, storages, objects ----------------------------


def test_serialization_efficient_zerotensor(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_efficient_zerotensor:
    torch.save refuses a ZeroTensor; so do we, with UnsupportedTypeError naming the file and
    key, before anything is written."""
    p = tmp_path / "zero.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=r"'model/z'.*zero tensor") as e:
        th5.save({"model": {"z": torch._efficientzerotensor((4, 5))}}, p)
    assert str(p) in str(e.value)
    assert not p.exists() and list(tmp_path.iterdir()) == []


def test_meta_serialization_refused(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_meta_serialization: torch saves a
    meta-device state dict as shapes only. Differs: a checkpoint here holds data, so meta
    tensors are refused with UnsupportedTypeError naming the key, and nothing is written."""
    big = torch.nn.Conv2d(20000, 320000, kernel_size=3, device="meta")
    p = tmp_path / "meta.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=r"'weight'.*meta") as e:
        th5.save(big.state_dict(), p)
    assert str(p) in str(e.value)
    assert not p.exists()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr", "bsc"])
def test_serialization_sparse_refused(tmp_path, layout):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization_sparse (and
    _safe): torch saves sparse COO/CSR/CSC/BSR/BSC tensors. Differs: only dense tensors are
    stored; a sparse one is refused with UnsupportedTypeError naming the key and its layout,
    and nothing is written."""
    x = torch.zeros(3, 3)
    x[1][1] = 1
    x = {"coo": x.to_sparse, "csr": x.to_sparse_csr, "csc": x.to_sparse_csc,
         "bsr": lambda: x.to_sparse_bsr((1, 1)), "bsc": lambda: x.to_sparse_bsc((1, 1))}[layout]()
    p = tmp_path / "sparse.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=rf"'tensor'.*sparse_{layout}"):
        th5.save({"tensor": x}, p)
    assert not p.exists()


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_serialization_storages_refused(tmp_path):
    """pytorch test/test_serialization.py::SerializationMixin::test_serialization (storages in
    the data) and ::test_serialization_storage_slice: torch saves UntypedStorage and
    TypedStorage objects. Differs: storages are not values we store; they are refused with
    UnsupportedTypeError naming the key path and the type."""
    a = torch.randn(5, 5)
    p = tmp_path / "storage.h5"
    for storage, name in ((a.untyped_storage(), "UntypedStorage"), (a.storage(), "TypedStorage")):
        with pytest.raises(th5.UnsupportedTypeError, match=rf"{name}.*'data/4'"):
            th5.save({"data": [a, a, a, a, storage]}, p)
    assert not p.exists()


class _WrapperSubclass(torch.Tensor):
    """The peer's TestWrapperSubclass: a meta tensor outside, the real data in ``elem``."""

    @staticmethod
    def __new__(cls, elem, *args, **kwargs):
        r = torch.Tensor._make_subclass(cls, elem.to("meta"), elem.requires_grad)
        r.elem = elem
        return r


class _UInt4Tensor(torch.Tensor):
    """The peer's UInt4Tensor: a wrapper subclass of dtype uint4 over packed uint8 data."""

    @staticmethod
    def __new__(cls, elem, **kwargs):
        return torch.Tensor._make_wrapper_subclass(cls, (*elem.shape[:-1], elem.shape[-1] * 2), dtype=torch.uint4)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        raise NotImplementedError(func)


def _two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.randn(2, 3), torch.randn(2, 3))


def _fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.randn(2, 3)


def _nested_jagged():
    return torch.nested.nested_tensor([torch.randn(3), torch.randn(2)], layout=torch.jagged)


@pytest.mark.parametrize("make,type_name", [
    (_two_tensor, "TwoTensor"),
    (lambda: torch.nn.Parameter(_two_tensor()), "TwoTensor"),
    (lambda: _UInt4Tensor(torch.zeros(3, 8, dtype=torch.uint8)), "_UInt4Tensor"),
    (_fake_tensor, "FakeTensor"),
    (_nested_jagged, "NestedTensor"),
], ids=["TwoTensor", "Parameter(TwoTensor)", "UInt4Tensor", "FakeTensor", "njt"])
def test_wrapper_subclasses_refused(tmp_path, make, type_name):
    """pytorch test/test_serialization.py::TestSerialization::test_weights_only_error,
    TestSubclassSerialization::test_safe_globals_for_weights_only (TwoTensor and a Parameter of
    it), TestSerialization::test_serialization_uintx_intx (UInt4Tensor), ::test_skip_data_serialization
    (a FakeTensor cannot be saved without skip_data) and ::test_load_njt_weights_only (nested
    jagged tensor): torch pickles wrapper subclasses with their class. Differs: a subclass that
    wraps other data has no storage of its own to store; it is refused with UnsupportedTypeError
    naming the key path and the type, and nothing is written."""
    value = make()
    p = tmp_path / "wrapped.h5"
    with pytest.raises(th5.UnsupportedTypeError) as e:
        th5.save({"sd": {"t": value}}, p)
    msg = str(e.value)
    assert str(p) in msg and "'sd/t'" in msg and type_name in msg
    assert not p.exists()


def test_wrapper_subclass_refusal_names_type(tmp_path):
    """pytorch test/test_serialization.py::TestSubclassSerialization::test_tensor_subclass_wrapper_serialization
    and ::test_tensor_subclass_getstate_overwrite: torch pickles the subclass (meta outside, data
    in ``elem``). Differs: refused with UnsupportedTypeError (the refusal itself holds today),
    whose message names the key path and the type (errors.py)."""
    my_tensor = _WrapperSubclass(torch.rand(2))
    my_tensor.foo = "bar"
    p = tmp_path / "wrapper.h5"
    with pytest.raises(th5.UnsupportedTypeError) as e:
        th5.save({"w": my_tensor}, p)
    assert not p.exists()
    assert "'w'" in str(e.value)
    assert "_WrapperSubclass" in str(e.value)


def test_wrapper_subclass_refusal_advice_exists(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_weights_only_error: the refusal
    of a wrapper subclass tells what to do instead; every tensorstore_h5 module it points to
    must exist."""
    import importlib
    import re

    with pytest.raises(th5.UnsupportedTypeError) as e:
        th5.save({"t": _two_tensor()}, tmp_path / "advice.h5")
    for name in re.findall(r"tensorstore_h5(?:\.\w+)+", str(e.value)):
        importlib.import_module(name)


def test_empty_class_serialization(tmp_path):
    """pytorch test/test_serialization.py::TestSubclassSerialization::test_empty_class_serialization:
    a plain subclass (no wrapping, ordinary storage), with data and empty, saves fine.
    Differs: torch returns the subclass; we store its plain data and return torch.Tensor."""

    class EmptySubclass(torch.Tensor):
        ...

    full = EmptySubclass([1.0, 2.5])
    empty = EmptySubclass()
    p = tmp_path / "subclass.h5"
    th5.save({"full": full, "empty": empty, "param": torch.nn.Parameter(EmptySubclass([3.0]))}, p)
    r = th5.load(p)
    assert type(r["full"]) is torch.Tensor and torch.equal(r["full"], torch.tensor([1.0, 2.5]))
    assert type(r["empty"]) is torch.Tensor and r["empty"].shape == (0,) and r["empty"].dtype == torch.float32
    assert torch.equal(r["param"], torch.tensor([3.0]))


def test_serialization_container_module_refused(tmp_path):
    """pytorch test/test_serialization.py::TestOldSerialization::test_serialization_container:
    torch.save pickles a whole nn.Module (its class by reference). Differs: modules are code,
    not values: refused with UnsupportedTypeError naming the key path and type; the state
    dict is what is stored."""
    net = torch.nn.Linear(2, 3)
    p = tmp_path / "module.h5"
    with pytest.raises(th5.UnsupportedTypeError, match=r"torch\.nn\.modules\.linear\.Linear.*'net'"):
        th5.save({"net": net}, p)
    assert not p.exists()
    th5.save({"net": net.state_dict()}, p)
    assert torch.equal(th5.load(p)["net"]["weight"], net.weight)


class _HelloWorld:
    def __reduce__(self):
        return (print, ("Hello World!",))


class _ClassAMock:
    class Nested:
        pass


_Point = namedtuple("_Point", ["x", "y"])


class _BuildInstruction:
    def __init__(self, num):
        self.num = num

    def __reduce_ex__(self, proto):
        return _BuildInstruction, (self.num,), {"foo": "bar"}


@dataclass
class _AllSlots:
    __slots__ = ["x", "y"]
    x: int
    y: int


@pytest.mark.parametrize("make,type_name", [
    (_HelloWorld, "_HelloWorld"),
    (_ClassAMock.Nested, "Nested"),
    (lambda: _Point(x=1, y=2), "_Point"),
    (lambda: _BuildInstruction(2), "_BuildInstruction"),
    (lambda: _AllSlots(2, 3), "_AllSlots"),
    (lambda: os.execv, "builtin_function_or_method"),
    (lambda: print, "builtin_function_or_method"),
    (lambda: datetime.datetime(2025, 1, 1, 12, 0, tzinfo=zoneinfo.ZoneInfo(key="UTC")), "datetime"),
    (lambda: {1, 2, 3}, "set"),
    (lambda: collections.Counter("ab"), "Counter"),
    (lambda: torch.device("cpu"), "torch.device"),
    (lambda: np.array(["a", "b"]), "numpy array"),
], ids=["reduce_print", "nested_class", "namedtuple", "build", "slots", "execv", "print", "datetime", "set", "Counter",
        "device", "str_array"])
def test_weights_only_refused(tmp_path, make, type_name):
    """pytorch test/test_serialization.py::TestSerialization::test_weights_only_assert,
    ::test_serialization_nested_class, ::test_weights_only_safe_globals_newobj,
    ::test_weights_only_safe_globals_build, ::test_weights_only_safe_globals_build_with_slots,
    ::test_weights_only_safe_globals_blocklist, ::test_weights_only_blocked_func_error_msg and
    TestSubclassSerialization::test_sets_are_loadable_with_weights_only: torch.save pickles these
    and torch.load(weights_only=True) refuses (or, for sets, allows) them on load. Differs: we
    never pickle, so anything but tensors, arrays, containers and plain values is refused at
    save time with UnsupportedTypeError naming the key path and type; nothing is written and an
    earlier file at the path is left as it was."""
    p = tmp_path / "objects.h5"
    th5.save({"ckpt": {"w": torch.ones(2)}}, p)
    before = _read(p)
    with pytest.raises(th5.UnsupportedTypeError) as e:
        th5.save({"ckpt": {"w": torch.zeros(2), "obj": make()}}, p)
    msg = str(e.value)
    assert str(p) in msg and "'ckpt/obj'" in msg and type_name in msg
    assert isinstance(e.value, TypeError)
    assert _read(p) == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["objects.h5"]


def test_weights_only_assert_convert_never_unpickles(tmp_path, capsys):
    """pytorch test/test_serialization.py::TestSerialization::test_weights_only_assert: a torch.save
    file whose unpickling would call ``print`` (any callable). torch.load(weights_only=False) runs
    it; th5.convert never does: it refuses the file with FormatError naming it, prints nothing,
    and writes no .h5 file."""
    src = tmp_path / "hello.pt"
    torch.save({"h": _HelloWorld(), "t": torch.ones(2)}, src)
    dst = tmp_path / "hello.h5"
    with pytest.raises(th5.FormatError) as e:
        th5.convert(src, dst)
    assert str(src) in str(e.value)
    assert "Hello World!" not in capsys.readouterr().out
    assert not dst.exists()
    with pytest.raises(th5.FormatError, match="torch.save"):
        th5.load(src)  # a torch.save file is not read as a tensorstore_h5 file either


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*TorchScript archive")
def test_serialization_zipfile_actually_jit(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_serialization_zipfile_actually_jit:
    torch.load(weights_only=True) refuses a TorchScript archive. th5.convert, which loads
    torch.save files with weights_only=True, refuses it with FormatError naming the file, and
    writes nothing."""
    src = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 4)), src)
    dst = tmp_path / "scripted.h5"
    with pytest.raises(th5.FormatError) as e:
        th5.convert(src, dst)
    assert str(src) in str(e.value)
    assert not dst.exists()


# -- torch.save files -> .h5 -------------------------------------------------------------------


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_serialization_new_format_old_format_compat_convert(tmp_path, zipped):
    """pytorch test/test_serialization.py::TestBothSerialization::test_serialization_new_format_old_format_compat:
    the same object saved with the zip format and with ``_use_new_zipfile_serialization=False``
    loads the same. Here each torch.save file is converted with th5.convert and the .h5 file
    loads the same as torch.load of the source: values, dtypes, Parameters and requires_grad,
    tied tensors as one object, gap-free strides, module ``_metadata``, plain values."""
    torch.manual_seed(12)
    a = torch.randn(5, 5)
    lin = torch.nn.Linear(3, 4)
    obj = {"ones": [torch.ones(20, 20) for _ in range(3)], "a": a, "a2": a, "t": a.t(), "rows": a[1:3], "step": a[::2],
           "sd": lin.state_dict(), "p": torch.nn.Parameter(torch.randn(2)), "q": torch.randn(3, requires_grad=True),
           "bf": torch.randn(3).bfloat16(), "c": torch.randn(2, dtype=torch.complex64), "e": torch.empty(0, 3),
           "z": torch.tensor(7), "i": 3, "s": "x", "f": 3.14, "b": False, "n": None}
    src = tmp_path / ("new.pt" if zipped else "old.pt")
    torch.save(obj, src, _use_new_zipfile_serialization=zipped)
    dst = tmp_path / "converted.h5"
    th5.convert(src, dst)
    ref = torch.load(src)
    r = th5.load(dst)
    assert list(r) == list(obj)
    for k, want in ref.items():
        if isinstance(want, torch.Tensor):
            _assert_bitwise(r[k], want)
            assert type(r[k]) is type(want) and r[k].requires_grad == want.requires_grad, k
        elif k == "ones":
            for got, w in zip(r[k], want):
                _assert_bitwise(got, w)
        elif k == "sd":
            assert r[k]._metadata == want._metadata == lin.state_dict()._metadata
            for kk in want:
                _assert_bitwise(r[k][kk], want[kk])
        else:
            assert r[k] == want and type(r[k]) is type(want), k
    assert r["a"] is r["a2"]
    assert r["t"].stride() == (1, 5)
    assert r["step"].is_contiguous() and torch.equal(r["step"], a[::2])


def test_convert_zip_newer_dtypes(tmp_path):
    """pytorch test/test_serialization.py::TestBothSerialization::test_serialization_new_format_old_format_compat
    with the dtypes of ::test_serialization_dtype (float8, complex32, uint16/32/64), which only
    the zip format can hold: th5.convert keeps them bitwise."""
    obj = {"e5m2": torch.arange(0.0, 10.0).to(torch.float8_e5m2), "e4m3": torch.arange(0.0, 10.0).to(torch.float8_e4m3fn),
           "c32": torch.randn(4).to(torch.complex32), "u16": torch.tensor([1, 60000], dtype=torch.uint16),
           "u32": torch.tensor([1, 2**32 - 1], dtype=torch.uint32), "u64": torch.tensor([1, 2**63 + 5], dtype=torch.uint64)}
    src, dst = tmp_path / "newer.pt", tmp_path / "newer.h5"
    torch.save(obj, src)
    th5.convert(src, dst)
    r = th5.load(dst)
    for k, want in obj.items():
        _assert_bitwise(r[k], want)


# -- checksums ---------------------------------------------------------------------------------


def test_crc32_options_checksums(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_crc32_options: torch writes
    (optionally) CRC-32s of its records, which zipfile checks. Ours: XXH3 checksums always,
    checked on request: a flipped byte in a tensor's data makes load(verify=True),
    load(verify=True, mmap=True), TensorHandle.read(verify=True), load_into(verify=True) (the
    target unchanged) and convert h5->h5 raise FormatError naming the file and the key;
    untouched keys load fine."""
    sd = torch.nn.Linear(3, 5).state_dict()
    p = tmp_path / "crc.h5"
    th5.save(sd, p)
    assert torch.equal(th5.load(p, verify=True)["weight"], sd["weight"])
    _flip_byte(p, _offset(p, "weight") + 5)
    for call in (lambda: th5.load(p, verify=True), lambda: th5.load(p, verify=True, mmap=True),
                 lambda: _read_handle(p, "weight"),
                 lambda: th5.convert(p, tmp_path / "copy.h5")):
        with pytest.raises(th5.FormatError) as e:
            call()
        assert str(p) in str(e.value) and "'weight'" in str(e.value)
    target = torch.nn.Linear(3, 5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(th5.FormatError, match="'weight'"):
        th5.load_into(target, p, verify=True)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(th5.load(p, select="bias", verify=True)["bias"], sd["bias"])
    assert not (tmp_path / "copy.h5").exists()


def _read_handle(path, key: str) -> torch.Tensor:
    with th5.open(path) as store:
        return store[key].read(verify=True)


def test_crc32_block_offset_in_message(tmp_path):
    """pytorch test/test_serialization.py::TestSerialization::test_crc32_options, for a tensor of
    more than one 8 MiB checksum block: the error names the damaged block and where it starts
    (block 1 starts at byte 8388608 of the tensor's data)."""
    t = torch.zeros(2**21 + 2**14)  # 8 MiB + 64 KiB: block 0 is 8 MiB, block 1 is 64 KiB
    p = tmp_path / "blocks.h5"
    th5.save({"t": t}, p)
    _flip_byte(p, _offset(p, "t") + 2**23 + 100)
    with pytest.raises(th5.FormatError, match="block 1") as e:
        th5.load(p, verify=True)
    assert "bytes 8388608..8454144" in str(e.value)
