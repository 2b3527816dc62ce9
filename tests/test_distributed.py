"""The DCP storage backend (tensorstore_h5.distributed): dcp.save / dcp.load / dcp.async_save on
CPU with gloo (2 and 4 ranks spawned on 127.0.0.1), DTensor resharding, FSDP2 model and
optimizer resume, plain values without pickle, and faults."""

from __future__ import annotations

import datetime
import json
import math
import os
import pickle
import shutil
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorstore_h5 as th5
from helpers import assert_same
from tensorstore_h5 import sharded
from tensorstore_h5.sharded import ShardedStore

dcp = pytest.importorskip("torch.distributed.checkpoint")

from tensorstore_h5.distributed import H5StorageReader, H5StorageWriter  # noqa: E402
from tensorstore_h5.distributed.backend import key_path  # noqa: E402

NO_DIST = "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
"""What dcp.save/dcp.load warn when no process group is initialised (the single-process tests)."""
pytestmark = pytest.mark.filterwarnings(NO_DIST)


# ---------------------------------------------------------------------------- running ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: object, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)  # type: ignore[operator]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that succeeded skips the interpreter's teardown: there, torch's gloo threads once
    # aborted a finished FSDP2 rank ("terminate called without an active exception", SIGABRT)
    # under the full suite's load. Failures still raise above and reach mp.spawn's error file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn: object, *args: object) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes joined by a gloo group; a failure
    in any rank fails the caller with that rank's traceback."""
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _full() -> dict[str, torch.Tensor]:
    """The global tensors of the resharding tests: uneven rows (7 on 2 and 4 ranks), rows of
    32 KiB (a column half is 16 KiB per row, read run by run), bfloat16, integers."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "e": torch.randn(64, 8192, generator=g),
        "h": torch.randn(6, 40, generator=g).to(torch.bfloat16),
        "i": torch.randint(-2**40, 2**40, (10, 3), generator=g),
    }


def _values() -> dict[str, object]:
    return {"step": 7, "name": "run-1", "betas": (0.9, 0.95), "lr": float("nan"), "tags": ["a", "b"], "none": None}


def _counting_pread():
    """Patch os.preadv (every positional read of the library goes through it) to count the
    bytes read; returns (counter, undo)."""
    count = [0]
    orig = os.preadv

    def preadv(fd, buffers, offset, *args):
        n = orig(fd, buffers, offset, *args)
        count[0] += n
        return n

    os.preadv = preadv

    def undo() -> None:
        os.preadv = orig

    return count, undo


# ---------------------------------------------------------------------------- the 2-rank scenario


def _two_ranks(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh((world,))
    full = _full()

    def dt(placement):
        return {k: distribute_tensor(v.clone(), mesh, [placement]) for k, v in full.items()}

    # A: Shard(0), with plain values
    a = os.path.join(root, "A")
    dcp.save({"model": dt(Shard(0)), "meta": _values()}, storage_writer=H5StorageWriter(a, sync_files=False))

    # ... loads into Shard(1): every rank reads only its columns of every piece
    target = {"model": {"e": distribute_tensor(torch.zeros(64, 8192), mesh, [Shard(1)])}}
    count, undo = _counting_pread()
    try:
        dcp.load(target, storage_reader=H5StorageReader(a))
    finally:
        undo()
    local = target["model"]["e"].to_local()
    assert torch.equal(target["model"]["e"].full_tensor(), full["e"])
    assert local.nbytes == 64 * 4096 * 4
    # the hyperslab only (plus each file's 64-byte header, its layout text, and the HDF5 metadata
    # that the first read of each file compares with its layout: a few windows of 64 KiB); reading
    # whole pieces would be twice the local bytes
    assert local.nbytes <= count[0] < local.nbytes + 16384 + 2 * 160 * 1024, (count[0], local.nbytes)

    # ... into Shard(1) and Replicate() for all, values too
    for placement in (Shard(1), Replicate()):
        tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [placement]) for k, v in full.items()},
               "meta": {k: None for k in _values()}}
        dcp.load(tgt, storage_reader=H5StorageReader(a))
        for k, v in full.items():
            assert torch.equal(tgt["model"][k].full_tensor(), v), (k, placement)
        assert_same(tgt["meta"], _values())

    # R: replicated tensors are stored once (DCP deduplicates them)
    dcp.save({"model": dt(Replicate())}, storage_writer=H5StorageWriter(os.path.join(root, "R"), sync_files=False))

    # C: without collectives every rank writes its own index
    c = os.path.join(root, "C")
    dcp.save({"model": dt(Shard(0))}, storage_writer=H5StorageWriter(c, sync_files=False), use_collectives=False)
    dist.barrier()
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}}
    dcp.load(tgt, storage_reader=H5StorageReader(c))
    for k, v in full.items():
        assert torch.equal(tgt["model"][k].full_tensor(), v), k

    # F: a rank that fails mid-save leaves the previous checkpoint loadable
    f = os.path.join(root, "F")
    dcp.save({"model": dt(Shard(0))}, storage_writer=H5StorageWriter(f, sync_files=False))
    first = ShardedStore(f).save_id
    bad = {k: distribute_tensor(v + 1, mesh, [Shard(0)]) for k, v in full.items()}
    planner = _FailingPlanner(fail_rank=1, after=2)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"model": bad}, storage_writer=H5StorageWriter(f, sync_files=False), planner=planner)
    assert "injected failure" in str(info.value)
    dist.barrier()
    with ShardedStore(f) as s:
        assert s.save_id == first
        for k, v in full.items():
            assert torch.equal(s[f"model/{k}"][...], v)
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}}
    dcp.load(tgt, storage_reader=H5StorageReader(f))
    for k, v in full.items():
        assert torch.equal(tgt["model"][k].full_tensor(), v), k
    dist.barrier()
    # the next save replaces it, and only then the files of the failed and the earlier save go
    dcp.save({"model": bad}, storage_writer=H5StorageWriter(f, sync_files=False))

    # T: tensor parallel (column-wise then row-wise linear layers)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    sd = get_model_state_dict(mlp)
    dcp.save({"model": sd}, storage_writer=H5StorageWriter(os.path.join(root, "T"), sync_files=False))
    full_sd = {k: v.full_tensor() for k, v in sd.items()}
    if rank == 0:
        th5.save(full_sd, os.path.join(root, "T_full.h5"))


class _FailingPlanner(dcp.DefaultSavePlanner):
    """Raises on one rank while that rank writes its ``after``-th tensor."""

    def __init__(self, fail_rank: int, after: int) -> None:
        super().__init__()
        self.fail_rank, self.after, self.seen = fail_rank, after, 0

    def resolve_data(self, write_item):
        if dist.is_initialized() and dist.get_rank() == self.fail_rank or not dist.is_initialized():
            self.seen += 1
            if self.seen >= self.after:
                raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("two_ranks"))
    spawn(2, _two_ranks, root)
    return root


@pytest.fixture
def no_pickle(monkeypatch):
    """Anything that unpickles during the test fails it."""
    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled during a load")

    class Refused:
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refused)
    monkeypatch.setattr(torch, "load", refuse)


def test_resharded_loads_in_the_ranks(two_ranks) -> None:
    """The in-rank checks of the scenario ran (Shard(0) by 2 -> Shard(1) and Replicate() on 2,
    reading only the column hyperslab); here what they left on disk."""
    names = sorted(os.listdir(os.path.join(two_ranks, "A")))
    assert names[-1] == sharded.INDEX_NAME
    assert [n.split(".")[0] for n in names[:-1]] == ["rank00000", "rank00001"]
    assert len({n.split(".")[1] for n in names[:-1]}) == 1  # one save id


def test_two_rank_checkpoint_loads_into_one_process_without_pickle(two_ranks, no_pickle) -> None:
    a = os.path.join(two_ranks, "A")
    full = _full()
    tgt = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "meta": {k: None for k in _values()}}
    dcp.load(tgt, storage_reader=H5StorageReader(a), no_dist=True)
    for k, v in full.items():
        assert torch.equal(tgt["model"][k], v), k
    assert_same(tgt["meta"], _values())


def test_directory_view_of_a_two_rank_checkpoint(two_ranks) -> None:
    a = os.path.join(two_ranks, "A")
    full = _full()
    with ShardedStore(a) as s:
        assert s.keys()[:4] == ["model/w", "model/e", "model/h", "model/i"]
        for k, v in full.items():
            h = s[f"model/{k}"]
            assert h.shape == v.shape and h.dtype == v.dtype and h.nbytes == v.nbytes
            assert len(h.pieces) == 2 and [p.offsets[0] for p in h.pieces] == [0, -(-v.shape[0] // 2)]
            assert torch.equal(h[...], v)
            assert torch.equal(h[1:5], v[1:5])
            assert torch.equal(h[:, 1:3], v[:, 1:3])
        assert s["meta/step"] == 7 and s["meta/betas/1"] == 0.95
        loaded = s.load(select="meta/*")
        assert_same(loaded, {"meta": _values()})
    # every rank file is an ordinary tensorstore_h5 file holding its rows, also for plain h5py
    rank1 = [n for n in os.listdir(a) if n.startswith("rank00001")][0]
    with th5.open(os.path.join(a, rank1)) as f:
        assert torch.equal(f["model/e"][...], full["e"][32:])
        assert f.metadata["rank"] == 1
    with h5py.File(os.path.join(a, rank1), "r") as f:
        assert np.array_equal(f["model/w"][()], full["w"][4:].numpy())


def test_replicated_tensors_are_stored_once(two_ranks) -> None:
    r = os.path.join(two_ranks, "R")
    full = _full()
    with ShardedStore(r) as s:
        for k, v in full.items():
            assert len(s[f"model/{k}"].pieces) == 1
            assert torch.equal(s[f"model/{k}"][...], v)
        data = sum(os.path.getsize(os.path.join(r, n)) for n in s.files)
    assert data < sum(v.nbytes for v in full.values()) + 64 * 1024  # one copy (and two small files' overhead)


def test_rank_local_indexes_without_collectives(two_ranks) -> None:
    c = os.path.join(two_ranks, "C")
    names = os.listdir(c)
    assert sharded.INDEX_NAME not in names
    assert {sharded.rank_index_name(0), sharded.rank_index_name(1)} <= set(names)
    with pytest.raises(th5.FormatError, match="rank=r"):
        ShardedStore(c)
    full = _full()
    with ShardedStore(c, rank=1) as s:
        assert s["model/e"].shape == (64, 8192)
        assert torch.equal(s["model/e"][40:64], full["e"][40:64])
        with pytest.raises(th5.FormatError, match="not all stored in this rank-local index"):
            s["model/e"][0:40]


def test_tensor_parallel_checkpoint_loads_whole(two_ranks) -> None:
    with ShardedStore(os.path.join(two_ranks, "T")) as s:
        got = s.load()["model"]
    assert_same(got, th5.load(os.path.join(two_ranks, "T_full.h5")))
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    sd = {"model": plain.state_dict()}
    dcp.load(sd, storage_reader=H5StorageReader(os.path.join(two_ranks, "T")), no_dist=True)
    for k, v in th5.load(os.path.join(two_ranks, "T_full.h5")).items():
        assert torch.equal(sd["model"][k], v)


def test_failed_rank_left_the_previous_checkpoint_then_the_next_save_replaced_it(two_ranks) -> None:
    f = os.path.join(two_ranks, "F")
    with ShardedStore(f) as s:
        for k, v in _full().items():
            assert torch.equal(s[f"model/{k}"][...], v + 1)  # the last, successful save
        kept = set(s.files)
    assert set(os.listdir(f)) == kept | {sharded.INDEX_NAME}  # earlier and failed saves' files removed


# ---------------------------------------------------------------------------- 4 ranks


def _four_ranks(rank: int, world: int, root: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = _full()
    a = os.path.join(root, "A")
    mesh = _mesh((world,))
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}}
    dcp.load(tgt, storage_reader=H5StorageReader(a))  # saved by 2 ranks (Shard(0)), loaded by 4 (Shard(1))
    for k, v in full.items():
        assert torch.equal(tgt["model"][k].full_tensor(), v), k
    mesh2 = _mesh((2, 2))
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh2, [Shard(0), Shard(1)]) for k, v in full.items()}}
    dcp.load(tgt, storage_reader=H5StorageReader(a))
    for k, v in full.items():
        assert torch.equal(tgt["model"][k].full_tensor(), v), k
    sd = {"model": {k: distribute_tensor(v.clone(), mesh2, [Shard(1), Shard(0)]) for k, v in full.items()}}
    dcp.save(sd, storage_writer=H5StorageWriter(os.path.join(root, "A4"), sync_files=False, compression="lz4"))


@pytest.mark.slow
def test_four_ranks_reshard_and_save_a_2d_grid(two_ranks) -> None:
    spawn(4, _four_ranks, two_ranks)
    full = _full()
    with ShardedStore(os.path.join(two_ranks, "A4")) as s:
        assert len(s.files) == 4
        for k, v in full.items():
            assert len(s[f"model/{k}"].pieces) == 4
            assert torch.equal(s[f"model/{k}"][...], v)
            assert torch.equal(s[f"model/{k}"][1:6:2, 1:], v[1:6:2, 1:])
    tgt = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(tgt, storage_reader=H5StorageReader(os.path.join(two_ranks, "A4")), no_dist=True)
    for k, v in full.items():
        assert torch.equal(tgt["model"][k], v)


# ---------------------------------------------------------------------------- model and optimizer (FSDP2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Every rank sees the same batch: the gradients FSDP averages are equal, so N ranks and one
    process compute the same numbers, bit for bit."""
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fsdp_training(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh((world,))
        probe = torch.nn.Linear(2, 2)
        fully_shard(probe, mesh=mesh)
        probe(torch.ones(1, 2)).sum().backward()
    except Exception as e:  # noqa: BLE001 - any failure means FSDP2 does not run here
        if rank == 0:
            with open(os.path.join(root, "skip.txt"), "w") as f:
                f.write(f"FSDP2 fully_shard does not run on CPU with gloo here: {type(e).__name__}: {e}")
        return

    def fresh():
        m = _model()
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)

    m, o = fresh()
    reference = _train(m, o, range(6))
    m, o = fresh()
    first = _train(m, o, range(3))
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, storage_writer=H5StorageWriter(os.path.join(root, "ckpt"), sync_files=False))
    m, o = fresh()  # resume on 2 ranks
    msd, osd = get_state_dict(m, o)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=H5StorageReader(os.path.join(root, "ckpt")))
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
    second = _train(m, o, range(3, 6))
    assert first + second == reference, (first + second, reference)
    if rank == 0:
        with open(os.path.join(root, "losses.json"), "w") as f:
            json.dump(reference, f)


