"""What a newcomer trips on in the API (issue #33, items 4, 5, 6 and 8): a round trip through
safetensors that changed the keys, load_into(assign=True) leaving targets on the meta device
without a word, handles that np.asarray read row by row and torch.as_tensor refused, and a
load_into whose keys all sit under a prefix that was not given."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tensorstore_h5 as th5
from tensorstore_h5 import cli
from tensorstore_h5.format.constants import KEY_PATHS, KEYS_MARKER
from tensorstore_h5.reading.store import TensorHandle

from helpers import assert_same, random_tensor


def _nested() -> dict:
    """Dicts in dicts, with '/', '.', '%' and the names '.', '' in keys, and several dtypes."""
    return {
        "model": {
            "layers.0.linear1.bias": random_tensor((3,), torch.float32, 1),
            "layers.0.linear1.weight": random_tensor((3, 4), torch.bfloat16, 2),
            "enc/dec": {"w%2F": random_tensor((2, 2), torch.float16, 3), ".": random_tensor((5,), torch.int64, 4),
                        "": {"x.y": random_tensor((1, 2), torch.uint8, 5)}},
            "100%": random_tensor((0, 3), torch.float32, 6),
        },
        "head": {"w": random_tensor((2,), torch.float64, 7)},
        "ü/key": torch.ones(2),
    }


def _header(path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


# ---------------------------------------------------------------------------- 4. safetensors round trip


def test_a_round_trip_through_safetensors_gives_back_the_keys_and_the_nesting(tmp_path) -> None:
    ckpt = _nested()
    th5.save(ckpt, tmp_path / "ckpt.h5", metadata={"run": "baseline"})
    th5.convert(tmp_path / "ckpt.h5", tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as f:  # the names are the key paths; the marker says so
        assert f.metadata() == {"run": "baseline", KEYS_MARKER: KEY_PATHS}
    th5.convert(tmp_path / "m.safetensors", tmp_path / "back.h5")
    with th5.open(tmp_path / "ckpt.h5") as a, th5.open(tmp_path / "back.h5") as b:
        assert b.keys() == a.keys()  # the same key paths, in the same order
        assert b.metadata == {"run": "baseline"}  # the marker is the file's, not the user's
        assert torch.equal(b["model/layers.0.linear1.bias"][:], ckpt["model"]["layers.0.linear1.bias"])
    assert_same(th5.load(tmp_path / "back.h5"), ckpt)
    # once more: the second safetensors file is the first, byte for byte
    th5.convert(tmp_path / "back.h5", tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()


def test_the_commands_of_the_issue_round_trip_a_selection(tmp_path, capsys) -> None:
    """`convert ckpt.h5 m.safetensors --select 'model/*'`, then `convert m.safetensors back.h5`."""
    ckpt = _nested()
    th5.save(ckpt, tmp_path / "ckpt.h5")
    assert cli.main(["convert", str(tmp_path / "ckpt.h5"), str(tmp_path / "m.safetensors"), "--select", "model/*"]) == 0
    assert cli.main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "back.h5")]) == 0
    with th5.open(tmp_path / "back.h5") as store:
        assert store.keys() == [k for k in th5.open(tmp_path / "ckpt.h5").keys() if k.startswith("model/")]
        assert store["model/layers.0.linear1.bias"].shape == (3,)
        assert store.metadata == {}
    assert_same(th5.load(tmp_path / "back.h5"), {"model": ckpt["model"]})
    # select= on the marked file takes key paths, containers included
    th5.convert(tmp_path / "m.safetensors", tmp_path / "part.h5", select=["model/enc%2Fdec"])
    assert_same(th5.load(tmp_path / "part.h5"), {"model": {"enc/dec": ckpt["model"]["enc/dec"]}})
    th5.convert(tmp_path / "m.safetensors", tmp_path / "glob.h5", select="model/layers.*")
    assert th5.open(tmp_path / "glob.h5").keys() == ["model/layers.0.linear1.bias", "model/layers.0.linear1.weight"]


def test_plain_keys_need_no_marker_and_a_plain_file_keeps_its_keys(tmp_path) -> None:
    th5.save({"a.weight": torch.ones(2), "b": torch.zeros(1)}, tmp_path / "flat.h5", metadata={"run": "x"})
    th5.convert(tmp_path / "flat.h5", tmp_path / "flat.safetensors")
    with safe_open(tmp_path / "flat.safetensors", "pt") as f:
        assert f.metadata() == {"run": "x"}  # every name reads the same either way: no marker
    # A Hugging Face file (no marker): each name is one key, dots and slashes kept, as before.
    hf = {"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2), "lm_head.weight": torch.zeros(3),
          "model.norm.weight": torch.ones(1), "enc/dec%": torch.ones(1)}
    save_file(hf, tmp_path / "hf.safetensors", metadata={"format": "pt"})
    th5.convert(tmp_path / "hf.safetensors", tmp_path / "hf.h5")
    with th5.open(tmp_path / "hf.h5") as store:
        assert sorted(store.keys()) == sorted(["model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                               "model.norm.weight", "enc%2Fdec%25"])
        assert store.metadata == {"format": "pt"}
    assert_same(dict(sorted(th5.load(tmp_path / "hf.h5").items())), dict(sorted(hf.items())))
    # a marker with another value is somebody else's metadata: kept, and the names stay flat
    save_file({"a/b": torch.ones(1)}, tmp_path / "other.safetensors", metadata={KEYS_MARKER: "something else"})
    th5.convert(tmp_path / "other.safetensors", tmp_path / "other.h5")
    with th5.open(tmp_path / "other.h5") as store:
        assert store.keys() == ["a%2Fb"] and store.metadata == {KEYS_MARKER: "something else"}


def test_a_marked_file_whose_names_are_not_key_paths_is_refused(tmp_path) -> None:
    marker = {KEYS_MARKER: KEY_PATHS}
    for name, tensors, match in [("bad", {"a/%zz": torch.ones(1)}, r"key 'a/%zz' is not a tensorstore_h5 key path"),
                                 ("empty", {"a//b": torch.ones(1)}, "not a tensorstore_h5 key path"),
                                 ("clash", {"a": torch.ones(1), "a/b": torch.ones(1)}, "'a' is a tensor and also holds")]:
        save_file(tensors, tmp_path / f"{name}.safetensors", metadata=marker)
        with pytest.raises(th5.FormatError, match=match):
            th5.convert(tmp_path / f"{name}.safetensors", tmp_path / f"{name}.h5")
        assert not (tmp_path / f"{name}.h5").exists()


def test_a_given_marker_in_the_metadata_does_not_travel(tmp_path) -> None:
    """metadata= that carries the marker (copied from another file) says nothing of this file's names."""
    th5.save({"a": torch.ones(1)}, tmp_path / "a.h5")
    th5.convert(tmp_path / "a.h5", tmp_path / "a.safetensors", metadata={KEYS_MARKER: KEY_PATHS, "n": 1})
    assert _header(tmp_path / "a.safetensors")["__metadata__"] == {"n": "1"}


