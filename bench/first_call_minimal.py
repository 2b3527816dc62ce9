"""An experiment for issue #29, not a reader: how fast could the first call's 1 % row slices be
if the library's read path were one small module?

``MINIMAL`` below is the least that reads a format-2 file's contiguous tensors: the header's and
the layout's checksums, the layout's head, each entry's dtype, shape, offset and hash strings
checked, one ``preadv`` a slice. It leaves out what the library does besides: the comparison of
the HDF5 links with the layout (``format/hdf5links.py``), the full check of the layout's
structure and entries, compressed and chunked data, ``same_as``, strides, values, escaped keys,
checksums of slices (``verify=True``), errors that name the key, GPU targets. Each contender runs
in a fresh interpreter that imports torch and numpy before the clock (as the bench's ``F.``
group does), interleaved, on the bench's default checkpoint (made in ``--dir`` when missing):

    python bench/first_call_minimal.py [--rounds 10] [--dir /tmp/th5-minimal] [--size-gb 2]

Prints best and median milliseconds of each and the ratios against safetensors (``>= 1``: as
fast); the README's first-call bounds quote a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

MINIMAL = r'''
import json, os, struct
import torch, xxhash

_HEADER = struct.Struct("<8sIIQQQQQQ")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8}


class Handle:
    __slots__ = ("fd", "dtype", "shape", "at")

    def __init__(self, fd, dtype, shape, at):
        self.fd, self.dtype, self.shape, self.at = fd, dtype, shape, at

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("step")
        row = self.dtype.itemsize
        for n in self.shape[1:]:
            row *= n
        out = torch.empty((stop - start) * row, dtype=torch.uint8)
        if out.numel() and os.preadv(self.fd, [out.numpy()], self.at + start * row) != out.numel():
            raise OSError("short read")
        return out.view(self.dtype).view((stop - start, *self.shape[1:]))


class Minimal:
    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 64, 0)
        magic, version, _hsize, length, offset, nbytes, layout_hash, _zero, header_hash = _HEADER.unpack_from(head)
        if magic != b"\x89TSH5\r\n\x1a" or xxhash.xxh3_64_intdigest(head[:56]) != header_hash or length != self.size:
            raise ValueError(f"{path}: damaged header")
        text = os.pread(self.fd, nbytes, offset)
        if xxhash.xxh3_64_intdigest(text) != layout_hash:
            raise ValueError(f"{path}: damaged layout")
        lines = text.split(b"\n")
        head = json.loads(lines[0])
        self.lines = lines[1:]
        self.index = {p: i for i, p in enumerate(head["paths"])}
        self.leaves = [p for p, kind in zip(head["paths"], head["types"]) if kind == "tensor"]

    def keys(self):
        return list(self.leaves)

    def __getitem__(self, key):
        item = json.loads(self.lines[self.index[key]])
        dtype, shape, at = _DTYPES[item["dtype"]], tuple(item["shape"]), item["at"]
        nbytes = dtype.itemsize
        for n in shape:
            if type(n) is not int or n < 0:
                raise ValueError("shape")
            nbytes *= n
        if type(at) is not int or at % 64 or not 4096 <= at <= at + nbytes <= self.size:
            raise ValueError("extent")
        for h in item["xxh3"]:
            if len(h) != 16 or h.strip("0123456789abcdef"):
                raise ValueError("hash")
        return Handle(self.fd, dtype, shape, at)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)
'''

_MINIMAL_SLICES = """
sys.path.insert(0, HERE)
import th5_minimal
with th5_minimal.Minimal(PATH) as s:
    for k in s.keys():
        h = s[k]
        h[: max(1, len(h) // 100)]
"""
_CONTENDERS = ("minimal", "tensorstore_h5", "safetensors")


def _script(name: str) -> str:
    """The timed body of contender ``name``: the library's and safetensors' are the bench's own
    first-call slice scripts (``tensorstore_h5.bench.firstcall.SCRIPTS``)."""
    from tensorstore_h5.bench import firstcall

    return {"minimal": _MINIMAL_SLICES, "tensorstore_h5": firstcall.SCRIPTS["th5 slices"],
            "safetensors": firstcall.SCRIPTS["st slices"]}[name]


def _files(directory: str, size_gb: float) -> tuple[str, str]:
    """The bench's checkpoint (``size_gb`` GB, ~300 tensors) as .h5 and .safetensors in
    ``directory`` (kept there; made when missing)."""
    h5, st = os.path.join(directory, "ckpt.h5"), os.path.join(directory, "ckpt.safetensors")
    if not (os.path.exists(h5) and os.path.exists(st)):
        from tensorstore_h5.bench import contenders, runner

        ctx = contenders.Ctx(directory, int(size_gb * 1e9), 300)
        for writer, made in runner.WRITERS.items():
            if made in ("ckpt.h5", "ckpt.safetensors"):
                contenders.CONTENDERS[writer][1](ctx)[0]()
    return h5, st


def check_same(directory: str, h5: str) -> int:
    """Compare every slice that the minimal reader returns with the library's (the experiment
    measures a reader that reads right); the number of tensors. Raises AssertionError."""
    import importlib.util

    import torch

    import tensorstore_h5 as th5

    spec = importlib.util.spec_from_file_location("th5_minimal", os.path.join(directory, "th5_minimal.py"))
    minimal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(minimal)  # type: ignore[union-attr]
    with minimal.Minimal(h5) as mini, th5.open(h5) as store:
        keys = store.keys()
        assert mini.keys() == keys, "the minimal reader lists other keys"
        for k in keys:
            h = store[k]
            rows = slice(0, max(1, len(h) // 100))
            a, b = mini[k][rows], h[rows]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{k}: the slices differ"
    return len(keys)


def _once(name: str, directory: str, h5: str, st: str) -> float:
    """Milliseconds that one fresh interpreter measured for contender ``name``."""
    from tensorstore_h5.bench import firstcall

    return 1e3 * firstcall.run_script(_script(name), {"HERE": directory, "PATH": h5, "PATH_ST": st}, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="fresh processes of each contender, interleaved")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "th5-minimal"), help="where the files are")
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB, when the files are made")
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    with open(os.path.join(args.dir, "th5_minimal.py"), "w") as f:
        f.write(MINIMAL)
    h5, st = _files(args.dir, args.size_gb)
    print(f"{check_same(args.dir, h5)} tensors: the minimal reader's slices equal the library's")
    for name in _CONTENDERS:  # once each, untimed: byte code compiled and cached, the files' pages read
        _once(name, args.dir, h5, st)
    times: dict[str, list[float]] = {name: [] for name in _CONTENDERS}
    for _ in range(args.rounds):
        for name in _CONTENDERS:
            times[name].append(_once(name, args.dir, h5, st))
    best = {n: min(t) for n, t in times.items()}
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"1 % row slice of every tensor, fresh process, {args.rounds} rounds (ms)")
    for n in _CONTENDERS:
        print(f"  {n:15s} best {best[n]:6.1f}  median {med[n]:6.1f}")
    print("safetensors' time / each (>= 1: as fast), best and median")
    for n in ("minimal", "tensorstore_h5"):
        print(f"  {n:15s} {best['safetensors'] / best[n]:5.2f} {med['safetensors'] / med[n]:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