@pytest.mark.slow
def test_fsdp2_model_and_optimizer_resume_on_two_ranks_and_on_one(tmp_path, no_pickle) -> None:
    spawn(2, _fsdp_training, str(tmp_path))
    if (tmp_path / "skip.txt").exists():
        pytest.skip((tmp_path / "skip.txt").read_text())
    reference = json.loads((tmp_path / "losses.json").read_text())
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model()  # resume in one process, no process group, no FSDP
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=H5StorageReader(tmp_path / "ckpt"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert _train(model, opt, range(3, 6)) == reference[3:]
    with ShardedStore(tmp_path / "ckpt") as s:  # the optimizer's plain values are in the index, as JSON
        assert s["optim/param_groups/0/betas/0"] == 0.9 and s["optim/param_groups/0/lr"] == 1e-2
        assert s["optim/state/0.weight/exp_avg"].shape == (32, 16)


# ---------------------------------------------------------------------------- one process (no_dist)


def _everything() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(6, 4, generator=g),
            "b": torch.randn(4, generator=g).to(torch.bfloat16),
            "f8": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
            "i": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
            "m": torch.tensor([True, False, True]),
            "c": torch.randn(2, 3, dtype=torch.complex64, generator=g),
            "s": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "t": torch.randn(4, 6, generator=g).t(),  # a transposed view: its values are stored
        },
        "step": 12, "big": 2**80, "lr": float("inf"), "eps": 1e-8, "z": 1 + 2j, "name": "résumé", "blob": b"\x00\xff",
        "none": None, "flag": True, "betas": (0.9, 0.999), "ids": [3, 1, 2], "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]), "np": np.float32(1.5), "nested": (1, [2, (3, "x")], {"k": None}),
    }


