from __future__ import annotations

import pytest
import torch

import tensorstore_h5 as th5

from helpers import assert_same


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.enc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def _ptrs(m: torch.nn.Module) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in m.state_dict().items()}


def test_load_into_module_in_place(tmp_path) -> None:
    torch.manual_seed(0)
    src, dst = Net(), Net()
    th5.save({"model": src.state_dict(), "epoch": 1}, tmp_path / "c.h5")
    before = _ptrs(dst)
    result = th5.load_into(dst, tmp_path / "c.h5", prefix="model/")
    assert result == th5.LoadResult([], []) and _ptrs(dst) == before
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k
    assert dst.head.weight is dst.embed.weight


def test_load_into_reports_missing_and_unexpected(tmp_path) -> None:
    src = Net()
    sd = src.state_dict()
    sd["extra"] = torch.ones(1)
    del sd["enc.bias"]
    th5.save(sd, tmp_path / "c.h5")
    dst = Net()
    with pytest.raises(th5.MismatchError, match=r"c.h5: .*nothing was changed: missing keys: 'enc.bias'; unexpected keys: 'extra'"):
        th5.load_into(dst, tmp_path / "c.h5")
    result = th5.load_into(dst, tmp_path / "c.h5", strict=False)
    assert result.missing_keys == ["enc.bias"] and result.unexpected_keys == ["extra"]
    assert torch.equal(dst.enc.weight, src.enc.weight)


def test_load_into_mismatch_changes_nothing(tmp_path) -> None:
    th5.save({"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(4)}, tmp_path / "c.h5")
    target = {"a": torch.zeros(3), "b": torch.zeros(2, 3), "c": torch.zeros(4, dtype=torch.float64)}
    with pytest.raises(th5.MismatchError, match=r"c.h5.*shapes differ: 'b' \(stored \[2, 2\], target \[2, 3\]\)$"):
        th5.load_into(target, tmp_path / "c.h5")
    assert all(t.eq(0).all() for t in target.values())
    del target["b"]
    with pytest.raises(th5.MismatchError, match=r"dtypes differ \(strict_dtype\): 'c' \(stored float32, target float64\)"):
        th5.load_into(target, tmp_path / "c.h5", strict=False, strict_dtype=True)
    assert all(t.eq(0).all() for t in target.values())


def test_load_into_nested_dict_and_select(tmp_path) -> None:
    obj = {"model": {"w": torch.randn(3, 3), "sub": {"b": torch.randn(3)}}, "opt": {"m": torch.randn(3)}}
    th5.save(obj, tmp_path / "c.h5")
    target = {"w": torch.empty(3, 3), "sub": {"b": torch.empty(3)}}
    th5.load_into(target, tmp_path / "c.h5", prefix="model/", select="model/*")
    assert torch.equal(target["w"], obj["model"]["w"]) and torch.equal(target["sub"]["b"], obj["model"]["sub"]["b"])
    with pytest.raises(TypeError, match="nn.Module or a nested dict"):
        th5.load_into([torch.empty(1)], tmp_path / "c.h5")


def test_adamw_optimizer_state_round_trip(tmp_path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        model.embed(torch.arange(10)).sum().backward()
        opt.step()
    state = opt.state_dict()
    th5.save({"optim": state}, tmp_path / "o.h5")
    loaded = th5.load(tmp_path / "o.h5")["optim"]
    assert_same(loaded, state)
    assert isinstance(next(iter(loaded["state"])), int) and loaded["param_groups"][0]["betas"] == (0.9, 0.95)
    opt2 = torch.optim.AdamW(Net().parameters(), lr=1.0)
    opt2.load_state_dict(loaded)
    assert opt2.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_root_tensor_and_metadata(tmp_path) -> None:
    t = torch.randn(5, 2)
    th5.save(t, tmp_path / "t.h5", metadata={"source": "unit test", "n": [1, 2]})
    assert torch.equal(th5.load(tmp_path / "t.h5"), t)
    with th5.open(tmp_path / "t.h5") as s:
        assert s.keys() == [""] and s.metadata == {"source": "unit test", "n": [1, 2]}
        assert torch.equal(s[""][1:3], t[1:3])
    with pytest.raises(TypeError, match="metadata"):
        th5.save(t, tmp_path / "bad.h5", metadata={"x": object()})
    assert not (tmp_path / "bad.h5").exists()


def test_device_argument_moves_tensors(tmp_path, device) -> None:
    th5.save({"a": torch.ones(2), "b": {"c": torch.zeros(3)}}, tmp_path / "d.h5")
    out = th5.load(tmp_path / "d.h5", device=device)
    assert out["a"].device.type == device.type and out["b"]["c"].device.type == device.type
    out = th5.load(tmp_path / "d.h5", device={"b/*": device})
    assert out["a"].device.type == "cpu" and out["b"]["c"].device.type == device.type
    out = th5.load(tmp_path / "d.h5", device=lambda k: device if k == "a" else "cpu")
    assert out["a"].device.type == device.type and out["b"]["c"].device.type == "cpu"


def test_load_and_load_into_run_with_the_cyclic_gc_paused_and_restore_it(tmp_path) -> None:
    import gc

    path = tmp_path / "p.h5"
    th5.save({"a": torch.ones(2), "b": torch.zeros(3)}, path)
    during = []

    def device(key):
        during.append(gc.isenabled())
        return "cpu"

    out = th5.load(path, device=device)
    assert during == [False, False] and gc.isenabled() and torch.equal(out["a"], torch.ones(2))
    target = {"a": torch.empty(2), "b": torch.empty(3)}
    with pytest.raises(th5.MismatchError):
        th5.load_into({"a": torch.empty(5)}, path, strict=False)
    assert gc.isenabled()  # back on after a refused load too
    th5.load_into(target, path)
    assert torch.equal(target["b"], torch.zeros(3)) and gc.isenabled()
