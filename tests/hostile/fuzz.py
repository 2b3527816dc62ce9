"""A mutation fuzzer for tensorstore_h5's readers.

Three surfaces, each mutated and read in a worker process through every public read path:

- files (this module): small valid format-2 files (plain, lz4, zstd) are mutated (byte flips
  anywhere, truncations, appended bytes, flips inside compressed chunks, and JSON edits of the
  layout with the header's hashes recomputed, which reach the parser past its checksums) and
  read through every public read path (tests/hostile/hostile_files.py: load, load(mmap),
  load(verify), items, slices, load_into, device=, convert) and the CLI (ls, info, verify);
- directories (tests/hostile/fuzz_dirs.py): tensorstore_h5 rank directories and Hugging Face
  sharded safetensors directories, their indexes and data files mutated, read through
  ``th5.open(dir)``, ``th5.load``, ``th5.load_into``, DCP's ``dcp.load`` and the CLI;
- HTTP answers (tests/hostile/fuzz_http.py): a loopback server answering hostilely, read
  through ``th5.load(url)``, ``th5.open(url)`` and ``th5.load_into`` with both clients.

The worker runs under an address-space limit of its own size plus 1 GiB, and each case has a
time limit: a crash, a hang or an allocation beyond that is a finding, as is any read that
raises something other than a TensorStoreError naming the file, returns bytes that a canary
planted in freed heap memory shows were never filled, or returns tensor bytes that neither
equal what was saved nor (unchecked reads) the file's own bytes where the layout says (each
surface's module says its own property).

    python tests/hostile/fuzz.py run --seconds 3600 --out findings/   # a release run (files)
    python tests/hostile/fuzz.py run --surface dirs --seconds 600     # one surface
    python tests/hostile/fuzz.py run --surface all --seconds 3600     # all, split by --split
    python tests/hostile/fuzz.py check FILE...                        # re-run kept findings

CI runs it for TH5_FUZZ_SECONDS (default 60, split between the surfaces by TH5_FUZZ_SPLIT,
default ``files=4,dirs=1,http=1``) through tests/hostile/test_fuzz.py; every case it ever found
is kept in tests/hostile/regressions/ (files), regressions_dirs/ and regressions_http/.
"""

from __future__ import annotations

import argparse
import contextlib
import io as stdio
import json
import os
import random
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CANARY = bytes.fromhex("c0ffee11deadbeef5a5aa5a5f00dcafe")
CASE_SECONDS = 20.0
SEED_NAMES = ("plain", "lz4", "zstd")


def _setup_path() -> None:
    sys.path.insert(0, str(HERE.parent))


# ---------------------------------------------------------------------------- seeds and mutations


def seed_object(kind: str) -> dict[str, Any]:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(len(kind))
    smooth = torch.randn(200, 24, generator=g) * 0.02
    obj: dict[str, Any] = {"w": torch.randn(12, 10, generator=g), "t": torch.randn(6, 5, generator=g).t(),
                           "b": torch.zeros(5, dtype=torch.bfloat16), "s": torch.tensor(7), "e": torch.empty(0, 2),
                           "x": torch.arange(3.0).expand(2, 3), "n": {"k": [1, "a", None]}, "a": np.arange(5, dtype="<i2")}
    if kind != "plain":
        obj["c"] = smooth.to(torch.bfloat16) if kind == "zstd" else smooth
    return obj


def make_seeds(d: Path) -> dict[str, Path]:
    import tensorstore_h5 as th5

    out = {}
    for kind in SEED_NAMES:
        path = d / f"seed-{kind}.h5"
        th5.save(seed_object(kind), path, compression=(lambda k, t, kind=kind: kind if k == "c" else None), chunk_bytes=4096)
        out[kind] = path
    return out


def _layout_range(data: bytes) -> tuple[int, int] | None:
    import struct

    if len(data) < 64 or data[:8] != b"\x89TSH5\r\n\x1a":
        return None
    offset, length = struct.unpack_from("<QQ", data, 24)
    return (offset, length) if offset + length <= len(data) else None


