"""The diff group (D., ``tensorstore-h5 bench --diff``): ``th5.diff`` of two checkpoints of
``--size-gb`` each, and ``th5.stats`` of one, against the naive way: both files loaded whole with
safetensors' ``load_file`` and a loop over the keys computing the same numbers (elements that
differ, max ``|b - a|``, ``‖b - a‖ / ‖a‖`` in float64; mean, std, min, max, nan, inf and zeros).
Time and peak RSS growth, as every group. The second checkpoint is the first with two of every
three tensors scaled by 1.01 (every element of those changes, bfloat16 ones too). The files are
written once, untimed, by the first contender that needs them, and read once before each timed
run (warm page cache: the figures are memory and page-cache speeds).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .contenders import Ctx, Timed, contender
from .measure import peer

__all__ = ["DIFF_ORDER", "diff_files"]

_FILES = ("diff-a.h5", "diff-b.h5", "diff-a.safetensors", "diff-b.safetensors")


def diff_files(ctx: Ctx) -> int:
    """Write the pair of checkpoints (.h5 and .safetensors of each) unless they are there; the
    bytes of tensor data of one checkpoint."""
    import tensorstore_h5 as th5

    if not all(os.path.exists(ctx.path(f)) for f in _FILES):
        from safetensors.torch import save_file

        sd = ctx.state()
        th5.save(sd, ctx.path("diff-a.h5"))
        save_file(sd, ctx.path("diff-a.safetensors"))
        for i, t in enumerate(sd.values()):
            if i % 3:
                t.mul_(1.01)
        th5.save(sd, ctx.path("diff-b.h5"))
        save_file(sd, ctx.path("diff-b.safetensors"))
        del sd
    with th5.open(ctx.path("diff-a.h5")) as s:
        return s.nbytes


def _naive_diff(path_a: str, path_b: str) -> list[tuple[Any, ...]]:
    """What one writes without a streaming diff: load both, compare key by key in float64."""
    from safetensors.torch import load_file

    a, b = load_file(path_a), load_file(path_b)
    rows: list[tuple[Any, ...]] = []
    for key in list(a) + [k for k in b if k not in a]:
        if key not in a or key not in b:
            rows.append((key, "only_a" if key in a else "only_b"))
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape:
            rows.append((key, "shape"))
            continue
        changed = int((x != y).sum())
        d = y.double() - x.double()
        rows.append((key, "equal" if changed == 0 and x.dtype == y.dtype else "changed", changed,
                     d.abs().max().item(), (d.norm() / x.double().norm()).item()))
    return rows


def _naive_stats(path: str) -> list[tuple[Any, ...]]:
    from safetensors.torch import load_file

    rows: list[tuple[Any, ...]] = []
    for key, t in load_file(path).items():
        x = t.double()
        finite = x[torch.isfinite(x)]
        not_nan = x[~torch.isnan(x)]
        rows.append((key, finite.mean().item(), finite.std().item(), not_nan.min().item(), not_nan.max().item(),
                     int(torch.isnan(x).sum()), int(torch.isinf(x).sum()), int((x == 0).sum())))
    return rows


@contender("D.tensorstore_h5 diff (two .h5 files)", "read", reads=("diff-a.h5", "diff-b.h5"))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    n = diff_files(ctx)
    return (lambda: th5.diff(ctx.path("diff-a.h5"), ctx.path("diff-b.h5"))), 2 * n


@contender("D.tensorstore_h5 diff (two .safetensors files)", "read",
           reads=("diff-a.safetensors", "diff-b.safetensors"))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    peer("safetensors", "safetensors")
    n = diff_files(ctx)
    return (lambda: th5.diff(ctx.path("diff-a.safetensors"), ctx.path("diff-b.safetensors"))), 2 * n


@contender("D.naive diff: safetensors load_file x2 + loop", "read",
           reads=("diff-a.safetensors", "diff-b.safetensors"))
def _(ctx: Ctx) -> Timed:
    peer("safetensors", "safetensors")
    n = diff_files(ctx)
    return (lambda: _naive_diff(ctx.path("diff-a.safetensors"), ctx.path("diff-b.safetensors"))), 2 * n


@contender("D.tensorstore_h5 stats (one .h5 file)", "read", reads=("diff-a.h5",))
def _(ctx: Ctx) -> Timed:
    import tensorstore_h5 as th5

    n = diff_files(ctx)
    return (lambda: th5.stats(ctx.path("diff-a.h5"))), n


@contender("D.naive stats: safetensors load_file + loop", "read", reads=("diff-a.safetensors",))
def _(ctx: Ctx) -> Timed:
    peer("safetensors", "safetensors")
    n = diff_files(ctx)
    return (lambda: _naive_stats(ctx.path("diff-a.safetensors"))), n


DIFF_ORDER = [
    "D.tensorstore_h5 diff (two .h5 files)", "D.tensorstore_h5 diff (two .safetensors files)",
    "D.naive diff: safetensors load_file x2 + loop",
    "D.tensorstore_h5 stats (one .h5 file)", "D.naive stats: safetensors load_file + loop",
]
"""The diff group, in the table's order (``tensorstore-h5 bench --diff``)."""
