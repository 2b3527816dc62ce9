"""The ``tensorstore-h5`` command (also ``python -m tensorstore_h5``).

Building the parser imports no torch (about 2 s): ``--help``, ``<command> --help`` and usage
errors answer at once; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import __version__
from .convert import SUFFIXES, format_of
from .display import AUTO_PROGRESS_BYTES, human_bytes
from .errors import KeyNotFoundError, TensorStoreError
from .format.constants import FORMAT_VERSION, PRESET_NAMES

__all__ = ["main", "build_parser"]

_EXIT_OK, _EXIT_ERROR = 0, 1  # argparse exits with 2 for usage errors


class _UsageError(Exception):
    """Arguments that parse but do not go together: reported like argparse's errors (status 2)."""


# ---------------------------------------------------------------------------- helpers


def _open(path: str, listing: bool = False) -> Any:
    """The file as a Store, a checkpoint directory as a ShardedStore; another directory is named
    as one, with the checkpoint files inside it. With ``listing`` (``ls``, ``info``: no reads),
    a local format-2 or 3 file is opened as a torch-free Listing instead: those commands then
    start without importing torch (~1.5 s)."""
    if os.path.isdir(path):
        from .sharded import ShardedStore, is_checkpoint_directory

        if is_checkpoint_directory(path):
            return ShardedStore(path)
        raise _not_a_checkpoint(path)
    if listing:
        from .storage.files import local_path

        local = local_path(path)
        if local is not None:
            from .reading.listing import Listing

            found = Listing.open(local)
            if found is not None:
                return found
    from .reading.store import Store

    return Store(path)


def _not_a_checkpoint(path: str) -> IsADirectoryError:
    """The error for a directory that holds no checkpoint index, naming the files in it."""
    try:
        inside = sorted(name for name in os.listdir(path) if os.path.splitext(name)[1].lower() in SUFFIXES)
    except OSError:
        inside = []
    hint = (f"give one of the files in it: {', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''}" if inside else
            "give the path of an .h5 file")
    return IsADirectoryError(f"{path}: is a directory but not a checkpoint directory (no "
                             f"tensorstore_h5.json, *.safetensors.index.json or model.safetensors); {hint}")


def _foreign_shape(store: Any, entry: Any) -> tuple[list[int] | None, str | None]:
    """Shape and type (``"string"``, ``"compound"``, a numpy dtype) of a foreign dataset that
    has no torch dtype; None where the file does not say."""
    try:
        import h5py

        ds = store._reader._file[entry.dataset]
        shape, dtype = ds.shape, ds.dtype
    except Exception:  # noqa: BLE001 - a listing never fails on what it only describes
        return None, None
    if h5py.check_string_dtype(dtype) is not None or dtype.kind in "SU":
        kind = "string"
    elif dtype.names:
        kind = "compound"
    elif h5py.check_vlen_dtype(dtype) is not None:
        kind = "vlen"
    elif h5py.check_enum_dtype(dtype) is not None:
        kind = "enum"
    elif h5py.check_ref_dtype(dtype) is not None:
        kind = "reference"
    else:
        kind = str(dtype)
    return (None if shape is None else list(shape)), kind


@functools.cache
def _entry_types() -> tuple[type, type, type]:
    """``(TensorEntry, ArrayEntry, ForeignEntry)``, imported once (an import statement a row was
    ~6 ms of ``ls`` of 10,000 keys)."""
    from .format.layout import ArrayEntry, ForeignEntry, TensorEntry

    return TensorEntry, ArrayEntry, ForeignEntry


def _leaf_info(store: Any, key: str) -> dict[str, Any]:
    """One row of ``ls``: ``key``, ``kind`` (tensor, ndarray, value, unsupported) and what
    describes that kind."""
    TensorEntry, ArrayEntry, ForeignEntry = _entry_types()

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
        shape, dtype = _foreign_shape(store, entry)
        return {"key": key, "kind": "unsupported", "shape": shape, "dtype": dtype, "reason": entry.reason}
    value = repr(entry.value)
    return {"key": key, "kind": "value", "type": type(entry.value).__name__,
            "value": value if len(value) <= 60 else value[:59] + "…"}


def _row_text(r: dict[str, Any]) -> str:
    if r["kind"] == "value":
        return f"{r['type']:<10} {r['value']}"
    shape = "?" if r["shape"] is None else str(r["shape"])
    if r["kind"] == "unsupported":
        return f"{r['dtype'] or '?':<10} {shape:<18} {'-':>10}  (HDF5 data with no torch dtype: not loadable)"
    desc = f"{r['dtype']:<10} {shape:<18} {human_bytes(r['nbytes']):>10}"
    if r["kind"] == "ndarray":
        desc += "  (numpy array)"
    if r.get("pieces", 1) > 1:
        desc += f"  ({r['pieces']} pieces)"
    if "same_as" in r:
        desc += f"  (same as {r['same_as']})"
    return desc


