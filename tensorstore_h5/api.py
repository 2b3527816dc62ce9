"""The functions most people call: :func:`load` and :func:`load_into` (``save`` lives in writer.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple, Union

import torch

from . import tree
from .errors import MismatchError
from .format import TensorEntry
from .select import Selector
from .store import Device, Store

__all__ = ["load", "load_into", "LoadResult"]

PathLike = Union[str, "os.PathLike[str]"]


def load(path: PathLike, *, select: Selector = None, device: Device = None, progress: bool | None = None,
         mmap: bool = False) -> Any:
    """Load a file (or the selected part of it) back into its saved nesting.

    Example::

        sd = th5.load("ckpt.h5", select="model/*")["model"]
        layer0 = th5.load("ckpt.h5", select=["model/layers/0"])

    Args:
        path: the file.
        select: None (everything), a glob on key paths, a list of exact keys or globs, or a
            callable ``key_path -> bool``. Exact keys may name a container (its whole subtree).
        device: None (CPU), a device, or a mapping (key path or glob -> device) or callable.
        progress: see :func:`tensorstore_h5.save`.
        mmap: tensors backed by the file's pages (copy-on-write) where the data allows, see
            :meth:`Store.load`.

    Raises:
        KeyNotFoundError: an exact key in ``select`` is not in the file (a KeyError).
        FormatError: the file is not readable as a checkpoint.
    """
    with Store(path) as store:
        return store.load(select=select, device=device, progress=progress, mmap=mmap)


class LoadResult(NamedTuple):
    """Keys that :func:`load_into` could not match, like ``Module.load_state_dict``'s result."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _target_tensors(target: Any) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        return {tree.escape(k): v for k, v in target.state_dict(keep_vars=True).items()}
    if not isinstance(target, Mapping):
        raise TypeError(f"load_into needs an nn.Module or a nested dict of tensors, got {type(target).__name__}")
    return {n.path: n.value for n in tree.flatten(dict(target)) if isinstance(n, tree.Leaf) and isinstance(n.value, torch.Tensor)}


def load_into(
    target: Any,
    path: PathLike,
    *,
    select: Selector = None,
    prefix: str = "",
    strict: bool = True,
    progress: bool | None = None,
) -> LoadResult:
    """Fill the tensors of ``target`` in place (same ``data_ptr``) from ``path``.

    ``target`` is an ``nn.Module`` (its ``state_dict(keep_vars=True)``: parameters and
    buffers) or a nested dict of tensors. The stored key path of a target tensor is
    ``prefix`` + its key path (``prefix="model/"`` for a file saved as ``{"model": sd}``).
    Every shape and dtype is checked before anything is written.

    Returns:
        LoadResult(missing_keys, unexpected_keys), target-side and file-side key paths.

    Raises:
        MismatchError: strict and some keys are missing or unexpected, or a stored tensor's
            shape or dtype differs from its target; no target has changed.
        KeyNotFoundError: an exact key in ``select`` is not in the file.
        FormatError: the file is not readable as a checkpoint.
    """
    targets = _target_tensors(target)
    with Store(path) as store:
        file_keys = [k for k in store.selected_keys(select) if k.startswith(prefix)]
        stored = {k[len(prefix):]: k for k in file_keys}
        missing = [k for k in targets if k not in stored]
        unexpected = [stored[k] for k in stored if k not in targets]
        problems = []
        if strict and (missing or unexpected):
            problems.append(f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}"
                            + (" (and more)" if len(missing) > 10 or len(unexpected) > 10 else ""))
        pairs = []
        for k, t in targets.items():
            if k not in stored:
                continue
            entry = store._entry(stored[k])
            if not isinstance(entry, TensorEntry):
                problems.append(f"{stored[k]!r} is not a tensor in the file")
            elif tuple(entry.shape) != tuple(t.shape) or entry.dtype.torch_dtype != t.dtype:
                problems.append(
                    f"{stored[k]!r}: stored {list(entry.shape)} {entry.dtype.name}, target {list(t.shape)} "
                    f"{str(t.dtype).removeprefix('torch.')}"
                )
            else:
                pairs.append((store[stored[k]], t))
        if problems:
            raise MismatchError(f"{store.path}: cannot load into the target; nothing was changed: " + "; ".join(problems))
        store._read_into(pairs, progress)
    return LoadResult(missing, unexpected)
