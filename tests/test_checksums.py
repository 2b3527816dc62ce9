"""Checksums are checked by default wherever a read covers whole checksum blocks (full loads,
load_into, items(), walk, whole-tensor handle reads, device loads, sharded directories), with
verify=False to skip; mappings and slices stay lazy unless verify=True (issue #30 item 5).

Each test flips one stored byte of a saved file and checks who notices, and that a failed
read into existing tensors changed none of them."""

from __future__ import annotations

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.format import checksum
from tensorstore_h5.format.slicing import whole
from tensorstore_h5.reading.many import Reader
from tensorstore_h5.reading.tensors import TensorReader
from tensorstore_h5.storage import files

BLOCK = checksum.HASH_BLOCK


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 32, generator=g), "small": torch.arange(10),
            "big": torch.randn(3 * BLOCK // 4 + 1000, generator=g),  # three checksum blocks and a bit
            "z": torch.randn(40, 30, generator=g)}


def _damaged(tmp_path, key: str, at: int = 0) -> tuple[dict[str, torch.Tensor], str]:
    """The state saved, with byte ``at`` of ``key``'s stored data flipped: (state, path)."""
    sd = _state()
    good = tmp_path / "good.h5"
    th5.save(sd, good)
    with th5.open(good) as s:
        offset = s._entry(key).extent.offset + at
    raw = bytearray(good.read_bytes())
    raw[offset] ^= 0x40
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(raw))
    return sd, str(bad)


def test_load_checks_by_default_and_verify_false_skips(tmp_path) -> None:
    sd, bad = _damaged(tmp_path, "z", 5)
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*key 'z'.*checksum"):
        th5.load(bad)
    got = th5.load(bad, verify=False)
    assert not torch.equal(got["z"], sd["z"]) and torch.equal(got["a"], sd["a"])
    with pytest.raises(th5.FormatError, match="'z'"):
        th5.load(bad, select="z")
    assert torch.equal(th5.load(bad, select="a")["a"], sd["a"])  # the bytes not read are not checked


def test_small_tensors_read_in_windows_are_checked(tmp_path) -> None:
    _, bad = _damaged(tmp_path, "small", 0)
    with pytest.raises(th5.FormatError, match="'small'"):
        th5.load(bad)


def test_mmap_stays_lazy_unless_verify(tmp_path) -> None:
    sd, bad = _damaged(tmp_path, "z", 5)
    got = th5.load(bad, mmap=True)  # mapped tensors are not read, so not checked
    assert not torch.equal(got["z"], sd["z"])
    with pytest.raises(th5.FormatError, match="'z'"):
        th5.load(bad, mmap=True, verify=True)
    with th5.open(bad) as s:
        s["z"].read(mmap=True)
        with pytest.raises(th5.FormatError, match="'z'"):
            s["z"].read(mmap=True, verify=True)


def test_items_and_walk_check_each_tensor(tmp_path) -> None:
    _, bad = _damaged(tmp_path, "z", 5)
    with th5.open(bad) as s:
        seen = []
        with pytest.raises(th5.FormatError, match="'z'"):
            for key, _ in s.items():
                seen.append(key)
        assert seen == ["a", "small", "big"]
        assert [k for k, _ in s.items(verify=False)] == ["a", "small", "big", "z"]
        with pytest.raises(th5.FormatError, match="'z'"):
            list(s.walk())