# ---------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    from .storage import gc_paused

    with _open(args.file, listing=True) as store:
        keys = store.selected_keys(args.pattern) if args.pattern else store.keys()
        if args.pattern and not keys:
            raise KeyNotFoundError(f"{args.file}: no key matches {args.pattern!r}; list every key with "
                                   f"`tensorstore-h5 ls {args.file}` (a glob: * also matches /)")
        with gc_paused():  # 10,000 keys: ~50,000 new objects in no cycle, collected over ~150 times (~15 ms)
            rows = [store.leaf_info(k) if hasattr(store, "leaf_info") else _leaf_info(store, k) for k in keys]
    if args.json:
        json.dump(rows, sys.stdout, indent=1, ensure_ascii=False)
        print()
        return _EXIT_OK
    width = max([len(r["key"]) for r in rows] + [3])
    for r in rows:
        print(f"{r['key']:<{width}}  {_row_text(r)}")
    return _EXIT_OK


def _info_dir(args: argparse.Namespace, store: Any) -> int:
    """``info`` of a checkpoint directory."""
    d = store.info()
    info = {k: d[k] for k in ("file", "kind", "format_version", "save_id", "files", "file_bytes", "keys", "data_bytes",
                              "metadata")}
    info["tensors"] = len(d["tensors"])
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str, ensure_ascii=False)
        print()
        return _EXIT_OK
    what = (f"tensorstore_h5 checkpoint directory (index v{info['format_version']}, save {info['save_id']})"
            if info["kind"] == "tensorstore_h5" else "Hugging Face safetensors checkpoint directory")
    print(f"{info['file']}: {what}")
    print(f"  keys       {info['keys']} ({info['tensors']} tensors)")
    print(f"  data       {human_bytes(info['data_bytes'])}")
    print(f"  files      {info['files']}, {human_bytes(info['file_bytes'])}")
    if info["metadata"]:
        print(f"  metadata   {json.dumps(info['metadata'], default=str, ensure_ascii=False)}")
    return _EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    from .storage import gc_paused

    TensorEntry, _, ForeignEntry = _entry_types()

    with _open(args.file, listing=True) as store:
        if hasattr(store, "leaf_info"):
            return _info_dir(args, store)
        with gc_paused():
            entries = [store._entry(k) for k in store.keys()]
        info = {
            "file": store.path,
            "format_version": store.format_version,
            "file_bytes": os.path.getsize(store.path),
            "keys": len(store),
            "tensors": sum(isinstance(e, TensorEntry) for e in entries),
            "unsupported": sum(isinstance(e, ForeignEntry) for e in entries),
            "data_bytes": store.nbytes,
            "metadata": store.metadata,
        }
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str, ensure_ascii=False)
        print()
        return _EXIT_OK
    version = f"tensorstore_h5 format v{info['format_version']}" if info["format_version"] else "foreign HDF5 file"
    print(f"{info['file']}: {version}")
    unsupported = f", {info['unsupported']} not loadable" if info["unsupported"] else ""
    print(f"  keys       {info['keys']} ({info['tensors']} tensors{unsupported})")
    print(f"  data       {human_bytes(info['data_bytes'])}")
    print(f"  file size  {human_bytes(info['file_bytes'])}")
    if info["metadata"]:
        print(f"  metadata   {json.dumps(info['metadata'], default=str, ensure_ascii=False)}")
    return _EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Save, inspect, slice, stream and load back an embedded synthetic checkpoint."""
    import tempfile

    import torch

    from . import api
    from .writing import writer
    from .reading.store import Store, TensorHandle
    from .bench.synthetic import checkpoint, transformer_state_dict

    ckpt = checkpoint(layers=args.layers, width=args.width)
    model = ckpt["model"]
    last = args.layers - 1
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
            n = sum(1 for _ in store.items(select=f"model/layers.{last}.*"))
            print(f"streamed {n} tensors of layer {last} one at a time")
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
            return _EXIT_ERROR
    print("demo OK")
    return _EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every byte of every leaf, checking checksums (format 2), and check the layout
    against the HDF5 metadata; report the problems."""
    from .display import Progress
    from .format.layout import ArrayEntry, ForeignEntry, TensorEntry
    from .storage.libhdf5 import verify_layout

    with _open(args.file) as store:
        if hasattr(store, "leaf_info"):  # a checkpoint directory: every piece, its file and its checksums
            report = store.verify()
            for p in report["problems"]:
                print(f"{args.file}: {p}", file=sys.stderr)
            if report["problems"]:
                print(f"{args.file}: FAILED, {len(report['problems'])} problem(s)", file=sys.stderr)
                return _EXIT_ERROR
            what = ("checksums, pieces, files and HDF5 metadata agree" if store.kind == "tensorstore_h5" else
                    "safetensors headers and data ranges checked (safetensors has no checksums)")
            print(f"{args.file}: OK, {report['keys']} keys in {report['files']} files, "
                  f"{human_bytes(report['tensor_bytes'])} of tensor data read; {what}")
            return _EXIT_OK
        entries = {k: store._entry(k) for k in store.keys()}
        sizes = {k: e.nbytes for k, e in entries.items() if isinstance(e, (TensorEntry, ArrayEntry))}
        skipped = [k for k, e in entries.items() if isinstance(e, ForeignEntry)]
        bar = Progress(args.progress, desc=f"verifying {os.path.basename(args.file)}")
        bar.total(sum(sizes.values()))
        n = total = 0
        try:
            for key, _value in store.items(select=lambda k: not isinstance(entries[k], ForeignEntry), verify=True):
                n += 1
                total += sizes.get(key, 0)
                bar.update(sizes.get(key, 0))
        finally:
            bar.close()
        reader = store._reader
        remote_source = None if reader.local else reader.rawfile()  # a URL or file object: h5py reads through it
        version = store.format_version
        if remote_source is not None and version in (2, 3):  # HDF5's metadata lies after the data and in
            ends = [o + n for e in entries.values() for o, n in reader.ranges(e)]  # the first block: fetched at
            start = max(ends, default=0)                                     # once, not by one request per read
            remote_source.prefetch([(0, 4096), (start, max(0, remote_source.size - start))])
        problems = list(verify_layout(store.path, store._layout, remote_source)) if version in (2, 3) else []
    if problems:
        for p in problems:
            print(f"{args.file}: {p}", file=sys.stderr)
        print(f"{args.file}: FAILED, {len(problems)} problem(s)", file=sys.stderr)
        return _EXIT_ERROR
    what = ("checksums and HDF5 metadata agree" if version in (2, 3) else
            "format 1 has no checksums: structure checked" if version == 1 else "a foreign HDF5 file: structure checked")
    also = (f"; {len(skipped)} dataset(s) of types torch cannot hold not read ({', '.join(map(repr, skipped[:3]))}"
            f"{' ...' if len(skipped) > 3 else ''})" if skipped else "")
    print(f"{args.file}: OK, {n} keys, {human_bytes(total)} of tensor data read; {what}{also}")
    return _EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from .reading import store  # noqa: F401 - imported before the clock starts
    from .writing import writer  # noqa: F401
    from .convert import convert

    options: dict[str, Any] = {}
    if args.compression:
        options["compression"] = args.compression
    if os.path.isdir(args.src):  # a checkpoint directory -> one .h5 file, or Hugging Face shards -> a directory
        from .sharded import convert_dir, is_checkpoint_directory

        if not is_checkpoint_directory(args.src):
            raise _not_a_checkpoint(args.src)

        t0 = time.perf_counter()
        convert_dir(args.src, args.dst, select=args.select, progress=args.progress, **options)
        size = (sum(os.path.getsize(os.path.join(args.dst, n)) for n in os.listdir(args.dst)) if os.path.isdir(args.dst)
                else os.path.getsize(args.dst))
        print(f"{args.src} -> {args.dst}: {human_bytes(size)} in {time.perf_counter() - t0:.1f} s")
        return _EXIT_OK
    t0 = time.perf_counter()
    convert(args.src, args.dst, select=args.select, progress=args.progress, **options)
    print(f"{args.src} -> {args.dst}: {human_bytes(os.path.getsize(args.dst))} in {time.perf_counter() - t0:.1f} s")
    return _EXIT_OK


