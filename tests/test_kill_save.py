"""``kill -9`` in the middle of a large save (issue #30): the earlier file at the path stays
bitwise intact and loads, the killed save's temporary is harmless and the next save removes
it, and that next save succeeds.

A controller process imports the library once, saves the earlier checkpoint, builds a
300 MB one and, for each way of saving it (``th5.save``, ``th5.save(compression="zstd")``,
``th5.save_async``), first times a complete save of it elsewhere, then forks children that
save it over the earlier file and SIGKILLs each when its temporary holds 5 %, 30 %, 60 %
and 95 % of the complete file's bytes (deterministic points: the temporary's size, polled
every millisecond, not a timer). After each kill it checks the path; after the four kills,
one more save of the same checkpoint, not killed, must succeed and leave no temporary.

Also: special files named like a save's temporary, or at the path being saved, never block
a save (``sweep_partials`` and the file to be replaced are opened without blocking)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork and Linux")

REPO = Path(__file__).parents[1]
MODES = ("save", "zstd", "async")
POINTS = (0.05, 0.30, 0.60, 0.95)
MEGABYTES = int(os.environ.get("TH5_KILL_SAVE_MB", "300"))

CONTROLLER = r'''
import glob, hashlib, json, os, shutil, signal, sys, time
import torch
torch.set_num_threads(1)  # no OpenMP pool in a process that forks (see SECURITY.md on forks)
import tensorstore_h5 as th5

d, megabytes, modes, points = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), [float(x) for x in sys.argv[4].split(",")]
path = os.path.join(d, "ckpt.h5")


def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def partials():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, ".ckpt.h5.*.partial")))


g = torch.Generator().manual_seed(9)
earlier = {"step": 1, "model": {"w": torch.randn(1024, 1024, generator=g), "b": torch.arange(100.0)}}
th5.save(earlier, path)
earlier_sha, earlier_copy = sha(path), os.path.join(d, "earlier.bak")
shutil.copyfile(path, earlier_copy)
n = megabytes * 2**20 // 4 // 6
new = {"step": 2, "model": {f"w{i}": torch.randn(n, generator=g) * 0.02 for i in range(6)}}


def child(mode, target):
    """Fork a child that saves ``new`` to ``target`` the way ``mode`` says; its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if mode == "async":
                th5.save_async(new, target).result()
            else:
                th5.save(new, target, compression="zstd" if mode == "zstd" else None)
            code = 0
        finally:
            os._exit(code)
    return pid