def test_one_process_round_trip_of_every_kind_without_pickle(tmp_path, monkeypatch) -> None:
    sd = _everything()
    path = tmp_path / "ckpt"
    meta = dcp.save(sd, storage_writer=H5StorageWriter(path, sync_files=False, metadata={"run": "x"}))
    assert meta.storage_meta is not None and meta.storage_meta.save_id is not None
    names = sorted(os.listdir(path))
    assert names == [f"rank00000.{meta.storage_meta.save_id}.h5", sharded.INDEX_NAME]
    index = json.loads((path / sharded.INDEX_NAME).read_text())
    assert index["format"] == "tensorstore_h5.sharded" and index["metadata"] == {"run": "x"}
    assert "pickle" not in (path / sharded.INDEX_NAME).read_text()

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled during a load")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    target = {k: (None if not isinstance(v, dict) else {n: torch.zeros_like(t) for n, t in v.items()})
              for k, v in sd.items()}
    target["model"]["t"] = torch.zeros(6, 4)
    dcp.load(target, storage_reader=H5StorageReader(path))
    expected = dict(sd)
    expected["model"] = dict(sd["model"], t=sd["model"]["t"].contiguous())
    expected["nested"] = (1, [2, (3, "x")], {"k": None})
    assert_same(target, expected)
    with ShardedStore(path) as s:
        got = s.load()
        assert s.metadata == {"run": "x"}
    assert_same(got["model"], expected["model"])
    for k in sd:
        if k != "model":
            assert_same(got[k], expected[k])


