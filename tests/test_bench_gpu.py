"""The GPU group's code (bench/gpu.py), run on the CPU (``TH5_BENCH_DEVICE=cpu``): a lent GPU
runs bench/gpu_check.sh once, so every contender must load what it claims before it gets there.
The figures of such a run mean nothing; what each contender returns is checked here."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.bench import contenders, gpu, measure, runner
from tensorstore_h5.storage import parallel


def test_every_gpu_contender_is_listed_once_and_opt_in() -> None:
    listed = [n for n in contenders.CONTENDERS if n.startswith("G.")]
    assert sorted(gpu.GPU_ORDER) == sorted(listed) and len(set(gpu.GPU_ORDER)) == len(gpu.GPU_ORDER)
    assert runner.GPU_ORDER is gpu.GPU_ORDER and not set(gpu.GPU_ORDER) & set(runner.ORDER)
    assert {contenders.CONTENDERS[n][0] for n in listed} == {"gpu", "gpu-limit", "gpu-partial"}
    assert all(contenders.READS[n] for n in listed)  # the runner makes only the files that are read


def test_without_cuda_a_gpu_contender_is_skipped_saying_why(tmp_path, monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv(gpu.DEVICE_ENV, raising=False)
    out = runner.worker("G.tensorstore_h5 load(device=cuda)", contenders.Ctx(str(tmp_path), 1000, 4))
    assert out["skip"].startswith("no CUDA device")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the runner would make for the G. group, small: the default checkpoint in each
    format and its raw bytes (by the writer contenders), and the 6,000-tensor optimizer state."""
    ctx = contenders.Ctx(str(tmp_path_factory.mktemp("gpu")), 3_000_000, 24)
    for writer, made in runner.WRITERS.items():
        if made in ("raw.bin", "ckpt.h5", "ckpt.pt", "ckpt.safetensors"):
            contenders.CONTENDERS[writer][1](ctx)[0]()
    gpu.prepare_gpu_files(ctx)
    return ctx


def _run(name: str, ctx: contenders.Ctx):
    op, nbytes = contenders.CONTENDERS[name][1](ctx)
    return op(), nbytes


def _on(device: torch.device, monkeypatch) -> None:
    """The G. contenders load to ``device``: the CPU here, CUDA on a GPU machine (gpu_check.sh
    runs these tests there first, with the peers it installed: a peer that breaks on CUDA shows
    in gpu-tests.txt before the benchmark)."""
    if device.type == "cpu":
        monkeypatch.setenv(gpu.DEVICE_ENV, "cpu")
    else:
        monkeypatch.delenv(gpu.DEVICE_ENV, raising=False)
    monkeypatch.setenv("FASTSAFETENSORS_ODIRECT", "")  # what a contender sets is undone afterwards


