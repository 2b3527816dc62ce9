"""save_async: the caller waits only for a copy; the file is written in the background,
atomically, one save at a time, with the buffers reused between saves."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.writing import background
from tensorstore_h5.writing.background import save_async

from helpers import assert_same


def _state(v: float) -> dict:
    emb = torch.full((64, 32), v)
    return {"model": {"emb": emb, "head": emb, "t": torch.full((16, 8), v).t(), "p": torch.nn.Parameter(torch.full((4,), v))},
            "step": int(v)}


def test_the_file_holds_the_state_at_the_call_whatever_changes_after(tmp_path) -> None:
    state = _state(1.0)
    expected = _state(1.0)
    future = save_async(state, tmp_path / "c.h5")
    with torch.no_grad():  # training goes on at once
        state["model"]["emb"].add_(100)
        state["model"]["p"].mul_(0)
    assert future.result(timeout=60) is None
    out = th5.load(tmp_path / "c.h5", verify=True)
    assert_same(out, expected)
    assert out["model"]["emb"] is out["model"]["head"] and out["model"]["t"].stride() == (1, 8)
    assert isinstance(out["model"]["p"], torch.nn.Parameter)


def test_saves_run_one_at_a_time_and_reuse_their_buffers(tmp_path, monkeypatch) -> None:
    started, release = threading.Event(), threading.Event()
    real = th5.Writer._write_root

    def slow(self, nodes):
        started.set()
        release.wait(30)
        real(self, nodes)

    monkeypatch.setattr(th5.Writer, "_write_root", slow)
    first = save_async(_state(1.0), tmp_path / "a.h5")
    assert started.wait(30)
    t = threading.Thread(target=lambda: second.append(save_async(_state(2.0), tmp_path / "b.h5")))
    second: list = []
    t.start()
    time.sleep(0.2)
    assert not second, "a second save started while the first was writing"
    release.set()
    t.join(30)
    first.result(30)
    second[0].result(30)
    assert th5.load(tmp_path / "a.h5")["step"] == 1 and th5.load(tmp_path / "b.h5")["step"] == 2
    pooled = {id(b) for bufs in background._pool.values() for b in bufs}
    third = save_async(_state(3.0), tmp_path / "c.h5")
    third.result(30)
    assert pooled and pooled == {id(b) for bufs in background._pool.values() for b in bufs}  # the same buffers again
    assert th5.load(tmp_path / "c.h5")["model"]["emb"].eq(3).all()


def test_a_failed_background_save_raises_from_its_future_and_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    th5.save({"a": torch.ones(3)}, tmp_path / "c.h5")
    before = (tmp_path / "c.h5").read_bytes()

    def fail(self, nodes):
        raise th5.WriteError("simulated: no space left on the device")

    monkeypatch.setattr(th5.Writer, "_write_root", fail)
    future = save_async({"a": torch.zeros(3)}, tmp_path / "c.h5")
    with pytest.raises(th5.WriteError, match="simulated"):
        future.result(30)
    assert (tmp_path / "c.h5").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint4, torch.complex32, torch.bool, torch.bfloat16])
def test_every_layout_and_dtype_is_copied_exactly(tmp_path, dtype) -> None:
    from helpers import random_tensor

    base = random_tensor((12, 10), dtype, seed=3)
    obj = {"t": base.t(), "stepped": base[::2], "expanded": base[:1].expand(5, 10), "empty": base[:0], "scalar": base[0, 0]}
    save_async(obj, tmp_path / "c.h5").result(30)
    assert_same(th5.load(tmp_path / "c.h5"), obj)


def test_unsupported_values_are_refused_before_returning(tmp_path) -> None:
    with pytest.raises(th5.UnsupportedTypeError, match="'bad'"):
        save_async({"bad": object()}, tmp_path / "c.h5")
    assert not (tmp_path / "c.h5").exists()