def test_a_value_json_cannot_hold_is_refused_naming_the_key(tmp_path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3), "step": 1}, storage_writer=H5StorageWriter(path, sync_files=False))
    before = sorted(os.listdir(path))

    class Opaque:
        pass

    for bad in ({1, 2}, Opaque(), (torch.ones(2), Opaque())):
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.zeros(3), "opt": {"extra": bad}}, storage_writer=H5StorageWriter(path, sync_files=False))
        failure = info.value.failures[0][0]
        assert isinstance(failure, th5.UnsupportedTypeError)
        assert "'opt.extra'" in str(failure) and "without pickle" in str(failure) and str(path) in str(failure)
    assert sorted(os.listdir(path)) == before  # nothing written, the earlier checkpoint as it was
    with ShardedStore(path) as s:
        assert torch.equal(s["w"][...], torch.ones(3)) and s["step"] == 1


def test_tensors_inside_plain_values_are_datasets(tmp_path) -> None:
    """DCP treats a tuple as one value (it would pickle it whole): its tensors and arrays go to
    the rank's file as datasets, its plain values to the index."""
    sd = {"pair": (torch.arange(4.0), np.arange(3, dtype=np.int16), "tag")}
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=H5StorageWriter(path, sync_files=False))
    with ShardedStore(path) as s:
        assert s.keys() == ["pair/0", "pair/1", "pair/2"]
        assert torch.equal(s["pair/0"][...], torch.arange(4.0))
        got = s.load()
    assert_same(got, sd)
    target = {"pair": None}
    dcp.load(target, storage_reader=H5StorageReader(path))
    assert_same(target, sd)


