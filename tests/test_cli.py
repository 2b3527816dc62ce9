"""The command line, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import tensorstore_h5 as th5

GOLDEN = Path(__file__).parent / "data" / "v1.h5"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorstore_h5", *args], capture_output=True, text=True, timeout=300)


def test_demo_runs_and_checks_itself() -> None:
    r = run("demo", "--layers", "2", "--width", "64")
    assert r.returncode == 0, r.stderr
    assert "bitwise equal: True" in r.stdout and r.stdout.strip().endswith("demo OK")


def test_ls_and_info_json() -> None:
    r = run("ls", str(GOLDEN), "model/*", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["key"]: row for row in json.loads(r.stdout)}
    assert rows["model/head.weight"]["same_as"] == "model/embed.weight"
    assert rows["model/enc.0.bias"]["dtype"] == "bfloat16" and all(k.startswith("model/") for k in rows)
    r = run("info", str(GOLDEN), "--json")
    info = json.loads(r.stdout)
    assert info["format_version"] == 1 and info["metadata"] == {"note": "golden v1"} and info["tensors"] == 10


def test_ls_text_and_verify(tmp_path) -> None:
    th5.save({"w": torch.zeros(3, 4), "n": 5}, tmp_path / "f.h5")
    r = run("ls", str(tmp_path / "f.h5"))
    assert r.returncode == 0 and "w" in r.stdout and "[3, 4]" in r.stdout and "int" in r.stdout
    r = run("verify", str(tmp_path / "f.h5"))
    assert r.returncode == 0 and "OK, 2 keys" in r.stdout


def test_user_errors_exit_nonzero_without_traceback(tmp_path) -> None:
    bad = tmp_path / "bad.h5"
    bad.write_text("not hdf5")
    for args in (("info", str(bad)), ("ls", str(tmp_path / "missing.h5"))):
        r = run(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("tensorstore-h5: error:")
    r = run("frobnicate")
    assert r.returncode == 2


def test_bench_runs_a_small_selection(tmp_path) -> None:
    out = tmp_path / "b.json"
    r = run("bench", "--size-gb", "0.002", "--keys", "16", "--repeat", "1", "--only", "K.,S.tensorstore_h5 save", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"K.tensorstore_h5 open + keys() (10,000 keys)", "K.safetensors safe_open + keys() (10,000 keys)",
                         "K.tensorstore_h5 load (10,000 keys)", "K.safetensors load_file (10,000 keys)",
                         "S.tensorstore_h5 save small objects"}
    assert all(row["best_s"] > 0 for row in rows.values()) and "time: open+keys 10k" in r.stdout
    assert "load of 10k small tensors vs safetensors load_file" in r.stdout


def test_bench_gpu_contenders_are_opt_in() -> None:
    from tensorstore_h5.bench import contenders, runner

    assert all(n.startswith("G.") and n in contenders.CONTENDERS for n in runner.GPU_ORDER)
    assert not any(n.startswith("G.") for n in runner.ORDER)  # a plain bench never needs CUDA
    if torch.cuda.is_available():
        return
    r = run("bench", "--gpu", "--only", "G.", "--size-gb", "0.001", "--repeat", "1")
    assert r.returncode == 1 and "CUDA is not available" in r.stderr


def test_bench_ratios_use_the_better_fresh_memory_limit() -> None:
    from tensorstore_h5.bench import runner

    def row(name: str, seconds: float, nbytes: int = 10**9) -> dict:
        return {"name": name, "best_s": seconds, "median_s": 2 * seconds, "bytes": nbytes, "peak_mib": 0}

    rows = [row("L.readinto fresh, 2 threads", 0.5), row("L.readinto fresh, 2 threads + huge pages", 0.25),
            row("R.tensorstore_h5 load", 0.4), row("R.tensorstore_h5 load (io.HUGEPAGES = True)", 0.8),
            row("R.tensorstore_h5 select 1% of keys", 0.02, 25 * 10**6)]
    lines: list[str] = []
    runner._ratios(rows, lines.append)
    got = {line.rsplit(None, 2)[0].strip(): tuple(map(float, line.rsplit(None, 2)[1:])) for line in lines if line.startswith("  ")}
    assert got["load (default) / best raw readinto fresh (target >= 0.9)"] == (0.62, 0.62)  # 0.25 / 0.4, against huge pages
    assert got["load (better of 4 KiB / huge pages) / best raw readinto fresh"] == (0.62, 0.62)
    assert got["time: select 1% of keys / full load (<= 0.02; 2.5% of the bytes)"] == (0.05, 0.05)  # 0.02 / 0.4
    rows[2]["median_s"] = 0.4  # the medians' ratio is its own: 0.5 / 0.4
    lines.clear()
    runner._ratios(rows, lines.append)
    assert any(line.split()[-2:] == ["0.62", "1.25"] for line in lines if line.strip().startswith("load (default)"))
    gpu = [row("G.L.file read into pinned memory, I/O threads", 0.5), row("G.L.pinned host-to-device copy", 0.2),
           row("G.tensorstore_h5 load(device=cuda)", 0.625)]
    gpu[1]["median_s"] = 2.0  # the slower stage bounds each statistic on its own: best 0.5 s, median 2.0 s
    lines.clear()
    runner._ratios(gpu, lines.append)
    assert any(line.split()[-2:] == ["0.80", "1.60"] for line in lines if line.strip().startswith("GPU load / min(read pinned, H2D)"))


def test_bench_detects_free_page_reporting(tmp_path, monkeypatch) -> None:
    import glob

    from tensorstore_h5.bench import measure

    features = tmp_path / "features"
    monkeypatch.setattr(glob, "glob", lambda pattern: [str(features)] if "virtio_balloon" in pattern else [])
    features.write_text("01100101" + "0" * 56 + "\n")  # bit 5: VIRTIO_BALLOON_F_REPORTING
    assert measure.reports_free_pages() and measure.settle_seconds() == 3.0
    features.write_text("01100001" + "0" * 56 + "\n")  # a balloon without reporting
    assert not measure.reports_free_pages() and measure.settle_seconds() == 0.0
    features.unlink()  # no balloon at all
    assert not measure.reports_free_pages()


def test_bench_worker_waits_before_timing_not_inside_it(monkeypatch) -> None:
    import time

    from tensorstore_h5.bench import contenders, runner

    monkeypatch.setitem(contenders.CONTENDERS, "R.test no-op", ("read", lambda ctx: ((lambda: None), 1)))
    t0 = time.time()
    result = runner.worker("R.test no-op", contenders.Ctx("/nonexistent", 1, 1), not_before=t0 + 0.3)
    assert time.time() - t0 >= 0.3 and result["seconds"] < 0.05


def test_bench_settles_reads_and_writes_not_touched_memory(monkeypatch) -> None:
    import time

    from tensorstore_h5.bench import contenders, runner

    calls: list[tuple[str, float, float]] = []

    def fake(name: str, ctx: contenders.Ctx, not_before: float = 0.0, settle: float = 0.0, profile: int = 0) -> dict:
        calls.append((name, not_before, time.time()))
        return {"name": name, "seconds": 0.1, "bytes": 10**9, "peak_bytes": 0}

    monkeypatch.setattr(runner, "_run_worker", fake)
    names = ["L.write raw bytes", "L.readinto fresh, 2 threads", "L.readinto touched, 2 threads", "R.tensorstore_h5 load"]
    runner.run(size_gb=0.001, repeat=1, only=",".join(names), echo=lambda line: None, settle=2.5)
    timed = [c for c in calls if c[0] in names][-len(names):]  # after the untimed set-up runs
    assert [c[0] for c in timed] == names
    waits = {name: not_before - (timed[i - 1][2] if i else 0) for i, (name, not_before, _) in enumerate(timed)}
    assert timed[2][1] == 0.0  # a read into touched memory
    for name in ("L.write raw bytes", "L.readinto fresh, 2 threads", "R.tensorstore_h5 load"):
        assert 2.5 <= waits[name] < 2.6 or name == names[0], (name, waits)
    assert timed[0][1] >= calls[-len(names) - 1][2] + 2.5 - 1e-3  # the writer: after the last set-up run exited
    calls.clear()
    runner.run(size_gb=0.001, repeat=1, only="L.readinto fresh, 2 threads", echo=lambda line: None, settle=0)
    assert calls[-1][1] <= calls[-1][2]  # --settle 0: nothing to wait for


def test_bench_worker_settles_after_its_own_set_up_removed_a_file(tmp_path, monkeypatch) -> None:
    import time

    from tensorstore_h5.bench import contenders, measure, runner

    old = tmp_path / "out.bin"

    def setup(ctx: contenders.Ctx) -> contenders.Timed:
        old.write_bytes(b"x")
        path = measure.fresh(str(old))  # frees the old output's pages now
        return (lambda: open(path, "wb").close()), 1

    for group, waits in (("write", True), ("touched", False)):
        monkeypatch.setitem(contenders.CONTENDERS, f"X.{group}", (group, setup))
        t0 = time.time()
        result = runner.worker(f"X.{group}", contenders.Ctx(str(tmp_path), 1, 1), not_before=0.0, settle=0.4)
        assert (time.time() - t0 >= 0.4) is waits and result["seconds"] < 0.2, group
    monkeypatch.setitem(contenders.CONTENDERS, "X.nothing to remove", ("write", lambda ctx: ((lambda: None), 1)))
    t0 = time.time()
    runner.worker("X.nothing to remove", contenders.Ctx(str(tmp_path), 1, 1), settle=5.0)
    assert time.time() - t0 < 2.0  # nothing freed in its set-up: only not_before counts


def test_bench_profile_names_where_the_time_goes(monkeypatch) -> None:
    from tensorstore_h5.bench import contenders, runner

    def slow_part() -> None:
        sum(range(200_000))

    def setup(ctx: contenders.Ctx) -> contenders.Timed:
        return (lambda: [slow_part() for _ in range(3)]), 1

    monkeypatch.setitem(contenders.CONTENDERS, "X.profiled", ("touched", setup))
    result = runner.worker("X.profiled", contenders.Ctx("/nonexistent", 1, 1), profile=5)
    lines = result["profile"].splitlines()
    assert lines[0].split()[:3] == ["own", "ms", "cum"] and len(lines) <= 6
    mine = [line for line in lines if "slow_part" in line]
    assert mine and mine[0].split()[2] == "3"  # called three times
    assert "profile" not in runner.worker("X.profiled", contenders.Ctx("/nonexistent", 1, 1))


def test_bench_cli_passes_settle_and_profile(monkeypatch) -> None:
    from tensorstore_h5 import cli
    from tensorstore_h5.bench import runner

    seen: dict = {}
    monkeypatch.setattr(runner, "run", lambda *a, **kw: seen.update(kw))
    assert cli.main(["bench", "--only", "K.", "--settle", "0", "--profile", "7"]) == 0
    assert seen["settle"] == 0.0 and seen["profile"] == 7
    assert cli.main(["bench", "--only", "K."]) == 0
    assert seen["settle"] is None and seen["profile"] == 0


def test_bench_writers_start_with_the_page_cache_flushed(monkeypatch) -> None:
    import os

    from tensorstore_h5.bench import contenders, runner

    synced: list[str] = []
    monkeypatch.setattr(os, "sync", lambda: synced.append("sync"))
    for group in ("write", "replace", "read"):
        monkeypatch.setitem(contenders.CONTENDERS, f"X.{group}", (group, lambda ctx: ((lambda: synced.append("op")), 1)))
        runner.worker(f"X.{group}", contenders.Ctx("/nonexistent", 1, 1))
    assert synced == ["sync", "op", "sync", "op", "op"]


def test_ls_and_info_pause_the_collector_only_while_they_list(tmp_path, capsys) -> None:
    """ls and info build every entry of a file with the cyclic collector off (objects in no
    cycle), and leave it as they found it, also when the listing fails."""
    import gc

    from tensorstore_h5 import cli

    path = tmp_path / "f.h5"
    th5.save({f"k{i}": torch.full((2,), float(i)) for i in range(50)}, path)
    seen = []
    real = cli._leaf_info
    try:
        cli._leaf_info = lambda store, key: seen.append(gc.isenabled()) or real(store, key)  # type: ignore[assignment]
        for was in (False, True):
            (gc.enable if was else gc.disable)()
            assert cli.main(["ls", str(path)]) == 0 and cli.main(["info", str(path)]) == 0
            assert gc.isenabled() is was

        def damaged(store, key):
            raise th5.FormatError(f"{path}: damaged layout entry (key {key!r})")

        cli._leaf_info = damaged  # type: ignore[assignment]
        assert cli.main(["ls", str(path)]) == 1 and gc.isenabled()  # on before (the loop's last pass), on after
    finally:
        cli._leaf_info = real  # type: ignore[assignment]
        gc.enable()
    assert seen == [False] * 100
    out = capsys.readouterr().out
    assert "k49" in out and "50 tensors" in out
