from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorstore_h5 import UnsupportedTypeError
from tensorstore_h5.format import tree
from tensorstore_h5.format.tree import Container, Leaf, decode_value, encode_value, escape, flatten, inflate, unescape

from helpers import assert_same


@given(st.text())
def test_escape_round_trips_every_str(key: str) -> None:
    name = escape(key)
    assert name and "/" not in name and "\x00" not in name and name not in (".", "..")
    name.encode("utf-8")  # a valid UTF-8 HDF5 link name
    assert unescape(name) == key


@pytest.mark.parametrize("key", ["", ".", "..", "...", "a/b", "%", "%2F", "x\x00y", "\udc80", "é", "a" * 300, "a.b.c"])
def test_escape_edge_cases(key: str) -> None:
    assert unescape(escape(key)) == key


def test_escape_keeps_dots_and_plain_names() -> None:
    assert escape("encoder.layers.0.weight") == "encoder.layers.0.weight"
    assert escape("a/b") == "a%2Fb" and escape("%") == "%25" and escape("") == "%" and escape("..") == "%2E%2E"


@pytest.mark.parametrize("name", ["a%zz", "a/b", "", ".", "..", "%2e", "%2F%", "%41"])
def test_unescape_rejects_non_canonical_names(name: str) -> None:
    with pytest.raises(ValueError):
        unescape(name)


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text() | st.binary()
    | st.complex_numbers(allow_nan=True),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4),
    max_leaves=12,
)


@given(VALUES)
def test_flatten_inflate_round_trip(value: object) -> None:
    nodes = flatten(value)
    assert_same(inflate(nodes), value)


def test_flatten_preorder_and_keys() -> None:
    nodes = flatten(OrderedDict([("b", 1), ("a", [2, {3: "x"}])]))
    assert [n.path for n in nodes] == ["", "b", "a", "a/0", "a/1", "a/1/3"]
    assert isinstance(nodes[0], Container) and nodes[0].type == "OrderedDict"
    assert nodes[-1] == Leaf("a/1/3", 3, "x")


@pytest.mark.parametrize("value", [object(), {1, 2}, bytearray(b"x"), {(1, 2): 3}, type("D", (dict,), {})()])
def test_unsupported_values_name_the_key_path(value: object) -> None:
    with pytest.raises(UnsupportedTypeError, match="'outer/inner'"):
        flatten({"outer": {"inner": value}})


def test_key_name_collision_is_refused() -> None:
    with pytest.raises(UnsupportedTypeError, match="both map"):
        flatten({1: "a", "1": "b"})


def test_cycle_is_refused() -> None:
    d: dict = {}
    d["self"] = d
    with pytest.raises(UnsupportedTypeError, match="contains itself"):
        flatten(d)


@pytest.mark.parametrize("value", [None, True, 0, -2**200, 1.5, -0.0, float("inf"), float("-inf"), 1e-310, "é",
                                   b"\x00\xff", 1 - 2j, torch.bfloat16, torch.Size([2, 0])])
def test_value_encoding_round_trip(value: object) -> None:
    assert_same(decode_value(encode_value(value, "k")), value)


@pytest.mark.parametrize("data", [{"float": "1"}, {"x": 1}, {"torch.dtype": "Tensor"}, {"complex": [1]}, [1]])
def test_decode_rejects_unknown_encodings(data: object) -> None:
    with pytest.raises(ValueError):
        decode_value(data)


@pytest.mark.parametrize("name", ["f4,,2", "1" * 5000, "(2,)f4", "i4,f8", "O", "V8", "S4", "<U4", "M8[ns]", "b16", "c32",
                                  "f4 ", "[('a', 'f4')]", "float32"])
def test_numpy_names_outside_dtype_str_are_refused_without_numpy_parsing_them(name: str) -> None:
    """A hostile layout's numpy dtype never reaches numpy's full parser ("f4,,2" raised
    SyntaxError from ast.literal_eval inside it, found by the fuzzer)."""
    assert tree.numpy_dtype(name) is None
    with pytest.raises(ValueError):
        tree.decode_value({"numpy": name, "value": 1})


@pytest.mark.parametrize("value", [np.float32(1.5), np.int8(-3), np.uint64(2**63), np.bool_(True), np.complex128(1 - 2j),
                                   np.float16(0.25), np.int64(7)])
def test_numpy_scalars_still_round_trip(value: object) -> None:
    back = tree.decode_value(tree.encode_value(value, "k"))
    assert type(back) is type(value) and back == value
    assert tree.numpy_dtype(value.dtype.str) == value.dtype


def test_a_numpy_value_out_of_its_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not fit int8"):
        tree.decode_value({"numpy": "<i1", "value": 1000})


def test_a_stored_torch_dtype_name_is_looked_up_not_fetched_from_torch(monkeypatch) -> None:
    """Only torch's own dtype names decode: another attribute of the torch module (whose lazy
    attributes import submodules) is refused without being touched."""
    assert tree.decode_value({"torch.dtype": "bfloat16"}) is torch.bfloat16
    touched = []
    monkeypatch.setattr(torch, "__getattr__", lambda name: touched.append(name), raising=False)
    for name in ("_dynamo", "onnx", "no_such_thing", "Tensor"):
        with pytest.raises(ValueError):
            tree.decode_value({"torch.dtype": name})
    assert touched == []