def test_compression_threads_and_async_save(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(256, 64, generator=g), "b": torch.randn(128, 64, generator=g).to(torch.bfloat16),
          "c": torch.zeros(300, 50), "n": 3}
    path = tmp_path / "ckpt"
    fut = dcp.async_save(sd, storage_writer=H5StorageWriter(path, compression="lz4", thread_count=2, sync_files=True))
    fut.result()
    with ShardedStore(path) as s:
        assert sorted(n.split(".")[0] for n in s.files) == ["rank00000_0", "rank00000_1"]
        for k in ("a", "b", "c"):
            assert torch.equal(s[k][...], sd[k])
            assert torch.equal(s[k][10:20, 3:9], sd[k][10:20, 3:9])
        piece = s["c"].pieces[0]
    with th5.open(path / piece.file) as f:
        assert f["c"].compression is not None  # stored compressed
        assert f.info()["tensors"]["c"]["stored_bytes"] < sd["c"].nbytes / 10
    target = {"a": torch.zeros(256, 64), "b": torch.zeros(128, 64, dtype=torch.bfloat16), "c": torch.ones(300, 50), "n": 0}
    dcp.load(target, storage_reader=H5StorageReader(path, verify=True))
    assert_same(target, sd)


def test_a_destination_of_another_dtype_is_cast_like_copy(tmp_path) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, storage_writer=H5StorageWriter(path, sync_files=False))
    target = {"w": torch.zeros(3, 4, dtype=torch.float64).t().contiguous().t()}  # other dtype, not contiguous
    dcp.load(target, storage_reader=H5StorageReader(path))
    assert torch.equal(target["w"], torch.arange(12.0, dtype=torch.float64).reshape(3, 4))


