"""The "gzip" preset (issue #32 item 1): HDF5's own shuffle + deflate, format version 3.

Round trips of every dtype, slices that decode only the chunks they touch, files that plain
HDF5 readers without hdf5plugin read (h5py in a fresh process, h5dump), what pyfive 1.3.0
makes of them, hostile deflate chunks (bombs and the rest), the golden version-3 file, and
that files without "gzip" chunks stay version 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import ctypes
import gzip
import threading
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.codecs import decoders, presets
from tensorstore_h5.format import checksum
from tensorstore_h5.format import layout as fmt

from data.make_v3 import compression as compression3
from data.make_v3 import golden as golden3
from helpers import ALL_DTYPES, assert_same, assert_same_tensor, bits, random_tensor

GOLDEN3 = Path(__file__).parent / "data" / "v3.h5"


def _smooth(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Compressible data for any dtype: runs of 16 equal elements (a staircase of its bytes)."""
    n = int(np.prod(shape))
    base = (torch.arange(n * dtype.itemsize) // (16 * dtype.itemsize) % 97).to(torch.uint8)
    return base.view(dtype).reshape(shape) if dtype.itemsize > 1 or dtype != torch.uint8 else base.reshape(shape)


def _inflaters() -> list[Any]:
    out = [zlib]
    try:
        from isal import isal_zlib
        out.append(isal_zlib)
    except ImportError:
        pass
    return out


def _layout(path: Path) -> tuple[fmt.Header, dict[str, Any], list[dict[str, Any]]]:
    raw = path.read_bytes()
    h = fmt.parse_header(raw[:64], str(path), len(raw))
    head, *lines = raw[h.layout_offset:h.layout_offset + h.layout_length].split(b"\n")
    return h, json.loads(head), [json.loads(line) for line in lines]


def _entry(head: dict[str, Any], entries: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return entries[head["paths"].index(key)]


def _rewrite(path: Path, edit: Callable[[dict[str, Any], list[dict[str, Any]], int], None], append: bytes = b"",
             version: int | None = None) -> None:
    """Append ``append``, then the layout as ``edit(head, entries, offset of the appended
    bytes)`` leaves it, under a valid header (of ``version``, else the file's) and hash: a
    crafted file, not a damaged one."""
    h, head, entries = _layout(path)
    raw = bytearray(path.read_bytes())
    at = len(raw)
    raw += append
    edit(head, entries, at)
    text = "\n".join(json.dumps(x) for x in [head, *entries]).encode()
    offset = len(raw)
    raw += text
    raw[:64] = fmt.pack_header(fmt.Header(h.version if version is None else version, len(raw), offset, len(text),
                                          checksum.digest(text)))
    path.write_bytes(bytes(raw))


def _set_chunk(path: Path, key: str, data: bytes, k: int = 0) -> None:
    def edit(head: dict[str, Any], entries: list[dict[str, Any]], at: int) -> None:
        _entry(head, entries, key)["chunks"]["at"][k] = [at, len(data)]
    _rewrite(path, edit, data)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(tmp_path, dtype) -> None:
    t = random_tensor((40, 300), dtype, seed=1)
    s = _smooth((64, 512), dtype)
    path = tmp_path / "g.h5"
    th5.save({"random": t, "smooth": s, "strided": s.t()}, path, compression="gzip", chunk_bytes=16384)
    out = th5.load(path, verify=True)
    assert_same_tensor(out["random"], t)
    assert_same_tensor(out["smooth"], s)
    assert_same_tensor(out["strided"], s.t())
    with th5.open(path) as store:
        assert store.format_version == 3
        info = store["smooth"].compression
        assert info["filters"][0]["id"] == fmt.DEFLATE_ID and info["filters"][0]["options"] == [presets.GZIP_LEVEL]
        chunked = store._reader.chunked(store["smooth"]._entry)
        assert len(chunked.chunks) > 1
        if dtype.itemsize * 64 * 512 >= 2 * 16384:
            assert chunked.stored_bytes < 0.6 * chunked.nbytes  # really compressed


@pytest.mark.parametrize("inflate", _inflaters(), ids=lambda m: m.__name__)
@pytest.mark.parametrize("unshuffle", ["blosc2", "numpy"])
def test_every_inflater_and_unshuffle_decode_the_same(tmp_path, monkeypatch, inflate, unshuffle) -> None:
    """zlib (the fallback) and isal where installed; c-blosc2's SIMD unshuffle and numpy's."""
    monkeypatch.setattr(decoders, "INFLATE", inflate)
    if unshuffle == "numpy":
        real = decoders._library

        def no_blosc2(name: str) -> Any:
            if name == "libh5blosc2.so":
                raise decoders.DecodeError("no hdf5plugin here")
            return real(name)
        monkeypatch.setattr(decoders, "_library", no_blosc2)
    objs = {str(d): _smooth((50, 333), d) for d in ALL_DTYPES if d.itemsize > 1}
    objs["random"] = random_tensor((100, 97), torch.float32, seed=5)
    th5.save(objs, tmp_path / "g.h5", compression="gzip", chunk_bytes=8192)
    out = th5.load(tmp_path / "g.h5", verify=True)
    for k, t in objs.items():
        assert_same_tensor(out[k], t)


def test_default_inflater_is_isal_where_installed() -> None:
    try:
        from isal import isal_zlib
    except ImportError:
        assert decoders.INFLATE is zlib
    else:
        assert decoders.INFLATE is isal_zlib


def test_chunks_are_encoded_on_the_io_threads_and_incompressible_ones_stored_raw(tmp_path, monkeypatch) -> None:
    seen = []
    real = presets._encode

    def encode(*args: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(presets, "_encode", encode)
    t = torch.cat([_smooth((256, 256), torch.float32).reshape(-1), random_tensor((49152,), torch.float32, seed=2)])
    path = tmp_path / "g.h5"
    th5.save({"t": t}, path, compression="gzip", chunk_bytes=65536)
    assert len(seen) == 7 and any(n.startswith("tensorstore_h5-io") for n in seen)
    _, head, entries = _layout(path)
    chunks = _entry(head, entries, "t")["chunks"]
    assert chunks["filter"] == [fmt.DEFLATE_ID, [presets.GZIP_LEVEL]]
    assert [len(c) == 3 for c in chunks["at"]] == [False] * 4 + [True] * 3  # random floats: deflate cannot shrink them
    assert_same_tensor(th5.load(path)["t"], t)
    with h5py.File(path) as f:  # HDF5 reads the raw chunks (filter mask 3) as well
        assert f["t"].id.read_direct_chunk((16384 * 3,))[0] == 0 and f["t"].id.read_direct_chunk((16384 * 4,))[0] == 3
        assert np.array_equal(f["t"][()].view(np.uint32), t.numpy().view(np.uint32))


def test_slices_decode_only_the_chunks_they_touch(tmp_path, monkeypatch) -> None:
    t = torch.randn(1000, 37) * 0.02
    path = tmp_path / "g.h5"
    th5.save({"t": t}, path, compression="gzip", chunk_bytes=37 * 4 * 64)  # 64-row chunks
    decoded: list[int] = []
    real = decoders.decoder_for

    def decoder_for(extent: Any) -> Any:
        decode = real(extent)

        def counted(src: Any, n: int, dst: int, dst_n: int) -> None:
            decoded.append(n)
            decode(src, n, dst, dst_n)
        return counted

    monkeypatch.setattr(decoders, "decoder_for", decoder_for)
    with th5.open(path) as s:
        h = s["t"]
        assert h.compression["chunks"] == [64, 37]
        for index, chunks in [(slice(0, 64), 1), (slice(63, 65), 2), (slice(64, 128), 1), (slice(999, 1000), 1),
                              (500, 1), ((slice(130, 140), slice(3, 9)), 1), (slice(0, 1000), 16)]:
            decoded.clear()
            assert torch.equal(h[index], t[index]), index
            assert len(decoded) == chunks, (index, len(decoded))


def test_files_without_gzip_chunks_stay_version_2(tmp_path) -> None:
    t = _smooth((128, 128), torch.float32)
    for name, compression in [("plain", None), ("lz4", "lz4"), ("tiny", "gzip")]:
        obj = {"w": t[:4] if name == "tiny" else t}  # a tiny tensor is never compressed: no gzip chunk, version 2
        th5.save(obj, tmp_path / f"{name}.h5", compression=compression)
        h, head, _ = _layout(tmp_path / f"{name}.h5")
        assert h.version == head["version"] == 2, name
        with h5py.File(tmp_path / f"{name}.h5") as f:
            assert f.attrs["tensorstore_h5.version"] == 2
    th5.save({"w": t, "x": t.clone()}, tmp_path / "mixed.h5", compression=lambda k, _: "gzip" if k == "x" else "zstd")
    h, head, _ = _layout(tmp_path / "mixed.h5")
    assert h.version == head["version"] == 3
    with h5py.File(tmp_path / "mixed.h5") as f:
        assert f.attrs["tensorstore_h5.version"] == 3
    with th5.Writer(tmp_path / "w.h5", compression="gzip") as w:  # key by key
        w["a"] = t
        w["b"] = t.to(torch.bfloat16)
    assert_same(th5.load(tmp_path / "w.h5"), {"a": t, "b": t.to(torch.bfloat16)})
    assert th5.open(tmp_path / "w.h5").format_version == 3


def test_gzip_level_and_unknown_values(tmp_path) -> None:
    t = _smooth((256, 256), torch.float32)
    th5.save({"w": t}, tmp_path / "g.h5", compression=presets.Gzip(9))
    assert th5.open(tmp_path / "g.h5")["w"].compression["filters"][0]["options"] == [9]
    assert torch.equal(th5.load(tmp_path / "g.h5")["w"], t)
    for level in (0, 10, "1"):
        with pytest.raises(ValueError, match="Gzip level"):
            th5.save({"w": t}, tmp_path / "x.h5", compression=presets.Gzip(level))  # type: ignore[arg-type]
    assert "gzip" in th5.PRESETS


# ---------------------------------------------------------------------------- plain HDF5 readers

_PLAIN_READER = r"""
import hashlib, json, sys
import h5py, numpy as np
assert "hdf5plugin" not in sys.modules and not h5py.h5z.filter_avail(32008) and not h5py.h5z.filter_avail(32026)
out = {}
with h5py.File(sys.argv[1], "r") as f:
    for key in json.loads(sys.argv[2]):
        ds = f[key]
        raw = np.empty(ds.size * ds.id.get_type().get_size(), dtype=np.uint8)
        ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=ds.id.get_type())  # the stored bits, no conversion
        values = ds[()]
        out[key] = [hashlib.sha256(raw.tobytes()).hexdigest(), str(values.dtype),
                    hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()]
    try:
        f["lz4"][()]
        out["lz4"] = "read"
    except OSError as e:
        out["lz4"] = str(e)
print(json.dumps(out))
"""


def _no_plugin_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    env["HDF5_PLUGIN_PATH"] = ""
    return env


def _sha(data: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def test_plain_h5py_without_hdf5plugin_reads_every_gzip_tensor_bitwise(tmp_path) -> None:
    """A fresh process, HDF5_PLUGIN_PATH empty, hdf5plugin never imported: every "gzip" tensor
    at its key path, its stored bits exactly (bfloat16: an HDF5 float type that h5py reads as
    exact float32 values); a Bitshuffle dataset beside them does not read there."""
    obj = {str(d).removeprefix("torch."): random_tensor((70, 130), d, seed=3) for d in ALL_DTYPES}
    obj["strided"] = _smooth((90, 200), torch.bfloat16).t()
    obj["lz4"] = _smooth((90, 200), torch.float32)
    path = tmp_path / "g.h5"
    th5.save({"model": obj}, path, compression=lambda k, _: "lz4" if k == "model/lz4" else "gzip", chunk_bytes=8192)
    keys = [f"model/{k}" for k in obj if k != "lz4"]
    r = subprocess.run([sys.executable, "-c", _PLAIN_READER.replace('f["lz4"]', 'f["model/lz4"]'), str(path),
                        json.dumps(keys)], capture_output=True, text=True, env=_no_plugin_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert "can't" in got["lz4"].lower() or "filter" in got["lz4"].lower()  # the plugin one does not read
    for key in keys:
        t = obj[key.removeprefix("model/")]
        assert got[key][0] == _sha(bits(t).numpy()), key
    bf16 = got["model/strided"]
    assert bf16[1] == "float32" and bf16[2] == _sha(obj["strided"].float().contiguous().numpy())


def _h5dump(*args: str) -> str:
    r = subprocess.run(["h5dump", *args], capture_output=True, text=True, env=_no_plugin_env(), timeout=120)
    return r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (Debian hdf5-tools) is not installed")
def test_h5dump_prints_the_values_without_plugins(tmp_path) -> None:
    path = GOLDEN3
    ref = golden3()
    for key, t in [("gzip/i16", ref["gzip"]["i16"]), ("gzip/f32", ref["gzip"]["f32"]),
                   ("gzip/bf16_t", ref["gzip"]["bf16_t"].contiguous())]:
        text = _h5dump("-y", "-w", "0", "-d", f"/{key}", str(path))
        assert "unable to print data" not in text, text
        data = text.split("DATA {", 1)[1].split("}", 1)[0]
        values = np.array([float(v) for v in data.replace("\n", " ").replace(",", " ").split()])
        assert np.array_equal(values, t.float().reshape(-1).numpy()), key
    assert "unable to print data" in _h5dump("-d", "/lz4", str(path))  # Bitshuffle: needs the plugin (issue #32)


def test_pyfive_1_3_0_cannot_read_the_values_of_format_2_or_3_files(tmp_path) -> None:
    """What pyfive (a pure-Python HDF5 reader) makes of these files, for README's table of
    readers. pyfive 1.3.0 sees the tree (keys), but reads contiguous data of a file with a user
    block from the wrong offset (zeros: every format-2/3 file has one) and opens no chunked
    dataset written with HDF5 1.10 bounds (layout message version 4). The same "gzip" values
    in a plain HDF5 file without user block, written with the earliest bounds, it reads."""
    pyfive = pytest.importorskip("pyfive")
    t = _smooth((200, 200), torch.float32) + 1
    path = tmp_path / "g.h5"
    th5.save({"gz": t, "plain": t[:2, :1000 // 200]}, path, compression="gzip")
    f = pyfive.File(str(path))
    assert sorted(f.keys()) == ["%layout", "gz", "plain"]
    if pyfive.__version__ != "1.3.0":
        pytest.skip(f"the findings below are pyfive 1.3.0's; this is {pyfive.__version__}: check README's table")
    plain = f["plain"]
    assert plain.shape == (2, 5) and not np.array_equal(plain[...], t[:2, :5].numpy())  # zeros: the user block
    with pytest.raises(Exception):
        f["gz"][...]
    with h5py.File(tmp_path / "plain.h5", "w", libver="earliest") as g:  # control: no user block, v1 B-tree chunks
        g.create_dataset("gz", data=t.numpy(), chunks=(50, 200), compression="gzip", shuffle=True)
    assert np.array_equal(pyfive.File(str(tmp_path / "plain.h5"))["gz"][...], t.numpy())


# ---------------------------------------------------------------------------- hostile chunks


def _victim(path: Path) -> torch.Tensor:
    t = torch.randn(256, 64) * 0.02
    th5.save({"model": {"w": t}}, path, compression="gzip", chunk_bytes=16384)  # 64-row chunks of 16 KiB
    return t


@pytest.mark.parametrize("name, chunk, why", [
    ("bomb", lambda cb: zlib.compress(b"\0" * (16 << 20), 9), "inflates past the chunk's 16384 bytes"),
    ("one byte more", lambda cb: zlib.compress(b"\0" * (cb + 1), 9), "inflates past"),
    ("short", lambda cb: zlib.compress(b"\0" * (cb - 4), 9), "holds 16380 bytes, expected 16384"),
    ("truncated", lambda cb: zlib.compress(os.urandom(cb), 1)[:-100], "ends early"),
    ("trailing bytes", lambda cb: zlib.compress(b"\1" * cb, 9) + b"tail", "4 stored bytes after the end"),
    ("bad adler", lambda cb: zlib.compress(b"\1" * cb, 9)[:-1] + b"\0", "does not decode"),
    ("raw deflate", lambda cb: zlib.compress(b"\1" * cb, 9)[2:-4], "does not decode"),
    ("gzip wrapper", lambda cb: gzip.compress(b"\1" * cb), "does not decode"),
    ("empty", lambda cb: b"", "ends early|does not decode"),
])
@pytest.mark.parametrize("inflate", _inflaters(), ids=lambda m: m.__name__)
def test_hostile_deflate_chunks_are_refused_naming_file_and_key(tmp_path, monkeypatch, inflate, name, chunk, why) -> None:
    monkeypatch.setattr(decoders, "INFLATE", inflate)
    path = tmp_path / "g.h5"
    t = _victim(path)
    data = chunk(16384)
    assert len(data) <= 16384 + 16384 // 16 + 1024  # within the stored-size bound: only the decoder can tell
    _set_chunk(path, "model/w", data, k=1)
    tracemalloc.start()
    try:
        with th5.open(path) as s:
            for read in (lambda: s["model/w"].read(), lambda: s["model/w"][64:70], lambda: s["model/w"].read(verify=False)):
                with pytest.raises(th5.FormatError, match=rf"g\.h5: key 'model/w'.*({why})"):
                    read()
            assert torch.equal(s["model/w"][:64], t[:64]) and torch.equal(s["model/w"][128:], t[128:])
        with pytest.raises(th5.FormatError, match=r"g\.h5.*model/w"):
            th5.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # a 16 MiB bomb stops one byte past the chunk's 16 KiB


def test_a_bomb_is_refused_by_the_decoder_itself() -> None:
    extent = fmt.Chunked((4096,), 4, (1024,), fmt.DEFLATE_ID, (1,), ((4096, 10),) * 4)
    decode = decoders.decoder_for(extent)
    bomb = zlib.compress(b"\0" * (256 << 20), 9)
    src = (ctypes.c_char * len(bomb)).from_buffer_copy(bomb)
    dst = (ctypes.c_char * 4096)()
    with pytest.raises(decoders.DecodeError, match="inflates past the chunk's 4096 bytes"):
        decode(src, len(bomb), ctypes.addressof(dst), 4096)


@pytest.mark.parametrize("values, why", [([10], "one level, 0-9"), ([1, 2], "one level"), ([], "one level")])
def test_deflate_filter_values_outside_the_table_are_refused(tmp_path, values, why) -> None:
    path = tmp_path / "g.h5"
    _victim(path)
    _rewrite(path, lambda h, es, at: _entry(h, es, "model/w")["chunks"].__setitem__("filter", [1, values]))
    with pytest.raises(th5.FormatError, match=rf"g\.h5.*model/w.*{why}"):
        th5.load(path)


def test_deflate_chunks_in_a_version_2_file_are_refused(tmp_path) -> None:
    """Filter 1 is version 3's: a version-2 file (header and head) that uses it is refused."""
    path = tmp_path / "g.h5"
    _victim(path)

    def to_v2(head: dict[str, Any], entries: list[dict[str, Any]], at: int) -> None:
        head["version"] = 2
    _rewrite(path, to_v2, version=2)
    with pytest.raises(th5.FormatError, match=r"g\.h5.*model/w.*filter 1 is not one this format allows"):
        th5.load(path)


def test_unknown_versions_are_refused(tmp_path) -> None:
    path = tmp_path / "v4.h5"
    shutil.copy(GOLDEN3, path)
    _rewrite(path, lambda h, es, at: h.__setitem__("version", 4), version=4)
    with pytest.raises(th5.FormatError, match=r"v4\.h5: written in tensorstore_h5 format version 4, which this library "
                                              r"does not read \(it reads 1, 2, 3\); upgrade"):
        th5.open(path)
    _, head, entries = _layout(GOLDEN3)
    lines = "\n".join(json.dumps(x) for x in [dict(head, version=4), *entries]).encode()
    with pytest.raises(th5.FormatError, match="damaged layout head"):
        fmt.parse_layout_v2(lines, "v4.h5", 1 << 20)
    lines = "\n".join(json.dumps(x) for x in [dict(head, version=2), *entries]).encode()
    with pytest.raises(th5.FormatError, match="damaged layout head"):  # a head that is not the header's version
        fmt.parse_layout_v2(lines, "v3.h5", 1 << 20, version=3)
    assert fmt.parse_layout_v2(lines, "v2.h5", 1 << 20, version=2).version == 2


# ---------------------------------------------------------------------------- the golden version-3 file


def test_golden_v3_file_loads_bitwise() -> None:
    with th5.open(GOLDEN3) as s:
        assert s.format_version == 3 and s.metadata == {"note": "golden v3"}
        noise = s._reader.chunked(s["gzip/noise"]._entry)
        assert [raw for _, _, raw in noise.chunks] == [True] * 4 + [False]  # incompressible chunks stored raw
    out = th5.load(GOLDEN3, verify=True)
    assert_same(out, golden3())
    assert out["gzip"]["bf16_t"].stride() == (1, 100)
    h, head, _ = _layout(GOLDEN3)
    assert h.version == head["version"] == 3
    with h5py.File(GOLDEN3) as f:
        assert f.attrs["tensorstore_h5.version"] == 3
        pipeline = [f["gzip/f32"].id.get_create_plist().get_filter(i)[:3] for i in range(2)]
        assert [(c, tuple(v)) for c, _, v in pipeline] == [(2, (4,)), (1, (1,))]  # HDF5's shuffle, then deflate


def test_fresh_save_matches_golden_v3(tmp_path) -> None:
    """The same layout but for where HDF5 put the bytes and how many deflate made of them (a
    zlib of another version or build may find other codes: both are right)."""
    th5.save(golden3(), tmp_path / "new.h5", metadata={"note": "golden v3"}, compression=compression3, chunk_bytes=4096)

    def placeless(path: Path) -> list[dict]:
        _, head, entries = _layout(path)
        out = [head]
        for e in entries:
            e = dict(e)
            if "chunks" in e:
                e["chunks"] = dict(e["chunks"], at=[len(c) == 3 for c in e["chunks"]["at"]])  # stored raw or not
            out.append(e)
        return out

    assert placeless(tmp_path / "new.h5") == placeless(GOLDEN3)


def test_format_doc_reader_reads_the_golden_v3_file() -> None:
    import hdf5plugin  # noqa: F401  (the golden file's lz4 tensor; the gzip ones need none)

    text = (Path(__file__).parents[1] / "docs" / "FORMAT.md").read_text()
    namespace: dict = {}
    exec(compile(text.split("```python\n", 1)[1].split("```", 1)[0], "FORMAT.md", "exec"), namespace)
    plain = namespace["read_plain"](GOLDEN3)
    ref = golden3()
    for key, t in [("gzip/f32", ref["gzip"]["f32"]), ("gzip/c64", ref["gzip"]["c64"]), ("gzip/noise", ref["gzip"]["noise"]),
                   ("gzip/i16", ref["gzip"]["i16"]), ("lz4", ref["lz4"])]:
        assert plain[key].dtype == t.dtype and torch.equal(bits(plain[key]), bits(t)), key
    assert torch.equal(plain["gzip/bf16_t"], ref["gzip"]["bf16_t"]) and plain["gzip/bf16_t"].stride() == (1, 100)
    assert plain["step"] == 7


def test_older_golden_files_still_read_exactly() -> None:
    from data.make_v1 import golden as golden1
    from data.make_v2 import golden as golden2

    data = Path(__file__).parent / "data"
    assert_same(th5.load(data / "v1.h5"), golden1())
    assert_same(th5.load(data / "v2.h5", verify=True), golden2())
    assert th5.open(data / "v2.h5").format_version == 2


def test_verify_cross_checks_the_hdf5_part_of_version_3_files(tmp_path) -> None:
    """`tensorstore-h5 verify` compares a gzip (version-3) file's layout with what libhdf5
    finds, as for version 2: a damaged HDF5 chunk index is a problem although every chunk
    the layout names still matches its checksum."""
    path = tmp_path / "g.h5"
    th5.save({"w": _smooth((4096, 1024), torch.float32), "b": torch.zeros(8)}, path, compression="gzip")
    assert th5.open(path).format_version == 3

    def verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tensorstore_h5", "verify", str(path)], capture_output=True,
                              text=True, timeout=300)

    r = verify()
    assert r.returncode == 0 and "checksums and HDF5 metadata agree" in r.stdout, r.stderr
    raw = bytearray(path.read_bytes())
    at = raw.find(b"FADB")  # libhdf5's fixed-array chunk index of the chunked dataset
    assert at > 0
    raw[at + 40] ^= 0xFF  # inside its chunk addresses (the block's checksum no longer matches)
    path.write_bytes(bytes(raw))
    assert torch.equal(th5.load(path)["b"], torch.zeros(8))  # the layout's own view is intact
    r = verify()
    assert r.returncode == 1 and "key 'w'" in r.stderr and "FAILED, 1 problem(s)" in r.stderr, (r.stdout, r.stderr)
