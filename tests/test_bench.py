"""The benchmark's parts that do not need a quiet machine: skipped peers, opt-in groups, ratios."""

from __future__ import annotations

import os

import pytest

from tensorstore_h5.bench import contenders, measure, runner


def test_a_contender_that_cannot_run_is_listed_as_skipped(tmp_path, monkeypatch) -> None:
    def missing(ctx):
        measure.peer("no_such_peer_module", "no-such-peer")

    monkeypatch.setitem(contenders.CONTENDERS, "R.no such peer", ("read", missing))
    out = runner.worker("R.no such peer", contenders.Ctx(str(tmp_path), 1000, 4))
    assert out == {"name": "R.no such peer", "skip": "no_such_peer_module is not installed (pip install no-such-peer)"}


def test_cold_and_gpu_groups_are_opt_in() -> None:
    assert all(n.startswith("C.") and n in contenders.CONTENDERS for n in runner.COLD_ORDER)
    assert not any(n.startswith(("C.", "G.")) for n in runner.ORDER)
    assert all(contenders.CONTENDERS[n][0] == "cold" for n in runner.COLD_ORDER)


def test_cold_contenders_skip_without_root(tmp_path, monkeypatch) -> None:
    import builtins

    real = builtins.open

    def no_root(path, *a, **k):
        if str(path) == "/proc/sys/vm/drop_caches":
            raise PermissionError(13, "Permission denied")
        return real(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_root)
    (tmp_path / "ckpt.h5").write_bytes(b"x" * 100)
    out = runner.worker("C.L.buffered reads of the file, 2 threads (cold)", contenders.Ctx(str(tmp_path), 1000, 4))
    assert "skip" in out and "run as root" in out["skip"]


def _row(name: str, best: float, median: float | None = None, nbytes: int = 10**9) -> dict:
    return {"name": name, "best_s": best, "median_s": median or best, "bytes": nbytes, "peak_mib": 0}


def test_new_ratios_are_printed_with_their_targets() -> None:
    rows = [_row("R.tensorstore_h5 load", 1.0), _row("R.tensorstore_h5 load(verify=False)", 1.0 / 1.1),
            _row("R.tensorizer TensorDeserializer", 2.0), _row("W.torch.save", 4.0),
            _row("W.tensorstore_h5 save_async: the caller's stall", 0.8), _row("C.tensorstore_h5 load (cold)", 2.0),
            _row("C.torch.load(mmap) + touch (cold)", 2.5), _row("C.safetensors load_file + touch (cold)", 1.6),
            _row("C.L.O_DIRECT reads of the file, 2 threads (cold)", 1.8)]
    lines: list[str] = []
    runner._ratios(rows, lines.append)
    text = "\n".join(lines)
    assert "load vs tensorizer (>= 1)" in text and " 2.00" in text
    assert "time: load / load(verify=False) (the cost of the default check)" in text and " 1.10" in text
    assert "time: save_async stall / torch.save (<= 0.3)" in text and " 0.20" in text
    assert "cold load vs the best cold peer (safetensors load_file + touch (cold); >= 1)" in text and " 0.80" in text
    assert "cold load / O_DIRECT disk limit (>= 0.9)" in text and " 0.90" in text


@pytest.mark.parametrize("direct", [False, True])
def test_the_disk_limit_reads_every_byte(tmp_path, direct) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 4096 * 5)  # 5 MiB: a partial last piece
    assert measure.read_file(str(path), direct, threads=2, piece=2 << 20) == 5 * 2**20


def test_past_ram_measures_every_operation_on_a_key_by_key_file(tmp_path) -> None:
    import os

    from tensorstore_h5.bench import past_ram as bench_past_ram

    if os.geteuid() != 0:
        pytest.skip("drops the page cache: needs root")
    lines: list[str] = []
    rows = bench_past_ram.run(0.02, keys=40, workdir=str(tmp_path), settle=0, echo=lines.append)
    assert [r["op"] for r in rows] == list(bench_past_ram.OPS)
    write, stream, select, slices = rows[0], rows[3], rows[4], rows[5]
    assert write["bytes"] == stream["bytes"] == stream["file_data"] > 0.9 * 0.02e9
    assert 0 < select["bytes"] < 0.1 * stream["bytes"] and 0 < slices["bytes"] < 0.05 * stream["bytes"]  # 1 key of 40
    assert rows[1]["bytes"] == rows[2]["bytes"] == stream["file_bytes"]
    assert rows[6]["written"] > stream["file_data"]  # a safetensors copy of every tensor, then removed
    assert any(line.startswith("stream every tensor (items)") for line in lines)
    assert os.listdir(tmp_path) == []  # the files are removed