def cmd_reindex(args: argparse.Namespace) -> int:
    """Rebuild a file's layout from its HDF5 part after an edit with h5py or h5repack."""
    from .writing.reindex import KEEP, reindex

    t0 = time.perf_counter()
    compression = KEEP if args.compression == "keep" else None if args.compression == "none" else args.compression
    done = reindex(args.file, compression=compression, progress=args.progress)

    def few(keys: list[str]) -> str:
        return ", ".join(map(repr, keys[:5])) + (" ..." if len(keys) > 5 else "")
    changes = [f"{len(done.added)} new: {few(done.added)}" if done.added else "",
               f"{len(done.removed)} gone: {few(done.removed)}" if done.removed else ""]
    what = "; ".join(c for c in changes if c) or "the same keys"
    print(f"{args.file}: reindexed, {len(done.keys)} keys ({what}), new checksums, in "
          f"{time.perf_counter() - t0:.1f} s")
    return _EXIT_OK


def _check_convert(args: argparse.Namespace) -> None:
    """Usage errors of ``convert`` found from the arguments alone."""
    try:
        kinds = format_of(args.src), format_of(args.dst)
    except ValueError:
        return  # convert names the file and the suffixes it knows
    if args.compression and kinds[1] != "h5":
        raise _UsageError(f"--compression applies to an .h5 destination only, not {args.dst}")
    if args.select and kinds[0] == "torch":
        raise _UsageError(f"--select applies to an .h5 or .safetensors source, not {args.src}: convert it whole to .h5, "
                          "then select from that")


