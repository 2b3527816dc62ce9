"""Hostile and damaged files, one generator each, and every public read path to try them on.

A hostile file is crafted (its hashes recomputed, its structure valid HDF5); a damaged one
is not. The property (tests/hostile/test_hostile.py): every read path raises a
TensorStoreError naming the file, or returns exactly what was saved; ``must_refuse`` cases
must be refused by a full load and by ``tensorstore-h5 verify``.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format import checksum, tree
from tensorstore_h5.format import layout as fmt

from data.make_v1 import golden as golden_v1

DATA = Path(__file__).parents[1] / "data"
SECRET = b"TOP-SECRET-" * 64


def v2_object() -> dict[str, Any]:
    """The object saved in the format-2 files made here: contiguous, strided, compressed."""
    g = torch.Generator().manual_seed(4)
    smooth = (torch.randn(256, 64, generator=g) * 0.02)
    return {"model": {"w": torch.randn(64, 32, generator=g), "t": torch.randn(16, 8, generator=g).t(),
                      "b": torch.zeros(7, dtype=torch.bfloat16), "step": torch.tensor(3)},
            "lz4": smooth.clone(), "zstd": smooth.to(torch.bfloat16), "n": 5}


def save_v2(path: Path) -> dict[str, Any]:
    obj = v2_object()
    th5.save(obj, path, compression=lambda k, t: k if k in ("lz4", "zstd") else None, chunk_bytes=8192)
    return obj


# ---------------------------------------------------------------------------- crafting format 2


def read_layout(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    raw = path.read_bytes()
    h = fmt.parse_header(raw[:64], str(path), len(raw))
    head, *lines = raw[h.layout_offset:h.layout_offset + h.layout_length].split(b"\n")
    return json.loads(head), [json.loads(line) for line in lines]


def craft_layout(path: Path, edit: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
    """Rewrite a format-2 file's layout through ``edit(head, entries)`` and append it, with a
    valid header and hash: a crafted file, not a damaged one."""
    head, entries = read_layout(path)
    edit(head, entries)
    text = "\n".join(json.dumps(x) for x in [head, *entries]).encode()
    raw = bytearray(path.read_bytes())
    offset = len(raw)
    raw += text
    raw[:64] = fmt.pack_header(fmt.Header(2, len(raw), offset, len(text), checksum.digest(text)))
    path.write_bytes(bytes(raw))


def entry(head: dict[str, Any], entries: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return entries[head["paths"].index(key)]


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def chunk_at(path: Path, key: str, k: int) -> tuple[int, int]:
    head, entries = read_layout(path)
    off, size = entry(head, entries, key)["chunks"]["at"][k][:2]
    return off, size


REFUSE = "refuse"
"""Every read path that reaches the damage raises; a full load and ``verify`` refuse."""
DATA_DAMAGE = "data"
"""Stored tensor bytes changed: checked reads (``verify``, ``convert``) refuse; unchecked reads
raise or return the file's bytes from where the layout says."""
HDF5_ONLY = "hdf5"
"""Only the HDF5 metadata changed: reads of the layout return what was saved; ``verify`` refuses."""
HARMLESS = "harmless"
"""Reads return what was saved and ``verify`` passes (a version-1 stride with gaps: the values
come back contiguous, nothing is allocated for the gaps)."""


@dataclass(frozen=True)
class Case:
    """A hostile file: ``make(dir) -> (path, original object)`` and what readers must do."""

    name: str
    make: Callable[[Path], tuple[Path, Any]]
    kind: str = REFUSE


def _v2(name: str, edit: Callable[[Path], None], kind: str = REFUSE) -> Case:
    def make(d: Path) -> tuple[Path, Any]:
        path = d / f"v2-{name}.h5"
        obj = save_v2(path)
        edit(path)
        return path, obj
    return Case(f"v2-{name}", make, kind)


def _v1(name: str, edit: Callable[[h5py.File, Path], None], kind: str = REFUSE) -> Case:
    def make(d: Path) -> tuple[Path, Any]:
        path = d / f"v1-{name}.h5"
        shutil.copy(DATA / "v1.h5", path)
        with h5py.File(path, "r+") as f:
            edit(f, d)
        return path, golden_v1()
    return Case(f"v1-{name}", make, kind)


def _secret_file(d: Path) -> Path:
    other = d / "secret.h5"
    with h5py.File(other, "w") as f:
        f["emb"] = np.frombuffer(SECRET[:16 * 8 * 4], dtype="<f4").reshape(16, 8)
    return other


def _replace(f: h5py.File, key: str, make: Callable[[], Any]) -> None:
    del f[key]
    f[key] = make()


