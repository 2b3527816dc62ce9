"""The ``tensorstore-h5`` command (also ``python -m tensorstore_h5``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import api, writer
from .display import human_bytes
from .errors import TensorStoreError
from .compression import PRESETS
from .format import FORMAT_VERSION, ArrayEntry, ForeignEntry, TensorEntry
from .store import Store, TensorHandle

__all__ = ["main"]


def _leaf_info(store: Store, key: str) -> dict[str, Any]:
    entry = store._entry(key)
    if isinstance(entry, TensorEntry):
        info: dict[str, Any] = {"key": key, "kind": "tensor", "shape": list(entry.shape), "dtype": entry.dtype.name,
                                "nbytes": entry.nbytes}
        if entry.stride is not None:
            info["stride"] = list(entry.stride)
        if entry.same_as is not None:
            info["same_as"] = entry.same_as
        return info
    if isinstance(entry, ArrayEntry):
        return {"key": key, "kind": "ndarray", "shape": list(entry.shape), "dtype": str(entry.dtype), "nbytes": entry.nbytes}
    if isinstance(entry, ForeignEntry):
        return {"key": key, "kind": "unsupported", "type": "-", "value": entry.reason}
    return {"key": key, "kind": "value", "type": type(entry.value).__name__, "value": repr(entry.value)[:60]}


def cmd_ls(args: argparse.Namespace) -> int:
    with Store(args.file) as store:
        keys = store.selected_keys(args.pattern) if args.pattern else store.keys()
        rows = [_leaf_info(store, k) for k in keys]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    width = max([len(r["key"]) for r in rows] + [3])
    for r in rows:
        if r["kind"] == "value":
            desc = f"{r['type']:<10} {r['value']}"
        else:
            desc = f"{r['dtype']:<10} {str(r['shape']):<18} {human_bytes(r['nbytes']):>10}"
            if "same_as" in r:
                desc += f"  (same as {r['same_as']})"
        print(f"{r['key']:<{width}}  {desc}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with Store(args.file) as store:
        tensors = [k for k in store.keys() if isinstance(store._entry(k), TensorEntry)]
        info = {
            "file": store.path,
            "format_version": store.format_version,
            "file_bytes": os.path.getsize(store.path),
            "keys": len(store),
            "tensors": len(tensors),
            "data_bytes": store.nbytes,
            "metadata": store.metadata,
        }
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str)
        print()
        return 0
    version = f"tensorstore_h5 format v{info['format_version']}" if info["format_version"] else "foreign HDF5 file"
    print(f"{info['file']}: {version}")
    print(f"  keys       {info['keys']} ({info['tensors']} tensors)")
    print(f"  data       {human_bytes(info['data_bytes'])}")
    print(f"  file size  {human_bytes(info['file_bytes'])}")
    if info["metadata"]:
        print(f"  metadata   {json.dumps(info['metadata'])}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Save, inspect, slice, stream and load back an embedded synthetic checkpoint."""
    from .synthetic import checkpoint, transformer_state_dict

    ckpt = checkpoint(layers=args.layers, width=args.width)
    model = ckpt["model"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "demo.h5")
        t0 = time.perf_counter()
        writer.save(ckpt, path, metadata={"made_by": "tensorstore-h5 demo"})
        t_save = time.perf_counter() - t0
        size = os.path.getsize(path)
        print(f"saved a synthetic checkpoint: {len(model)} model tensors + AdamW state, "
              f"{human_bytes(size)} on disk in {t_save * 1e3:.0f} ms")
        with Store(path) as store:
            print(f"opened: {store}")
            for key in store.keys()[:5]:
                print(f"  {key}: {store[key]!r}" if isinstance(store[key], TensorHandle) else f"  {key} = {store[key]!r}")
            q = store["model/layers.0.attn.qkv.weight"]
            rows = q[10:20]
            assert torch.equal(rows, model["layers.0.attn.qkv.weight"][10:20])
            print(f"row slice q[10:20] -> {tuple(rows.shape)}, read {rows.nbytes} of {q.nbytes} bytes")
            n = sum(1 for _ in store.items(select="model/layers.1.*"))
            print(f"streamed {n} tensors of layer 1 one at a time")
        part = api.load(path, select="model/layers.0.*")
        print(f"load(select='model/layers.0.*') -> {len(part['model'])} tensors")
        fresh = transformer_state_dict(args.layers, args.width, seed=1)
        result = api.load_into(fresh, path, prefix="model/")
        same = all(torch.equal(fresh[k], model[k]) for k in model)
        print(f"load_into a fresh state dict: {result}; bitwise equal: {same}")
        full = api.load(path)
        tied = full["model"]["head.weight"] is full["model"]["embed.weight"]
        print(f"full load: {len(full['optimizer']['state'])} optimizer states, tied head/embed aliased: {tied}")
        if not (same and tied):
            print("demo FAILED: data did not round-trip", file=sys.stderr)
            return 1
    print("demo OK")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every byte of every leaf, checking checksums (format 2), and check the layout
    against the HDF5 metadata; report the problems."""
    from .hdf5source import verify_layout

    with Store(args.file) as store:
        n = total = 0
        for _key, value in store.items(verify=True):
            n += 1
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
        problems = list(verify_layout(store.path, store._layout)) if store.format_version == 2 else []
        version = store.format_version
    if problems:
        for p in problems:
            print(f"{args.file}: {p}", file=sys.stderr)
        print(f"{args.file}: FAILED, {len(problems)} problem(s)", file=sys.stderr)
        return 1
    what = ("checksums and HDF5 metadata agree" if version == 2 else
            "format 1 has no checksums: structure checked" if version == 1 else "a foreign HDF5 file: structure checked")
    print(f"{args.file}: OK, {n} keys, {human_bytes(total)} of tensor data read; {what}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert, format_of

    options: dict[str, Any] = {}
    if args.compression:
        if format_of(args.dst) != "h5":
            raise TensorStoreError("--compression applies to an .h5 destination only")
        options["compression"] = args.compression
    t0 = time.perf_counter()
    convert(args.src, args.dst, select=args.select, **options)
    print(f"{args.src} -> {args.dst}: {human_bytes(os.path.getsize(args.dst))} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run_args(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorstore-h5", description="PyTorch checkpoints in HDF5 (format v%d)." % FORMAT_VERSION)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("demo", help="save, inspect and load an embedded synthetic checkpoint")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--width", type=int, default=256)
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("ls", help="list keys with shape, dtype and size")
    s.add_argument("file")
    s.add_argument("pattern", nargs="?", help="glob on key paths")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("info", help="totals, format version and metadata")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)
    s = sub.add_parser("convert", help="convert between .h5, .safetensors and torch.save files")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--compression", help="preset for an .h5 destination: " + ", ".join(sorted(PRESETS)))
    s.add_argument("--select", action="append", help="glob or key of an .h5 source (repeatable)")
    s.set_defaults(func=cmd_convert)
    s = sub.add_parser("bench", help="benchmark against the machine's limits and the peers (see bench/README.md)")
    from .bench import add_arguments

    add_arguments(s)
    s.set_defaults(func=cmd_bench)
    s = sub.add_parser("verify", help="read every byte and check the structure")
    s.add_argument("file")
    s.set_defaults(func=cmd_verify)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (TensorStoreError, FileNotFoundError, PermissionError, IsADirectoryError, ValueError) as e:
        print(f"tensorstore-h5: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
