"""The first call (F.): what a script, a notebook's first cell or a shell command pays, the
library's own import included. Each run is a fresh interpreter that imports torch (and numpy)
before the clock, then times, from its ``import`` of the library or peer to holding the
result, one of: open + keys of 10,000 keys, a 1 % row slice of every tensor, ``load(mmap=True)``
+ touch, a full load (with checksums, the default, and without: what checking costs there).
The F.cli rows time whole commands (``tensorstore-h5 ls`` / ``info`` / ``--help``) against the
bare interpreter start. Byte-code caches are warm (a second run of a script), as are the
files' pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

from .contenders import Ctx, Timed, contender
from .measure import peer

__all__ = ["Measured", "FIRST_CALL_ORDER", "PRELUDE", "SCRIPTS", "run_script"]


class Measured(float):
    """Seconds that a contender's operation measured itself (in a child process), which the
    runner reports instead of the time the operation took (the child's start)."""


PRELUDE = """
import json, sys, time
import numpy, torch
def touch(ts):
    for t in ts:
        if t.numel():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()
t0 = time.perf_counter()
"""
"""What each child runs before the clock starts (``t0``): torch and numpy imported."""

SCRIPTS = {
    "th5 keys": """
import tensorstore_h5 as th5
with th5.open(PATH_KEYS) as s:
    s.keys()
""",
    "st keys": """
from safetensors import safe_open
with safe_open(PATH_KEYS_ST, "pt") as f:
    f.keys()
""",
    "th5 slices": """
import tensorstore_h5 as th5
with th5.open(PATH) as s:
    for k in s.keys():
        h = s[k]
        h[: max(1, len(h) // 100)]
""",
    "st slices": """
from safetensors import safe_open
with safe_open(PATH_ST, "pt") as f:
    for k in f.keys():
        sl = f.get_slice(k)
        sl[: max(1, sl.get_shape()[0] // 100)].clone()
""",
    "th5 mmap": """
import tensorstore_h5 as th5
touch(th5.load(PATH, mmap=True).values())
""",
    "torch mmap": """
touch(torch.load(PATH_PT, weights_only=True, mmap=True).values())
""",
    "st touch": """
from safetensors.torch import load_file
touch(load_file(PATH_ST).values())
""",
    "th5 load": """
import tensorstore_h5 as th5
th5.load(PATH)
""",
    "th5 load unchecked": """
import tensorstore_h5 as th5
th5.load(PATH, verify=False)
""",
    "st clone": """
from safetensors.torch import load_file
[t.clone() for t in load_file(PATH_ST).values()]
""",
    "tensorizer load": """
import tensorizer
d = tensorizer.TensorDeserializer(PATH_TZ, device="cpu")
dict(d.items())
d.close()
""",
}
"""Each contender's timed body (``PATH``... name its files): from its import to holding the result."""


def _child(ctx: Ctx, script: str) -> Measured:
    """Run ``SCRIPTS[script]`` in a fresh interpreter; the seconds it measured itself."""
    paths = {"PATH": ctx.path("ckpt.h5"), "PATH_ST": ctx.path("ckpt.safetensors"), "PATH_PT": ctx.path("ckpt.pt"),
             "PATH_TZ": ctx.path("ckpt.tensors"), "PATH_KEYS": ctx.path("many.h5"),
             "PATH_KEYS_ST": ctx.path("many.safetensors")}
    return run_script(SCRIPTS[script], paths, script)


def run_script(body: str, variables: dict[str, Any], name: str) -> Measured:
    """Run :data:`PRELUDE` and ``body`` (a timed body as in :data:`SCRIPTS`, with ``variables``
    bound first) in a fresh interpreter, byte code cached; the seconds it measured itself.
    Raises RuntimeError naming ``name`` with the child's error output when it fails."""
    code = "".join(f"{k} = {v!r}\n" for k, v in variables.items()) + PRELUDE + textwrap.dedent(body) + \
        "print(json.dumps(time.perf_counter() - t0))\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # byte code cached, as users have it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"first-call script {name!r} failed: {out.stderr.strip()[-2000:]}")
    return Measured(json.loads(out.stdout.strip().splitlines()[-1]))


def _first(name: str, script: str, files: tuple[str, ...], nbytes: Any = 0, needs: str | None = None) -> None:
    @contender(name, "first", reads=files)
    def _(ctx: Ctx) -> Timed:
        if needs:
            peer(needs, needs)
        _child(ctx, script)  # once, untimed: byte code compiled and cached, as a second run of a script finds it
        return (lambda: _child(ctx, script)), nbytes(ctx) if callable(nbytes) else nbytes


def _data(ctx: Ctx) -> int:
    from .contenders import _file_data

    return _file_data(ctx)


_first("F.tensorstore_h5 open + keys() (10,000 keys), fresh process", "th5 keys", ("many.h5",))
_first("F.safetensors safe_open + keys() (10,000 keys), fresh process", "st keys", ("many.safetensors",))
_first("F.tensorstore_h5 1% row slice of every tensor, fresh process", "th5 slices", ("ckpt.h5",))
_first("F.safetensors get_slice 1% rows of every tensor, fresh process", "st slices", ("ckpt.safetensors",))
_first("F.tensorstore_h5 load(mmap) + touch, fresh process", "th5 mmap", ("ckpt.h5",), _data)
_first("F.torch.load(mmap) + touch, fresh process", "torch mmap", ("ckpt.pt",), _data)
_first("F.safetensors load_file + touch, fresh process", "st touch", ("ckpt.safetensors",), _data)
_first("F.tensorstore_h5 load, fresh process", "th5 load", ("ckpt.h5",), _data)
_first("F.tensorstore_h5 load(verify=False), fresh process", "th5 load unchecked", ("ckpt.h5",), _data)
_first("F.safetensors load_file + clone, fresh process", "st clone", ("ckpt.safetensors",), _data)
_first("F.tensorizer TensorDeserializer, fresh process", "tensorizer load", ("ckpt.tensors",), _data, "tensorizer")


def _command(argv: list[str]) -> Measured:
    """Wall seconds of a whole command (its interpreter start included)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, env=env, check=False)
    seconds = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.decode(errors='replace').strip()[-2000:]}")
    return Measured(seconds)


def _cli(name: str, args: Any, files: tuple[str, ...] = ()) -> None:
    @contender(name, "first", reads=files)
    def _(ctx: Ctx) -> Timed:
        argv = [sys.executable, *args(ctx)]
        _command(argv)  # byte code compiled, untimed
        return (lambda: _command(argv)), 0


_cli("F.cli python -c pass (the interpreter's start)", lambda ctx: ["-c", "pass"])
_cli("F.cli python -c 'import torch'", lambda ctx: ["-c", "import torch"])
_cli("F.cli tensorstore-h5 --help", lambda ctx: ["-m", "tensorstore_h5", "--help"])
_cli("F.cli tensorstore-h5 ls (10,000 keys)", lambda ctx: ["-m", "tensorstore_h5", "ls", ctx.path("many.h5")],
     ("many.h5",))
_cli("F.cli tensorstore-h5 info (10,000 keys)", lambda ctx: ["-m", "tensorstore_h5", "info", ctx.path("many.h5")],
     ("many.h5",))

FIRST_CALL_ORDER = [
    "F.tensorstore_h5 open + keys() (10,000 keys), fresh process",
    "F.safetensors safe_open + keys() (10,000 keys), fresh process",
    "F.tensorstore_h5 1% row slice of every tensor, fresh process",
    "F.safetensors get_slice 1% rows of every tensor, fresh process",
    "F.tensorstore_h5 load(mmap) + touch, fresh process", "F.torch.load(mmap) + touch, fresh process",
    "F.safetensors load_file + touch, fresh process",
    "F.tensorstore_h5 load, fresh process", "F.tensorstore_h5 load(verify=False), fresh process",
    "F.safetensors load_file + clone, fresh process",
    "F.tensorizer TensorDeserializer, fresh process",
    "F.cli python -c pass (the interpreter's start)", "F.cli python -c 'import torch'", "F.cli tensorstore-h5 --help",
    "F.cli tensorstore-h5 ls (10,000 keys)", "F.cli tensorstore-h5 info (10,000 keys)",
]
"""The first-call group, in the table's order (``tensorstore-h5 bench --first-call``)."""