def _external_link(f: h5py.File, d: Path) -> None:
    _secret_file(d)
    del f["model/embed.weight"]
    f["model/embed.weight"] = h5py.ExternalLink(str(d / "secret.h5"), "/emb")


def _soft_to_external(f: h5py.File, d: Path) -> None:
    _secret_file(d)
    f["elsewhere"] = h5py.ExternalLink(str(d / "secret.h5"), "/emb")
    del f["model/embed.weight"]
    f["model/embed.weight"] = h5py.SoftLink("/elsewhere")


def _soft_leaving_path(f: h5py.File, d: Path) -> None:
    f["decoy"] = np.frombuffer(SECRET[:16 * 8 * 4], dtype="<f4").reshape(16, 8)
    del f["model/embed.weight"]
    f["model/embed.weight"] = h5py.SoftLink("/decoy")


def _virtual(f: h5py.File, d: Path) -> None:
    _secret_file(d)
    layout = h5py.VirtualLayout(shape=(16, 8), dtype="<f4")
    layout[:] = h5py.VirtualSource(str(d / "secret.h5"), "emb", shape=(16, 8))
    del f["model/embed.weight"]
    f.create_virtual_dataset("model/embed.weight", layout)


def _virtual_missing(f: h5py.File, d: Path) -> None:
    layout = h5py.VirtualLayout(shape=(16, 8), dtype="<f4")
    layout[:] = h5py.VirtualSource(str(d / "absent.h5"), "emb", shape=(16, 8))
    del f["model/embed.weight"]
    f.create_virtual_dataset("model/embed.weight", layout)


def _external_storage(f: h5py.File, d: Path) -> None:
    (d / "passwd").write_bytes(SECRET)
    del f["optim/state/0/exp_avg"]
    f.create_dataset("optim/state/0/exp_avg", shape=(16, 8), dtype="<f4", external=[(str(d / "passwd"), 0, 512)])
    f["optim/state/0/exp_avg"].attrs["torch_dtype"] = "float32"


def _unallocated(f: h5py.File, d: Path) -> None:
    del f["optim/state/0/exp_avg"]
    f.create_dataset("optim/state/0/exp_avg", shape=(16, 8), dtype="<f4")
    f["optim/state/0/exp_avg"].attrs["torch_dtype"] = "float32"


def _edit_v1_entry(f: h5py.File, key: str, changes: dict[str, Any]) -> None:
    layout = json.loads(f.attrs[fmt.ATTR_LAYOUT])
    for e in layout["entries"]:
        if e["path"] == key:
            e.update(changes)
    f.attrs[fmt.ATTR_LAYOUT] = json.dumps(layout)


def _huge_unallocated(f: h5py.File, d: Path) -> None:
    f.create_dataset("huge", shape=(2**28,), dtype="<f4")
    layout = json.loads(f.attrs[fmt.ATTR_LAYOUT])
    layout["entries"].append({"path": "huge", "type": "tensor", "dtype": "float32", "shape": [2**28]})
    f.attrs[fmt.ATTR_LAYOUT] = json.dumps(layout)


def _filtered(make_filter: Callable[[], Any]) -> Callable[[h5py.File, Path], None]:
    def edit(f: h5py.File, d: Path) -> None:
        data = f["optim/state/0/exp_avg"][()]
        del f["optim/state/0/exp_avg"]
        f.create_dataset("optim/state/0/exp_avg", data=data, chunks=(8, 8), **make_filter())
    return edit


def _unwritten_chunk(f: h5py.File, d: Path) -> None:
    data = f["optim/state/0/exp_avg"][()]
    del f["optim/state/0/exp_avg"]
    ds = f.create_dataset("optim/state/0/exp_avg", shape=(16, 8), dtype="<f4", chunks=(8, 8), **hdf5plugin.Blosc2())
    ds[:8] = data[:8]


def _array_dtype(f: h5py.File, d: Path) -> None:
    _edit_v1_entry(f, "array", {"dtype": "<i2"})


def _damaged_format_attr(f: h5py.File, d: Path) -> None:
    f.attrs[fmt.ATTR_FORMAT] = "tensorstore_hX"


def _stride(stride: list[int]) -> Callable[[h5py.File, Path], None]:
    return lambda f, d: _edit_v1_entry(f, "model/embed.weight", {"stride": stride})


# -- format 2: crafted layouts, chunks and headers


def _edit(key: str, changes: dict[str, Any]) -> Callable[[Path], None]:
    return lambda p: craft_layout(p, lambda h, es: entry(h, es, key).update(changes))


