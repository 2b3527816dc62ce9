"""Special files in checkpoint directories (issue #30, item 4): a FIFO, a device (``/dev/zero``
through a symlink), a directory, a socket or a huge sparse file where an index, a shard or a
single checkpoint file should be, and a NUL in a path. Every public read (``th5.open`` + keys +
reads, ``th5.load``, ``dcp.load`` through ``H5StorageReader``, ``python -m tensorstore_h5
ls/info/verify``) runs in a worker process with an address-space limit (its size after
importing torch + 1 GiB) and a wall-time limit per call, and must end in time with a
``TensorStoreError`` naming the path (the command: status 1 and one line naming it). Symlinks
to regular files (the Hugging Face cache) still load."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_h5 as th5

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torch.distributed.checkpoint")

from tensorstore_h5.bench.simulate import save_as_ranks  # noqa: E402

NO_DIST = "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"

CALL_SECONDS = float(os.environ.get("TH5_HOSTILE_CALL_SECONDS", "20"))
"""Wall time one public call may take in the worker (its alarm ends it after that)."""
STARTUP_SECONDS = 60.0
"""Extra wall time for the worker to import torch before its first call."""
HUGE = 4 << 30
"""Length of the sparse files made to be larger than any cap (no byte of them is stored)."""

# The worker: imports torch and the library, limits its address space, then runs each call with
# an alarm and prints one JSON line of results. A hung call (a FIFO's open) is ended by the alarm.
WORKER = r'''
import contextlib, io, json, os, resource, runpy, signal, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import tensorstore_h5 as th5
import tensorstore_h5.cli  # noqa: F401 - imported before the limit, as everything else
from tensorstore_h5.distributed import H5StorageReader
from tensorstore_h5.errors import TensorStoreError
from tensorstore_h5.sharded import ShardedStore

with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
calls, seconds = json.loads(sys.argv[1]), float(sys.argv[2])


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


signal.signal(signal.SIGALRM, _alarm)


def read_all(p):
    with th5.open(p) as s:
        for k in s.keys():
            v = s[k]
            if hasattr(v, "read"):
                v.read()


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["tensorstore-h5", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module("tensorstore_h5", run_name="__main__", alter_sys=True)  # python -m tensorstore_h5
    except SystemExit as e:
        code = e.code
    return code, err.getvalue()


class TorchWrapped(Exception):
    """DCP's load turns a failed read_metadata into an AssertionError holding its message."""


def dcp_load(p):
    target = {"model": {"e": torch.zeros(64, 1024), "b": torch.zeros(8)}}
    try:
        dcp.load(target, storage_reader=H5StorageReader(p), no_dist=True)
    except CheckpointException as e:
        failure = next(iter(e.failures.values()))[0]  # the rank's own error
        if isinstance(failure, AssertionError) and "metadata read failed: " in str(failure):
            raise TorchWrapped(str(failure)) from None
        raise failure from None


results = []
for call, p in calls:
    r = {"call": call, "path": p}
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        if call == "open":
            read_all(p)
        elif call == "load":
            th5.load(p)
        elif call == "rank":
            with ShardedStore(p, rank=0) as s:
                s.keys()
        elif call == "dcp":
            dcp_load(p)
        elif call == "dcp_metadata":  # what DCP's load calls first
            H5StorageReader(p).read_metadata()
        else:
            code, err = run_cli(call, p)
            r.update(exit=code, stderr=err)
        r["outcome"] = "ok" if r.get("exit", 0) == 0 else "error"
    except Hang:
        r["outcome"] = "hang"
    except BaseException as e:  # noqa: BLE001 - reported
        r.update(outcome="error", type=type(e).__name__, message=str(e),
                 library=isinstance(e, (TensorStoreError, TorchWrapped)))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    r["seconds"] = time.monotonic() - start
    results.append(r)
