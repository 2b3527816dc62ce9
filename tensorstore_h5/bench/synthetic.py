"""Synthetic transformer-like checkpoints for the demo, the benchmark, notebooks and tests."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["transformer_state_dict", "optimizer_state", "checkpoint", "bench_state_dict", "bench_optimizer_state"]


def transformer_state_dict(
    layers: int = 4, width: int = 256, vocab: int = 1000, dtype: torch.dtype = torch.float32, seed: int = 0,
    bf16_every: int = 0,
) -> OrderedDict[str, torch.Tensor]:
    """A GPT-style state dict: tied embeddings, per-layer attention/MLP weights, norms, buffers.

    ``bf16_every=k`` stores every k-th layer's weights in bfloat16 (mixed-precision files).
    Sizes: about ``layers * 12 * width**2 + vocab * width`` elements.
    """
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dt)

    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    sd["embed.weight"] = w(vocab, width)
    for i in range(layers):
        dt = torch.bfloat16 if bf16_every and i % bf16_every == bf16_every - 1 else dtype
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = w(3 * width, width, dt=dt)
        sd[p + "attn.qkv.bias"] = torch.zeros(3 * width, dtype=dt)
        sd[p + "attn.out.weight"] = w(width, width, dt=dt)
        sd[p + "mlp.up.weight"] = w(4 * width, width, dt=dt)
        sd[p + "mlp.down.weight"] = w(width, 4 * width, dt=dt)
        sd[p + "norm1.weight"] = torch.ones(width, dtype=dt)
        sd[p + "norm2.weight"] = torch.ones(width, dtype=dt)
        sd[p + "attn.mask"] = torch.ones(16, 16, dtype=torch.bool).tril()
    sd["norm.weight"] = torch.ones(width, dtype=dtype)
    sd["head.weight"] = sd["embed.weight"]  # tied, stored once
    return sd


def optimizer_state(params: list[torch.Tensor], steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """An AdamW state dict after ``steps`` steps on random gradients (int keys, ``step`` tensors)."""
    g = torch.Generator().manual_seed(seed)
    leaves = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(leaves, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        for p in leaves:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt.state_dict()


def checkpoint(layers: int = 4, width: int = 256, vocab: int = 1000, with_optimizer: bool = True, seed: int = 0) -> dict[str, Any]:
    """A complete training checkpoint: model, optimizer state, step counters and config."""
    model = transformer_state_dict(layers, width, vocab, seed=seed)
    out: dict[str, Any] = {"model": model}
    if with_optimizer:
        unique = list({id(t): t for t in model.values() if t.is_floating_point()}.values())
        out["optimizer"] = optimizer_state(unique, seed=seed)
    out["epoch"] = 3
    out["config"] = {"layers": layers, "width": width, "vocab": vocab, "dtype": torch.float32, "lr": 1e-3}
    return out


def bench_state_dict(total_bytes: int, keys: int = 300, seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """A transformer-like state dict of about ``total_bytes`` in about ``keys`` tensors, half of
    the layers float32 and half bfloat16, filled fast from one tiled random block."""
    return OrderedDict(bench_tensors(total_bytes, keys, seed))


def bench_tensors(total_bytes: int, keys: int = 300, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of :func:`bench_state_dict`, made one at a time (for checkpoints larger than
    memory: only the one being made is held)."""
    layers = max(1, keys // 8)
    width = max(8, int((total_bytes / (layers * 12 * 3)) ** 0.5) // 8 * 8)
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(1 << 22, generator=g) * 0.02

    def fill(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - start)
            flat[start:start + n].copy_(block[:n])
        return out

    w = width
    for i in range(layers):
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        p = f"layers.{i}."
        for name, shape in (("attn.qkv.weight", (3 * w, w)), ("attn.qkv.bias", (3 * w,)), ("attn.out.weight", (w, w)),
                            ("attn.out.bias", (w,)), ("mlp.up.weight", (4 * w, w)), ("mlp.down.weight", (w, 4 * w)),
                            ("norm1.weight", (w,)), ("norm2.weight", (w,))):
            yield p + name, fill(shape, dt)


def bench_optimizer_state(total_bytes: int, params: int = 2000, seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """An Adam-like optimizer state of ``3 * params`` tensors and about ``total_bytes``: for each
    parameter of a :func:`bench_tensors` model, a 0-d float32 ``step`` and float32 ``exp_avg``
    and ``exp_avg_sq`` of its shape (flat keys ``state.{i}.{name}``, as safetensors needs).
    Many small tensors: a third of them 0-d, half of the rest under 2 KB (for 0.5 GB in all, the
    others 74-296 KB)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    # bench_tensors keeps half of its layers in bfloat16: float32 moments are ~1.35x its bytes each
    for i, (_, t) in enumerate(bench_tensors(int(total_bytes / 2.7), params, seed)):
        avg = t.float()
        out[f"state.{i}.step"] = torch.tensor(float(i + 1))
        out[f"state.{i}.exp_avg"] = avg
        out[f"state.{i}.exp_avg_sq"] = avg.abs()
    return out