def test_nested_keys_follow_dcp_flattening(tmp_path) -> None:
    sd = {"model": {"layers.0.w": torch.ones(2)}, "lst": [torch.zeros(1), {"x": torch.ones(1)}], "a/b": torch.ones(1)}
    dcp.save(sd, storage_writer=H5StorageWriter(tmp_path / "c", sync_files=False))
    with ShardedStore(tmp_path / "c") as s:
        assert s.keys() == ["model/layers.0.w", "lst/0", "lst/1/x", "a%2Fb"]
        assert_same(s.load(), sd)
    assert key_path("model.layers.0.w", {"model.layers.0.w": ("model", "layers.0.w")}) == "model/layers.0.w"
    assert key_path("lst.0", {"lst.0": ("lst", 0)}) == "lst/0"
    assert key_path("a/b", None) == "a%2Fb"


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    dcp.save({"w": torch.ones(1)}, storage_writer=H5StorageWriter(tmp_path, sync_files=False))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save({"w": torch.ones(1)}, storage_writer=H5StorageWriter(tmp_path, sync_files=False, overwrite=False))


def test_import_does_not_load_torch_distributed_checkpoint() -> None:
    code = ("import sys, tensorstore_h5, tensorstore_h5.sharded, tensorstore_h5.distributed as d\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported early'\n"
            "d.H5StorageWriter\n"
            "assert 'torch.distributed.checkpoint' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- faults


def _saved(tmp_path, **writer) -> tuple[str, dict[str, torch.Tensor]]:
    from tensorstore_h5.bench.simulate import save_as_ranks

    full = _full()
    path = str(tmp_path / "ckpt")
    save_as_ranks({f"model.{k}": v for k, v in full.items()}, path, ranks=2,
                  mappings={f"model.{k}": ("model", k) for k in full}, **writer)
    return path, full


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, [n for n in os.listdir(path) if n.startswith(f"rank{rank:05d}")][0])


def _dcp_failure(path: str) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    target = {"model": {k: torch.zeros_like(v) for k, v in _full().items()}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=H5StorageReader(path))
    return info.value.failures[0][0]


def test_missing_rank_file(tmp_path) -> None:
    path, full = _saved(tmp_path)
    victim = _rank_file(path, 1)
    os.unlink(victim)
    with ShardedStore(path) as s:
        assert torch.equal(s["model/e"][0:32], full["e"][:32])  # rank 0's rows need only rank 0's file
        with pytest.raises(th5.FormatError) as info:
            s["model/e"][30:34]
    assert victim in str(info.value) and "'model/e'" in str(info.value) and "missing" in str(info.value)
    failure = _dcp_failure(path)
    assert isinstance(failure, th5.FormatError) and victim in str(failure) and "missing" in str(failure)


def test_truncated_rank_file(tmp_path) -> None:
    path, _ = _saved(tmp_path)
    victim = _rank_file(path, 0)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    with ShardedStore(path) as s, pytest.raises(th5.FormatError) as info:
        s["model/w"][...]
    assert victim in str(info.value) and "'model/w'" in str(info.value) and "truncated" in str(info.value)
    failure = _dcp_failure(path)
    assert isinstance(failure, th5.FormatError) and "truncated" in str(failure)


