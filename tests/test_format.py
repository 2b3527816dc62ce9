from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format import layout as fmt

from data.make_v1 import golden
from data.make_v2 import compression as compression2
from data.make_v2 import golden as golden2
from helpers import assert_same, bits

GOLDEN = Path(__file__).parent / "data" / "v1.h5"
GOLDEN2 = Path(__file__).parent / "data" / "v2.h5"


def _structure(path: Path) -> dict:
    """Every object name with its attributes and HDF5 type, plus the root attributes."""
    out = {}
    with h5py.File(path) as f:
        def visit(name, obj):
            attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in obj.attrs.items()}
            shape = obj.shape if isinstance(obj, h5py.Dataset) and name != "%layout" else None  # the layout's
            out[name] = (type(obj).__name__, attrs, str(obj.dtype) if isinstance(obj, h5py.Dataset) else None, shape)
            # length follows the digits of the byte offsets in it, which depend on where HDF5 put the data
        f.visititems(visit)
        out["/"] = {k: f.attrs[k] for k in f.attrs}
    return out


def test_golden_v1_file_loads() -> None:
    with th5.open(GOLDEN) as s:
        assert s.format_version == 1 and s.metadata == {"note": "golden v1"}
    out = th5.load(GOLDEN)
    assert_same(out, golden())
    assert out["model"]["embed.weight"] is out["model"]["head.weight"]


def test_golden_v2_file_loads() -> None:
    with th5.open(GOLDEN2) as s:
        assert s.format_version == 2 and s.metadata == {"note": "golden v2"}
    out = th5.load(GOLDEN2, verify=True)
    ref = golden2()
    assert_same(out, ref)
    assert out["model"]["embed.weight"] is out["model"]["head.weight"]
    assert out["model"]._metadata == ref["model"]._metadata
    assert out["grad"].requires_grad and isinstance(out["param"], torch.nn.Parameter) and not out["param"].requires_grad
    assert out["model"]["pos"].stride() == (0, 1) and out["model"]["enc.0.weight"].stride() == (1, 12)


def _layout_text(path: Path) -> list[dict]:
    with h5py.File(path) as f:
        head, *lines = bytes(f["%layout"][()]).decode().split("\n")
    return [json.loads(head), *[json.loads(line) for line in lines]]


def test_fresh_save_matches_golden_v2(tmp_path) -> None:
    """Same names, attributes and HDF5 types; the same layout but for where HDF5 put the bytes."""
    th5.save(golden2(), tmp_path / "new.h5", metadata={"note": "golden v2"}, compression=compression2, chunk_bytes=8192)
    assert _structure(tmp_path / "new.h5") == _structure(GOLDEN2)

    def placeless(entries: list[dict]) -> list[dict]:
        out = []
        for e in entries:
            e = dict(e)
            e.pop("at", None)
            if "chunks" in e:
                e["chunks"] = {k: v for k, v in e["chunks"].items() if k != "at"} | {"n": len(e["chunks"]["at"])}
            out.append(e)
        return out

    assert placeless(_layout_text(tmp_path / "new.h5")) == placeless(_layout_text(GOLDEN2))


def test_fresh_file_is_aligned_checksummed_hdf5_with_its_header(tmp_path) -> None:
    th5.save(golden2(), tmp_path / "new.h5", compression=compression2, chunk_bytes=8192)
    raw = (tmp_path / "new.h5").read_bytes()
    assert raw[:8] == fmt.MAGIC and raw[4096:4104] == fmt.HDF5_SIGNATURE
    assert raw[4104] >= 2  # superblock version 2 or later: metadata with checksums
    header = fmt.parse_header(raw[:64], "new.h5", len(raw))
    assert header.version == 2 and header.file_length == len(raw)
    for e in _layout_text(tmp_path / "new.h5")[1:]:
        if "at" in e:
            assert e["at"] % 64 == 0
    with h5py.File(tmp_path / "new.h5") as f:
        assert f.attrs["tensorstore_h5.version"] == 2 and f.attrs["tensorstore_h5.format"] == b"tensorstore_h5"
        assert f.id.get_create_plist().get_file_space_strategy()[0] == h5py.h5f.FSPACE_STRATEGY_AGGR  # no free-space manager
        assert f["model/enc.0.bias"].shape == (3,)  # a 6-byte tensor is a dataset at its key path
        assert f["model/head.weight"].id == f["model/embed.weight"].id  # hard link, one copy