def test_the_package_is_imported_before_the_timed_operation(tmp_path) -> None:
    """tensorstore_h5 resolves its public API on first use; a fresh worker imports it in its
    set-up, so no contender's time includes importing (or compiling) the package."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from tensorstore_h5.bench import contenders, measure, runner\n"
        "seen = {}\n"
        "def setup(ctx):\n"
        "    return (lambda: seen.setdefault('api', 'tensorstore_h5.api' in sys.modules)), 0\n"
        "contenders.CONTENDERS['X.probe'] = ('keys', setup)\n"
        f"runner.worker('X.probe', contenders.Ctx({str(tmp_path)!r}, 0, 0))\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"api": True}


def test_a_warm_contender_finds_its_files_in_the_page_cache(tmp_path) -> None:
    """A contender of a warm group reads its declared files once before the timed run: a file
    dropped from the page cache is cached again when the operation starts (RWF_NOWAIT reads
    of its first and last bytes succeed); a writer's files are left as they are."""
    from tensorstore_h5.bench import contenders, runner

    if not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"):
        pytest.skip("needs RWF_NOWAIT and posix_fadvise")
    path = tmp_path / "in.bin"
    path.write_bytes(os.urandom(3 << 20))

    def dropped() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def cached() -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            for at in (0, (3 << 20) - 4096):
                os.preadv(fd, [bytearray(4096)], at, os.RWF_NOWAIT)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    seen = {}
    for group in ("read", "write"):
        probe = (lambda ctx, g=group: ((lambda: seen.setdefault(g, cached())), 0))
        contenders.contender(f"X.{group}", group, reads=("in.bin",))(probe)
    try:
        dropped()
        if cached():
            pytest.skip("this file system keeps the file cached despite POSIX_FADV_DONTNEED")
        runner.worker("X.read", contenders.Ctx(str(tmp_path), 0, 0))
        dropped()
        runner.worker("X.write", contenders.Ctx(str(tmp_path), 0, 0))
    finally:
        for group in ("read", "write"):
            contenders.CONTENDERS.pop(f"X.{group}")
            contenders.READS.pop(f"X.{group}")
    assert seen == {"read": True, "write": False}


def test_remote_bench_measures_every_operation_and_counts_bytes_on_the_server() -> None:
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from tensorstore_h5.bench import remote as bench_remote

    lines: list[str] = []
    rows = bench_remote.run(0.02, keys=20, repeat=2, latencies=(0.0,), echo=lines.append)
    by = {r["name"]: r for r in rows}
    assert len(rows) == 9 and all(r["seconds"] <= r["median_seconds"] for r in rows)
    full, select = by["tensorstore_h5 load(url)"], by["tensorstore_h5 select 1% of keys"]
    through_fsspec = by[bench_remote.FSSPEC_LOAD]  # the same load through fsspec's session: the same bytes
    assert through_fsspec["moved_mb"] == pytest.approx(full["moved_mb"], rel=0.05) and through_fsspec["requests"] > 0
    for raw in (bench_remote.SOCKETS, bench_remote.SOCKETS_FRESH):  # the same bytes as the load's tensors
        assert by[raw]["moved_mb"] * 1e6 == by["raw limit: concurrent range GETs of the data"]["moved_mb"] * 1e6 \
            >= full["bytes"]
    assert full["moved_mb"] * 1e6 >= full["bytes"] > 0.9 * 0.02e9  # every tensor byte crossed the wire
    assert select["bytes"] <= select["moved_mb"] * 1e6 < 0.2 * full["bytes"]  # 1 key of 20 (+ the layout)
    assert any("full load / raw limit" in line for line in lines)
    assert any("full load / raw limit by plain sockets, fresh memory" in line for line in lines)
    assert any("full load: own HTTP client vs fsspec's" in line for line in lines)
    from tensorstore_h5.storage import remote

    assert remote.PLAIN_HTTP is True  # the fsspec row set it back


