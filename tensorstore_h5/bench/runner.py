"""``tensorstore-h5 bench``: tensorstore_h5 against the machine's limits and every peer, in one run.

Each contender runs in a fresh subprocess (``python -m tensorstore_h5.bench worker NAME DIR``),
best and median of ``--repeat`` runs, taken in rounds over all contenders (so a slow spell of a
shared machine lands on every contender, not on one); a contender that reads a file in the page
cache reads it once, untimed, before its timed run (:func:`_warm`), so the figures are memory
and page-cache speeds. GB/s are 10**9 bytes of tensor data per second. ``peak`` is the growth
of peak RSS during the timed operation (MiB), measured by resetting the kernel's high-water
mark (``/proc/self/clear_refs``) just before it. A full garbage collection runs before each
timed operation: in a fresh process that has imported torch, the first full collection costs
~80 ms (measured) and would otherwise land in whichever short operation happens to trigger it.
Writers start with their output removed (see bench/README.md); the ``replace`` group measures
saving over a file that still exists. On a virtual machine that reports free memory to its
hypervisor (:func:`reports_free_pages`), every read that faults in fresh memory and every
writer starts ``--settle`` seconds (default 3) after memory was last freed (the previous
worker's exit, its own set-up's removing a file), so that none of them gets memory the host has
not yet taken back while another does; writers also start with the page cache flushed (see
bench/README.md). ``--profile`` shows where each contender's time goes.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from . import measure
from .contenders import CONTENDERS, Ctx, READS, prepare_keys_files
from .compare import DIFF_ORDER
from .firstcall import FIRST_CALL_ORDER, Measured
from .gpu import DEVICE_ENV, GPU_ORDER, OPTIM, gpu_ratios, prepare_gpu_files
from .measure import Skip, reset_peak, settle_seconds, status, warm

__all__ = ["ORDER", "GPU_ORDER", "COLD_ORDER", "ContenderFailed", "worker", "run", "main", "run_args"]


WARM_GROUPS = ("read", "mmap", "prealloc", "stream", "partial", "touched", "keys", "small-read", "gpu", "gpu-limit",
               "gpu-partial")
"""Groups whose contenders read files in the page cache. The bench's files (about ten of 2 GB
each, rewritten every round by the writers) do not all fit this machine's page cache beside
the readers' memory, so without :func:`warm` a "warm" read found its file partly evicted in
some rounds and not in others."""


SETTLED_GROUPS = ("read", "gpu", "write", "replace", "cold")
"""Contenders whose operation faults in fresh memory (new tensors, or a new file's page cache):
on a machine that reports free pages to its hypervisor they start ``--settle`` seconds after
the previous worker exited and after their own set-up last removed a file, so every one of them
writes into memory the host has taken back, none into memory just freed."""


SYNCED_GROUPS = ("write", "replace")
"""Writers start with no dirty page cache from an earlier contender (``os.sync()``, untimed):
measured back to back, each 2 GB writer inherited the previous one's ~2 GB of dirty pages and
ran 1.4-6.1 s as the kernel throttled it behind their writeback."""


def worker(name: str, ctx: Ctx, not_before: float = 0.0, settle: float = 0.0, profile: int = 0) -> dict[str, Any]:
    """Run one contender once, its timed operation starting no earlier than ``not_before``
    (``time.time()``) nor, in :data:`SETTLED_GROUPS`, ``settle`` seconds after its set-up last
    removed a file; returns seconds, bytes and peak RSS growth. With ``profile``, the operation
    runs under cProfile and the result's ``"profile"`` holds its ``profile`` costliest functions
    by own time (then the seconds are the profiled ones)."""
    measure.last_free = 0.0
    import tensorstore_h5

    tensorstore_h5._import_all()  # the package's public API resolves lazily: import it here, untimed, as peers are
    import tensorstore_h5.reading.many  # noqa: F401  # and a store's reader, made on its first read (the F. group times these)
    try:
        op, nbytes = CONTENDERS[name][1](ctx)
    except Skip as e:
        return {"name": name, "skip": str(e)}
    group = CONTENDERS[name][0]
    if group in WARM_GROUPS:
        warm([ctx.path(f) for f in READS.get(name, ())])
    gc.collect()  # start every contender with the same collector state, as timeit does (see module doc)
    if group in SYNCED_GROUPS:
        os.sync()
    if group in SETTLED_GROUPS and measure.last_free:
        not_before = max(not_before, measure.last_free + settle)
    wait = not_before - time.time()
    if wait > 0:
        time.sleep(wait)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        op = functools.partial(profiler.runcall, op)
    rss0 = status("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    result = op()
    seconds = time.perf_counter() - t0
    if isinstance(result, Measured):  # the child process timed itself (F.: its start is not the operation)
        seconds = float(result)
    peak = status("VmHWM") - rss0
    del result
    out = {"name": name, "seconds": seconds, "bytes": nbytes, "peak_bytes": max(0, peak)}
    if profiler is not None:
        out["profile"] = _profile_text(profiler, profile)
    return out


def _profile_text(profiler: Any, top: int) -> str:
    """The ``top`` functions of ``profiler`` by own time: own and cumulative milliseconds,
    calls, and where. h5py's compiled calls count in the time of their Python caller."""
    import pstats

    stats = pstats.Stats(profiler).stats  # {(file, line, function): (prim calls, calls, own s, cum s, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    total = sum(v[2] for v in stats.values())
    lines = [f"  {'own ms':>8} {'cum ms':>8} {'calls':>7}  function   (own time of all functions: {total * 1e3:.1f} ms)"]
    for (file, line, func), (_, calls, own, cum, _) in rows:
        where = f"{os.path.basename(file)}:{line}({func})" if line else func
        lines.append(f"  {own * 1e3:8.2f} {cum * 1e3:8.2f} {calls:7d}  {where}")
    return "\n".join(lines)


ORDER = [
    "L.write raw bytes", "W.tensorstore_h5 save", "W.tensorstore_h5 save(direct=True)", "W.torch.save",
    "W.safetensors save_file",
    "W.pickle header + raw storages", "W.naive h5py create_dataset(data=t.numpy())",
    "L.write raw bytes over an existing file (in place)", "W.tensorstore_h5 save over an existing file",
    "W.torch.save over an existing file",
    "W.tensorstore_h5 save_async: the caller's stall", "W.tensorstore_h5 save_async: until written",
    "W.tensorizer TensorSerializer",
    "L.memcpy 1 thread (touched)", "L.readinto fresh, 2 threads", "L.readinto fresh, 2 threads + huge pages",
    "L.readinto touched, 2 threads", "R.tensorstore_h5 load", "R.tensorstore_h5 load (memory.HUGEPAGES = True)",
    "R.tensorstore_h5 load(verify=False)",
    "R.torch.load(weights_only)", "R.safetensors load_file + clone", "R.tensorizer TensorDeserializer",
    "R.runai-model-streamer SafetensorsStreamer + clone",
    "R.pickle header + raw storages (frombuffer)", "R.naive h5py ds[()] + from_numpy",
    "R.tensorstore_h5 load(mmap) + touch", "R.torch.load(mmap) + touch", "R.safetensors load_file + touch",
    "R.tensorstore_h5 load_into (touched targets)", "R.tensorstore_h5 load_into(verify=False) (touched targets)",
    "R.safetensors safe_open get_tensor + copy_ (touched targets)",
    "R.tensorstore_h5 items() streaming", "R.safetensors safe_open streaming",
    "M.tensorstore_h5 merge 3 checkpoints key by key (items + Writer)",
    "M.safetensors merge 3 checkpoints (safe_open + save_file)",
    "R.tensorstore_h5 select 1% of keys", "R.tensorstore_h5 1% row slice of every tensor",
    "R.safetensors get_slice 1% rows of every tensor",
    "K.tensorstore_h5 open + keys() (10,000 keys)", "K.safetensors safe_open + keys() (10,000 keys)",
    "K.tensorstore_h5 load (10,000 keys)", "K.safetensors load_file (10,000 keys)",
    "S.tensorstore_h5 save small objects", "S.libhdf5 metadata: tensorstore_h5 save small objects",
    "S.torch.save small objects",
    "S.tensorstore_h5 load small objects", "S.torch.load small objects",
]


COLD_ORDER = [
    "C.L.O_DIRECT reads of the file, 2 threads (cold)", "C.L.buffered reads of the file, 2 threads (cold)",
    "C.tensorstore_h5 load (cold)", "C.tensorstore_h5 load(mmap) + touch (cold)", "C.torch.load(mmap) + touch (cold)",
    "C.safetensors load_file + touch (cold)", "C.safetensors load_file + clone (cold)",
    "C.tensorizer TensorDeserializer (cold)", "C.runai-model-streamer + clone (cold)",
]
"""Run with ``--cold`` (root: each drops the page cache first)."""


WRITERS = {
    "L.write raw bytes": "raw.bin", "W.tensorstore_h5 save": "ckpt.h5", "W.torch.save": "ckpt.pt",
    "W.safetensors save_file": "ckpt.safetensors", "W.pickle header + raw storages": "ckpt.raw",
    "W.naive h5py create_dataset(data=t.numpy())": "naive.h5", "W.tensorizer TensorSerializer": "ckpt.tensors",
}
"""The writer that makes each file the read contenders read (:data:`READS`): run untimed first
when the contender itself is not run."""


def _run_worker(name: str, ctx: Ctx, not_before: float = 0.0, settle: float = 0.0, profile: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tensorstore_h5.bench", "worker", name, ctx.dir, str(ctx.size), str(ctx.keys),
           repr(not_before), repr(settle), str(profile)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"contender {name!r} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class ContenderFailed(RuntimeError):
    """Raised by :func:`run` after the table when contenders failed (not skipped): the others
    were still measured and printed."""


def run(size_gb: float = 2.0, keys: int = 300, repeat: int = 3, only: str | None = None,
        workdir: str | None = None, out: str | None = None, echo: Callable[[str], None] = print,
        gpu: bool = False, settle: float | None = None, profile: int = 0, cold: bool = False,
        first_call: bool = False, diff: bool = False) -> list[dict[str, Any]]:
    """Run the contenders (``only``: a substring filter; ``gpu``: add the CUDA ones) and print
    the table; returns the rows. ``settle``: seconds between a worker's exit (or its set-up's
    removing a file) and the timed operation of a contender in :data:`SETTLED_GROUPS` (None:
    :func:`settle_seconds`). ``profile``: run every operation under cProfile and print, after
    the table, the ``profile`` costliest functions of each contender's fastest run (the
    table's times then include the profiler's overhead). ``cold``: add the cold-cache group;
    ``first_call``: the first-call group (:mod:`.firstcall`); ``diff``: the diff group (:mod:`.compare`).
    Contenders that cannot run here (a peer not installed, no root to drop the cache) are
    listed as skipped, with the reason."""
    order = ORDER + (GPU_ORDER if gpu else []) + (COLD_ORDER if cold else []) + (FIRST_CALL_ORDER if first_call else [])
    order += DIFF_ORDER if diff else []
    names = [n for n in order if only is None or any(o in n for o in only.split(","))]
    if workdir is not None:
        os.makedirs(workdir, exist_ok=True)  # (--dir names a folder that need not exist yet)
    tmp = tempfile.mkdtemp(prefix="th5-bench-", dir=workdir)
    ctx = Ctx(tmp, int(size_gb * 1e9), keys)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}  # name -> why, of contenders whose worker failed
    try:
        needs = set(names)
        files = {f for n in needs for f in READS.get(n, ())}
        every = any(n.startswith("C.") for n in needs)  # the cold group reads the files without listing them
        if files & set(WRITERS.values()):
            files.add("ckpt.h5")  # the contenders of every format take their sizes and keys from it
        for w, made in WRITERS.items():
            if w not in needs and (every or made in files):
                _run_worker(w, ctx)  # produce the files the read contenders need
        if any(n.startswith("K.") or "10,000" in n for n in needs):
            prepare_keys_files(ctx)
        if any(OPTIM in n for n in needs):
            prepare_gpu_files(ctx)
        if any(n.startswith("S.") and "load" in n for n in needs):
            for w in ("S.tensorstore_h5 save small objects", "S.torch.save small objects"):
                if w not in needs:
                    _run_worker(w, ctx)
        settle = settle_seconds() if settle is None else settle
        if settle:
            echo(f"reads and writes start {settle:g} s after memory was last freed (--settle; see bench/README.md)")
        last_exit = time.time()
        bar = _contender_bar(len(names) * repeat)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(repeat):  # rounds over every contender: a slow spell of the machine hits all alike
            if bar is None and r:
                print(f"tensorstore-h5 bench: round {r + 1} of {repeat}", file=sys.stderr)
            for name in names:
                if results[name] and ("skip" in results[name][0] or "failed" in results[name][-1]):
                    continue
                not_before = last_exit + settle if CONTENDERS[name][0] in SETTLED_GROUPS else 0.0
                try:
                    results[name].append(_run_worker(name, ctx, not_before, settle, profile))
                except RuntimeError as e:  # one contender's failure costs its row, not the others' (a lent GPU runs once)
                    results[name].append({"name": name, "failed": str(e).strip().splitlines()[-1]})
                    print(f"tensorstore-h5 bench: {e}", file=sys.stderr)
                last_exit = time.time()
                if bar is None and "seconds" in results[name][-1]:  # a log: a run cut short still shows its figures
                    print(f"tensorstore-h5 bench: round {r + 1}: {name}: {results[name][-1]['seconds'] * 1e3:.1f} ms",
                          file=sys.stderr)
                if CONTENDERS[name][0] == "replace":  # only these read them: give the page cache back
                    for leftover in ("raw-replaced.bin", "replaced.h5", "replaced.pt"):
                        measure.fresh(ctx.path(leftover))
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        skipped = {name: res[0]["skip"] for name, res in results.items() if res and "skip" in res[0]}
        failed.update((name, res[-1]["failed"]) for name, res in results.items() if res and "failed" in res[-1])
        for name in names:
            if name in skipped:
                echo(f"{name:<62} skipped: {skipped[name]}")
                continue
            if name in failed:
                echo(f"{name:<62} FAILED: {failed[name]}")
                continue
            secs = [r["seconds"] for r in results[name]]
            row = {"name": name, "group": CONTENDERS[name][0], "bytes": results[name][0]["bytes"], "best_s": min(secs),
                   "median_s": statistics.median(secs), "peak_mib": max(r["peak_bytes"] for r in results[name]) / 2**20}
            row["best_gbps"] = row["bytes"] / row["best_s"] / 1e9 if row["bytes"] else None
            row["median_gbps"] = row["bytes"] / row["median_s"] / 1e9 if row["bytes"] else None
            rows.append(row)
            echo(_format(row))
        _ratios(rows, echo)
        if profile:
            for name in names:
                if name in skipped or name in failed:
                    continue
                fastest = min(results[name], key=lambda r: r["seconds"])
                echo(f"\nprofile of {name} (its fastest run, {fastest['seconds'] * 1e3:.1f} ms under cProfile):")
                echo(fastest["profile"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if out:
        with open(out, "w") as f:
            json.dump({"size_gb": size_gb, "keys": keys, "repeat": repeat, "settle_s": settle, "machine": _machine(),
                       "rows": rows, "failed": failed}, f, indent=1)
    if failed:
        raise ContenderFailed(f"{len(failed)} contender(s) failed (their rows say why; the others' figures are above): "
                              + ", ".join(failed))
    return rows


def _contender_bar(total: int) -> Any:
    """A progress bar over contender runs in interactive output (None otherwise)."""
    from ..display import interactive

    if not interactive():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", leave=False)


def _machine() -> str:
    return f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, torch {torch.__version__}"


def _format(row: dict[str, Any]) -> str:
    big = row["bytes"] >= 10**8  # GB/s of a few hundred kB would read 0.00
    speed = f"best {row['best_gbps']:7.2f} GB/s  med {row['median_gbps']:6.2f}" if big else \
        f"best {row['best_s'] * 1e3:7.1f} ms    med {row['median_s'] * 1e3:6.1f} ms"
    return f"{row['name']:<62} {speed}  peak {row['peak_mib']:7.0f} MiB"


def _ratios(rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    by = {r["name"]: r for r in rows}

    def ratio(a: str, b: str, label: str, time_ratio: bool = False) -> None:
        if a in by and b in by:
            ra, rb = by[a], by[b]
            values = []
            for key in ("best_s", "median_s"):
                if key in ra and key in rb:
                    values.append(ra[key] / rb[key] if time_ratio else rb[key] / ra[key])
            echo(f"  {label:<70} " + " ".join(f"{v:6.2f}" for v in values))

    echo("\nratios of best times, then of medians (> 1 means tensorstore_h5 is faster, except where it says 'time')")
    fresh = [by[n] for n in ("L.readinto fresh, 2 threads", "L.readinto fresh, 2 threads + huge pages") if n in by]
    if fresh:  # the better of the two fresh-memory limits, against the better of the two loads
        by["L.readinto fresh, best"] = min(fresh, key=lambda r: r["best_s"])
        loads = [by[n] for n in ("R.tensorstore_h5 load", "R.tensorstore_h5 load (memory.HUGEPAGES = True)") if n in by]
        if loads:
            by["R.tensorstore_h5 load, best"] = min(loads, key=lambda r: r["best_s"])
        ratio("R.tensorstore_h5 load", "L.readinto fresh, best", "load (default) / best raw readinto fresh (target >= 0.9)")
        ratio("R.tensorstore_h5 load, best", "L.readinto fresh, best", "load (better of 4 KiB / huge pages) / best raw readinto fresh")
    ratio("R.tensorstore_h5 load", "R.torch.load(weights_only)", "load vs torch.load")
    ratio("R.tensorstore_h5 load", "R.safetensors load_file + clone", "load vs safetensors load_file + clone (>= 1)")
    ratio("R.tensorstore_h5 load", "R.tensorizer TensorDeserializer", "load vs tensorizer (>= 1)")
    ratio("R.tensorstore_h5 load", "R.runai-model-streamer SafetensorsStreamer + clone", "load vs runai-model-streamer (>= 1)")
    ratio("R.tensorstore_h5 load", "R.tensorstore_h5 load(verify=False)",
          "time: load / load(verify=False) (the cost of the default check)", True)
    ratio("R.tensorstore_h5 load_into (touched targets)", "R.tensorstore_h5 load_into(verify=False) (touched targets)",
          "time: load_into / load_into(verify=False) (checked first)", True)
    ratio("R.tensorstore_h5 load(mmap) + touch", "R.torch.load(mmap) + touch", "load(mmap)+touch vs torch.load(mmap)+touch (>= 1)")
    ratio("R.tensorstore_h5 load(mmap) + touch", "R.safetensors load_file + touch", "load(mmap)+touch vs safetensors+touch (>= 1)")
    ratio("R.tensorstore_h5 load_into (touched targets)", "L.readinto touched, 2 threads", "load_into / raw readinto touched (>= 0.9)")
    ratio("R.tensorstore_h5 load_into (touched targets)", "R.safetensors safe_open get_tensor + copy_ (touched targets)",
          "load_into vs safe_open + copy_")
    ratio("W.tensorstore_h5 save", "L.write raw bytes", "save / raw write (>= 0.8)")
    ratio("W.tensorstore_h5 save", "W.safetensors save_file", "save vs safetensors save_file")
    ratio("W.tensorstore_h5 save", "W.torch.save", "save vs torch.save")
    ratio("W.tensorstore_h5 save(direct=True)", "W.torch.save", "save(direct=True) vs torch.save")
    ratio("W.tensorstore_h5 save(direct=True)", "W.tensorstore_h5 save", "save(direct=True) vs save")
    ratio("W.tensorstore_h5 save_async: the caller's stall", "W.torch.save", "time: save_async stall / torch.save (<= 0.3)", True)
    ratio("W.tensorstore_h5 save_async: until written", "W.tensorstore_h5 save", "time: save_async until written / save", True)
    ratio("W.tensorstore_h5 save over an existing file", "L.write raw bytes over an existing file (in place)",
          "save over a file / raw write over it in place")
    ratio("W.tensorstore_h5 save over an existing file", "W.torch.save over an existing file",
          "save over a file vs torch.save over it")
    for part, label in (("R.tensorstore_h5 select 1% of keys", "select 1% of keys"),
                        ("R.tensorstore_h5 1% row slice of every tensor", "1% row slices")):
        if part in by and "R.tensorstore_h5 load" in by and by["R.tensorstore_h5 load"]["bytes"]:
            share = by[part]["bytes"] / by["R.tensorstore_h5 load"]["bytes"]
            target = "0.02" if "keys" in label else "0.05"
            ratio(part, "R.tensorstore_h5 load", f"time: {label} / full load (<= {target}; {share:.1%} of the bytes)", True)
    ratio("R.tensorstore_h5 1% row slice of every tensor", "R.safetensors get_slice 1% rows of every tensor",
          "time: 1% row slices / safetensors get_slice (<= 1.2)", True)
    ratio("K.tensorstore_h5 open + keys() (10,000 keys)", "K.safetensors safe_open + keys() (10,000 keys)",
          "time: open+keys 10k / safetensors (<= 1)", True)
    ratio("K.tensorstore_h5 load (10,000 keys)", "K.safetensors load_file (10,000 keys)",
          "load of 10k small tensors vs safetensors load_file")
    ratio("S.tensorstore_h5 save small objects", "S.torch.save small objects", "small objects save vs torch.save (>= 1)")
    ratio("S.tensorstore_h5 save small objects", "S.libhdf5 metadata: tensorstore_h5 save small objects",
          "small objects save: metadata encoded here vs by libhdf5 (> 1: encoder faster)")
    ratio("S.tensorstore_h5 load small objects", "S.torch.load small objects", "small objects load vs torch.load (>= 1)")
    gpu_ratios(by, ratio, echo)
    peers = [by[n] for n in COLD_ORDER[4:] if n in by]
    if peers and "C.tensorstore_h5 load (cold)" in by:
        by["C.best peer (cold)"] = min(peers, key=lambda r: r["best_s"])
        ratio("C.tensorstore_h5 load (cold)", "C.best peer (cold)", f"cold load vs the best cold peer ({by['C.best peer (cold)']['name'][2:]}; >= 1)")
        ratio("C.tensorstore_h5 load (cold)", "C.L.O_DIRECT reads of the file, 2 threads (cold)", "cold load / O_DIRECT disk limit (>= 0.9)")
        ratio("C.tensorstore_h5 load (cold)", "C.L.buffered reads of the file, 2 threads (cold)", "cold load / buffered disk limit")
    first = "F.{}, fresh process"
    ratio(first.format("tensorstore_h5 open + keys() (10,000 keys)"), first.format("safetensors safe_open + keys() (10,000 keys)"),
          "first call: open + keys(10k) vs safetensors (>= 1)")
    ratio(first.format("tensorstore_h5 1% row slice of every tensor"), first.format("safetensors get_slice 1% rows of every tensor"),
          "first call: 1% row slices vs safetensors (>= 0.83)")
    ratio(first.format("tensorstore_h5 load(mmap) + touch"), first.format("torch.load(mmap) + touch"),
          "first call: load(mmap)+touch vs torch.load(mmap)+touch (>= 1)")
    ratio(first.format("tensorstore_h5 load(mmap) + touch"), first.format("safetensors load_file + touch"),
          "first call: load(mmap)+touch vs safetensors load_file+touch (>= 0.91)")
    ratio(first.format("tensorstore_h5 load"), first.format("safetensors load_file + clone"),
          "first call: load vs safetensors load_file + clone (>= 1)")
    ratio(first.format("tensorstore_h5 load(verify=False)"), first.format("safetensors load_file + clone"),
          "first call: load(verify=False) vs safetensors load_file + clone")
    ratio(first.format("tensorstore_h5 load"), first.format("tensorizer TensorDeserializer"), "first call: load vs tensorizer")
    start = by.get("F.cli python -c pass (the interpreter's start)")
    if start is not None:
        for name in ("F.cli python -c 'import torch'", "F.cli tensorstore-h5 --help", "F.cli tensorstore-h5 ls (10,000 keys)",
                     "F.cli tensorstore-h5 info (10,000 keys)"):
            if name in by:
                echo(f"  {name[6:] + ': ms beyond the interpreter start':<70} "
                     f"{(by[name]['best_s'] - start['best_s']) * 1e3:6.0f} {(by[name]['median_s'] - start['median_s']) * 1e3:6.0f}")
    ratio("D.tensorstore_h5 diff (two .h5 files)", "D.naive diff: safetensors load_file x2 + loop",
          "diff of two checkpoints vs load both + loop (>= 1)")
    ratio("D.tensorstore_h5 stats (one .h5 file)", "D.naive stats: safetensors load_file + loop",
          "stats of a checkpoint vs load + loop (>= 1)")
    for ours, naive in (("D.tensorstore_h5 diff (two .h5 files)", "D.naive diff: safetensors load_file x2 + loop"),
                        ("D.tensorstore_h5 stats (one .h5 file)", "D.naive stats: safetensors load_file + loop")):
        if ours in by and naive in by:
            echo(f"  {ours[2:] + ' vs naive: peak RSS growth (MiB)':<70} {by[ours]['peak_mib']:6.0f} vs "
                 f"{by[naive]['peak_mib']:.0f}")
    if "R.tensorstore_h5 items() streaming" in by and "R.safetensors safe_open streaming" in by:
        echo(f"  {'streaming peak RSS growth (MiB), tensorstore_h5 vs safetensors':<70} "
             f"{by['R.tensorstore_h5 items() streaming']['peak_mib']:6.0f} vs "
             f"{by['R.safetensors safe_open streaming']['peak_mib']:.0f}")
    merge = [by.get(n) for n in ("M.tensorstore_h5 merge 3 checkpoints key by key (items + Writer)",
                                 "M.safetensors merge 3 checkpoints (safe_open + save_file)")]
    if merge[0]:
        peer = f", safetensors {merge[1]['peak_mib']:.0f}" if merge[1] else ""
        echo(f"  {'merge of 3 checkpoints: peak RSS growth (MiB) / one input (MiB)':<70} "
             f"{merge[0]['peak_mib']:6.0f} / {merge[0]['bytes'] / 2**20:.0f}{peer}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "worker":
        name, d, size, keys = args[1], args[2], int(args[3]), int(args[4])
        not_before = float(args[5]) if len(args) > 5 else 0.0
        settle = float(args[6]) if len(args) > 6 else 0.0
        profile = int(args[7]) if len(args) > 7 else 0
        print(json.dumps(worker(name, Ctx(d, size, keys), not_before, settle, profile)))
        return 0
    import argparse

    from .args import add_arguments

    p = argparse.ArgumentParser(prog="tensorstore-h5 bench")
    add_arguments(p)
    return run_args(p.parse_args(args))


def run_args(a: Any) -> int:
    """Run what the options of :func:`add_arguments` ask for (parsed into ``a``); returns the
    exit status. Shared by ``python -m tensorstore_h5.bench`` and ``tensorstore-h5 bench``."""
    if a.distributed:
        from .distributed import run as run_distributed

        rows = run_distributed(2**30 / 1e9 if a.size_gb == 2.0 else a.size_gb, 64 if a.keys == 300 else a.keys, a.repeat,
                               tuple(int(r) for r in a.ranks.split(",")), a.dir, a.settle, sync_files=a.sync_files,
                               cold_loads=a.cold_loads)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.past_ram:
        from .past_ram import run as run_past_ram

        rows = run_past_ram(28.0 if a.size_gb == 2.0 else a.size_gb, a.keys, a.dir)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.remote:
        from .remote import run as run_remote

        rows = run_remote(min(a.size_gb, 0.5) if a.size_gb == 2.0 else a.size_gb, min(a.keys, 100), a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.compression:
        from .compression import run as run_compression

        rows = run_compression(a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
        return 0
    if a.gpu and not torch.cuda.is_available() and os.environ.get(DEVICE_ENV) != "cpu":
        print(f"tensorstore-h5 bench --gpu: CUDA is not available on this machine ({DEVICE_ENV}=cpu runs the "
              "G. contenders' code on the CPU, for tests)", file=sys.stderr)
        return 1
    try:
        run(a.size_gb, a.keys, a.repeat, a.only, a.dir, a.json, gpu=a.gpu, settle=a.settle, profile=a.profile,
            cold=a.cold, first_call=a.first_call, diff=a.diff)
    except ContenderFailed as e:
        print(f"tensorstore-h5 bench: {e}", file=sys.stderr)
        return 1
    return 0