def test_golden_file_is_readable_with_plain_h5py() -> None:
    """What docs/FORMAT.md promises to a reader without tensorstore_h5."""
    with h5py.File(GOLDEN) as f:
        assert f.attrs["tensorstore_h5.format"] == "tensorstore_h5" and f.attrs["tensorstore_h5.version"] == 1
        layout = json.loads(f.attrs["tensorstore_h5.layout"])
        entries = {e["path"]: e for e in layout["entries"]}
        assert entries["model/head.weight"]["same_as"] == "model/embed.weight"
        assert entries["optim/state/0"]["key"] == 0
        enc = f["model/enc.0.weight"]
        assert list(enc.attrs["stride"]) == [1, 12] and enc.attrs["torch_dtype"] == "float32"
        np.testing.assert_array_equal(enc[()], golden()["model"]["enc.0.weight"].numpy())
        assert f["%packed/bfloat16"].dtype == np.float32  # bfloat16 as an HDF5 float type: real numbers
        bias = entries["model/enc.0.bias"]
        assert bias["dataset"] == "%packed/bfloat16" and f["%packed/bfloat16"].attrs["torch_dtype"] == "bfloat16"
        np.testing.assert_array_equal(f["%packed/bfloat16"][bias["offset"]:bias["offset"] + 3], np.zeros(3, np.float32))
        assert "keys/a%2Fb" in entries and "keys/%" in entries and "keys/%2E%2E" in entries


@pytest.mark.parametrize("mutate, match", [
    (lambda f: f.attrs.__setitem__(fmt.ATTR_VERSION, 2), "format-2 file without its header"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_VERSION, 3), "format-3 file without its header"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_VERSION, 4), "version 4, which this library does not read"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_VERSION, "one"), "damaged root attribute"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_FORMAT, "other"), "expected 'tensorstore_h5'"),
    (lambda f: f.attrs.__delitem__(fmt.ATTR_FORMAT), "expected 'tensorstore_h5'"),
    (lambda f: f.attrs.__delitem__(fmt.ATTR_LAYOUT), "incomplete file"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_LAYOUT, "{not json"), "not valid JSON"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_LAYOUT, '{"entries": []}'), "no entries"),
    (lambda f: f.attrs.__setitem__(fmt.ATTR_METADATA, "[1]"), "metadata"),
])
def test_damaged_root_attributes_raise_format_error(tmp_path, mutate, match) -> None:
    path = tmp_path / "d.h5"
    shutil.copy(GOLDEN, path)
    with h5py.File(path, "r+") as f:
        mutate(f)
    with pytest.raises(th5.FormatError, match=f"d.h5.*{match}"):
        th5.load(path)


def _edit_entry(file: Path, key: str, changes: dict) -> None:
    with h5py.File(file, "r+") as f:
        layout = json.loads(f.attrs[fmt.ATTR_LAYOUT])
        for e in layout["entries"]:
            if e["path"] == key:
                e.update(changes)
        f.attrs[fmt.ATTR_LAYOUT] = json.dumps(layout)


