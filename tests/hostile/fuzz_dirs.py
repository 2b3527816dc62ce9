"""The mutation fuzzer's directory surface (issue #30): small valid checkpoint directories,
mutated, read through every public read path of a directory in the fuzzer's limited worker.

Seeds: tensorstore_h5 rank directories (``save_as_ranks``, two ranks, rows and columns,
one lz4 tensor) and a Hugging Face sharded safetensors directory
(``model.safetensors.index.json`` + two shards). Mutations, one to three a case:

- the index JSON: offsets, shapes, dtypes, keys and file names of pieces (``../`` paths,
  absolute paths, a NUL, names of missing files), pieces that overlap or leave gaps, file
  lengths and layout hashes, paths and types, huge and odd numbers, duplicate keys, raw byte
  flips and truncation; the Hugging Face ``weight_map`` likewise, and shard headers rewritten
  (data offsets, dtypes, shapes, header length);
- the data files: byte flips, truncations, appended bytes, the file fuzzer's own mutations
  (tests/hostile/fuzz.py) with the index updated to the mutated file's length and layout hash
  ("crafted": reaching the file's parser past the index's checks), two files swapped, a file
  replaced by a symlink to another file of the directory, to a copy outside it (which must
  load exactly), to ``/dev/zero``, a dangling or looping symlink, a FIFO, a directory, an
  empty file, or removed.

Read paths (each in the worker, a canary planted in freed memory first): ``th5.open(dir)`` +
keys + whole reads, row and column slices, ``read(index=, verify=True)`` and ``read(out=)``;
``th5.load(dir)`` (and ``verify=False``), ``items``, ``th5.load_into``, ``dcp.load(...,
storage_reader=H5StorageReader(dir), no_dist=True)``, and ``tensorstore-h5 ls/info/verify dir``.

The property: every read raises a TensorStoreError naming a path of the directory (DCP's
``CheckpointException`` is unwrapped; DCP's own planner refusing a checkpoint whose shapes or
keys differ from the target's is allowed) or returns exactly what the directory holds, as an
independent reader computes it from the (mutated) index and files (:func:`reference`: each
piece read from its file on its own, checked or not as the read path is, placed at its offsets;
a piece that escapes the directory, names a missing or special file, another save's file, a
dataset of another shape or dtype, or pieces that overlap or leave a gap, must be refused). No
crash, hang or allocation beyond the worker's limit, no memory that no read filled (canary),
and no file opened outside the directory (an audit hook records every ``open``; a symlink in
the directory is the directory's own file, as the Hugging Face cache needs).

    python tests/hostile/fuzz.py run --surface dirs --seconds 300 --out findings/
"""

from __future__ import annotations

import contextlib
import io as stdio
import json
import math
import os
import random
import re
import shutil
import stat
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEED_KINDS = ("ours", "ours-cols", "hf")
CASE_SECONDS = 30.0
"""Wall time one case (every read path) may take in the worker before it counts as a hang."""

_DATA_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\.[0-9a-f]{16}\.h5")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_ST_MAX_HEADER = 100 * 2**20
MAX_REF_ELEMENTS = 1 << 20
"""A global tensor larger than this gets no reference (the library may still refuse or read it)."""


# ---------------------------------------------------------------------------- seeds


def seed_state(kind: str) -> dict[str, Any]:
    """The flat state a seed directory holds: DCP key (ours) or tensor name (Hugging Face) -> tensor."""
    import torch

    g = torch.Generator().manual_seed(11 + len(kind))
    if kind.startswith("ours"):
        return {"model.w": torch.randn(8, 6, generator=g), "model.b": torch.arange(8.0),
                "model.h": torch.randn(6, 4, generator=g).to(torch.bfloat16),
                "model.c": torch.randn(64, 16, generator=g) * 0.02, "model.s": torch.tensor(3.0),
                "opt.n": torch.arange(12, dtype=torch.int32).reshape(4, 3)}
    return {"model.embed.weight": torch.randn(10, 4, generator=g), "model.norm.weight": torch.ones(4),
            "lm_head.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
            "model.idx": torch.arange(5, dtype=torch.int64)}


def key_path(kind: str, name: str) -> str:
    from tensorstore_h5.format import tree

    return name.replace(".", "/", 1) if kind.startswith("ours") else tree.escape(name)


def expected(kind: str) -> dict[str, Any]:
    """Key path -> the tensor saved there."""
    return {key_path(kind, k): v for k, v in seed_state(kind).items()}


def make_seed(kind: str, d: Path) -> None:
    import torch  # noqa: F401

    state = seed_state(kind)
    if kind.startswith("ours"):
        from tensorstore_h5.bench.simulate import save_as_ranks

        save_as_ranks(state, str(d), ranks=2, dim=1 if kind == "ours-cols" else 0,
                      mappings={k: tuple(k.split(".", 1)) for k in state},
                      compression=lambda k, t: "lz4" if k == "model/c" else None, chunk_bytes=1024)
        return
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for k in range(2):
        part = {n: state[n] for n in names[k::2]}
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(part, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.nbytes for t in state.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))