def _chunk_edit(key: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda p: craft_layout(p, lambda h, es: change(entry(h, es, key)["chunks"]))


def _header_hash(p: Path) -> None:
    patch(p, 20, b"\x01")


def _version3(p: Path) -> None:
    raw = p.read_bytes()
    h = fmt.parse_header(raw[:64], str(p), len(raw))
    body = struct.pack("<8sIIQQQQQ", fmt.MAGIC, 3, 64, h.file_length, h.layout_offset, h.layout_length, h.layout_hash, 0)
    patch(p, 0, body + struct.pack("<Q", checksum.digest(body)))


def _layout_flip(p: Path) -> None:
    raw = p.read_bytes()
    h = fmt.parse_header(raw[:64], str(p), len(raw))
    patch(p, h.layout_offset + 30, b"X")


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _append(p: Path) -> None:
    p.write_bytes(p.read_bytes() + b"\0" * 10)


def _bitshuffle_bomb(p: Path) -> None:
    """A Bitshuffle chunk whose header claims 3 GiB and whose first block claims 2 GiB."""
    off, size = chunk_at(p, "lz4", 1)
    patch(p, off, (3 << 30).to_bytes(8, "big") + (8192).to_bytes(4, "big") + (2**31 - 1).to_bytes(4, "big"))


def _bitshuffle_block(p: Path) -> None:
    """A Bitshuffle chunk whose block table runs past its stored bytes."""
    off, size = chunk_at(p, "lz4", 1)
    patch(p, off + 12, (size * 4).to_bytes(4, "big"))


def _bitshuffle_zero_block(p: Path) -> None:
    off, size = chunk_at(p, "lz4", 1)
    patch(p, off + 8, (0).to_bytes(4, "big"))


def _b2nd_smaller(p: Path) -> None:
    """A B2ND frame of a smaller shape in place of a chunk (the frame of a smaller array)."""
    off, size = chunk_at(p, "zstd", 0)
    small = Path(str(p) + ".small.h5")
    t = torch.zeros(8, 64, dtype=torch.bfloat16)
    with h5py.File(small, "w") as f:
        f.create_dataset("s", data=t.view(torch.int16).numpy(), chunks=(8, 64), **hdf5plugin.Blosc2(cname="zstd"))
    with h5py.File(small) as f:
        frame = f["s"].id.read_direct_chunk((0, 0))[1]
    small.unlink()
    assert len(frame) <= size
    patch(p, off, frame + b"\0" * (size - len(frame)))


def _raw_chunk_wrong_size(p: Path) -> None:
    def change(c: dict[str, Any]) -> None:
        c["at"][0] = [c["at"][0][0], c["at"][0][1], 1]
    craft_layout(p, lambda h, es: change(entry(h, es, "lz4")["chunks"]))


def _external_link_v2(p: Path) -> None:
    _secret_file(p.parent)
    with h5py.File(p, "r+") as f:  # the HDF5 part only: the layout still names the original bytes
        del f["model/w"]
        f["model/w"] = h5py.ExternalLink(str(p.parent / "secret.h5"), "/emb")


def _data_flip(p: Path) -> None:
    head, entries = read_layout(p)
    patch(p, entry(head, entries, "model/w")["at"] + 5, b"\xff")


def _chunk_flip(p: Path) -> None:
    off, size = chunk_at(p, "zstd", 1)
    patch(p, off + size // 2, b"\x55\xaa")


CASES = [
    _v1("external-link", _external_link),
    _v1("soft-link-to-external", _soft_to_external),
    _v1("soft-link-leaving-path", _soft_leaving_path),
    _v1("virtual-dataset", _virtual),
    _v1("virtual-missing-source", _virtual_missing),
    _v1("external-storage", _external_storage),
    _v1("unallocated", _unallocated),
    _v1("huge-unallocated", _huge_unallocated),
    _v1("bzip2-filter", _filtered(lambda: hdf5plugin.BZip2())),
    _v1("sz3-filter", _filtered(lambda: hdf5plugin.SZ3(absolute=0.1))),
    _v1("zstd-plugin-filter", _filtered(lambda: hdf5plugin.Zstd())),
    _v1("unwritten-chunk", _unwritten_chunk),
    _v1("array-dtype-differs", _array_dtype),
    _v1("damaged-format-attribute", _damaged_format_attr),
    _v1("stride-1e15", _stride([10**15, 1]), HARMLESS),
    _v1("stride-2e9", _stride([2 * 10**9, 1]), HARMLESS),
    _v1("stride-overflow", _stride([2**63 - 1, 1])),
    _v1("stride-zero-disagrees", _stride([0, 1])),
    _v2("header-hash", _header_hash),
    _v2("version-3", _version3),
    _v2("layout-flipped", _layout_flip),
    _v2("truncated", _truncate),
    _v2("appended", _append),
    _v2("at-outside", _edit("model/w", {"at": 10**9})),
    _v2("at-misaligned", _edit("model/w", {"at": 4100})),
    _v2("at-in-header", _edit("model/w", {"at": 0})),
    _v2("hashes-missing", _edit("model/w", {"xxh3": []})),
    _v2("shape-huge", _edit("model/w", {"shape": [2**30, 2**10]})),
    _v2("stride-gaps", _edit("model/w", {"stride": [64, 1]})),
    _v2("stride-1e15", _edit("model/t", {"stride": [10**15, 1]})),
    _v2("stride-zero-disagrees", _edit("model/w", {"stride": [0, 1]})),
    _v2("requires-grad-int", _edit("model/step", {"requires_grad": True})),
    _v2("same-as-mismatch", _edit("model/t", {"same_as": "model/w", "xxh3": None})),
    _v2("unknown-field", _edit("model/w", {"pickle": "cos\nsystem"})),
    _v2("dtype-unknown", _edit("model/w", {"dtype": "float128"})),
    _v2("chunk-missing", _chunk_edit("lz4", lambda c: c["at"].pop())),
    _v2("chunk-outside", _chunk_edit("lz4", lambda c: c["at"].__setitem__(0, [10**9, 100]))),
    _v2("chunk-oversized", _chunk_edit("lz4", lambda c: c["at"].__setitem__(0, [c["at"][0][0], 10**6]))),
    _v2("chunk-shape-huge", _chunk_edit("lz4", lambda c: c.__setitem__("shape", [2**20, 64]))),
    _v2("chunk-shape-columns", _chunk_edit("lz4", lambda c: c.__setitem__("shape", [256, 8]))),
    _v2("filter-not-allowed", _chunk_edit("lz4", lambda c: c.__setitem__("filter", [307, [9]]))),
    _v2("filter-elem-size-0", _chunk_edit("lz4", lambda c: c["filter"][1].__setitem__(2, 0))),
    _v2("raw-chunk-wrong-size", _raw_chunk_wrong_size),
    _v2("bitshuffle-3gib-header", _bitshuffle_bomb),
    _v2("bitshuffle-block-past-end", _bitshuffle_block),
    _v2("bitshuffle-block-size-0", _bitshuffle_zero_block),
    _v2("b2nd-smaller-shape", _b2nd_smaller),
    _v2("external-link-in-hdf5-part", _external_link_v2, HDF5_ONLY),
    _v2("data-flipped", _data_flip, DATA_DAMAGE),
    _v2("chunk-flipped", _chunk_flip, DATA_DAMAGE),
]


# ---------------------------------------------------------------------------- read paths


def flat(obj: Any) -> dict[str, Any]:
    """Key path -> leaf of a loaded (or saved) object."""
    return {n.path: n.value for n in tree.flatten(obj) if isinstance(n, tree.Leaf)}


def _zeros_like_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        out = {k: _zeros_like_tensors(v) for k, v in obj.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    return None


def _slices(path: Path) -> dict[str, Any]:
    out = {}
    with th5.open(path) as s:
        for key in s.keys():
            h = s[key]
            if isinstance(h, th5.TensorHandle):
                out[key] = h[...] if h.ndim == 0 else h[: max(1, len(h) // 2)]
    return out


def _load_into(path: Path, original: Any) -> dict[str, Any]:
    targets = _zeros_like_tensors(original)
    th5.load_into(targets, path, strict=False)
    return flat(targets)


def _convert(path: Path) -> dict[str, Any]:
    out = path.with_name(path.stem + ".converted.h5")
    th5.convert(path, out)
    return flat(th5.load(out, verify=True))


def _items(path: Path) -> dict[str, Any]:
    with th5.open(path) as s:
        return dict(s.items())


READ_PATHS: dict[str, Callable[[Path, Any], dict[str, Any]]] = {
    "load": lambda p, o: flat(th5.load(p)),
    "load(mmap)": lambda p, o: flat(th5.load(p, mmap=True)),
    "load(verify)": lambda p, o: flat(th5.load(p, verify=True)),
    "load(mmap, verify)": lambda p, o: flat(th5.load(p, mmap=True, verify=True)),
    "items": lambda p, o: _items(p),
    "slices": lambda p, o: _slices(p),
    "load_into": _load_into,
    "device=cpu:0": lambda p, o: flat(th5.load(p, device={"*": "cpu:0"})),
    "convert": lambda p, o: _convert(p),
}
CHECKED = ("load(verify)", "load(mmap, verify)", "convert")
"""Read paths that check every checksum."""


def expected_part(original: Any, got: dict[str, Any], read: str) -> dict[str, Any]:
    """What ``got`` must equal: the original's leaves at the same keys (a slice for 'slices')."""
    ref = flat(original)
    if read == "slices":
        return {k: (ref[k][...] if ref[k].dim() == 0 else ref[k][: max(1, len(ref[k]) // 2)]) for k in got}
    return {k: ref[k] for k in got}
