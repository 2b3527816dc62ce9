"""Saves are atomic for readers and for crashes: a reader sees the old file or the new one,
whole; a killed save leaves the old file intact and its temporary is removed by the next
save; disk full and read-only directories give a clear error and change nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.writing.writer import sweep_partials

SAVER = textwrap.dedent("""
    import sys, time, torch, tensorstore_h5 as th5
    path, compression, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    end, v = time.monotonic() + seconds, 1
    while time.monotonic() < end:
        obj = {f"w{i}": torch.full((64, 256), float(v)) for i in range(24)}
        obj["small"] = torch.tensor(float(v))
        obj["v"] = v
        th5.save(obj, path, compression=None if compression == "none" else compression)
        v += 1
    print(v)
""")


def _versions(obj: dict) -> set[float]:
    """The values held by every tensor of one load (one save wrote one value everywhere)."""
    found = {float(obj["v"])}
    for k, t in obj.items():
        if isinstance(t, torch.Tensor):
            found.update(torch.unique(t).tolist())
    return found


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_reader_never_mixes_two_saves(tmp_path, compression) -> None:
    path = tmp_path / "ckpt.h5"
    th5.save({f"w{i}": torch.zeros(64, 256) for i in range(24)} | {"small": torch.tensor(0.0), "v": 0}, path)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(path), compression, "6"], stdout=subprocess.PIPE, text=True)
    seen, loads = set(), 0
    try:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            for read in (lambda: th5.load(path), lambda: th5.load(path, mmap=True), lambda: dict(th5.open(path).items())):
                versions = _versions(read())
                assert len(versions) == 1, f"one load saw several saves: {sorted(versions)}"
                seen |= versions
                loads += 1
            with th5.open(path) as s:
                parts = {float(s[f"w{i}"][3:5, 7:9].unique()) for i in (0, 23)} | {float(s["small"][...])}
                assert len(parts) == 1, parts
    finally:
        out, _ = saver.communicate(timeout=60)
    assert saver.returncode == 0 and len(seen) > 3, (loads, seen, out)  # the file really was replaced meanwhile
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


KILLED = textwrap.dedent("""
    import sys, time, torch, tensorstore_h5 as th5
    print("saving", flush=True)
    with th5.Writer(sys.argv[1]) as w:  # 48 x 4 MiB, slowed so that every kill lands mid-save
        for i in range(48):
            w[f"w{i}"] = torch.full((1024, 1024), float(i))
            time.sleep(0.05)
""")


def test_killed_saves_leave_the_old_file_and_their_temporaries_are_swept(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    old = {"a": torch.arange(10.0), "b": torch.ones(3, 3)}
    th5.save(old, path)
    before = path.read_bytes()
    for delay in (0.05, 0.3, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert path.read_bytes() == before
        assert torch.equal(th5.load(path, verify=True)["a"], old["a"])
    stale = [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
    assert stale, "no save was killed mid-way (the delays were too long?)"
    th5.save(old | {"c": torch.zeros(2)}, path)
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


def test_a_live_saves_temporary_is_not_swept(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    with th5.Writer(path) as w:
        w["a"] = torch.ones(4)
        partial = [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
        assert len(partial) == 1
        th5.save({"b": torch.zeros(2)}, path)  # another save of the same target meanwhile
        assert sweep_partials(path) == [] and (tmp_path / partial[0]).exists()
        w["c"] = torch.ones(2)
    assert sorted(th5.load(path)) == ["a", "c"] and os.listdir(tmp_path) == ["ckpt.h5"]


@pytest.fixture()
def small_fs(tmp_path):
    """A 2 MiB tmpfs (root only; skipped elsewhere)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_gives_a_clear_error_and_keeps_the_old_file(small_fs) -> None:
    path = small_fs / "ckpt.h5"
    old = {"a": torch.arange(1000.0)}
    th5.save(old, path)
    before = path.read_bytes()
    with pytest.raises(th5.WriteError, match=r"ckpt.h5: cannot write key 'w\d+' \(no space left on the device\).*nothing"):
        th5.save({f"w{i}": torch.randn(256, 256) for i in range(8)}, path)  # 2 MiB of data
    assert path.read_bytes() == before and os.listdir(small_fs) == ["ckpt.h5"]


def test_read_only_directory_gives_a_clear_error_and_keeps_the_old_file(small_fs) -> None:
    path = small_fs / "ckpt.h5"
    th5.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(PermissionError, match="ckpt.h5: .*read-only file system; nothing was written"):
        th5.save({"a": torch.zeros(3)}, path)
    assert path.read_bytes() == before


def test_file_size_limit_is_a_write_error(tmp_path) -> None:
    """RLIMIT_FSIZE (another way a disk runs out): the same clear error, nothing left behind."""
    code = textwrap.dedent("""
        import resource, signal, sys, torch, tensorstore_h5 as th5
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            th5.save({"w": torch.zeros(1 << 20)}, sys.argv[1])
        except th5.WriteError as e:
            print("WriteError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.h5")], capture_output=True, text=True, timeout=120)
    assert "WriteError: " in out.stdout and "big.h5: cannot write key 'w'" in out.stdout, out.stdout + out.stderr
    assert os.listdir(tmp_path) == []


def test_missing_directory_names_it_not_the_temporary(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="the directory .*nowhere.* does not exist") as e:
        th5.save({"a": torch.ones(1)}, tmp_path / "nowhere" / "x.h5")
    assert ".partial" not in str(e.value)


def test_saving_over_a_directory_names_it(tmp_path) -> None:
    (tmp_path / "d.h5").mkdir()
    with pytest.raises(IsADirectoryError, match="d.h5 is a directory"):
        th5.save({"a": torch.ones(3)}, tmp_path / "d.h5")
    assert sorted(os.listdir(tmp_path)) == ["d.h5"]


def test_sync_saves_are_durable_renames(tmp_path, monkeypatch) -> None:
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    th5.save({"a": torch.ones(3)}, tmp_path / "s.h5", sync=True)
    assert len(synced) == 2  # the file before the rename, its directory after
    th5.save({"a": torch.ones(3)}, tmp_path / "n.h5")
    assert len(synced) == 2
    assert Path(tmp_path / "s.h5").exists()