def _same(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> bool:
    return got.device.type == device.type and torch.equal(got.cpu(), want)


def test_the_optimizer_state_has_6000_small_tensors_in_every_format(files) -> None:
    from safetensors.torch import load_file

    sd = th5.load(files.path("optim.h5"))
    assert len(sd) == 6000 and sum(t.dim() == 0 for t in sd.values()) == 2000
    st = load_file(files.path("optim.safetensors"))
    pt = torch.load(files.path("optim.pt"), weights_only=True)
    assert list(sd) == list(pt) and all(torch.equal(sd[k], st[k]) and torch.equal(sd[k], pt[k]) for k in sd)
    raw = sum(t.nbytes for t in sd.values())
    assert os.path.getsize(files.path("optim.bin")) == raw


_FULL_LOADS = ["tensorstore_h5 load(device=cuda)", "tensorstore_h5 load(device=cuda, verify=False)",
               "tensorstore_h5 load_into (CUDA targets)",
               "torch.load(map_location=cuda)", "safetensors load_file(device=cuda)",
               "fastsafetensors fastsafe_open(nogds) + get_tensor"]


@pytest.mark.parametrize("name", [f"G.{who}{tail}" for who in _FULL_LOADS for tail in ("", f" {gpu.OPTIM}")]
                         + ["G.fastsafetensors fastsafe_open(nogds) + get_tensor, its default O_DIRECT reads"])
def test_each_full_load_returns_every_tensor_of_the_checkpoint(files, monkeypatch, name, device) -> None:
    _on(device, monkeypatch)
    if "fastsafetensors" in name:
        pytest.importorskip("fastsafetensors")
    expected = th5.load(files.path("optim.h5" if gpu.OPTIM in name else "ckpt.h5"))
    got, nbytes = _run(name, files)
    assert sorted(got) == sorted(expected) and nbytes == sum(t.nbytes for t in expected.values())
    assert all(_same(got[k], expected[k], device) for k in expected)
    if "fastsafetensors" in name:  # through the page cache as every contender, or with its default
        assert os.environ["FASTSAFETENSORS_ODIRECT"] == ("1" if "O_DIRECT" in name else "0")


def test_the_partial_loads_return_the_same_keys_and_rows(files, monkeypatch, device) -> None:
    _on(device, monkeypatch)
    pytest.importorskip("fastsafetensors")
    full = th5.load(files.path("ckpt.h5"))
    keys = list(full)[::100]
    for name in ("G.tensorstore_h5 load 1% of keys (cuda)", "G.safetensors safe_open(device=cuda) 1% of keys",
                 "G.fastsafetensors 1% of keys (set_tensor_filter)"):
        got, nbytes = _run(name, files)
        assert sorted(got) == sorted(keys) and all(_same(got[k], full[k], device) for k in keys), name
        assert nbytes == sum(full[k].nbytes for k in keys)
    rows = {k: max(1, len(t) // 100) for k, t in full.items()}
    for name in ("G.tensorstore_h5 1% row slice of every tensor (cuda)",
                 "G.safetensors get_slice 1% rows of every tensor (cuda)",
                 "G.fastsafetensors 1% row slices (the whole file to the GPU, sliced)"):
        got, nbytes = _run(name, files)
        assert sorted(got) == sorted(full), name
        assert all(_same(got[k], full[k][:n], device) for k, n in rows.items()), name
        assert nbytes == sum(got[k].nbytes for k in got)


@pytest.mark.parametrize("suffix", ["", gpu.OPTIM])
def test_the_limits_read_and_copy_every_byte_of_the_raw_file(files, monkeypatch, suffix, device) -> None:
    _on(device, monkeypatch)
    tail = f" {suffix}" if suffix else ""
    raw = files.path("optim.bin" if suffix else "raw.bin")
    for name in (f"G.L.file read into pinned memory, I/O threads{tail}", f"G.L.pinned host-to-device copy{tail}"):
        op, nbytes = contenders.CONTENDERS[name][1](files)
        op()
        assert nbytes == os.path.getsize(raw), name


def test_kvikio_is_skipped_with_what_to_install_when_absent(files, monkeypatch) -> None:
    import builtins

    monkeypatch.setenv(gpu.DEVICE_ENV, "cpu")
    real_import = builtins.__import__

    def no_kvikio(name, *args, **kwargs):
        if name.split(".")[0] == "kvikio":
            raise ImportError("No module named 'kvikio'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kvikio)
    with pytest.raises(measure.Skip, match="pip install kvikio-cu12 or kvikio-cu13"):
        contenders.CONTENDERS[KVIKIO][1](files)


KVIKIO = "G.kvikio CuFile.read, compatibility mode (the file's bytes, one buffer)"


class _FakeKvikio(types.ModuleType):
    """kvikio's API as the contender uses it (26.x, read from its wheel): ``defaults.set(dict)``,
    ``CompatMode.ON``, ``CuFile(path, "r")`` as a context manager whose ``read(buf)`` fills the
    whole buffer and returns the bytes read."""

    def __init__(self) -> None:
        super().__init__("kvikio")
        self.settings: dict = {}
        self.CompatMode = types.SimpleNamespace(ON="ON", OFF="OFF", AUTO="AUTO")
        self.defaults = types.ModuleType("kvikio.defaults")
        self.defaults.set = self.settings.update
        fake = self

        class CuFile:
            def __init__(self, path, flags="r"):
                assert flags == "r" and fake.settings == {"compat_mode": "ON", "num_threads": parallel.IO_THREADS,
                                                          "auto_direct_io_read": False}
                self._f = open(path, "rb")

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

            def read(self, buf, size=None, file_offset=0, task_size=None):
                view = memoryview(buf.numpy()).cast("B")
                return self._f.readinto(view)

        self.CuFile = CuFile


def test_kvikio_reads_every_byte_of_the_raw_file_in_compat_mode(files, monkeypatch) -> None:
    monkeypatch.setenv(gpu.DEVICE_ENV, "cpu")
    fake = _FakeKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", fake.defaults)
    got, nbytes = _run(KVIKIO, files)
    with open(files.path("raw.bin"), "rb") as f:
        raw = f.read()
    assert nbytes == len(raw) and bytes(got.numpy()) == raw


@pytest.mark.cuda
def test_kvikio_reads_every_byte_into_cuda_memory(files, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    pytest.importorskip("kvikio")
    _on(torch.device("cuda"), monkeypatch)
    got, nbytes = _run(KVIKIO, files)
    with open(files.path("raw.bin"), "rb") as f:
        raw = f.read()
    assert got.is_cuda and nbytes == len(raw) and bytes(got.cpu().numpy()) == raw