def make_secret(kind: str, d: Path) -> None:
    """A file outside the checkpoint directory that looks like one of its data files, holding
    ``SECRET`` bytes (escapes are told by the audit hook; the bytes show one in a value)."""
    import torch

    secret = torch.frombuffer(bytearray(b"SECRET!!" * 1024), dtype=torch.float32)
    if kind.startswith("ours"):
        from tensorstore_h5.bench.simulate import save_as_ranks

        state = {k: secret[:v.numel()].reshape(v.shape).to(v.dtype).clone() if v.is_floating_point() else v.clone()
                 for k, v in seed_state(kind).items()}
        save_as_ranks(state, str(d / "secret-ckpt"), ranks=2, mappings={k: tuple(k.split(".", 1)) for k in state})
        for name in os.listdir(d / "secret-ckpt"):
            os.replace(d / "secret-ckpt" / name, d / name)
        os.rmdir(d / "secret-ckpt")
    else:
        from safetensors.torch import save_file

        state = {n: secret[:v.numel()].reshape(v.shape).to(v.dtype).clone() if v.is_floating_point() else v.clone()
                 for n, v in seed_state(kind).items()}
        save_file(state, str(d / "secret.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------- mutations


class Case:
    """A case's folder: ``ckpt/`` (the checkpoint directory) and ``outside/`` (copies of its
    files, and a secret checkpoint, beside it)."""

    def __init__(self, root: Path, kind: str) -> None:
        self.root, self.kind = root, kind
        self.ckpt, self.outside = root / "ckpt", root / "outside"
        self.index = self.ckpt / ("tensorstore_h5.json" if kind.startswith("ours") else "model.safetensors.index.json")

    def data_files(self) -> list[str]:
        suffix = ".h5" if self.kind.startswith("ours") else ".safetensors"
        return sorted(n for n in os.listdir(self.ckpt) if n.endswith(suffix))

    def secret_names(self) -> list[str]:
        return sorted(os.listdir(self.outside))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)


_NUMBERS = [-1, 0, 1, 2, 3, 4, 7, 8, 9, 63, 64, 4096, 2**31, 2**32, 2**62 - 1, 2**62, 2**63, 2**64, 10**30, 1.5, -0.0,
            "1", None, True, [], {}]
_DTYPES = ["float16", "bfloat16", "float64", "int32", "int64", "uint8", "bool", "float8_e4m3fn", "complex64",
           "float128", "", None, 7, "float32"]
_ST_DTYPES = ["F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "C64", "F32", "X9", "", None, 4]


def _pick_number(rng: random.Random, around: int | None = None) -> Any:
    if around is not None and rng.random() < 0.5:
        return around + rng.choice([-2, -1, 1, 2])
    return rng.choice(_NUMBERS)


def _edit_list(rng: random.Random, value: Any) -> Any:
    """A list of ints (offsets, shape) edited: one element changed, dropped or added."""
    if type(value) is not list:
        return [rng.randrange(9)]
    out = list(value)
    r = rng.random()
    if out and r < 0.6:
        i = rng.randrange(len(out))
        out[i] = _pick_number(rng, out[i] if type(out[i]) is int else None)
    elif out and r < 0.8:
        out.pop(rng.randrange(len(out)))
    else:
        out.insert(rng.randrange(len(out) + 1), rng.choice([0, 1, 2]))
    return out


def _escape_names(case: Case, name: str, rng: random.Random) -> list[str]:
    """File names a hostile index may give in place of ``name``."""
    secret = rng.choice(case.secret_names() or ["x"])
    return ["../outside/" + secret, str(case.outside / secret), "../outside/" + name, "sub/" + name, name + "\0",
            "\0" + name, "", ".", "..", "/", "../ckpt/" + name, "./" + name, name.upper(), name + "/",
            re.sub(r"\.[0-9a-f]{16}\.", ".0123456789abcdef.", name), re.sub(r"rank0000\d", "rank00009", name),
            "model-00009-of-00002.safetensors", "/dev/zero", "../" * 40 + "dev/zero"]


def _mutate_ours_index(case: Case, rng: random.Random) -> str:
    text = case.index.read_bytes()
    if rng.random() < 0.25:
        return _raw_text_edit(case, text, rng)
    obj = json.loads(text)
    tensors = [i for i, t in enumerate(obj["types"]) if t == "tensor"]
    i = rng.choice(tensors)
    entry = obj["entries"][i]
    pieces = entry["pieces"]
    what = rng.choice(["piece-offsets", "piece-shape", "piece-file", "piece-key", "piece-file", "dtype", "shape",
                       "drop-piece", "dup-piece", "shift-piece", "swap-files", "swap-offsets", "files-bytes",
                       "files-hash", "files-rename", "files-drop", "files-add", "type", "path", "top", "dcp",
                       "entry-field", "pieces-odd"])
    names = list(obj["files"])
    j = rng.randrange(len(pieces))
    if what == "piece-offsets":
        pieces[j]["offsets"] = _edit_list(rng, pieces[j]["offsets"])
    elif what == "piece-shape":
        pieces[j]["shape"] = _edit_list(rng, pieces[j]["shape"])
    elif what == "piece-file":
        old = pieces[j]["file"]
        new = rng.choice([n for n in names if n != old] or names) if rng.random() < 0.3 else \
            rng.choice(_escape_names(case, old, rng))
        pieces[j]["file"] = new
        if rng.random() < 0.6 and new not in obj["files"]:  # the index's file list names it too
            obj["files"][new] = obj["files"][old]
    elif what == "piece-key":
        pieces[j]["key"] = rng.choice([p for p in obj["paths"] if p] + ["", "/model/w", "../x", "model", "model/w@4_0",
                                                                        "model/w\0", 123, None, "%2E%2E"])
    elif what == "dtype":
        entry["dtype"] = rng.choice(_DTYPES)
    elif what == "shape":
        entry["shape"] = _edit_list(rng, entry["shape"])
    elif what == "drop-piece" and len(pieces) > 1:
        pieces.pop(j)
    elif what == "dup-piece":
        pieces.insert(j, dict(pieces[j]))
    elif what == "shift-piece":
        offs = pieces[j]["offsets"]
        if offs:
            d = rng.randrange(len(offs))
            offs[d] += rng.choice([-1, 1])
    elif what == "swap-files" and len(pieces) > 1:
        k = (j + 1) % len(pieces)
        pieces[j]["file"], pieces[k]["file"] = pieces[k]["file"], pieces[j]["file"]
    elif what == "swap-offsets" and len(pieces) > 1:
        k = (j + 1) % len(pieces)
        pieces[j]["offsets"], pieces[k]["offsets"] = pieces[k]["offsets"], pieces[j]["offsets"]
    elif what == "files-bytes":
        info = obj["files"][rng.choice(names)]
        info["bytes"] = _pick_number(rng, info["bytes"])
    elif what == "files-hash":
        info = obj["files"][rng.choice(names)]
        other = obj["files"][rng.choice(names)]["layout_xxh3"]
        info["layout_xxh3"] = rng.choice([other, "0" * 16, "", None, info["layout_xxh3"].upper(), "g" * 16])
    elif what == "files-rename":
        old = rng.choice(names)
        new = rng.choice(_escape_names(case, old, rng))
        obj["files"] = {(new if n == old else n): v for n, v in obj["files"].items()}
        for e in obj["entries"]:
            for p in e.get("pieces", []) if isinstance(e, dict) else []:
                if p.get("file") == old:
                    p["file"] = new
    elif what == "files-drop":
        obj["files"].pop(rng.choice(names))
    elif what == "files-add":
        old = rng.choice(names)
        obj["files"][re.sub(r"rank0000\d", "rank00009", old)] = dict(obj["files"][old])
        pieces[j]["file"] = re.sub(r"rank0000\d", "rank00009", old)
    elif what == "type":
        obj["types"][i] = rng.choice(["ndarray", "value", "dict", "list", "tuple", "OrderedDict", "x", "", None])
    elif what == "path":
        k = rng.randrange(len(obj["paths"]))
        obj["paths"][k] = rng.choice(["", "model", "model/w", "model//w", "model/w/x", "/model", "model/", "..", 3,
                                      obj["paths"][(k + 1) % len(obj["paths"])]])
    elif what == "top":
        key = rng.choice(["version", "format", "save_id", "metadata", "files", "paths", "types", "entries", "rank",
                          "extra"])
        obj[key] = rng.choice([None, 1, 2, 3, "2", "x", [], {}, -1, "tensorstore_h5.sharded", obj.get("save_id")])
    elif what == "dcp":
        dcp = obj.get("dcp") or {}
        sub = rng.choice(["fqns", "planner_data", "version"])
        if sub == "fqns" and dcp.get("fqns"):
            k = rng.choice(list(dcp["fqns"]))
            dcp["fqns"][k] = rng.choice(["model/w", "model", "nope", "", "model/b", 1])
        elif sub == "planner_data" and dcp.get("planner_data"):
            k = rng.choice(list(dcp["planner_data"]))
            dcp["planner_data"][k] = rng.choice([["model"], ["model", "w", "x"], [1], [-1, "w"], [], ["opt", "n"]])
        else:
            dcp["version"] = rng.choice([None, "9", 1, ""])
        obj["dcp"] = dcp
    elif what == "entry-field":
        entry[rng.choice(["parameter", "requires_grad", "pickle", "at", "stride"])] = rng.choice([True, False, 1, None,
                                                                                                  [1, 2]])
    elif what == "pieces-odd":
        entry["pieces"] = rng.choice([[], None, {}, [None], [[]], pieces * 40, "x"])
    return f"index-{what}" + _write_json(case.index, obj, rng)


def _write_json(path: Path, obj: Any, rng: random.Random) -> str:
    if rng.random() < 0.1:  # duplicate keys: a second value for one field, which json keeps (the last)
        text = json.dumps(obj)
        spots = [m.start() for m in re.finditer(r'"(shape|offsets|file|dtype|pieces|bytes|key)": ', text)]
        if spots:
            at = rng.choice(spots)
            field = text[at:text.index(":", at)]
            text = text[:at] + f'{field}: {json.dumps(rng.choice(_NUMBERS))}, ' + text[at:]
            path.write_text(text)
            return ":dup-key"
    path.write_text(json.dumps(obj))
    return ""


_RAW_TOKENS = [b"0", b"1", b"-1", b"1e400", b"-1e400", b"NaN", b"Infinity", b"99999999999999999999999",
               b"1" + b"0" * 400, b"[]", b"{}", b"null", b'"\\u0000"', b'"../x"', b"\x00", b"\xff", b"[" * 100000,
               b'"' + b"a" * 10000 + b'"', b"-0", b"1.0", b"true"]


def _raw_text_edit(case: Case, text: bytes, rng: random.Random) -> str:
    out = bytearray(text)
    mode = rng.choice(["token", "token", "flip", "truncate", "number"])
    if mode == "truncate":
        out = out[:rng.randrange(len(out))]
    elif mode == "flip":
        for _ in range(rng.randrange(1, 6)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif mode == "number":
        spots = [m.span() for m in re.finditer(rb"-?\d+", bytes(out))]
        a, b = rng.choice(spots)
        out[a:b] = rng.choice(_RAW_TOKENS[:9])
    else:
        i = rng.randrange(len(out))
        out[i:min(len(out), i + rng.randrange(1, 8))] = rng.choice(_RAW_TOKENS)
    case.index.write_bytes(bytes(out))
    return f"index-raw-{mode}"


def _mutate_hf_index(case: Case, rng: random.Random) -> str:
    text = case.index.read_bytes()
    if rng.random() < 0.25:
        return _raw_text_edit(case, text, rng)
    obj = json.loads(text)
    wmap = obj["weight_map"]
    names = list(wmap)
    what = rng.choice(["file", "file", "other-shard", "drop", "add", "rename", "metadata", "wmap-odd", "value-odd"])
    n = rng.choice(names)
    if what == "file":
        wmap[n] = rng.choice(_escape_names(case, wmap[n], rng))
    elif what == "other-shard":
        wmap[n] = rng.choice(sorted(set(wmap.values())))
    elif what == "drop":
        wmap.pop(n)
    elif what == "add":
        wmap[rng.choice(["extra", n + ".x", "", "a/b", "../x", "%2F"])] = rng.choice(list(wmap.values()))
    elif what == "rename":
        wmap[rng.choice([n.upper(), n + "\0", "/" + n, n.replace(".", "/"), ""])] = wmap.pop(n)
    elif what == "metadata":
        obj["metadata"] = rng.choice([None, [], "x", 1, {"total_size": -1}, {"total_size": 2**70},
                                      {"tensorstore_h5.keys": "paths"}])
    elif what == "wmap-odd":
        obj["weight_map"] = rng.choice([None, [], "x", {n: 1}, {n: None}, {}])
    else:
        wmap[n] = rng.choice([1, None, [], {}, True])
    return f"hf-index-{what}" + _write_json(case.index, obj, rng)


def _mutate_st_header(path: Path, rng: random.Random) -> str:
    """Rewrite a safetensors file's header (its length kept right unless that is the edit)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    names = [k for k in head if k != "__metadata__"]
    what = rng.choice(["offsets", "offsets", "dtype", "shape", "length", "metadata", "drop", "alias", "odd"])
    if what == "length":
        new_n = rng.choice([0, 1, n - 1, n + 1, n + 8, 2**31, 2**63, 100 * 2**20 + 1, len(raw), len(raw) - 8])
        path.write_bytes(struct.pack("<Q", new_n % 2**64) + raw[8:])
        return f"st-header-length:{new_n}"
    if names:
        k = rng.choice(names)
        e = head[k]
        if what == "offsets":
            e["data_offsets"] = rng.choice([_edit_list(rng, e["data_offsets"]), [0, 0], [e["data_offsets"][0]] * 2,
                                            [e["data_offsets"][1], e["data_offsets"][0]], [0, len(body) + 8],
                                            [len(body), len(body) + (e["data_offsets"][1] - e["data_offsets"][0])],
                                            [x + 4 for x in e["data_offsets"]], [x - 4 for x in e["data_offsets"]]])
        elif what == "dtype":
            e["dtype"] = rng.choice(_ST_DTYPES)
        elif what == "shape":
            e["shape"] = _edit_list(rng, e["shape"])
        elif what == "drop":
            head.pop(k)
        elif what == "alias":  # another tensor's bytes, of the same size where they fit
            other = head[rng.choice(names)]
            e["data_offsets"] = list(other["data_offsets"])
        elif what == "odd":
            head[k] = rng.choice([None, [], "x", {"dtype": "F32"}, {**e, "extra": 1}])
    if what == "metadata":
        head["__metadata__"] = rng.choice([None, [], "x", {"format": 1}, {"tensorstore_h5.keys": "paths"}, {}])
    text = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return f"st-header-{what}"


def _update_index_for(case: Case, name: str) -> None:
    """Record the (mutated) data file ``name``'s length and layout hash in the index, as a
    crafted directory would (the file's own header says them)."""
    from tensorstore_h5.format import checksum
    from tensorstore_h5.format import layout as fmt

    raw = (case.ckpt / name).read_bytes()
    try:
        header = fmt.parse_header(raw[:64], name, len(raw))
    except Exception:  # noqa: BLE001 - a damaged header: the index keeps the old record
        return
    obj = json.loads(case.index.read_bytes())
    if name in obj.get("files", {}):
        obj["files"][name] = {"bytes": header.file_length, "layout_xxh3": checksum.to_hex(header.layout_hash)}
        case.index.write_text(json.dumps(obj))


_SAME_SIZE = {"float32": ["int32", "uint32"], "int32": ["float32"], "bfloat16": ["float16", "int16"],
              "float16": ["bfloat16"], "int64": ["float64", "complex64"]}


def _craft_rank_entry(case: Case, name: str, rng: random.Random) -> str:
    """Rewrite one entry of a rank file's layout (hashes recomputed: a crafted file) and record
    the file in the index: a stride (transposed, with gaps, broadcast), another entry's bytes,
    an alias (``same_as``), a dtype of the same size (the index's too, or not)."""
    from hostile.hostile_files import craft_layout, read_layout

    path = case.ckpt / name
    head, entries = read_layout(path)
    keys = [k for k, e in zip(head["paths"], entries) if "dtype" in e and ("at" in e or "chunks" in e)]
    if not keys:
        return "none"
    key = rng.choice(keys)
    what = rng.choice(["stride", "stride", "at", "same_as", "dtype", "dtype-both"])
    note = what

    def edit(h: dict[str, Any], es: list[dict[str, Any]]) -> None:
        nonlocal note
        e = es[h["paths"].index(key)]
        shape = e.get("shape", [])
        others = [x for k, x in zip(h["paths"], es) if k != key and "at" in x]
        if what == "stride" and shape:
            r = shape[0]
            c = shape[1] if len(shape) > 1 else 1
            e["stride"] = rng.choice([[1, r], [c * 2, 1], [0, 1], [c, 0], [c + 1, 1]]) if len(shape) == 2 else \
                rng.choice([[0], [2], [3]]) if len(shape) == 1 else [c] * len(shape)
            e["stride"] = e["stride"][:len(shape)]
            note = f"stride {e['stride']}"
        elif what == "at" and others:
            o = rng.choice(others)
            e.pop("chunks", None)
            e["at"] = rng.choice([o["at"], o["at"] + 64, max(0, o["at"] - 64), e.get("at", o["at"]) + 64])
            note = f"at {e['at']}"
        elif what == "same_as":
            e["same_as"] = rng.choice([k for k in h["paths"] if k != key] or [key])
            for f in ("at", "chunks", "xxh3"):
                e.pop(f, None)
            note = f"same_as {e['same_as']}"
        elif what.startswith("dtype") and e.get("dtype") in _SAME_SIZE:
            e["dtype"] = rng.choice(_SAME_SIZE[e["dtype"]])
            note = f"dtype {e['dtype']}"

    craft_layout(path, edit)
    if what == "dtype-both":  # the index says the new dtype too: the same bytes, read as another type
        new = next((e.get("dtype") for k, e in zip(*read_layout(path)) if k == key), None)
        obj = json.loads(case.index.read_bytes())
        for path_, e, kind in zip(obj["paths"], obj["entries"], obj["types"]):
            for p in e.get("pieces", []) if kind == "tensor" and isinstance(e, dict) else []:
                if p.get("file") == name and p.get("key", path_) == key and new:
                    e["dtype"] = new
        case.index.write_text(json.dumps(obj))
    _update_index_for(case, name)
    return f"crafted-entry {key}: {note}"


def _mutate_data_file(case: Case, rng: random.Random) -> str:
    from hostile import fuzz

    names = case.data_files()
    if not names:
        return "none"
    name = rng.choice(names)
    path = case.ckpt / name
    ours = case.kind.startswith("ours")
    what = rng.choice(["flip", "flip", "truncate", "append", "crafted", "crafted", "crafted", "swap", "link-other",
                       "link-outside-copy", "link-devzero", "link-dangling", "link-loop", "fifo", "directory", "empty",
                       "remove", "secret"])
    if not path.is_file():
        what = "remove"
    if what in ("flip", "truncate", "append"):
        data = bytearray(path.read_bytes())
        if what == "flip":
            for _ in range(rng.randrange(1, 9)):
                i = rng.randrange(len(data)) if rng.random() < 0.7 else rng.randrange(min(len(data), 128))
                data[i] ^= 1 << rng.randrange(8)
        elif what == "truncate":
            data = data[:rng.randrange(len(data))]
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        path.write_bytes(bytes(data))
    elif what == "crafted":
        if ours and rng.random() < 0.4:
            what = _craft_rank_entry(case, name, rng)
        elif ours:
            mode, data = fuzz.mutate(path.read_bytes(), rng)
            path.write_bytes(data)
            _update_index_for(case, name)
            what = f"crafted-{mode}"
        else:
            what = _mutate_st_header(path, rng)
    elif what == "swap" and len(names) > 1:
        other = case.ckpt / rng.choice([n for n in names if n != name])
        tmp = case.ckpt / ".swap"
        os.replace(path, tmp)
        os.replace(other, path)
        os.replace(tmp, other)
    elif what == "link-other" and len(names) > 1:
        other = rng.choice([n for n in names if n != name])
        _remove(path)
        os.symlink(other, path)
    elif what == "link-outside-copy":  # the Hugging Face cache's layout: must load exactly
        case.outside.mkdir(exist_ok=True)
        shutil.copy(path, case.outside / ("copy-" + name))
        _remove(path)
        os.symlink(os.path.join("..", "outside", "copy-" + name), path)
    elif what == "link-devzero":
        _remove(path)
        os.symlink("/dev/zero", path)
    elif what == "link-dangling":
        _remove(path)
        os.symlink("nowhere-" + name, path)
    elif what == "link-loop":
        _remove(path)
        os.symlink(name, path)
    elif what == "fifo":
        _remove(path)
        os.mkfifo(path)
    elif what == "directory":
        _remove(path)
        path.mkdir()
    elif what == "empty":
        path.write_bytes(b"")
    elif what == "secret":  # a file of another save, of the same name
        secrets = [n for n in case.secret_names() if n.endswith(".h5" if ours else ".safetensors")]
        if secrets:
            shutil.copy(case.outside / secrets[0], path)
    else:
        what = "remove"
        _remove(path)
    return f"file-{what}:{name}"


def mutate_case(case: Case, rng: random.Random) -> list[str]:
    """Mutate the case's directory one to three times; the mutations' names."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        r = rng.random()
        try:
            if r < 0.5:
                ours = case.kind.startswith("ours")
                done.append(_mutate_ours_index(case, rng) if ours else _mutate_hf_index(case, rng))
            else:
                done.append(_mutate_data_file(case, rng))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OSError) as e:
            done.append(f"skipped({type(e).__name__})")  # an earlier mutation left nothing of the kind
    return done


# ---------------------------------------------------------------------------- keeping and restoring cases


def save_case(src: Path, dst: Path, info: dict[str, Any]) -> None:
    """Copy a case folder (regular files; symlinks, FIFOs and directories recorded in
    ``manifest.json``, FIFOs never opened) to ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    special: dict[str, Any] = {"symlinks": {}, "fifos": [], "dirs": []}
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            r = os.path.normpath(os.path.join(rel, name))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                special["symlinks"][r] = os.readlink(p)
            elif stat.S_ISFIFO(st.st_mode):
                special["fifos"].append(r)
            elif stat.S_ISDIR(st.st_mode):
                special["dirs"].append(r)
                (dst / "files" / r).mkdir(parents=True, exist_ok=True)
            elif stat.S_ISREG(st.st_mode):
                (dst / "files" / r).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dst / "files" / r)
    (dst / "manifest.json").write_text(json.dumps({**info, **special}, indent=1))


def restore_case(src: Path, dst: Path) -> dict[str, Any]:
    """A case folder kept by :func:`save_case`, made again at ``dst``; its info."""
    info = json.loads((src / "manifest.json").read_text())
    shutil.copytree(src / "files", dst, symlinks=True, dirs_exist_ok=True)
    for r in info["dirs"]:
        (dst / r).mkdir(parents=True, exist_ok=True)
    for r in info["fifos"]:
        os.mkfifo(dst / r)
    for r, target in info["symlinks"].items():
        os.symlink(target, dst / r)
    return info


# ---------------------------------------------------------------------------- the reference reader


class Refuse(Exception):
    """The library must refuse this (the reason)."""


class Unknown(Exception):
    """The reference cannot tell (the reason): no check."""


def _regular_size(path: str) -> int:
    """The size of a regular file (a symlink to one followed); Refuse for anything else."""
    if "\0" in path:
        raise Refuse(f"NUL in {path!r}")
    try:
        st = os.stat(path)
    except OSError as e:
        raise Refuse(f"{path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refuse(f"{path}: not a regular file")
    return st.st_size


class PieceRef:
    """One piece as read on its own: ``box`` (offsets, shape) of the global tensor, and
    ``data`` (its tensor, unchecked) / ``checked`` (whether a checked read passes), or
    ``refuse`` (why any read touching it must fail) / ``unknown``."""

    def __init__(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.offsets, self.shape = offsets, shape
        self.data: Any = None
        self.checked = False
        self.refuse: str | None = None
        self.unknown: str | None = None


class EntryRef:
    """A tensor of the directory: its dtype and shape and pieces, or ``refuse`` for the whole entry."""

    def __init__(self, refuse: str | None = None, unknown: str | None = None) -> None:
        self.refuse, self.unknown = refuse, unknown
        self.dtype: Any = None
        self.shape: tuple[int, ...] = ()
        self.pieces: list[PieceRef] = []

    def verdict(self, sel: tuple[slice, ...] | None, checked: bool) -> tuple[str, Any]:
        """What a read of ``sel`` (None: all of it) must give: ``("refuse", why)``, ``("value",
        tensor)`` or ``("unknown", why)``."""
        import torch

        if self.refuse:
            return "refuse", self.refuse
        if self.unknown:
            return "unknown", self.unknown
        box = _box(sel, self.shape)
        out = torch.zeros(self.shape, dtype=self.dtype)
        unknown = None
        for p in self.pieces:
            if not _overlaps(box, p.offsets, p.shape):
                continue
            if p.refuse:
                return "refuse", p.refuse
            if p.unknown or p.data is None:
                unknown = p.unknown or "no data"
                continue
            if checked and not p.checked:
                return "refuse", "a piece's checksum does not match"
            out[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.shape))] = p.data
        if unknown:
            return "unknown", unknown
        return "value", out[tuple(slice(a, b) for a, b in box)] if box else out


def _box(sel: tuple[slice, ...] | None, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    box = [(0, n) for n in shape]
    for d, s in enumerate(sel or ()):
        a, b, _ = s.indices(shape[d])
        box[d] = (a, max(a, b))
    return box


def _overlaps(box: list[tuple[int, int]], offsets: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    if any(s == 0 for s in shape) or any(b <= a for a, b in box):
        return False
    return all(a < o + s and o < b for (a, b), o, s in zip(box, offsets, shape))


def _ints(value: Any, minimum: int = 0) -> tuple[int, ...]:
    if type(value) is not list or len(value) > 64 or not all(type(n) is int and minimum <= n < 2**62 for n in value):
        raise Refuse(f"invalid ints {value!r}")
    return tuple(value)


def _cover(shape: tuple[int, ...], pieces: list[PieceRef]) -> None:
    """Refuse pieces outside the shape, overlapping, or leaving a gap (complete cover)."""
    import torch

    numel = math.prod(shape)
    for p in pieces:
        if len(p.offsets) != len(shape) or len(p.shape) != len(shape):
            raise Refuse("piece of another rank")
        if any(o + s > n for o, s, n in zip(p.offsets, p.shape, shape)):
            raise Refuse("piece outside the shape")
    if numel > MAX_REF_ELEMENTS:
        raise Unknown("too large for the reference")
    count = torch.zeros(shape, dtype=torch.int32)
    for p in pieces:
        if math.prod(p.shape):
            count[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.shape))] += 1
    if numel and not bool((count == 1).all()):
        raise Refuse("pieces overlap or leave a gap")


def _ours_reference(ckpt: Path) -> dict[str, EntryRef] | str:
    """Per key path of a tensorstore_h5 directory: what reads must give; a string where the
    whole index must be refused ("refuse: why")."""
    import tensorstore_h5 as th5
    from tensorstore_h5.format import checksum
    from tensorstore_h5.format import layout as fmt
    from tensorstore_h5.format.dtypes import spec_for_name

    ipath = str(ckpt / "tensorstore_h5.json")
    try:
        _regular_size(ipath)
        obj = json.loads(Path(ipath).read_bytes())
    except (Refuse, ValueError, RecursionError, OSError) as e:
        return f"refuse: index {e}"[:300]
    top = {"format", "version", "save_id", "metadata", "files", "paths", "types", "entries"}
    if type(obj) is not dict or obj.get("format") != "tensorstore_h5.sharded" or obj.get("version") != 2 or \
            not top <= obj.keys() or not obj.keys() <= top | {"dcp", "rank"}:
        return "refuse: index top"
    if "rank" in obj:
        return "unknown: a rank-local index" if type(obj["rank"]) is int and obj["rank"] >= 0 else "refuse: rank"
    if type(obj["save_id"]) is not str or not _HEX16.fullmatch(obj["save_id"]) or \
            type(obj["metadata"]) is not dict or type(obj["files"]) is not dict:
        return "refuse: index top fields"
    files: dict[str, tuple[int, str]] = {}
    for name, info in obj["files"].items():
        if not _DATA_FILE.fullmatch(name) or type(info) is not dict or set(info) != {"bytes", "layout_xxh3"} or \
                type(info["bytes"]) is not int or info["bytes"] < fmt.USERBLOCK or type(info["layout_xxh3"]) is not str \
                or not _HEX16.fullmatch(info["layout_xxh3"]):
            return f"refuse: files entry {name!r}"
        files[name] = (info["bytes"], info["layout_xxh3"])
    paths, kinds, entries = obj["paths"], obj["types"], obj["entries"]
    if type(paths) is not list or type(kinds) is not list or type(entries) is not list or not paths or \
            not len(paths) == len(kinds) == len(entries):
        return "refuse: paths/types/entries"
    if len(set(map(str, paths))) != len(paths) or not all(type(p) is str for p in paths):
        return "unknown: paths"
    stores: dict[str, Any] = {}

    def piece_file(name: str) -> Any:
        if name in stores:
            if isinstance(stores[name], Exception):
                raise stores[name]
            return stores[name]
        full = str(ckpt / name)
        try:
            size = _regular_size(full)
            size_rec, hash_rec = files[name]
            if size != size_rec:
                raise Refuse("length differs from the index's")
            with open(full, "rb") as f:
                head = f.read(64)
            try:
                header = fmt.parse_header(head, full, size)
            except th5.TensorStoreError as e:
                raise Refuse(f"header: {e}") from None
            if checksum.to_hex(header.layout_hash) != hash_rec:
                raise Refuse("layout hash differs from the index's")
            try:
                store = th5.open(full)
            except th5.TensorStoreError as e:
                raise Refuse(f"the file alone does not open: {e}") from None
            if store.format_version != 2:
                raise Refuse("not format 2")
            try:
                store._layout.check_disjoint()
            except th5.TensorStoreError as e:
                raise Refuse(f"entries share bytes: {e}") from None
        except Exception as e:  # noqa: BLE001 - kept for the next piece of the file
            stores[name] = e
            raise
        stores[name] = store
        return store

    out: dict[str, EntryRef] = {}
    try:
        for path, kind, item in zip(paths, kinds, entries):
            if kind != "tensor":
                continue
            try:
                out[path] = _ours_entry(path, item, files, piece_file, spec_for_name)
            except Refuse as e:
                out[path] = EntryRef(refuse=str(e)[:300])
            except Unknown as e:
                out[path] = EntryRef(unknown=str(e)[:300])
    finally:
        for s in stores.values():
            if not isinstance(s, Exception):
                s.close()
    return out


def _ours_entry(path: str, item: Any, files: dict[str, Any], piece_file: Any, spec_for_name: Any) -> EntryRef:
    import tensorstore_h5 as th5

    if type(item) is not dict:
        raise Refuse("entry not an object")
    if not item.keys() <= {"key", "dtype", "shape", "pieces", "parameter", "requires_grad"}:
        raise Refuse("unknown fields")
    if "key" in item:
        raise Unknown("an entry key")
    spec = spec_for_name(item.get("dtype")) if type(item.get("dtype")) is str else None
    if spec is None:
        raise Refuse("unknown dtype")
    if "parameter" in item or "requires_grad" in item:
        raise Unknown("flags")
    shape = _ints(item.get("shape"))
    raw = item.get("pieces")
    if type(raw) is not list:
        raise Refuse("pieces")
    ref = EntryRef()
    ref.dtype, ref.shape = spec.torch_dtype, shape
    specs = []
    for p in raw:
        if type(p) is not dict or not p.keys() <= {"file", "key", "offsets", "shape"} or "file" not in p:
            raise Refuse("piece fields")
        name, key = p["file"], p.get("key", path)
        if type(name) is not str or name not in files:
            raise Refuse("piece file not among the files")
        if type(key) is not str:
            raise Refuse("piece key")
        off, shp = p.get("offsets"), p.get("shape")
        if type(off) is not list or type(shp) is not list or len(off) != len(shape) or len(shp) != len(shape):
            raise Refuse("piece offsets/shape rank")
        pr = PieceRef(_ints(off), _ints(shp))
        ref.pieces.append(pr)
        specs.append((name, key))
    _cover(shape, ref.pieces)
    for pr, (name, key) in zip(ref.pieces, specs):
        if not math.prod(pr.shape):
            continue
        try:
            store = piece_file(name)
        except Refuse as e:
            pr.refuse = str(e)
            continue
        try:
            h = store[key]
        except th5.TensorStoreError:
            pr.refuse = "no such key in the file"
            continue
        except Exception as e:  # noqa: BLE001
            pr.unknown = f"the file's key: {type(e).__name__}"
            continue
        if not isinstance(h, th5.TensorHandle):
            pr.refuse = "not a tensor in the file"
            continue
        if tuple(h.shape) != pr.shape or h.dtype != spec.torch_dtype:
            pr.refuse = "the dataset's shape or dtype differs"
            continue
        try:
            pr.data = h.read(index=..., verify=False)
        except th5.TensorStoreError as e:
            pr.unknown = f"unchecked read: {e}"[:200]
            continue
        try:
            h.read(index=..., verify=True)
            pr.checked = True
        except th5.TensorStoreError:
            pr.checked = False
    return ref


_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
             "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
             "C64": "complex64"}


def _st_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A safetensors file read on its own (json + bytes): ``(name -> tensor, metadata)``; Refuse."""
    import torch

    from tensorstore_h5.format.dtypes import spec_for_name

    size = _regular_size(path)
    with open(path, "rb") as f:
        raw = f.read()
    if size < 8:
        raise Refuse("short")
    n = int.from_bytes(raw[:8], "little")
    if n > _ST_MAX_HEADER or 8 + n > size:
        raise Refuse("header length")
    try:
        head = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError):
        raise Refuse("header json") from None
    if type(head) is not dict:
        raise Refuse("header not an object")
    meta = head.pop("__metadata__", None) or {}
    if type(meta) is not dict:
        raise Refuse("metadata")
    body = raw[8 + n:]
    out = {}
    for name, info in head.items():
        if type(info) is not dict or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise Refuse("entry")
        dname = _ST_NAMES.get(info["dtype"]) if type(info["dtype"]) is str else None
        spec = spec_for_name(dname) if dname else None
        if spec is None:
            raise Refuse("dtype")
        shape = _ints(info["shape"])
        offs = _ints(info["data_offsets"])
        if len(offs) != 2:
            raise Refuse("offsets")
        a, b = offs
        if not a <= b <= len(body) or b - a != math.prod(shape) * spec.itemsize:
            raise Refuse("range")
        data = bytearray(body[a:b])
        t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        empty = not math.prod(shape)
        out[name] = torch.empty(shape, dtype=spec.torch_dtype) if empty else t.view(spec.torch_dtype).reshape(shape)
    return out, meta


def _hf_reference(ckpt: Path) -> dict[str, EntryRef] | str:
    from tensorstore_h5.format import tree

    ipath = ckpt / "model.safetensors.index.json"
    try:
        _regular_size(str(ipath))
        obj = json.loads(ipath.read_bytes())
    except (Refuse, ValueError, RecursionError, OSError) as e:
        return f"refuse: index {e}"[:300]
    wmap = obj.get("weight_map") if type(obj) is dict else None
    if type(wmap) is not dict or not all(type(k) is str and type(v) is str for k, v in wmap.items()):
        return "refuse: weight_map"
    if type(obj.get("metadata") or {}) is not dict:
        return "refuse: metadata"
    shards = {}
    try:
        for name in sorted(set(wmap.values())):
            if "/" in name or name in (".", "..") or "\0" in name:
                return "refuse: escape"
            shards[name] = _st_file(str(ckpt / name))
    except Refuse as e:
        return f"refuse: shard {e}"
    if any(m.get("tensorstore_h5.keys") is not None for _, m in shards.values()):
        return "unknown: key paths"
    out = {}
    for key, name in wmap.items():
        tensors = shards[name][0]
        if key not in tensors:
            return "refuse: key not in its shard"
        ref = EntryRef()
        t = tensors[key]
        ref.dtype, ref.shape = t.dtype, tuple(t.shape)
        p = PieceRef((0,) * t.dim(), tuple(t.shape))
        p.data, p.checked = t, True  # no checksums
        ref.pieces = [p]
        path = tree.escape(key)
        if path in out:
            return "unknown: names escape alike"
        out[path] = ref
    return out


def reference(ckpt: Path, kind: str) -> dict[str, EntryRef] | str:
    return _ours_reference(ckpt) if kind.startswith("ours") else _hf_reference(ckpt)


# ---------------------------------------------------------------------------- the worker side


class _Opens:
    """The audit hook's record of files opened while on (each path as given, made absolute)."""

    on = False
    seen: list[str] = []

    @classmethod
    def hook(cls, event: str, args: tuple[Any, ...]) -> None:
        if cls.on and event == "open" and args and isinstance(args[0], (str, bytes)):
            p = os.fsdecode(args[0])
            cls.seen.append(os.path.normpath(os.path.join(os.getcwd(), p)))


def prepare() -> None:
    """In the worker, before its limit: import what the reads use; install the audit hook."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)  # DCP logs each metadata fallback with a traceback
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: F401

    import tensorstore_h5.cli  # noqa: F401
    import tensorstore_h5.distributed  # noqa: F401
    from tensorstore_h5.distributed import H5StorageReader  # noqa: F401

    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        pass
    sys.addaudithook(_Opens.hook)


def _flat(obj: Any) -> dict[str, Any]:
    from hostile.hostile_files import flat

    return flat(obj)


def _zeros(kind: str) -> Any:
    import torch

    state = seed_state(kind)
    if kind.startswith("ours"):
        out: dict[str, Any] = {}
        for k, v in state.items():
            a, b = k.split(".", 1)
            out.setdefault(a, {})[b] = torch.zeros(v.shape, dtype=v.dtype)
        return out
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def _dcp_load(ckpt: Path, kind: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tensorstore_h5.distributed import H5StorageReader

    target = _zeros(kind)
    try:
        dcp.load(target, storage_reader=H5StorageReader(str(ckpt)), no_dist=True)
    except CheckpointException as e:
        failure = next(iter(e.failures.values()))[0]
        raise failure from None
    return _flat(target) if kind.startswith("ours") else {key_path(kind, k): v for k, v in target.items()}


def _dcp_own(e: BaseException) -> bool:
    """An error DCP's own code raised checking the plan (not the library's, not a crash in it)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and "torch/distributed/checkpoint" in last and "tensorstore_h5" not in last and \
        isinstance(e, (ValueError, RuntimeError, KeyError, AssertionError)) and "metadata read failed" not in str(e)


def _canary() -> None:
    from hostile.fuzz import _plant_canary

    _plant_canary()


def check_case(case: dict[str, Any]) -> dict[str, Any]:
    """Every read path on the case's directory; ``{"problems": [...], "stats": {...}}``."""
    import torch

    import tensorstore_h5 as th5
    from tensorstore_h5 import cli

    from helpers import bits
    from hostile.fuzz import CANARY

    ckpt, kind = Path(case["path"]), case["seed"]
    root = str(ckpt)
    problems: list[str] = []
    stats = {"exact": 0, "ref": 0, "refused": 0, "unverified": 0, "dcp_own": 0}
    try:
        ref = reference(ckpt, kind)
    except Exception as e:  # noqa: BLE001 - the reference's own failure: no value checks
        ref = f"unknown: reference failed: {type(e).__name__}: {e}"
    saved = expected(kind)

    def judge(name: str, key: str, value: Any, sel: tuple[slice, ...] | None, checked: bool,
              cast: bool = False) -> None:
        """``value``, read by ``name`` (of ``sel``, ``checked`` or not), against the reference;
        ``cast``: read into a target of its own dtype (load_into, DCP), as ``copy_`` casts."""
        if not isinstance(value, torch.Tensor):
            return
        raw = bytes(bits(value.detach().contiguous()).numpy())
        if CANARY[:8] in raw:
            problems.append(f"{name}: {key}: holds memory that no read filled (canary)")
            return
        if isinstance(ref, str):
            if ref.startswith("refuse"):
                problems.append(f"{name}: {key}: returned a tensor from a directory that must be refused ({ref})")
            else:
                stats["unverified"] += 1
            return
        e = ref.get(key)
        if e is None:
            stats["unverified"] += 1
            return
        verdict, what = e.verdict(sel, checked)
        if verdict == "refuse":
            problems.append(f"{name}: {key}: returned a tensor where the read must be refused ({what})")
        elif verdict == "unknown":
            stats["unverified"] += 1
        else:
            if cast and what.dtype != value.dtype:
                what = torch.empty(what.shape, dtype=value.dtype).copy_(what)
            if value.shape == what.shape and value.dtype == what.dtype and raw == bytes(bits(what.contiguous()).numpy()):
                stats["exact" if isinstance(saved.get(key), torch.Tensor) and sel is None and torch.equal(
                    bits(saved[key]), bits(value)) else "ref"] += 1
                return

            problems.append(f"{name}: {key}: {tuple(value.shape)} {value.dtype} differs from what the directory holds "
                            f"({tuple(what.shape)} {what.dtype})")

    def failed(name: str, e: BaseException) -> None:
        if isinstance(e, th5.TensorStoreError):
            stats["refused"] += 1
            if root not in str(e):
                problems.append(f"{name}: error without a path of the directory: {type(e).__name__}: {e}"[:600])
        elif name == "dcp" and _dcp_own(e):
            stats["dcp_own"] += 1
        elif name == "dcp" and isinstance(e, AssertionError) and "metadata read failed: " in str(e):
            stats["refused"] += 1  # DCP's read_metadata failure, wrapped by DCP: the message is the library's
            if root not in str(e):
                problems.append(f"{name}: error without a path of the directory: {e}"[:600])
        else:
            import traceback

            where = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))[-700:]
            problems.append(f"{name}: {type(e).__name__}: {e}"[:400] + f"\n    {where}")

    def whole(name: str, got: dict[str, Any], checked: bool) -> None:
        for key, value in got.items():
            judge(name, key, value, None, checked, cast=name in ("load_into", "dcp"))

    def opened() -> None:
        with th5.open(root) as s:
            keys = s.keys()
            for key in keys:
                try:
                    h = s[key]
                except (th5.TensorStoreError, Exception) as e:  # noqa: BLE001
                    failed(f"open[{key}]", e)
                    continue
                if not hasattr(h, "read") or not hasattr(h, "shape"):
                    continue
                shape = tuple(h.shape)
                reads: list[tuple[str, Any, tuple[slice, ...] | None, bool]] = [
                    ("read()", lambda: h.read(), None, True)]
                if len(shape) >= 1 and shape[0] > 1:
                    half = (slice(1, max(2, shape[0] // 2 + 1)),)
                    reads.append(("rows", lambda half=half: h[half], half, False))
                    reads.append(("rows(verify)", lambda half=half: h.read(index=half, verify=True), half, True))
                if len(shape) >= 2 and shape[1] > 1:
                    cols = (slice(None), slice(1, shape[1]))
                    reads.append(("cols", lambda cols=cols: h[cols], cols, False))
                if len(shape) >= 1 and math.prod(shape) <= MAX_REF_ELEMENTS:
                    def into() -> Any:
                        return h.read(out=torch.empty(shape, dtype=h.dtype))
                    reads.append(("read(out=)", into, None, True))
                for what, fn, sel, checked in reads:
                    _canary()
                    try:
                        value = fn()
                    except Exception as e:  # noqa: BLE001
                        failed(f"open {what} {key}", e)
                        continue
                    judge(f"open {what}", key, value, sel, checked)

    def items() -> dict[str, Any]:
        with th5.open(root) as s:
            return dict(s.items())

    def load_into() -> dict[str, Any]:
        target = _zeros(kind)
        th5.load_into(target, root, strict=False)
        return _flat(target) if kind.startswith("ours") else {key_path(kind, k): v for k, v in target.items()}

    _Opens.seen = []
    _Opens.on = True
    try:
        paths: list[tuple[str, Any, bool]] = [
            ("load", lambda: _flat(th5.load(root)), True),
            ("load(verify=False)", lambda: _flat(th5.load(root, verify=False)), False),
            ("items", items, True),
            ("load_into", load_into, True),
            ("dcp", lambda: _dcp_load(ckpt, kind), True),
        ]
        _canary()
        try:
            opened()
        except Exception as e:  # noqa: BLE001
            failed("open", e)
        for name, fn, checked in paths:
            _canary()
            try:
                got = fn()
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                failed(name, e)
                continue
            whole(name, got, checked)
        for command in ("ls", "info", "verify"):
            out, err = stdio.StringIO(), stdio.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    status = cli.main([command, root])
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                problems.append(f"cli {command}: {type(e).__name__}: {e}"[:400])
                continue
            text = err.getvalue()
            if status not in (0, 1) or status == 1 and root not in text or "Traceback" in text:
                problems.append(f"cli {command}: status {status}: {text[-300:]}")
            if command == "verify" and status == 0 and _must_fail_verify(ref):
                problems.append(f"cli verify: passed a directory that reads must refuse ({_must_fail_verify(ref)})")
    finally:
        _Opens.on = False
    outside = sorted({p for p in _Opens.seen if _escapes(p, ckpt)})
    if outside:
        problems.append(f"opened files outside the directory: {outside[:5]}")
    return {"problems": problems, "stats": stats}


def _must_fail_verify(ref: dict[str, EntryRef] | str) -> str | None:
    """Why ``verify`` must report a problem, where the reference knows one."""
    if isinstance(ref, str):
        return ref if ref.startswith("refuse") else None
    for key, e in ref.items():
        verdict, why = e.verdict(None, True)
        if verdict == "refuse":
            return f"{key}: {why}"
    return None


def _escapes(p: str, ckpt: Path) -> bool:
    """Whether an opened path lies outside the checkpoint directory and is one of the case's
    (beside it) or a device."""
    inside = os.path.commonpath([p, str(ckpt)]) == str(ckpt)
    if inside:
        return False
    return os.path.commonpath([p, str(ckpt.parent)]) == str(ckpt.parent) or p.startswith("/dev/") and p != "/dev/null"


# ---------------------------------------------------------------------------- the driver


def run(seconds: float, out: Path, seed: int, worker: Any = None) -> list[tuple[str, list[str]]]:
    """Fuzz directories for ``seconds``; findings are kept in ``out`` (:func:`save_case`)."""
    from hostile import fuzz

    fuzz._setup_path()
    rng = random.Random(seed)
    findings: list[tuple[str, list[str]]] = []
    out.mkdir(parents=True, exist_ok=True)
    w = worker or fuzz.Worker()
    totals: dict[str, int] = {}
    n = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        seeds = {}
        try:
            import safetensors.torch  # noqa: F401
            kinds = SEED_KINDS
        except ImportError:  # no Hugging Face seed
            kinds = tuple(k for k in SEED_KINDS if k.startswith("ours"))
        for kind in kinds:
            seeds[kind] = Path(tmp) / "seeds" / kind
            make_seed(kind, seeds[kind] / "ckpt")
            (seeds[kind] / "outside").mkdir()
            make_secret(kind, seeds[kind] / "outside")
        end = start + seconds
        try:
            while time.monotonic() < end:
                kind = rng.choice(kinds)
                root = Path(tmp) / "case"
                if root.exists():
                    shutil.rmtree(root)
                shutil.copytree(seeds[kind], root, symlinks=True)
                c = Case(root, kind)
                done = mutate_case(c, rng)
                result = w.ask({"surface": "dirs", "path": str(c.ckpt), "seed": kind}, CASE_SECONDS)
                n += 1
                for k, v in result.get("stats", {}).items():
                    totals[k] = totals.get(k, 0) + v
                if result["problems"]:
                    name = f"dir-{kind}-{seed}-{n}"
                    save_case(root, out / name, {"seed": kind, "mutations": done, "problems": result["problems"]})
                    findings.append((name, [f"mutations: {done}", *result["problems"]]))
        finally:
            if worker is None:
                w.stop()
    took = time.monotonic() - start
    print(f"fuzz dirs: {n} cases in {took:.0f} s ({n / max(took, 1e-9):.1f}/s, seed {seed}), {len(findings)} findings "
          f"in {out}; reads: {totals}")
    return findings


def check_saved(paths: list[Path], worker: Any) -> list[tuple[str, list[str]]]:
    """Re-run kept directory cases (folders made by :func:`save_case`)."""
    out = []
    for src in paths:
        with tempfile.TemporaryDirectory() as tmp:
            info = restore_case(src, Path(tmp) / "case")
            result = worker.ask({"surface": "dirs", "path": str(Path(tmp) / "case" / "ckpt"), "seed": info["seed"]},
                                CASE_SECONDS)
            out.append((src.name, result["problems"]))
    return out