def _json_safe(value: Any) -> Any:
    """``value`` with floats that JSON cannot hold (nan, inf) as the strings ``"nan"``, ``"inf"``."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


_EXIT_DIFFERENT, _EXIT_DIFF_ERROR = 1, 2  # diff exits as cmp and diff do: 0 equal, 1 different, 2 trouble


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two checkpoints key by key: 0 when every key is equal, 1 when any differs."""
    from .reading.compare import diff

    result = diff(args.a, args.b, args.select, progress=args.progress, verify=args.verify, opener=_open)
    if args.json:
        json.dump(_json_safe({"a": result.a, "b": result.b, "equal": result.equal, "counts": result.counts(),
                              "rows": list(result)}), sys.stdout, indent=1, ensure_ascii=False)
        print()
    else:
        print(result.text(all=args.all))
    return _EXIT_OK if result.equal else _EXIT_DIFFERENT


def cmd_stats(args: argparse.Namespace) -> int:
    from .reading.compare import stats

    result = stats(args.file, args.select, progress=args.progress, verify=args.verify, opener=_open)
    if args.json:
        json.dump(_json_safe({"file": result.source, "rows": list(result)}), sys.stdout, indent=1, ensure_ascii=False)
        print()
    else:
        print(result.text())
    return _EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.runner import run_args

    return run_args(args)