@pytest.mark.parametrize("key, changes, match", [
    ("model/head.weight", {"dtype": "float128"}, "unknown torch dtype"),
    ("model/head.weight", {"shape": [-1]}, "invalid shape"),
    ("optim/state/0/exp_avg", {"shape": [6, 5]}, "'optim/state/0/exp_avg'.*does not match"),
    ("optim/state/0/exp_avg", {"dtype": "int32"}, "'optim/state/0/exp_avg'.*type does not match"),
    ("model/mask", {"dtype": "float32"}, "'model/mask'.*invalid packed"),
    ("model/mask", {"offset": 10**6}, "'model/mask'.*packed range"),
    ("model/head.weight", {"stride": [1]}, "stride and shape"),
    ("model/head.weight", {"type": "pickle"}, "unknown entry type"),
    ("model/head.weight", {"same_as": "model/mask"}, "same_as"),
    ("model/head.weight", {"extra": 1}, "unexpected fields"),
    ("model/head.weight", {"path": "nowhere/x"}, "parent"),
    ("optim/state/0", {"key": "0"}, "does not match name"),
    ("values/1", {"value": {"pickle": "x"}}, "unrecognised value"),
])
def test_damaged_entries_name_file_and_key(tmp_path, key, changes, match) -> None:
    path = tmp_path / "d.h5"
    shutil.copy(GOLDEN, path)
    _edit_entry(path, key, changes)
    with pytest.raises(th5.FormatError, match=f"d.h5.*{match}"):
        th5.load(path)


_T = {"type": "tensor", "dtype": "float32", "shape": [1]}


@pytest.mark.parametrize("entries, match", [
    ([{"path": "", "type": "dict"}, {"path": "a", **_T}, {"path": "a", **_T}], "entry 2 \\(key 'a'\\): duplicate path"),
    ([{"path": "a", **_T}], "entry 0 .*root entry must come first"),
    ([{"path": "", "type": "dict"}, {"path": "", "type": "dict"}], "entry 1 .*root entry must come first"),
    ([{"path": "", "type": "dict"}, ["a"]], "entry 1 .*path is not a string"),
    ([{"path": "", "type": "dict"}, {"path": 3, **_T}], "entry 1 .*path is not a string"),
    ([{"path": "", "type": "dict"}, {"path": "a", **_T}, {"path": "a/b", **_T}], "entry 2 .*parent 'a' is not an earlier container"),
    ([{"path": "", "type": "dict"}, {"path": "a", "type": "pickle"}], "entry 1 .*unknown entry type 'pickle'"),
])
def test_damaged_layout_structure_names_the_entry(entries, match) -> None:
    with pytest.raises(th5.FormatError, match=f"f.h5: damaged layout {match}"):
        fmt.parse_layout(json.dumps({"entries": entries}), "f.h5")


def test_layout_structure_indexes_containers_and_leaves() -> None:
    entries = [{"path": "", "type": "dict"}, {"path": "m", "type": "list"}, {"path": "m/0", **_T}, {"path": "b", **_T}]
    layout = fmt.parse_layout(json.dumps({"entries": entries}), "f.h5")
    assert layout.leaf_paths == ["m/0", "b"] and layout.container_paths == ["m"]


def test_missing_dataset_names_the_key(tmp_path) -> None:
    path = tmp_path / "d.h5"
    shutil.copy(GOLDEN, path)
    with h5py.File(path, "r+") as f:
        del f["optim/state/0/exp_avg"]
    with th5.open(path) as s:
        assert torch.equal(s["model/embed.weight"].read(), golden()["model"]["embed.weight"])
        with pytest.raises(th5.FormatError, match="d.h5.*'optim/state/0/exp_avg'"):
            s["optim/state/0/exp_avg"].read()