def wait(pid, limit=120.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def same_as_new(got):
    return got["step"] == 2 and all(torch.equal(got["model"][k], v) for k, v in new["model"].items())


def report(**r):
    sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.flush()


for mode in modes:
    ref = os.path.join(d, f"ref-{mode}.h5")
    start = time.monotonic()
    status = wait(child(mode, ref))
    seconds, size = time.monotonic() - start, os.path.getsize(ref) if os.path.exists(ref) else 0
    os.unlink(ref)
    report(mode=mode, point="reference", status=status, seconds=seconds, size=size)
    for point in points:
        pid = child(mode, path)
        start, status, killed_at = time.monotonic(), None, None
        while time.monotonic() - start < 120:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            for name in partials():
                try:
                    grown = os.stat(os.path.join(d, name)).st_size
                except FileNotFoundError:
                    continue
                if grown >= point * size:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = grown
                    break
            if killed_at is not None:
                status = os.waitpid(pid, 0)[1]
                break
            time.sleep(0.001)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        left = partials()
        intact = sha(path) == earlier_sha
        try:
            got = th5.load(path, verify=True)
            loads = got["step"] == 1 and all(torch.equal(got["model"][k], v) for k, v in earlier["model"].items())
        except Exception as e:  # noqa: BLE001 - reported
            loads = f"{type(e).__name__}: {e}"
        report(mode=mode, point=point, status=status, signaled=status is not None and os.WIFSIGNALED(status)
               and os.WTERMSIG(status) == signal.SIGKILL, killed_at=killed_at, size=size, intact=intact, loads=loads,
               partials=left, seconds=time.monotonic() - start)
    # the next save, not killed: it succeeds and sweeps what the killed ones left
    before = partials()
    status = wait(child(mode, path))
    try:
        ok = same_as_new(th5.load(path))
    except Exception as e:  # noqa: BLE001 - reported
        ok = f"{type(e).__name__}: {e}"
    report(mode=mode, point="after", status=status, loads=ok, partials_before=before, partials=partials())
    os.replace(earlier_copy, path)  # the earlier file again, for the next mode
    shutil.copyfile(path, earlier_copy)
os._exit(0)
'''


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[tuple[str, Any], dict[str, Any]]:
    d = tmp_path_factory.mktemp("kill-save")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CONTROLLER, str(d), str(MEGABYTES), ",".join(MODES), ",".join(map(str, POINTS))],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {(x["mode"], x["point"]): x for x in results}


@pytest.mark.parametrize("mode", MODES)
def test_a_complete_save_of_the_checkpoint_works(killed, mode) -> None:
    ref = killed[(mode, "reference")]
    assert ref["status"] == 0 and ref["size"] > (10 << 20), ref


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_save_killed_midway_leaves_the_earlier_file_intact(killed, mode, point) -> None:
    r = killed[(mode, point)]
    assert r["signaled"] and r["killed_at"] is not None, f"the save was not killed mid-way (it ended first): {r}"
    assert r["killed_at"] < r["size"]
    assert r["intact"], f"the earlier file changed: {r}"
    assert r["loads"] is True, f"the earlier file does not load as saved: {r}"
    assert all(name.startswith(".ckpt.h5.") and name.endswith(".partial") for name in r["partials"])


@pytest.mark.parametrize("mode", MODES)
def test_the_next_save_succeeds_and_removes_the_killed_saves_temporaries(killed, mode) -> None:
    r = killed[(mode, "after")]
    assert r["partials_before"], f"no temporary was left by the killed saves: {r}"
    assert r["status"] == 0 and r["loads"] is True, r
    assert r["partials"] == [], r


# ---------------------------------------------------------------------------- special files

SPECIAL = r'''
import json, os, signal, socket, sys, time
import torch
import tensorstore_h5 as th5
from tensorstore_h5.writing.writer import sweep_partials

d = sys.argv[1]


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


signal.signal(signal.SIGALRM, _alarm)
results = {}
for case in ("fifo-partial", "fifo-target", "symlink-partial", "directory-partial", "socket-partial", "device-partial"):
    target = os.path.join(d, case, "ckpt.h5")
    os.makedirs(os.path.dirname(target))
    decoy = os.path.join(d, case, ".ckpt.h5." + "0" * 32 + ".partial")
    victim = os.path.join(d, case, "victim.bin")
    with open(victim, "wb") as f:
        f.write(b"victim")
    if case == "fifo-partial":
        os.mkfifo(decoy)
    elif case == "fifo-target":
        os.mkfifo(target)
    elif case == "symlink-partial":
        os.symlink(victim, decoy)
    elif case == "directory-partial":
        os.mkdir(decoy)
    elif case == "socket-partial":
        s = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        os.chdir(os.path.dirname(decoy))  # a relative name: the full path may be longer than AF_UNIX allows
        s.bind(os.path.basename(decoy))
        os.chdir(here)
    else:
        os.symlink("/dev/zero", decoy)
    r = {}
    signal.setitimer(signal.ITIMER_REAL, float(sys.argv[2]))
    try:
        th5.save({"a": torch.arange(10.0)}, target)
        th5.save({"a": torch.arange(5.0)}, target, compression="zstd")
        r["swept"] = sweep_partials(target)
        r["loads"] = bool(torch.equal(th5.load(target)["a"], torch.arange(5.0)))
        r["outcome"] = "ok"
    except Hang:
        r["outcome"] = "hang"
    except BaseException as e:  # noqa: BLE001 - reported
        r.update(outcome="error", message=f"{type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    r["decoy_left"] = os.path.lexists(decoy) or case == "fifo-target"
    with open(victim, "rb") as f:
        r["victim_intact"] = f.read() == b"victim"
    results[case] = r
sys.stdout.write(json.dumps(results) + "\n")
sys.stdout.flush()
os._exit(0)
'''


def test_special_files_named_like_a_temporary_or_at_the_path_never_block_a_save(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SPECIAL), str(tmp_path), "20"], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for case, x in results.items():
        assert x["outcome"] == "ok", (case, x)
        assert x["loads"] and x["victim_intact"], (case, x)
        assert x["decoy_left"] and x["swept"] == [], (case, x)  # not a temporary of a save: left alone