sys.stdout.write(json.dumps(results) + "\n")
sys.stdout.flush()
os._exit(0)  # threads left blocked by a hung call must not keep the process
'''


def _run(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Run ``(call, path)`` pairs in a fresh limited worker; its results, in order."""
    # The limit is for what the reads allocate, not for idle malloc arenas and OpenMP threads (many cores).
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(calls), str(CALL_SECONDS)], capture_output=True,
                       text=True, env=env, timeout=STARTUP_SECONDS + CALL_SECONDS * len(calls))
    assert r.returncode == 0 and r.stdout.strip(), f"the worker died ({r.returncode}): {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(results: list[dict[str, Any]], expected: dict[tuple[str, str], tuple[str, ...] | None]) -> None:
    """Each result ended in time and, where ``expected`` gives words, failed with the library's
    error (the command: status 1, one line) whose message holds every word (the path first);
    None: it succeeded; absent: either (it need not read the file)."""
    problems = []
    for r in results:
        where = f"{r['call']} {r['path']!r}"
        if r["outcome"] == "hang" or r["seconds"] >= CALL_SECONDS:
            problems.append(f"{where}: still running after {r['seconds']:.1f} s")
            continue
        key = (r["call"], r["path"])
        words = expected.get(key, ())
        if words is None:
            if r["outcome"] != "ok":
                problems.append(f"{where}: failed: {r.get('type')} {r.get('message') or r.get('stderr')}")
            continue
        if r["outcome"] == "ok":
            if key in expected:
                problems.append(f"{where}: succeeded, expected an error naming {words[0]!r}")
            continue
        if "exit" in r:  # the command: status 1 and one error line (verify: a line per problem, then FAILED)
            text = r["stderr"]
            one_line = text.startswith("tensorstore-h5: error:") and text.count("\n") == 1
            if r["exit"] != 1 or "Traceback" in text or not (one_line or r["call"] == "verify" and "FAILED" in text):
                problems.append(f"{where}: exit status {r['exit']}, not one error line: {text[-500:]!r}")
        else:
            text = r["message"]
            if not r["library"]:
                problems.append(f"{where}: {r['type']} is not a TensorStoreError: {text[:300]}")
        missing = [w for w in words if w not in text]
        if missing:
            problems.append(f"{where}: the message lacks {missing}: {text[:500]!r}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- directories and hostile files


def _ours(root: Path) -> str:
    """A directory of four ranks' files and ``tensorstore_h5.json`` (as tests/test_sharded.py makes)."""
    e = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5))
    path = str(root)
    save_as_ranks({"model.e": e, "model.b": torch.arange(8.0)}, path, ranks=4,
                  mappings={"model.e": ("model", "e"), "model.b": ("model", "b")})
    return path


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed.weight": torch.randn(10, 4, generator=g), "model.norm.weight": torch.ones(4),
            "lm_head.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16)}


def _hf(root: Path, names: tuple[str, str] = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        ) -> str:
    """A Hugging Face sharded checkpoint: two shards and ``model.safetensors.index.json``."""
    os.makedirs(root, exist_ok=True)
    tensors = _hf_tensors()
    weight_map = {}
    for k, name in enumerate(names):
        part = {n: t for i, (n, t) in enumerate(tensors.items()) if i % 2 == k}
        if "\0" not in name:
            safetensors_torch.save_file(part, os.path.join(root, name), metadata={"format": "pt"})
        weight_map.update({n: name for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(root)


def _fs_writer(root: Path) -> str:
    """A checkpoint of DCP's own FileSystemWriter (``.metadata``, pickled, and ``.distcp`` files)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(root)))
    return str(root)


def _make(path: str, kind: str) -> None:
    """Replace ``path`` by a hostile ``kind`` of file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "fifo_link":
        os.mkfifo(path + ".pipe")
        os.symlink(os.path.basename(path) + ".pipe", path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(HUGE)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        os.chdir(os.path.dirname(path))  # a relative name: AF_UNIX paths hold at most 107 bytes
        try:
            s.bind(os.path.basename(path))
        finally:
            os.chdir(here)
            s.close()
    else:
        raise AssertionError(kind)


WORDS = {"fifo": ("FIFO",), "fifo_link": ("FIFO", "symlink"), "devzero": ("character device", "/dev/zero"),
         "directory": ("directory",), "huge": (f"{HUGE} bytes", "refused without reading"), "socket": ("socket",)}
"""What the message says of each kind of file, beside its path."""


# ---------------------------------------------------------------------------- indexes


@pytest.mark.parametrize("layout", ["tensorstore_h5", "safetensors"])
def test_an_index_that_is_not_a_regular_file_is_refused_unread(tmp_path, layout) -> None:
    """The index is a FIFO, a symlink to a FIFO, a symlink to /dev/zero, a directory, or a
    sparse file of 4 GiB (beyond the cap): every public read refuses it at once, naming it,
    without reading it (a FIFO blocked them forever; /dev/zero was read for 2 GiB)."""
    calls, expected = [], {}
    for kind in WORDS:
        if kind == "socket":
            continue
        if layout == "tensorstore_h5":
            d, index = _ours(tmp_path / kind), "tensorstore_h5.json"
        else:
            d, index = _hf(tmp_path / kind), "model.safetensors.index.json"
        _make(os.path.join(d, index), kind)
        for call in ("open", "load", "ls", "info") + (("dcp_metadata", "dcp") if layout == "tensorstore_h5" else ()):
            calls.append((call, d))
            expected[call, d] = (os.path.join(d, index), *WORDS[kind])
    _check(_run(calls), expected)


def test_a_rank_local_index_that_is_a_fifo_is_refused(tmp_path) -> None:
    d = _ours(tmp_path / "ckpt")
    os.rename(os.path.join(d, "tensorstore_h5.json"), os.path.join(d, "tensorstore_h5.rank00001.json"))
    index = os.path.join(d, "tensorstore_h5.rank00000.json")
    _make(index, "fifo")
    _check(_run([("rank", d)]), {("rank", d): (index, "FIFO")})


def test_the_index_path_itself_that_is_a_fifo_is_refused(tmp_path) -> None:
    """Opening the index file by its own path (a FIFO there)."""
    d = _hf(tmp_path / "hf")
    index = os.path.join(d, "model.safetensors.index.json")
    _make(index, "fifo")
    calls = [(call, index) for call in ("open", "load", "ls", "info")]
    _check(_run(calls), {c: (index, "FIFO") for c in calls})


# ---------------------------------------------------------------------------- shards and single files


def test_a_shard_that_is_not_a_regular_file_is_refused(tmp_path) -> None:
    """A rank's file that is a FIFO (read when a tensor needs it: the listing, which reads only
    the index, may succeed), a Hugging Face shard that is a FIFO or a directory (read when
    the directory is opened)."""
    calls, expected = [], {}
    ours = _ours(tmp_path / "ours")
    victim = os.path.join(ours, sorted(n for n in os.listdir(ours) if n.endswith(".h5"))[1])
    _make(victim, "fifo")
    for call in ("open", "load", "verify", "dcp", "ls", "info"):
        calls.append((call, ours))
        if call not in ("ls", "info"):
            expected[call, ours] = (victim, "FIFO")
    for kind in ("fifo", "directory"):
        hf = _hf(tmp_path / f"hf_{kind}")
        victim = os.path.join(hf, "model-00002-of-00002.safetensors")
        _make(victim, kind)
        for call in ("open", "load", "ls", "info", "verify"):
            calls.append((call, hf))
            expected[call, hf] = (victim, *WORDS[kind])
    _check(_run(calls), expected)


def test_a_single_file_that_is_not_a_regular_file_is_refused(tmp_path) -> None:
    calls, expected = [], {}
    for kind in ("fifo", "fifo_link", "socket"):
        path = str(tmp_path / f"{kind}.h5")
        _make(path, kind)
        for call in ("open", "load", "ls", "info"):
            calls.append((call, path))
            expected[call, path] = (path, *WORDS[kind])
    _check(_run(calls), expected)


def test_a_nul_in_a_path_is_the_librarys_error(tmp_path) -> None:
    """A NUL in a file's path, in a directory's path, and in a shard name of a Hugging Face index
    (a bare ValueError before); the message shows it as ``\\0``."""
    hf = _hf(tmp_path / "hf", names=("model-00001-of-00002.safetensors", "evil\0.safetensors"))
    shown = {str(tmp_path / "x\0y.h5"): str(tmp_path / "x\\0y.h5"), str(tmp_path) + "/d\0": str(tmp_path) + "/d\\0",
             hf: os.path.join(hf, "evil\\0.safetensors")}  # path -> how the message shows it
    calls = [(call, p) for p in shown for call in ("open", "load", "ls")]
    _check(_run(calls), {(call, p): (shown[p], "NUL") for call, p in calls})


def test_symlinks_to_regular_files_load(tmp_path) -> None:
    """The Hugging Face cache's layout (a snapshot of symlinks into blobs/), an index that is a
    symlink, and a single file that is one: all load."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    _hf(blobs)
    snap.mkdir(parents=True)
    for name in os.listdir(blobs):
        os.symlink(os.path.relpath(blobs / name, snap), snap / name)
    ours = _ours(tmp_path / "ours")
    os.rename(os.path.join(ours, "tensorstore_h5.json"), tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", os.path.join(ours, "tensorstore_h5.json"))
    th5.save({"w": torch.arange(6.0)}, tmp_path / "real.h5")
    os.symlink(tmp_path / "real.h5", tmp_path / "link.h5")
    paths = [str(snap), ours, str(tmp_path / "link.h5")]
    calls = [(call, p) for p in paths for call in ("open", "load", "ls", "info")]
    _check(_run(calls), {c: None for c in calls})
    got = th5.load(snap)
    assert all(torch.equal(got[k], t) for k, t in _hf_tensors().items()) and len(got) == 3
    assert torch.equal(th5.load(tmp_path / "link.h5")["w"], torch.arange(6.0))


# ---------------------------------------------------------------------------- DCP directories


@pytest.mark.filterwarnings(NO_DIST)
def test_a_dcp_filesystem_writer_metadata_is_named_never_opened(tmp_path) -> None:
    """A FileSystemWriter checkpoint whose ``.metadata`` is a FIFO, /dev/zero, a directory or a
    4 GiB sparse file, and whose ``.distcp`` files are FIFOs: refused at once, naming
    ``.metadata``, which is never opened (it is pickled). The command names the directory."""
    calls, expected = [], {}
    for kind in ("fifo", "devzero", "directory", "huge"):
        d = _fs_writer(tmp_path / kind)
        meta = os.path.join(d, ".metadata")
        _make(meta, kind)
        for name in os.listdir(d):
            if name.endswith(".distcp"):
                _make(os.path.join(d, name), "fifo")
        for call in ("open", "load", "dcp_metadata", "dcp", "ls"):
            calls.append((call, d))
            expected[call, d] = (d,) if call == "ls" else (meta, "pickled")
    _check(_run(calls), expected)


# ---------------------------------------------------------------------------- the helpers, in process


class StillRunning(Exception):
    """Raised by :func:`alarm` (not an OSError, which the code under test may catch)."""


@pytest.fixture
def alarm():
    """Fail (instead of hanging the suite) a test still running after CALL_SECONDS."""
    def fire(*_):
        raise StillRunning(f"still running after {CALL_SECONDS} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_open_regular_and_read_small(tmp_path, monkeypatch, alarm) -> None:
    from tensorstore_h5.storage import files

    f = tmp_path / "f.json"
    f.write_bytes(b"[1, 2]")
    fd = files.open_regular(f, "index")
    try:
        assert os.get_blocking(fd) and not os.get_inheritable(fd)
    finally:
        os.close(fd)
    assert files.read_small(f, 6) == b"[1, 2]"
    with pytest.raises(th5.FormatError, match=r"f\.json: the index is 6 bytes, more than the 5 B"):
        files.read_small(f, 5, "index")
    with pytest.raises(FileNotFoundError, match=r"absent.json: No such file or directory \(the index\)") as e:
        files.read_small(tmp_path / "absent.json", what="index")
    assert isinstance(e.value, th5.TensorStoreError) and e.value.filename == str(tmp_path / "absent.json")
    os.mkfifo(tmp_path / "p")
    with pytest.raises(th5.FormatError, match="p: the index is a FIFO"):
        files.read_small(tmp_path / "p", what="index")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)  # (the tests run as root, whom chmod does not stop)
    with pytest.raises(PermissionError, match=r"f.json: Permission denied \(cannot read the index\)") as e:
        files.open_regular(f, "index")
    assert isinstance(e.value, th5.TensorStoreError)


def test_a_fifo_among_a_directorys_temporaries_does_not_block_a_save(tmp_path, alarm) -> None:
    """The sweep after a commit opens index temporaries to see whether a live writer holds
    them: a FIFO with such a name is left alone."""
    from tensorstore_h5 import sharded

    d = _ours(tmp_path / "ckpt")
    fifo = os.path.join(d, f".tensorstore_h5.json.{'0' * 32}.partial")
    os.mkfifo(fifo)
    with open(os.path.join(d, "tensorstore_h5.json"), "rb") as f:
        obj = json.load(f)
    sharded.commit_index(d, obj)
    assert os.path.exists(fifo)


def test_an_index_over_the_cap_is_never_committed(tmp_path, monkeypatch) -> None:
    from tensorstore_h5.errors import WriteError
    from tensorstore_h5.sharded import index

    d = _ours(tmp_path / "ckpt")
    with open(os.path.join(d, "tensorstore_h5.json"), "rb") as f:
        obj = json.load(f)
    before = sorted(os.listdir(d))
    monkeypatch.setattr(index, "MAX_INDEX_BYTES", 100)
    with pytest.raises(WriteError, match="tensorstore_h5.json: the index would be .* more than"):
        index.commit_index(d, obj)
    assert sorted(os.listdir(d)) == before