def test_foreign_rank_file(tmp_path) -> None:
    path, _ = _saved(tmp_path)
    victim = _rank_file(path, 0)
    size = os.path.getsize(victim)
    th5.save({"model": {"w": torch.zeros(4, 5)}}, tmp_path / "other.h5")  # a valid file, not this save's
    shutil.copy(tmp_path / "other.h5", victim)
    with ShardedStore(path) as s, pytest.raises(th5.FormatError) as info:
        s["model/w"][...]
    assert victim in str(info.value) and "'model/w'" in str(info.value)
    assert "bytes" in str(info.value) or "not the file this checkpoint wrote" in str(info.value)
    # of the right length: padded or cut, its own header disagrees with its length
    with open(tmp_path / "other.h5", "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data + b"\0" * (size - len(data)) if size > len(data) else data[:size])
    with ShardedStore(path) as s, pytest.raises(th5.FormatError, match="'model/w'") as info:
        s["model/w"][...]
    assert victim in str(info.value)
    with open(victim, "wb") as f:
        f.write(b"\0" * size)  # the right length, not even a tensorstore_h5 file
    with ShardedStore(path) as s, pytest.raises(th5.FormatError) as info:
        s["model/w"][...]
    assert victim in str(info.value) and "not a tensorstore_h5 format-2 file" in str(info.value)


def test_same_length_file_of_another_save_is_refused(tmp_path) -> None:
    path, full = _saved(tmp_path)
    victim = _rank_file(path, 0)
    other, _ = _saved(tmp_path / "second")  # same shapes, another save: same length, other layout hash
    shutil.copy(_rank_file(other, 0), victim)
    assert os.path.getsize(victim) == os.path.getsize(_rank_file(other, 0))
    with ShardedStore(path) as s, pytest.raises(th5.FormatError, match="not the file this checkpoint wrote"):
        s["model/e"][...]


def _edit_index(path: str, edit) -> None:
    index_file = os.path.join(path, sharded.INDEX_NAME)
    with open(index_file) as f:
        obj = json.load(f)
    edit(obj)
    with open(index_file, "w") as f:
        json.dump(obj, f)


def _entry_of(obj: dict, key: str) -> dict:
    return obj["entries"][obj["paths"].index(key)]


@pytest.mark.parametrize("edit, why", [
    (lambda e: e.update(shape=[8, 5]), "gap"),                                     # global shape larger than the pieces
    (lambda e: e.update(shape=[6, 5]), "outside the global shape"),                # smaller
    (lambda e: e["pieces"][1].update(offsets=[3, 0]), "overlap"),                  # overlapping pieces
    (lambda e: e["pieces"][1].update(offsets=[4, 1]), "outside the global shape"),
    (lambda e: e["pieces"].pop(), "gap"),
    (lambda e: e.update(dtype="float64"), "dtype"),
    (lambda e: e["pieces"][0].update(file="rank00009.0123456789abcdef.h5"), "not among the index's files"),
    (lambda e: e["pieces"][0].update(shape=[3, 5], offsets=[0, 0]), "gap"),
])
def test_damaged_pieces_are_refused(tmp_path, edit, why) -> None:
    path, _ = _saved(tmp_path)
    _edit_index(path, lambda obj: edit(_entry_of(obj, "model/w")))
    with ShardedStore(path) as s:
        assert torch.equal(s["model/e"][...], _full()["e"])  # other keys still read
        with pytest.raises(th5.FormatError) as info:
            s["model/w"][...]
    assert "'model/w'" in str(info.value) and why in str(info.value)
    assert sharded.INDEX_NAME in str(info.value) or _rank_file(path, 0) in str(info.value)


def test_global_plan_with_disagreeing_ranks_is_refused(tmp_path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    def item(offsets, sizes, size, dtype=torch.float32):
        return WriteItem(index=MetadataIndex("w", offsets), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                     properties=TensorProperties(dtype=dtype), size=torch.Size(size)))

    w = H5StorageWriter(tmp_path, sync_files=False)
    w.set_up_storage_writer(True, rank=0, use_collectives=True)
    cases = [
        ([item([0, 0], [4, 5], [8, 5])], [item([4, 0], [4, 5], [9, 5])], "global tensor of shape"),
        ([item([0, 0], [4, 5], [8, 5])], [item([4, 0], [4, 5], [8, 5], torch.float16)], "torch.float16"),
        ([item([0, 0], [5, 5], [8, 5])], [item([4, 0], [4, 5], [8, 5])], "overlap"),
        ([item([0, 0], [3, 5], [8, 5])], [item([4, 0], [4, 5], [8, 5])], "gap"),
        ([item([0, 0], [4, 5], [8, 5])], [item([6, 0], [4, 5], [8, 5])], "outside"),
    ]
    for r0, r1, why in cases:
        with pytest.raises(ValueError, match=why) as info:
            w.prepare_global_plan([SavePlan(r0), SavePlan(r1)])
        assert "'w'" in str(info.value) and str(tmp_path) in str(info.value)
    assert os.listdir(tmp_path) == []


def test_crash_before_the_index_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(4), "step": 1}, storage_writer=H5StorageWriter(path, sync_files=False))
    old = set(os.listdir(path))

    def crash(*args, **kwargs):
        raise OSError("killed before the index was renamed into place")

    monkeypatch.setattr(sharded, "commit_index", crash)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="killed before"):
        dcp.save({"w": torch.zeros(4), "step": 2}, storage_writer=H5StorageWriter(path, sync_files=False))
    monkeypatch.undo()
    orphans = set(os.listdir(path)) - old
    assert len(orphans) == 1 and orphans.pop().startswith("rank00000.")  # the new data file, no index temporary
    with ShardedStore(path) as s:
        assert torch.equal(s["w"][...], torch.ones(4)) and s["step"] == 1
    dcp.save({"w": torch.full((4,), 3.0), "step": 3}, storage_writer=H5StorageWriter(path, sync_files=False))
    with ShardedStore(path) as s:
        assert s["step"] == 3 and set(os.listdir(path)) == set(s.files) | {sharded.INDEX_NAME}