def test_not_hdf5_and_truncated_files(tmp_path) -> None:
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"definitely not hdf5" * 10)
    with pytest.raises(th5.FormatError, match="junk.h5: not a readable HDF5 or tensorstore_h5 file"):
        th5.open(junk)
    junk.write_bytes(b"PK\x03\x04 a zip" * 10)
    with pytest.raises(th5.FormatError, match="junk.h5: .*torch.save \\(zip\\) file.*tensorstore-h5 convert"):
        th5.open(junk)
    data = GOLDEN.read_bytes()
    for cut in (len(data) // 2, 600, 100):
        trunc = tmp_path / f"trunc{cut}.h5"
        trunc.write_bytes(data[:cut])
        with pytest.raises(th5.TensorStoreError, match=f"trunc{cut}.h5"):
            th5.load(trunc)
    with pytest.raises(FileNotFoundError):
        th5.open(tmp_path / "absent.h5")


def test_big_data_truncated_reports_key(tmp_path) -> None:
    path = tmp_path / "big.h5"
    th5.save({"small": torch.ones(2), "w": torch.randn(256, 1024)}, path)
    data = path.read_bytes()
    with h5py.File(path) as f:
        offset = f["w"].id.get_offset()
    path.write_bytes(data[: offset + 1000] + b"\0" * 0)
    with pytest.raises(th5.TensorStoreError, match="big.h5"):
        with th5.open(path) as s:
            s["w"].read()


def test_loading_never_unpickles(tmp_path, monkeypatch) -> None:
    import pickle

    def boom(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(pickle, "dumps", boom)
    th5.save(golden(), tmp_path / "g.h5")
    assert_same(th5.load(tmp_path / "g.h5"), golden())


def _doc_example() -> dict:
    """The h5py-only reader printed in docs/FORMAT.md, executed as written."""
    text = (Path(__file__).parents[1] / "docs" / "FORMAT.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "FORMAT.md", "exec"), namespace)
    return namespace


def test_format_doc_reader_reads_the_golden_file() -> None:
    plain = _doc_example()["read_plain"](GOLDEN)
    ref = golden()
    for key, t in [("model/embed.weight", ref["model"]["embed.weight"]), ("model/enc.0.bias", ref["model"]["enc.0.bias"]),
                   ("model/fp8", ref["model"]["fp8"]), ("model/mask", ref["model"]["mask"]),
                   ("optim/state/0/step", ref["optim"]["state"][0]["step"])]:
        assert plain[key].dtype == t.dtype and torch.equal(bits(plain[key]), bits(t)), key
    assert plain["model/enc.0.weight"].stride() == (1, 12)
    assert torch.equal(plain["model/enc.0.gate"], ref["model"]["enc.0.gate"]) and plain["model/enc.0.gate"].stride() == (1, 4)
    assert plain["values/6"] == "text" and plain["values/2"] == 2**70


def test_decode_lines_takes_only_lines_that_are_one_json_text_each() -> None:
    """Lines decoded together must decode as each alone would: a line holding two values, or
    two lines holding halves of one, are left out (json.loads refuses them one by one)."""
    lines = [b'{"a":1}', b"1,2", b'{"x":[3', b"4]}", b"\xff{}", b' {"b":2}', b'{"c":[1,{"d":null}]}', b""]
    assert fmt.decode_lines(lines, range(len(lines))) == [(0, {"a": 1}), (6, {"c": [1, {"d": None}]})]
    assert fmt.decode_lines(lines, [6, 0]) == [(6, {"c": [1, {"d": None}]}), (0, {"a": 1})]


def _v2_layout(tmp_path: Path, n: int, edit=None) -> tuple[fmt.Layout, list[str]]:
    """The parsed layout of a file of ``n`` tensors ``t00``..., its entry lines changed by
    ``edit(lines, index)`` (``index``: key -> line number) first."""
    path = tmp_path / "many.h5"
    th5.save({f"t{i:02d}": torch.full((4,), float(i)) for i in range(n)}, path)
    with h5py.File(path) as f:
        head, *lines = bytes(f["%layout"][()]).split(b"\n")
    index = {p: i for i, p in enumerate(json.loads(head)["paths"])}
    if edit is not None:
        edit(lines, index)
    return fmt.parse_layout_v2(b"\n".join([head, *lines]), "many.h5", path.stat().st_size), sorted(index)[1:]


@pytest.mark.parametrize("hashes", [
    ["%016X" % 0xABCDEF], ["0x" + "0" * 14], [" " + "0" * 15], ["0" * 15 + "\n"], ["0_" + "0" * 14],
    ["\u0663" * 16], ["+" + "0" * 15], ["0" * 15, "0" * 17], [0, 0], [None, "0" * 16], [["0" * 16], "0" * 16], ["0" * 32],
])
def test_block_hashes_are_16_lower_case_hex_digits_each(tmp_path, hashes) -> None:
    """The entry parser checks all of an entry's hashes at once (a joined string): each must
    still be exactly 16 of ``0-9a-f``, not whatever ``int(h, 16)`` takes (upper case, ``0x``,
    blanks, ``_``, signs, other scripts' digits), and two hashes of 15 and 17 digits are not two
    of 16. A two-block tensor (8 MiB blocks) has room for two."""
    path = tmp_path / "two.h5"
    th5.save({"big": torch.zeros(2**21 + 1), "small": torch.ones(3)}, path)
    with h5py.File(path) as f:
        head, *lines = bytes(f["%layout"][()]).split(b"\n")
    index = {p: i for i, p in enumerate(json.loads(head)["paths"])}
    entry = json.loads(lines[index["big"]])
    assert len(entry["xxh3"]) == 2
    good = fmt.parse_layout_v2(b"\n".join([head, *lines]), "two.h5", path.stat().st_size)
    assert good.entry("big").extent.hashes == tuple(int(h, 16) for h in entry["xxh3"])
    lines[index["big"]] = json.dumps(dict(entry, xxh3=hashes)).encode()
    layout = fmt.parse_layout_v2(b"\n".join([head, *lines]), "two.h5", path.stat().st_size)
    with pytest.raises(th5.FormatError, match=r"two.h5: damaged layout entry .*key 'big'.*invalid hash"):
        layout.entry("big")
    assert layout.entry("small").shape == (3,)


@pytest.mark.parametrize("name", ["w", "layers.0.w", "%", "%25", "a%2Fb", "%2E", "%2E%2E", ".", "..", "", "a\x00b",
                                  "é", "\ud800", "a%zz", "%2e", "x y", "%C3%A9"])
def test_a_keys_name_is_unescaped_as_tree_unescape_does(name) -> None:
    """parse_key takes a plain ASCII name as it is without calling tree.unescape: the answer,
    or the refusal, is still unescape's."""
    try:
        expected = th5.unescape(name)
    except ValueError:
        with pytest.raises(ValueError):
            fmt.parse_key({}, "m/" + name, {"m": "dict"})
    else:
        assert fmt.parse_key({}, "m/" + name, {"m": "dict"}) == expected


def test_entries_split_across_lines_are_refused_by_the_bulk_parse(tmp_path) -> None:
    def split(lines, index):  # t05's line gets t06's first field; t06's line keeps the rest
        i, j = index["t05"], index["t06"]
        first, rest = lines[j].split(b",", 1)
        lines[i], lines[j] = lines[i] + b"," + first, rest

    layout, keys = _v2_layout(tmp_path, 40, split)
    with pytest.raises(th5.FormatError, match="many.h5: damaged layout entry .*key 't05'"):
        layout.select(None)
    layout, _ = _v2_layout(tmp_path, 40, split)
    with pytest.raises(th5.FormatError, match="key 't06'"):
        layout.select({"t06"} | {f"t{i:02d}" for i in range(20, 40)})


def test_entries_asked_for_in_order_are_parsed_ahead_and_a_damaged_one_only_when_asked(tmp_path) -> None:
    def damage(lines, index):
        lines[index["t20"]] = b'{"dtype":"float32","shape":"four"}'

    layout, keys = _v2_layout(tmp_path, 40, damage)
    assert layout.entry("t00").shape == (4,) and layout.entry("t01").shape == (4,)
    assert layout._parsed[layout._index["t10"]] is not None  # in order: the next lines were parsed at once
    for k in keys:
        if k == "t20":
            with pytest.raises(th5.FormatError, match="many.h5: damaged layout entry .*key 't20'.*shape"):
                layout.entry(k)
        else:
            assert layout.entry(k).shape == (4,) and layout.entry(k).path == k
    random_order, _ = _v2_layout(tmp_path, 40)
    random_order.entry("t30")
    random_order.entry("t03")
    assert [e is not None for e in random_order._parsed].count(True) == 2  # out of order: one at a time
