"""Chunk decoding (codecs.py) against HDF5's own filter path, byte for byte, and its refusals."""

from __future__ import annotations

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.codecs import decoders as codecs
from tensorstore_h5.reading.tensors import TensorReader
from tensorstore_h5.storage import parallel

from helpers import ALL_DTYPES, assert_same_tensor, bits, random_tensor

FILTERS = {
    "blosc2-zstd-shuffle": lambda: hdf5plugin.Blosc2(cname="zstd", clevel=3, filters=hdf5plugin.Blosc2.SHUFFLE),
    "blosc2-lz4-bitshuffle": lambda: hdf5plugin.Blosc2(cname="lz4", clevel=5, filters=hdf5plugin.Blosc2.BITSHUFFLE),
    "blosc2-blosclz-noshuffle": lambda: hdf5plugin.Blosc2(cname="blosclz", clevel=9, filters=hdf5plugin.Blosc2.NOFILTER),
    "bitshuffle-lz4": lambda: hdf5plugin.Bitshuffle(cname="lz4"),
    "bitshuffle-zstd": lambda: hdf5plugin.Bitshuffle(cname="zstd"),
}


def _weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Weight-like values (compressible a little) for float dtypes, random bits otherwise."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)
    return random_tensor(shape, dtype, seed)


def _hdf5_bytes(path, dataset: str) -> np.ndarray:
    """The dataset's bytes as HDF5's filter pipeline decodes them (its own file type)."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        out = np.empty(ds.size * ds.dtype.itemsize, dtype=np.uint8)
        ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=ds.id.get_type())
        return out


@pytest.mark.parametrize("name", sorted(FILTERS))
@pytest.mark.parametrize("shape", [(300_001,), (1000, 77), (20, 33, 65)], ids=str)
def test_decode_matches_hdf5_filter_path(tmp_path, name, shape) -> None:
    t = _weights(shape, torch.float32, seed=len(shape))
    th5.save({"t": t}, tmp_path / "c.h5", compression=FILTERS[name](), chunk_bytes=64 * 1024)
    with th5.open(tmp_path / "c.h5") as s:
        got = s["t"].read(verify=True)
        chunked = s._reader.chunked(s["t"]._entry)
        assert chunked is not None and len(chunked.chunks) > 2
        assert chunked.nbytes % chunked.chunk_bytes and not chunked.chunks[-1][2]  # a padded, filtered last chunk
    assert np.array_equal(bits(got).numpy(), _hdf5_bytes(tmp_path / "c.h5", "t"))
    assert_same_tensor(got, t)


@pytest.mark.parametrize("preset", sorted(th5.PRESETS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_preset_and_dtype_decodes_here(tmp_path, preset, dtype) -> None:
    t = _weights((700, 40), dtype, seed=3)
    th5.save({"t": t}, tmp_path / "c.h5", compression=preset, chunk_bytes=16 * 1024)
    with th5.open(tmp_path / "c.h5") as s:
        assert_same_tensor(s["t"].read(verify=True), t)
        assert s._reader.chunked(s["t"]._entry) is not None


@pytest.mark.parametrize("preset", ["lz4", "zstd"])
def test_byte_ranges_across_chunk_edges(tmp_path, preset) -> None:
    t = _weights((1000, 37), torch.bfloat16, seed=5)
    th5.save({"t": t}, tmp_path / "c.h5", compression=preset, chunk_bytes=37 * 2 * 64)  # 64-row chunks
    with th5.open(tmp_path / "c.h5") as s:
        h = s["t"]
        chunked = s._reader.chunked(h._entry)
        assert chunked.chunk_bytes == 37 * 2 * 64
        for index in [slice(0, 64), slice(63, 65), slice(64, 128), slice(1, 999), slice(960, 1000), slice(999, 1000),
                      7, 64, 999, (500, slice(3, 9)), (63, slice(36, 37)), slice(5, 5), (slice(None), 3),
                      (slice(10, 900, 7), slice(1, 30, 4))]:
            assert_same_tensor(h[index], t[index], layout=False)
        reader = codecs.ChunkReader(chunked, s._reader.rawfile().pread)
        for offset, n in [(0, 1), (1, 4735), (4735, 2), (4736, 4736), (73_999, 1)]:  # raw byte ranges
            buf = np.zeros(n, dtype=np.uint8)
            reader.read(offset, buf)
            assert np.array_equal(buf, bits(t).numpy()[offset:offset + n]), (offset, n)
        with pytest.raises(ValueError, match="outside"):
            reader.read(73_999, np.zeros(2, dtype=np.uint8))


def test_chunks_of_one_run_of_a_later_dimension(tmp_path) -> None:
    """Rows larger than a chunk: chunks of shape (1, c, whole...) are consecutive runs too."""
    t = _weights((3, 5000, 8), torch.float32, seed=6)
    th5.save({"t": t}, tmp_path / "c.h5", compression="lz4", chunk_bytes=16 * 1024)
    with th5.open(tmp_path / "c.h5") as s:
        chunked = s._reader.chunked(s["t"]._entry)
        assert chunked.chunk_shape[0] == 1 and chunked.chunk_shape[1] < 5000
        assert_same_tensor(s["t"].read(verify=True), t)
        assert_same_tensor(s["t"][1, 4000:4900], t[1, 4000:4900], layout=False)
        assert_same_tensor(s["t"][:, 17, 2:5], t[:, 17, 2:5], layout=False)


def test_full_load_batches_decodes_of_many_datasets(tmp_path, monkeypatch) -> None:
    import threading

    sd = {f"w{i}": _weights((200, 50), torch.float16, seed=i) for i in range(12)}
    th5.save(sd, tmp_path / "c.h5", compression="zstd", chunk_bytes=4096)
    monkeypatch.setattr(parallel, "PIECE_BYTES", 8192 * codecs.DECODE_COST)  # batches of ~2 chunks, as of 8 MiB in a real load
    monkeypatch.setattr(parallel, "IO_THREADS", 2)
    batches = []
    real = parallel._run_all
    monkeypatch.setattr(parallel, "_run_all", lambda jobs: (batches.append((len(jobs), threading.current_thread().name)), real(jobs))[1])
    with th5.open(tmp_path / "c.h5") as s:
        out = s.load()
        assert all(s._reader.chunked(s[k]._entry) is not None for k in sd)
    for k in sd:
        assert_same_tensor(out[k], sd[k])
    chunks = 12 * -(-20_000 // 4096)
    assert sum(n for n, _ in batches) == chunks and len(batches) >= chunks // 3  # one plan, batches of whole chunks
    assert any(name.startswith("tensorstore_h5-io") for _, name in batches)  # run on the pool while the plan grew


def test_a_chunk_the_decoder_refuses_is_an_error_not_a_fallback(tmp_path, monkeypatch) -> None:
    t = _weights((500, 64), torch.float32, seed=7)
    th5.save({"t": t}, tmp_path / "c.h5", compression="zstd", chunk_bytes=8192)
    real = codecs.decoder_for

    def decoder_for(extent):
        decode = real(extent)

        def refuse_third(src, n, dst, dst_n, calls=iter(range(10**6))):
            if next(calls) == 2:
                raise codecs.DecodeError("simulated")
            decode(src, n, dst, dst_n)
        return refuse_third

    monkeypatch.setattr(codecs, "decoder_for", decoder_for)
    with th5.open(tmp_path / "c.h5") as s:
        with pytest.raises(th5.FormatError, match=r"c\.h5: key 't'.*does not decode.*simulated"):
            s["t"].read()


def test_chunks_stored_unfiltered_are_copied(tmp_path) -> None:
    """HDF5 stores a chunk raw (filter mask set) when an optional filter declines it."""
    t = _weights((256, 32), torch.float32, seed=9)
    with h5py.File(tmp_path / "raw.h5", "w") as f:
        ds = f.create_dataset("t", shape=(256, 32), dtype="<f4", chunks=(64, 32), **hdf5plugin.Blosc2(cname="zstd"))
        ds[:128] = t[:128].numpy()
        for first in (128, 192):
            ds.id.write_direct_chunk((first, 0), t[first:first + 64].numpy().tobytes(), filter_mask=1)
    with th5.open(tmp_path / "raw.h5") as s:
        assert torch.equal(s["t"].read(), t)
        assert [raw for _, _, raw in s._reader.chunked(s["t"]._entry).chunks] == [False, False, True, True]


def test_hdf5s_own_filters_are_read_by_hdf5_and_others_refused(tmp_path) -> None:
    t = _weights((300, 16), torch.float32, seed=11)
    with h5py.File(tmp_path / "o.h5", "w") as f:
        f.create_dataset("gzip", data=t.numpy(), chunks=(32, 16), compression="gzip", shuffle=True, fletcher32=True)
        f.create_dataset("columns", data=t.numpy(), chunks=(300, 4), **hdf5plugin.Blosc2())
        part = f.create_dataset("part", shape=(300, 16), dtype="<f4", chunks=(32, 16), fillvalue=1.5, **hdf5plugin.Blosc2())
        part[:100] = t[:100].numpy()
        f.create_dataset("big_endian", data=t.numpy().astype(">f4"), chunks=(32, 16), **hdf5plugin.Blosc2())
        f.create_dataset("zstd", data=t.numpy(), chunks=(32, 16), **hdf5plugin.Zstd())
    with th5.open(tmp_path / "o.h5") as s:
        assert torch.equal(s["gzip"].read(), t) and torch.equal(s["gzip"][5:9, 2], t[5:9, 2])
        for key, why in [("columns", "not a run of whole rows"), ("part", "unwritten chunks"),
                         ("big_endian", "would need HDF5's filter"), ("zstd", r"filters \[32015\]")]:
            with pytest.raises(th5.FormatError, match=f"o.h5: key '{key}'.*{why}"):
                s[key].read()


def test_damaged_chunk_names_file_and_key(tmp_path) -> None:
    t = _weights((400, 64), torch.float32, seed=13)
    path = tmp_path / "c.h5"
    th5.save({"model": {"w": t}}, path, compression="zstd", chunk_bytes=8192)
    with th5.open(path) as s:
        offset = s._reader.chunked(s["model/w"]._entry).chunks[2][0]
    with open(path, "r+b") as fh:
        fh.seek(offset + 8)
        fh.write(b"\xff" * 64)
    with th5.open(path) as s:
        with pytest.raises(th5.FormatError, match=r"c\.h5.*model/w"):
            s["model/w"].read()
        assert torch.equal(s["model/w"][:64], t[:64])  # chunks before the damage still read


def test_compressed_data_streams_through_staging_buffers(tmp_path, monkeypatch) -> None:
    """Device targets: compressed chunks decode into the staging buffers, block = whole chunks."""
    monkeypatch.setattr(TensorReader, "staged", staticmethod(lambda dev: True))
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", 10_000)
    t = _weights((500, 40), torch.float32, seed=17)
    th5.save({"t": t}, tmp_path / "c.h5", compression="lz4", chunk_bytes=40 * 4 * 16)  # 2560-byte chunks
    with th5.open(tmp_path / "c.h5") as s:
        out = torch.empty(500, 40)
        s["t"].read(out=out)
        assert torch.equal(out, t)
        stager = s._reader._stagers[torch.device("cpu")]
        assert stager.block_size(2560) == 7680 and sum(stager.uses) == len(stager.iter_blocks(80_000, 2560)) == 11
        part = torch.empty(33, 40)
        s["t"].read(out=part, index=slice(100, 133))
        assert torch.equal(part, t[100:133])