def _rehash(data: bytearray, text: bytes) -> bytes:
    """``data`` with ``text`` appended as its layout, under a valid header."""
    from tensorstore_h5.format import checksum
    from tensorstore_h5.format import layout as fmt

    out = bytearray(data)
    start = len(out)
    out += text
    out[:64] = fmt.pack_header(fmt.Header(2, len(out), start, len(text), checksum.digest(text)))
    return bytes(out)


def _chunks(text: bytes) -> list[tuple[int, int]]:
    """``(offset, size)`` of every stored chunk a layout text names."""
    out = []
    for line in text.split(b"\n")[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        for c in entry.get("chunks", {}).get("at", []) if isinstance(entry, dict) else []:
            out.append((c[0], c[1]))
    return out


_JSON_EDITS = [b"0", b"1", b"-1", b"4096", b"2147483648", b"1e400", b"[]", b"{}", b"null", b"true", b'"x"',
               b'"%2F"', b"[1,2]", b"99999999999999999999", b"64", b"[[4096,16]]", b'"float8_e4m3fn"', b"[0,1]"]


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of a seed file: ``(mode, new bytes)``."""
    mode = rng.choice(["flip", "flip", "truncate", "append", "chunk", "layout", "layout", "layout"])
    out = bytearray(data)
    span = _layout_range(data)
    if mode == "truncate":
        return mode, bytes(out[:rng.randrange(len(out))])
    if mode == "append":
        return mode, bytes(out + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    if mode == "layout" and span is not None:
        text = bytearray(out[span[0]:span[0] + span[1]])
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.5:  # replace a JSON token-ish run by another value
                i = rng.randrange(len(text))
                j = min(len(text), i + rng.randrange(1, 12))
                text[i:j] = rng.choice(_JSON_EDITS)
            else:
                text[rng.randrange(len(text))] = rng.randrange(32, 127)
        return mode, _rehash(out, bytes(text))
    if mode == "chunk" and span is not None:
        chunks = _chunks(bytes(out[span[0]:span[0] + span[1]]))
        if chunks:  # the first bytes of a chunk hold its framing: hit them most
            off, size = rng.choice(chunks)
            for _ in range(rng.randrange(1, 5)):
                i = off + (rng.randrange(min(size, 64)) if rng.random() < 0.6 else rng.randrange(size))
                if rng.random() < 0.5:
                    out[i] ^= 1 << rng.randrange(8)
                else:
                    out[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
            return mode, bytes(out)
    for _ in range(rng.randrange(1, 9)):
        i = rng.randrange(len(out)) if rng.random() < 0.7 else rng.randrange(min(len(out), 128))
        out[i] ^= 1 << rng.randrange(8)
    return "flip", bytes(out)


# ---------------------------------------------------------------------------- the worker


def _plant_canary() -> None:
    """Fill freed heap memory with the canary, so memory handed out unfilled shows it."""
    import ctypes

    blocks = [ctypes.create_string_buffer(CANARY * (n // 16)) for n in (64, 256, 1024, 4096, 65536, 262144) for _ in range(8)]
    del blocks


def check(path: Path, original: Any, rewritten: bool = False) -> list[str]:
    """Every read path and CLI command on ``path`` (saved from ``original``); the list of
    property violations. When the layout itself was ``rewritten``, a returned tensor must hold
    the file's bytes from where that layout says, checked or not."""
    import torch

    import tensorstore_h5 as th5
    from tensorstore_h5 import cli

    from helpers import bits
    from hostile.hostile_files import CHECKED, READ_PATHS, expected_part, read_layout

    problems = []
    try:
        head, entries = read_layout(path)
        layout = {p: e for p, e in zip(head["paths"], entries)}
    except Exception:  # noqa: BLE001 - a mutated layout: no file-byte oracle
        layout = {}
    data = path.read_bytes()
    rewritten = rewritten or original is None
    for name, read in READ_PATHS.items():
        if original is None and name == "load_into":
            continue  # its targets are made from what was saved
        _plant_canary()
        try:
            got = read(path, original)
        except th5.TensorStoreError as e:
            if path.name not in str(e):
                problems.append(f"{name}: error without the file name: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - the finding
            problems.append(f"{name}: {type(e).__name__}: {e}")
            continue
        try:
            ref = {} if rewritten else expected_part(original, {k: v for k, v in got.items()}, name)
        except (KeyError, TypeError, IndexError, AttributeError):
            ref = {}
        for key, value in got.items():
            if not isinstance(value, torch.Tensor):
                continue
            raw = bytes(bits(value.detach().contiguous()).numpy())
            if CANARY[:8] in raw:
                problems.append(f"{name}: {key}: holds memory that no read filled (canary)")
                continue
            expected = ref.get(key)
            same = isinstance(expected, torch.Tensor) and expected.shape == value.shape and \
                expected.dtype == value.dtype and raw == bytes(bits(expected.contiguous()).numpy())
            if same:
                continue
            if name in CHECKED and not rewritten:
                problems.append(f"{name}: {key}: checked read returned bytes that were not saved")
                continue
            e = layout.get(key, {})
            if "at" in e and raw != data[e["at"]:e["at"] + len(raw)]:
                problems.append(f"{name}: {key}: bytes neither saved nor the file's at {e['at']}")
    for command in (["ls"], ["info"], ["verify"]):
        out, err = stdio.StringIO(), stdio.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = cli.main([*command, str(path)])
        except Exception as e:  # noqa: BLE001
            problems.append(f"cli {command[0]}: {type(e).__name__}: {e}")
            continue
        if status not in (0, 1) or status == 1 and path.name not in err.getvalue():
            problems.append(f"cli {command[0]}: status {status}: {err.getvalue()[-300:]}")
    return problems


SURFACES = ("files", "dirs", "http")
"""What the fuzzer mutates: single format-2 files (this module), checkpoint directories
(tests/hostile/fuzz_dirs.py) and HTTP servers' answers (tests/hostile/fuzz_http.py)."""


def _surface(name: str) -> Any:
    """The module of a surface other than files (None where its optional packages are missing)."""
    import importlib

    try:
        return importlib.import_module(f"hostile.fuzz_{name}")
    except ImportError:
        return None


def worker() -> None:
    """Read case lines (``{"path": ..., "seed": ..., "mode": ...}`` for a file, ``{"surface":
    "dirs" | "http", ...}`` for the others); write one JSON result line each."""
    _setup_path()
    import torch  # noqa: F401 - imported before the limit: its mappings count once

    import tensorstore_h5  # noqa: F401

    surfaces = {}
    for name in SURFACES[1:]:  # their imports (DCP, fsspec, aiohttp) and threads, before the limit too
        module = _surface(name)
        if module is not None:
            try:
                module.prepare()
            except ImportError:
                continue
            surfaces[name] = module
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
    originals = {kind: seed_object(kind) for kind in SEED_NAMES}
    for line in sys.stdin:
        case = json.loads(line)
        surface = case.get("surface", "files")
        if surface == "files":
            result: dict[str, Any] = {"problems": check(Path(case["path"]), originals.get(case["seed"]),
                                                        case.get("mode") == "layout")}
        elif surface in surfaces:
            result = surfaces[surface].check_case(case)
        else:
            result = {"problems": [], "skipped": f"the {surface} surface needs packages that are not installed"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


class Worker:
    """A worker process, restarted after it dies or hangs."""

    STARTUP = 60.0
    """Extra seconds for a new worker's first answer (it imports torch first)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.warm = False

    def start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            # Few malloc arenas: the limit is for what reads allocate, not for idle arenas of I/O threads.
            env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
            self.proc = subprocess.Popen([sys.executable, str(HERE / "fuzz.py"), "worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
            self.warm = False
        return self.proc

    def run(self, path: Path, seed: str, mode: str, timeout: float = CASE_SECONDS) -> list[str]:
        """The problems of a file case."""
        return self.ask({"path": str(path), "seed": seed, "mode": mode}, timeout)["problems"]

    def ask(self, case: dict[str, Any], timeout: float = CASE_SECONDS) -> dict[str, Any]:
        """The worker's result for one case (``{"problems": [...], ...}``); a worker that dies
        or does not answer within ``timeout`` is a problem (a crash, a hang), and is restarted
        for the next case."""
        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(case) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout + (0 if self.warm else self.STARTUP))
        if not ready:
            self.stop()
            return {"problems": [f"hang: no answer in {timeout:.0f} s"]}
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.stop()
            return {"problems": [f"crash: the worker died (exit status {code})"]}
        self.warm = True
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None


def run(seconds: float, out: Path, seed: int, worker: Worker | None = None) -> list[tuple[str, list[str]]]:
    """Fuzz files for ``seconds``; findings are copied to ``out``. Returns (file, problems) of
    each. ``worker``: a running worker to use (and leave running), else one of its own."""
    _setup_path()
    rng = random.Random(seed)
    findings: list[tuple[str, list[str]]] = []
    out.mkdir(parents=True, exist_ok=True)
    w = worker or Worker()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        seeds = {k: p.read_bytes() for k, p in make_seeds(Path(tmp)).items()}
        case = Path(tmp) / "case.h5"
        n = 0
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                kind = rng.choice(SEED_NAMES)
                mode, data = mutate(seeds[kind], rng)
                case.write_bytes(data)
                problems = w.run(case, kind, mode)
                n += 1
                if problems:
                    name = f"{kind}-{mode}-{seed}-{n}.h5"
                    shutil.copy(case, out / name)
                    findings.append((name, problems))
        finally:
            if worker is None:
                w.stop()
    took = time.monotonic() - start
    print(f"fuzz files: {n} cases in {took:.0f} s ({n / max(took, 1e-9):.1f}/s, seed {seed}), {len(findings)} findings "
          f"in {out}")
    return findings


def split_seconds(seconds: float, split: str | None = None) -> dict[str, float]:
    """Each surface's share of ``seconds``, from ``split`` (``TH5_FUZZ_SPLIT``, default
    ``files=4,dirs=1,http=1``: weights; a surface left out, or given 0, is not run)."""
    text = split if split is not None else os.environ.get("TH5_FUZZ_SPLIT", "files=4,dirs=1,http=1")
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, w = part.partition("=")
        if name not in SURFACES:
            raise ValueError(f"TH5_FUZZ_SPLIT: unknown surface {name!r} (known: {', '.join(SURFACES)})")
        weights[name] = float(w or 1)
    total = sum(weights.values()) or 1.0
    return {name: seconds * weights.get(name, 0.0) / total for name in SURFACES}


def run_surface(surface: str, seconds: float, out: Path, seed: int, worker: Worker | None = None
                ) -> list[tuple[str, list[str]]]:
    """Fuzz one surface for ``seconds`` (see :func:`run`)."""
    if surface == "files":
        return run(seconds, out, seed, worker)
    module = _surface(surface)
    if module is None:
        raise ImportError(f"the {surface} surface needs packages that are not installed")
    return module.run(seconds, out, seed, worker)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seconds", type=float, default=60, help="in all, split between the surfaces (--split)")
    r.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    r.add_argument("--seed", type=int, default=int(time.time()))
    r.add_argument("--surface", choices=[*SURFACES, "all"], default="files")
    r.add_argument("--split", default=None, help="with --surface all: weights, e.g. files=4,dirs=1,http=1 "
                                                 "(default TH5_FUZZ_SPLIT or that)")
    c = sub.add_parser("check", help="re-run kept findings: .h5 files, directory cases, HTTP cases (.json)")
    c.add_argument("files", nargs="+", type=Path)
    sub.add_parser("worker")
    args = p.parse_args(argv)
    if args.cmd == "worker":
        worker()
        return 0
    _setup_path()
    if args.cmd == "run":
        shares = split_seconds(args.seconds, args.split) if args.surface == "all" else {args.surface: args.seconds}
        findings = []
        w = Worker()
        try:
            for surface, seconds in shares.items():
                if seconds > 0:
                    findings += run_surface(surface, seconds, args.out, args.seed, w)
        finally:
            w.stop()
        for name, problems in findings:
            print(name, *problems, sep="\n  ")
        return 1 if findings else 0
    w = Worker()
    bad = 0
    try:
        for f in args.files:
            if f.is_dir():
                problems = _surface("dirs").check_saved([f], w)[0][1]
            elif f.suffix == ".json":
                problems = _surface("http").check_saved([f], w)[0][1]
            else:
                seed, mode = (f.name.split("-") + ["", ""])[:2]
                problems = w.run(f, seed, mode)
            bad += bool(problems)
            print(f, "ok" if not problems else "", *problems, sep="\n  ")
    finally:
        w.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