# ---------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """A command's parser: options may come between positionals (``ls f.h5 --json 'model/*'``),
    and its arguments may be added on first use (``loader``), so that listing the commands
    does not import the module that defines a command's arguments."""

    loader: Any = None
    _inside = False

    def _load(self) -> None:
        loader, self.loader = self.loader, None
        if loader is not None:
            loader(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._load()
        if self._inside:  # parse_known_intermixed_args calls this method itself (Python < 3.12)
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False

    def format_usage(self) -> str:
        self._load()
        return super().format_usage()

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from .bench.args import add_arguments

    add_arguments(p)


def _progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar by bytes (default: for work over "
                        f"{human_bytes(AUTO_PROGRESS_BYTES)} when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (imports no torch)."""
    p = argparse.ArgumentParser(prog="tensorstore-h5", description=f"PyTorch checkpoints in HDF5 (format v{FORMAT_VERSION}).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the version of tensorstore_h5 and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    s = sub.add_parser("demo", help="save, inspect and load an embedded synthetic checkpoint")
    s.add_argument("--layers", type=_at_least_one, default=4, help="transformer layers (at least 1; default 4)")
    s.add_argument("--width", type=_at_least_one, default=256, help="hidden width (at least 1; default 256)")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("ls", help="list keys with shape, dtype and size")
    s.add_argument("file")
    s.add_argument("pattern", nargs="?", help="glob or exact key (a container lists everything under it)")
    s.add_argument("--json", action="store_true", help="one JSON object per key: key, kind (tensor, ndarray, value, "
                                                      "unsupported) and what describes it")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("info", help="totals, format version and metadata")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)
    s = sub.add_parser("convert", help="convert between .h5, .safetensors and torch.save files and checkpoint directories",
                       description="Convert by the files' suffixes: " + ", ".join(sorted(SUFFIXES)) + ". Pairs: "
                                   "safetensors->h5, torch->h5, h5->safetensors, h5->h5; a checkpoint directory "
                                   "(tensorstore_h5 or Hugging Face sharded safetensors) -> one .h5 file, and a Hugging "
                                   "Face directory -> a tensorstore_h5 directory.")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--compression", choices=PRESET_NAMES, help="compression preset for an .h5 destination")
    s.add_argument("--select", action="append", metavar="GLOB",
                   help="glob or key of an .h5 or .safetensors source to convert (repeatable)")
    _progress_argument(s)
    s.set_defaults(func=cmd_convert, check=_check_convert, command_parser=s)
    s = sub.add_parser("bench", help="benchmark against the machine's limits and the peers (see bench/README.md)")
    s.loader = _bench_arguments
    s.set_defaults(func=cmd_bench)
    s = sub.add_parser("diff", help="compare two checkpoints key by key (exit 0: equal, 1: different, 2: error)",
                       description="Compare two checkpoints key by key, streaming (a few tensors in memory, never a "
                                   "checkpoint): files, checkpoint directories, Hugging Face shards, URLs or "
                                   ".safetensors files. Prints the keys that differ with their status (changed, dtype, "
                                   "shape, only_a, only_b), the largest |b - a|, the relative change ||b - a|| / ||a|| "
                                   "(float64 sums) and the number of elements that differ.",
                       epilog="Exit status: 0 when every key is in both and bitwise equal, 1 when anything differs, "
                              "2 on an error (as cmp and diff; other commands exit 1 on an error).")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--select", action="append", metavar="GLOB", help="glob or key to compare (repeatable)")
    s.add_argument("--all", action="store_true", help="list the keys that are equal too")
    s.add_argument("--json", action="store_true", help="one JSON object: a, b, equal, counts per status, and a row per "
                                                      "key (nan and inf as strings)")
    s.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="check the stored checksums of every block read too (default: of tensors read whole)")
    _progress_argument(s)
    s.set_defaults(func=cmd_diff, error_status=_EXIT_DIFF_ERROR)
    s = sub.add_parser("stats", help="mean, std, min, max and nan/inf/zero counts of each tensor",
                       description="Per-tensor statistics, streaming, in float64: mean and std (Bessel-corrected) of "
                                   "the finite elements, min and max of those not nan, and counts of nan, inf and "
                                   "zeros.")
    s.add_argument("file")
    s.add_argument("--select", action="append", metavar="GLOB", help="glob or key (repeatable)")
    s.add_argument("--json", action="store_true", help="one JSON object: file, and a row per tensor (nan and inf as "
                                                      "strings)")
    s.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="check the stored checksums of every block read too (default: of tensors read whole)")
    _progress_argument(s)
    s.set_defaults(func=cmd_stats)
    s = sub.add_parser("verify", help="read every byte and check the structure")
    s.add_argument("file")
    _progress_argument(s)
    s.set_defaults(func=cmd_verify)
    s = sub.add_parser("reindex", help="adopt changes made with h5py or h5repack: rebuild the layout from the HDF5 part",
                       description="Rewrite FILE (beside itself, then renamed over it, as a save) from what its HDF5 "
                                   "part holds now, after an edit with h5py (values written, datasets renamed, added "
                                   "or deleted) or h5repack: afterwards loads return what h5py reads, with new "
                                   "checksums. Plain values, container types and user metadata of the old layout "
                                   "are kept where their group still exists.")
    s.add_argument("file")
    s.add_argument("--compression", choices=("keep", "none", *PRESET_NAMES), default="keep",
                   help="keep: each dataset compressed as it was (default); none; or a preset for every tensor")
    _progress_argument(s)
    s.set_defaults(func=cmd_reindex)
    return p


_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
"""Terminal escape sequences (colours, bold) that messages of other libraries carry."""


def _error_text(e: BaseException) -> str:
    """The message of an expected error: it names the file (OSError's ``filename``); without
    terminal escape sequences (stderr may be a log file)."""
    if isinstance(e, OSError) and not isinstance(e, TensorStoreError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return _ESCAPES.sub("", str(e)) or type(e).__name__


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so that the flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (tests redirect stdout): nothing is flushed at exit


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage; ``diff``: 0 equal, 1
    different, 2 error or usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "check", None) is not None:
            args.check(args)
        status = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is caught below
        return status
    except _UsageError as e:
        args.command_parser.error(str(e))  # exits with status 2, as argparse's own errors do
        raise AssertionError("unreachable") from None
    except BrokenPipeError:  # `tensorstore-h5 ls big.h5 | head`: the reader took what it wanted, which is no
        _quiet_stdout()      # error: stop quietly (status 0, no traceback, nothing printed at exit)
        return _EXIT_OK
    except (TensorStoreError, OSError, ValueError) as e:
        print(f"tensorstore-h5: error: {_error_text(e)}", file=sys.stderr)
        return getattr(args, "error_status", _EXIT_ERROR)  # diff: 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