def test_handle_reads_whole_checked_slices_lazy(tmp_path) -> None:
    """A whole read is checked; a slice is not, unless verify=True, which checks the checksum
    blocks the slice touches (a slice of another block reads fine)."""
    sd, bad = _damaged(tmp_path, "big", BLOCK + 8)  # in the second 8 MiB block
    with th5.open(bad) as s:
        h = s["big"]
        with pytest.raises(th5.FormatError, match=r"bad\.h5.*'big'"):
            h.read()
        with pytest.raises(th5.FormatError, match="'big'"):
            h[...]
        h[BLOCK // 4:BLOCK // 4 + 10]  # lazy: unchecked
        with pytest.raises(th5.FormatError, match="'big'"):
            h.read(index=slice(BLOCK // 4, BLOCK // 4 + 10), verify=True)
        first = h.read(index=slice(0, 100), verify=True)  # block 0 is intact
        assert torch.equal(first, sd["big"][:100])
        assert torch.equal(s.read_many({"big": slice(0, 5)})["big"], sd["big"][:5])
        with pytest.raises(th5.FormatError, match="'big'"):
            s.read_many({"big": ...})
        assert not torch.equal(h.read(verify=False), sd["big"])


def test_read_into_out_leaves_out_unchanged_on_a_bad_checksum(tmp_path) -> None:
    _, bad = _damaged(tmp_path, "big", 2 * BLOCK + 3)
    out = torch.full((3 * BLOCK // 4 + 1000,), 7.0)
    with th5.open(bad) as s, pytest.raises(th5.FormatError, match="'big'"):
        s["big"].read(out=out)
    assert bool((out == 7.0).all())


def test_load_into_checks_before_any_target_changes(tmp_path) -> None:
    sd, bad = _damaged(tmp_path, "z", 5)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*'z'"):
        th5.load_into(targets, bad)
    assert all(not t.any() for t in targets.values())  # 'a', 'small' and 'big' come first, untouched
    th5.load_into(targets, bad, verify=False)
    assert torch.equal(targets["a"], sd["a"]) and not torch.equal(targets["z"], sd["z"])


def test_load_into_assign_replaces_nothing_on_a_bad_checksum(tmp_path) -> None:
    sd, bad = _damaged(tmp_path, "z", 5)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    before = dict(targets)
    with pytest.raises(th5.FormatError, match="'z'"):
        th5.load_into(targets, bad, assign=True)
    assert all(targets[k] is before[k] for k in targets)


def test_verify_many_reads_each_byte_once_and_names_the_key(tmp_path, monkeypatch) -> None:
    """The checking pass reads neighbouring small tensors by one pread and every byte once."""
    g = torch.Generator().manual_seed(1)
    sd = {f"p{i}": torch.randn(i + 1, generator=g) for i in range(50)}
    th5.save(sd, tmp_path / "m.h5")
    reads: list[tuple[int, int]] = []
    real = files.RawFile.pread
    monkeypatch.setattr(files.RawFile, "pread", lambda self, o, v: reads.append((o, len(v))) or real(self, o, v))
    with th5.open(tmp_path / "m.h5") as s:
        entries = [s._entry(k) for k in sd]
        reads.clear()
        s._reader.verify_many(entries)
    assert len(reads) == 1 and reads[0][1] >= sum(t.nbytes for t in sd.values())


@pytest.fixture
def device_cpu(monkeypatch):
    """The CPU as a device: load(device="cpu") takes the staged device branch."""
    monkeypatch.setattr(TensorReader, "staged", staticmethod(lambda dev: True))
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", 2 * BLOCK)
    real_target = Reader.target
    monkeypatch.setattr(Reader, "target", lambda self, device, key: torch.device("cpu") if device == "cpu"
                        else real_target(self, device, key))


def test_device_loads_are_checked(tmp_path, device_cpu) -> None:
    sd, bad = _damaged(tmp_path, "big", BLOCK + 8)
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*'big'"):
        th5.load(bad, device="cpu")
    got = th5.load(bad, device="cpu", verify=False)
    assert torch.equal(got["a"], sd["a"]) and not torch.equal(got["big"], sd["big"])


def test_device_loads_check_in_the_staging_buffers_and_read_each_byte_once(tmp_path, device_cpu, monkeypatch) -> None:
    """A device load checks each tensor's checksum blocks in the staging buffers as they are
    read (not by a second read of the file afterwards); with checksum blocks larger than a
    buffer it still checks them, by that second read."""
    sd, bad = _damaged(tmp_path, "big", 2 * BLOCK + 3)
    th5.save(sd, tmp_path / "good.h5")
    data = sum(t.nbytes for t in sd.values())
    reads: list[tuple[int, int]] = []
    real = files.RawFile.pread
    monkeypatch.setattr(files.RawFile, "pread", lambda self, o, v: reads.append((o, len(v))) or real(self, o, v))

    def load(path, **kw):
        with th5.open(path) as s:
            s._entry("a")  # (the HDF5 links are compared with the layout on first use: not counted)
            reads.clear()
            return s.load(device="cpu", **kw)

    got = load(tmp_path / "good.h5")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert data <= sum(n for _, n in reads) < data + 4096  # each stored byte once (and the padding between)
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*key 'big'.*checksum"):
        load(bad)
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", BLOCK // 2)  # blocks larger than a buffer
    got = load(tmp_path / "good.h5")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert sum(n for _, n in reads) >= data + sd["big"].nbytes  # checked by a second read
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*key 'big'.*checksum"):
        load(bad)


def test_staged_whole_reads_hash_in_the_buffers_without_reading_twice(tmp_path, device_cpu, monkeypatch) -> None:
    """A whole-tensor read into a new device tensor checks each checksum block in the staging
    buffer it passes through: every stored byte is read once."""
    sd, bad = _damaged(tmp_path, "big", 2 * BLOCK + 3)
    th5.save(sd, tmp_path / "good.h5")
    reads: list[tuple[int, int]] = []
    real = files.RawFile.pread
    monkeypatch.setattr(files.RawFile, "pread", lambda self, o, v: reads.append((o, len(v))) or real(self, o, v))
    with th5.open(tmp_path / "good.h5") as s:
        entry = s._entry("big")
        reads.clear()
        t = s._reader.read_tensor(entry, whole(entry.shape), torch.empty(entry.shape), restore_layout=False, verify=True)
    assert torch.equal(t, sd["big"]) and sum(n for _, n in reads) == sd["big"].nbytes
    with th5.open(bad) as s, pytest.raises(th5.FormatError, match="'big'.*block 2"):
        entry = s._entry("big")
        s._reader.read_tensor(entry, whole(entry.shape), torch.empty(entry.shape), restore_layout=False, verify=True)


def test_compressed_chunks_are_checked_by_default(tmp_path) -> None:
    """A chunk whose stored bytes still decode, but to other values (a flipped byte inside
    LZ4's literals of incompressible data), is caught by its checksum."""
    sd = {"w": torch.randint(0, 256, (256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))}
    th5.save(sd, tmp_path / "c.h5", compression="lz4", chunk_bytes=16384)
    with th5.open(tmp_path / "c.h5") as s:
        offset, size, _ = s._entry("w").extent.chunks[1]
    data = bytearray((tmp_path / "c.h5").read_bytes())
    data[offset + size // 2] ^= 0x01
    (tmp_path / "bad.h5").write_bytes(bytes(data))
    with pytest.raises(th5.FormatError, match="'w'.*checksum.*chunk 1"):
        th5.load(tmp_path / "bad.h5")
    with th5.open(tmp_path / "bad.h5") as s:
        s["w"][100:101, :]  # a slice: lazy
        with pytest.raises(th5.FormatError, match="'w'.*checksum.*chunk 1"):
            s["w"].read(index=(slice(100, 101), slice(None)), verify=True)  # the chunk it touches, checked
        assert torch.equal(s["w"].read(index=slice(0, 64), verify=True), sd["w"][:64])  # chunk 0 is intact
    assert not torch.equal(th5.load(tmp_path / "bad.h5", verify=False)["w"], sd["w"])


def test_sharded_directories_check_by_default(tmp_path) -> None:
    from tensorstore_h5.bench.simulate import save_as_ranks

    g = torch.Generator().manual_seed(5)
    sd = {"a": torch.randn(8, 6, generator=g), "z": torch.randn(12, 5, generator=g)}
    d = tmp_path / "ckpt"
    save_as_ranks(sd, d, ranks=2)
    store = th5.open(d)
    piece = store["z"].pieces[0]
    store.close()
    f = d / piece.file
    with th5.open(f) as s:
        offset = s._entry(piece.key).extent.offset
    data = bytearray(f.read_bytes())
    data[offset + 5] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(th5.FormatError, match="'z'"):
        th5.load(d)
    assert not torch.equal(th5.load(d, verify=False)["z"], sd["z"])
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(th5.FormatError):
        th5.load_into(targets, d)
    assert all(not t.any() for t in targets.values())
    with th5.open(d) as s:
        with pytest.raises(th5.FormatError):
            s["z"].read()
        s["z"][0:1]  # a slice: lazy


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_checks_pieces_read_whole_before_any_destination_changes(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from tensorstore_h5.bench.simulate import save_as_ranks
    from tensorstore_h5.distributed import H5StorageReader

    g = torch.Generator().manual_seed(6)
    sd = {"a": torch.randn(8, 6, generator=g), "z": torch.randn(12, 5, generator=g)}
    d = tmp_path / "ckpt"
    save_as_ranks(sd, d, ranks=2)
    with th5.open(d) as store:
        piece = store["z"].pieces[-1]
    f = d / piece.file
    with th5.open(f) as s:
        offset = s._entry(piece.key).extent.offset
    data = bytearray(f.read_bytes())
    data[offset + 3] ^= 0x40
    f.write_bytes(bytes(data))
    tgt = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(BaseException, match=r"rank0000\d\.\w+\.h5: key 'z': stored bytes do not match their checksum"):
        dcp.load(tgt, storage_reader=H5StorageReader(d), no_dist=True)  # (DCP wraps it in a CheckpointException)
    assert all(not t.any() for t in tgt.values())
    dcp.load(tgt, storage_reader=H5StorageReader(d, verify=False), no_dist=True)
    assert torch.equal(tgt["a"], sd["a"]) and not torch.equal(tgt["z"], sd["z"])