# ---------------------------------------------------------------------------- 5. targets left on meta


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("position_ids", torch.arange(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_load_into_warns_of_targets_still_on_meta_and_lists_them(tmp_path) -> None:
    src = _Block()
    th5.save({k: v for k, v in src.state_dict().items() if k != "position_ids"}, tmp_path / "m.h5")
    with torch.device("meta"):
        model = _Block()
    with pytest.warns(th5.TensorStoreWarning, match=r"2 target tensor\(s\) are still on the meta device.*"
                                                    r"'position_ids', 'scratch'") as caught:
        result = th5.load_into(model, tmp_path / "m.h5", assign=True, strict=False)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller's line
    assert result.meta_keys == ["position_ids", "scratch"]
    missing, unexpected = result  # still the pair it was
    assert (missing, unexpected) == (["position_ids"], []) and result == th5.LoadResult(["position_ids"], [])
    assert "meta_keys=['position_ids', 'scratch']" in repr(result)
    assert not model.lin.weight.is_meta and torch.equal(model.lin.weight, src.lin.weight)


def test_many_meta_targets_are_named_a_few_then_counted(tmp_path) -> None:
    th5.save({"other": torch.ones(1)}, tmp_path / "o.h5")
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    with pytest.warns(th5.TensorStoreWarning, match=r"8 target tensor.*'0.weight', '0.bias', '1.weight', "
                                                    r"'1.bias', '2.weight' and 3 more"):
        result = th5.load_into(model, tmp_path / "o.h5", assign=True, strict=False)
    assert len(result.meta_keys) == 8 and result.unexpected_keys == ["other"]
    # a nested dict of tensors, not assigned: a meta target the file lacks stays meta, and says so
    th5.save({"a": torch.ones(2)}, tmp_path / "d.h5")
    target = {"a": torch.zeros(2), "sub": {"b": torch.empty(3, device="meta")}}
    with pytest.warns(th5.TensorStoreWarning, match="'sub/b'"):
        result = th5.load_into(target, tmp_path / "d.h5", strict=False)
    assert result.meta_keys == ["sub/b"] and torch.equal(target["a"], torch.ones(2))


def test_a_load_that_leaves_nothing_on_meta_says_nothing(tmp_path) -> None:
    src = _Block()
    th5.save(src.state_dict(), tmp_path / "m.h5")
    model = _Block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = th5.load_into(model, tmp_path / "m.h5")
    assert result.meta_keys == [] and result == th5.LoadResult([], []) and repr(result) == \
        "LoadResult(missing_keys=[], unexpected_keys=[])"


# ---------------------------------------------------------------------------- 6. handles convert


def test_np_asarray_of_a_handle_reads_once(tmp_path, monkeypatch) -> None:
    t = torch.randn(300, 40)
    th5.save({"m": t, "t": t[:5, :7].t(), "s": torch.tensor(2.5), "e": torch.empty(0, 3)}, tmp_path / "a.h5")
    reads = []
    real = TensorHandle.read
    monkeypatch.setattr(TensorHandle, "read", lambda self, *a, **k: reads.append(self.key) or real(self, *a, **k))
    with th5.open(tmp_path / "a.h5") as store:
        h = store["m"]
        a = np.asarray(h)
        assert reads == ["m"]  # one read, not one per row
        assert a.dtype == np.float32 and np.array_equal(a, h[:].numpy())
        assert np.array_equal(np.array(store["t"]), t[:5, :7].t().numpy())
        assert np.asarray(store["s"]).shape == () and float(np.asarray(store["s"])) == 2.5
        assert np.asarray(store["e"]).shape == (0, 3)
        assert np.asarray(h, dtype=np.float64).dtype == np.float64
        assert np.array_equal(np.asarray(h, copy=False), a)  # read into new memory, which is no copy: accepted
        reads.clear()
        x = torch.as_tensor(h)
        assert reads == ["m"] and torch.equal(x, t)


def test_torch_takes_a_handle_through_dlpack(tmp_path) -> None:
    base = torch.randn(6, 4)
    th5.save({"m": base, "t": base.t(), "b": base.to(torch.bfloat16), "i": torch.arange(5)}, tmp_path / "a.h5")
    with th5.open(tmp_path / "a.h5") as store:
        for convert in (torch.as_tensor, torch.tensor, torch.asarray, torch.from_dlpack):
            assert torch.equal(convert(store["m"]), base), convert
            assert torch.equal(convert(store["b"]), base.to(torch.bfloat16)), convert
        t = torch.as_tensor(store["t"])
        assert torch.equal(t, base.t()) and t.stride() == base.t().stride()  # the saved layout
        assert torch.as_tensor(store["i"], dtype=torch.float32).dtype == torch.float32
        assert np.array_equal(np.from_dlpack(store["i"]), np.arange(5))
        assert store["m"].__dlpack_device__() == (1, 0)


def test_numpy_refuses_bfloat16_naming_the_key_and_the_way_out(tmp_path) -> None:
    th5.save({"w": torch.ones(3, dtype=torch.bfloat16), "f8": torch.ones(2).to(torch.float8_e4m3fn)}, tmp_path / "b.h5")
    with th5.open(tmp_path / "b.h5") as store:
        with pytest.raises(TypeError, match=r"b\.h5: key 'w' has dtype bfloat16, which numpy has no dtype for.*"
                                            r"h\[:\]\.float\(\)\.numpy\(\)"):
            np.asarray(store["w"])
        with pytest.raises(TypeError, match="key 'f8' has dtype float8_e4m3fn"):
            np.asarray(store["f8"])
        a = np.asarray(store["w"], dtype=np.float32)  # a dtype numpy has: converted as torch would
        assert a.dtype == np.float32 and a.tolist() == [1.0, 1.0, 1.0]


def test_a_sharded_handle_converts_too(tmp_path) -> None:
    base = torch.randn(5, 3)
    (tmp_path / "hf").mkdir()
    save_file({"w": base, "b": base.to(torch.bfloat16)}, tmp_path / "hf" / "model.safetensors")
    with th5.open(tmp_path / "hf") as store:
        assert type(store["w"]).__name__ == "ShardedTensorHandle"
        assert np.array_equal(np.asarray(store["w"]), base.numpy())
        assert torch.equal(torch.as_tensor(store["w"]), base)
        with pytest.raises(TypeError, match="key 'b' has dtype bfloat16"):
            np.asarray(store["b"])


# ---------------------------------------------------------------------------- 8. the prefix that was meant


def test_load_into_suggests_the_prefix_the_keys_sit_under(tmp_path) -> None:
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    th5.save({"model": src.state_dict(), "epoch": 3}, tmp_path / "ckpt.h5")
    with pytest.raises(th5.MismatchError, match=r"did you mean prefix='model/'\? \(the file's keys match 4 of the "
                                                r"target's 4 keys with it, 0 with prefix=''\)"):
        th5.load_into(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), tmp_path / "ckpt.h5")
    with torch.device("meta"):  # through load_state_dict (assign=True): the same hint
        meta_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises(th5.MismatchError, match=r"(?s)load_state_dict refused.*did you mean prefix='model/'\?"):
        th5.load_into(meta_model, tmp_path / "ckpt.h5", assign=True)
    target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert th5.load_into(target, tmp_path / "ckpt.h5", prefix="model/", select="model/*") == th5.LoadResult([], [])
    # Hugging Face's dotted prefix ("model." of a ...ForCausalLM file into its base model)
    th5.save({f"model.{k}": v for k, v in src.state_dict().items()}, tmp_path / "hf.h5")
    with pytest.raises(th5.MismatchError, match=r"did you mean prefix='model\.'\?"):
        th5.load_into(target, tmp_path / "hf.h5")
    # a prefix given where the file has none
    th5.save(src.state_dict(), tmp_path / "plain.h5")
    with pytest.raises(th5.MismatchError, match=r"did you mean prefix=''\?"):
        th5.load_into(target, tmp_path / "plain.h5", prefix="model/")


def test_no_prefix_hint_when_no_prefix_would_help(tmp_path) -> None:
    th5.save({"model": {"other.weight": torch.ones(2)}}, tmp_path / "o.h5")
    with pytest.raises(th5.MismatchError) as e:
        th5.load_into(torch.nn.Linear(2, 2), tmp_path / "o.h5")
    assert "did you mean" not in str(e.value)


def test_saving_a_module_suggests_its_state_dict(tmp_path) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(th5.UnsupportedTypeError, match=r"did you mean th5\.save\(model\.state_dict\(\), path\)"):
        th5.save(model, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_a_directory_holding_a_converted_safetensors_file_keeps_the_nesting(tmp_path) -> None:
    """A lone model.safetensors that convert wrote from a nested file opens as a directory
    with the same key paths and loads into the same nesting (the marker is not metadata)."""
    g = torch.Generator().manual_seed(4)
    obj = {"model": {"layers.0.w": torch.randn(3, 2, generator=g), "sub": {"b": torch.zeros(2)}},
           "head": torch.ones(4)}
    th5.save(obj, tmp_path / "n.h5")
    d = tmp_path / "hf"
    d.mkdir()
    th5.convert(tmp_path / "n.h5", d / "model.safetensors")
    with th5.open(tmp_path / "n.h5") as a, th5.open(d) as b:
        assert b.keys() == a.keys()
        assert KEYS_MARKER not in b.metadata
    got = th5.load(d)
    assert set(got) == {"model", "head"} and torch.equal(got["model"]["sub"]["b"], obj["model"]["sub"]["b"])
    assert torch.equal(got["model"]["layers.0.w"], obj["model"]["layers.0.w"])