def test_unrelated_files_in_the_directory_are_kept(tmp_path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "README.txt").write_text("mine")
    (path / "notes.h5").write_bytes(b"x")
    for step in range(2):
        dcp.save({"w": torch.ones(2) * step}, storage_writer=H5StorageWriter(path, sync_files=False))
    assert {"README.txt", "notes.h5"} <= set(os.listdir(path))
    assert len([n for n in os.listdir(path) if n.startswith("rank")]) == 1


def test_index_size_grows_linearly_with_ranks() -> None:
    from tensorstore_h5.bench.simulate import index_size

    shapes = {f"layers.{i}.w": (256, 64) for i in range(8)}
    sizes = [index_size(shapes, r) for r in (2, 8, 32)]
    assert [b["pieces"] for b in sizes] == [16, 64, 256]
    slopes = [(b["index_bytes"] - a["index_bytes"]) / (b["pieces"] - a["pieces"]) for a, b in zip(sizes, sizes[1:])]
    assert math.isclose(slopes[0], slopes[1], rel_tol=0.2) and slopes[1] < 150, slopes  # bytes per piece (and file)
    for b in sizes:
        assert b["index_bytes"] < b["dcp_metadata_bytes"]


def test_a_load_leaves_no_file_open(tmp_path) -> None:
    """A file held open after dcp.load would keep a removed checkpoint's pages and disk space."""
    path, full = _saved(tmp_path)
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(target, storage_reader=H5StorageReader(path))
    dcp.load(target, storage_reader=H5StorageReader(path, verify=True))
    open_files = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [f for f in open_files if f.startswith(path)], open_files
    assert torch.equal(target["model"]["e"], full["e"])


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized:UserWarning")
def test_load_without_a_target_state_dict(tmp_path) -> None:
    """DCP's empty-state-dict planner (what its conversion tools use) rebuilds the nesting from
    the index's planner_data and gets the plain values without unpickling."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "opt": {"param_groups": [{"lr": 0.1, "params": ["w"]}]},
          "step": 4}
    dcp.save(sd, storage_writer=H5StorageWriter(tmp_path, sync_files=False))
    assert_same(_load_state_dict_from_keys(storage_reader=H5StorageReader(tmp_path)), sd)
    assert_same(_load_state_dict_from_keys({"model.w"}, storage_reader=H5StorageReader(tmp_path)),
                {"model": {"w": sd["model"]["w"]}})


def test_cuda_tensors_save_and_load_through_dcp(tmp_path, device) -> None:
    """State on ``device`` (CPU, and CUDA where present) saves, loads back into tensors on that
    device (contiguous, a transposed view, another dtype), and the directory view loads it there."""
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(64, 33, generator=g).to(device), "b": torch.randn(7, generator=g).to(torch.bfloat16).to(device),
          "step": 3}
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=H5StorageWriter(path, sync_files=False))
    target = {"w": torch.zeros(33, 64, device=device).t(), "b": torch.zeros(7, dtype=torch.float32, device=device),
              "step": 0}
    dcp.load(target, storage_reader=H5StorageReader(path, verify=True))
    assert target["w"].device.type == device.type and target["w"].stride() == (1, 64)
    assert torch.equal(target["w"].cpu(), sd["w"].cpu())
    assert torch.equal(target["b"].cpu(), sd["b"].float().cpu()) and target["step"] == 3
    with ShardedStore(path) as s:
        got = s.load(device=device)
        part = s["w"][10:20, 3:9]
        out = torch.empty(10, 6, device=device)
        s["w"].read(out=out, index=(slice(10, 20), slice(3, 9)))
    assert got["w"].device.type == device.type and torch.equal(got["w"].cpu(), sd["w"].cpu())
    assert torch.equal(part, sd["w"][10:20, 3:9].cpu()) and torch.equal(out.cpu(), part)
    into = {"w": torch.zeros(64, 33, device=device), "b": torch.zeros(7, dtype=torch.bfloat16, device=device)}
    th5.load_into(into, path, strict=False)  # "step" is not a target; the directory's whole-row pieces, staged into the device tensors
    assert torch.equal(into["w"].cpu(), sd["w"].cpu()) and torch.equal(into["b"].cpu(), sd["b"].cpu())