def test_bench_dir_is_made_when_it_does_not_exist(tmp_path) -> None:
    """``bench --dir`` names a folder for the files; one that is not there yet is made (it
    raised FileNotFoundError from mkdtemp)."""
    from tensorstore_h5.bench import runner

    where = tmp_path / "not" / "yet"
    lines: list[str] = []
    rows = runner.run(0.001, keys=4, repeat=1, only="L.memcpy 1 thread", workdir=str(where), settle=0,
                      echo=lines.append)
    assert where.is_dir() and [r["name"] for r in rows] == ["L.memcpy 1 thread (touched)"], (rows, lines)
    assert list(where.iterdir()) == []  # its own temporary folder inside is removed afterwards


def test_a_failing_contender_costs_its_row_not_the_run(tmp_path, monkeypatch) -> None:
    """A worker that fails (a peer that breaks on the machine) is reported with the reason after
    the others were measured, and the run then raises: a GPU check runs once, so one broken
    peer must not lose the rest of its table."""
    calls: list[str] = []

    def fake(name, ctx, not_before=0.0, settle=0.0, profile=0):
        calls.append(name)
        if name == "L.readinto touched, 2 threads":
            raise RuntimeError(f"contender {name!r} failed:\nTraceback ...\nOSError: libcudart.so: cannot open")
        return {"name": name, "seconds": 0.1, "bytes": 10**9, "peak_bytes": 0}

    monkeypatch.setattr(runner, "_run_worker", fake)
    names = ["L.readinto fresh, 2 threads", "L.readinto touched, 2 threads", "L.memcpy 1 thread (touched)"]
    lines: list[str] = []
    with pytest.raises(runner.ContenderFailed, match="1 contender"):
        runner.run(size_gb=0.001, repeat=2, only=",".join(names), echo=lines.append, settle=0,
                   out=str(tmp_path / "r.json"))
    assert calls.count("L.readinto touched, 2 threads") == 1 and calls.count("L.memcpy 1 thread (touched)") == 2
    assert any(line.startswith("L.readinto touched, 2 threads") and "FAILED: OSError: libcudart.so" in line
               for line in lines)
    assert any(line.startswith("L.memcpy 1 thread (touched)") and "GB/s" in line for line in lines)
    import json

    saved = json.loads((tmp_path / "r.json").read_text())
    measured = [r["name"] for r in saved["rows"]]
    assert names[0] in measured and names[2] in measured and names[1] not in measured
    assert list(saved["failed"]) == [names[1]]


def test_gpu_ratios_name_each_target_and_the_limit_is_the_slower_stage() -> None:
    from tensorstore_h5.bench import gpu

    o = f" {gpu.OPTIM}"
    rows = [_row("G.L.file read into pinned memory, I/O threads", 0.05), _row("G.L.pinned host-to-device copy", 0.04),
            _row("G.tensorstore_h5 load(device=cuda)", 0.1), _row("G.fastsafetensors fastsafe_open(nogds) + get_tensor", 0.2),
            _row("G.tensorstore_h5 load(device=cuda, verify=False)", 0.0625),
            _row("G.L.file read into pinned memory, I/O threads" + o, 0.01), _row("G.L.pinned host-to-device copy" + o, 0.02),
            _row("G.tensorstore_h5 load(device=cuda)" + o, 0.04),
            _row("G.tensorstore_h5 1% row slice of every tensor (cuda)", 0.01),
            _row("G.safetensors get_slice 1% rows of every tensor (cuda)", 0.03)]
    lines: list[str] = []
    runner._ratios(rows, lines.append)
    text = "\n".join(lines)
    assert "GPU load / min(read pinned, H2D) (>= 0.85)" in text and "  0.50   0.50" in text
    assert "GPU load of 6,000 tensors / min(read pinned, H2D) (>= 0.85)" in text and "  0.50" in text
    unchecked = [line for line in lines if "GPU load, verify=False / min(read pinned, H2D)" in line]
    assert len(unchecked) == 1 and unchecked[0].split()[-2:] == ["0.80", "0.80"]
    assert "GPU load of 6,000 tensors, verify=False" not in text  # (no such row: no line)
    assert "GPU load vs fastsafetensors (>= 1)" in text and "  2.00" in text
    assert "1% row slices to the GPU vs safetensors" in text and "  3.00" in text
    assert "GPU load: peak host RSS growth (MiB; <= 256)" in text
