"""The fast paths return exactly the bytes of HDF5's own read."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch

import shutil
from pathlib import Path

import tensorstore_h5 as th5
from tensorstore_h5.format.layout import Contiguous
from tensorstore_h5.storage import files, memory, parallel
from tensorstore_h5.storage.libhdf5 import HDF5Read

from helpers import ALL_DTYPES, assert_same, assert_same_tensor, bits, random_tensor

GOLDEN = Path(__file__).parent / "data" / "v1.h5"


@pytest.fixture()
def small_pieces(monkeypatch):
    """Odd piece size: many pieces per tensor, and a partial last piece."""
    monkeypatch.setattr(parallel, "PIECE_BYTES", 1000)
    monkeypatch.setattr(parallel, "IO_THREADS", 2)


def _h5py_bits(path, key: str) -> np.ndarray:
    """A dataset's stored bits as plain h5py reads them (its own file type, no conversion)."""
    with h5py.File(path, "r") as f:
        ds = f[key]
        out = np.empty(ds.size * ds.id.get_type().get_size(), dtype=np.uint8)
        if ds.size:
            ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=ds.id.get_type())
        return out


SHAPES = [(0,), (), (1,), (37, 11), (5000,), (3, 1, 2)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_raw_reads_match_what_hdf5_stored(tmp_path, small_pieces, dtype) -> None:
    """Every tensor, small ones included, is a dataset at its key path holding what the
    layout's byte range holds."""
    tensors = {f"t{i}": random_tensor(shape, dtype, seed=i) for i, shape in enumerate(SHAPES)}
    th5.save(tensors, tmp_path / "f.h5")
    out = th5.load(tmp_path / "f.h5", verify=True)
    for k, t in tensors.items():
        assert_same_tensor(out[k], t)
        assert np.array_equal(bits(out[k]).numpy(), _h5py_bits(tmp_path / "f.h5", k))


@pytest.mark.parametrize("window", [10**9, 64, 7], ids=["one window", "row windows", "split rows"])
def test_row_and_strided_slices_at_odd_offsets(tmp_path, small_pieces, monkeypatch, window) -> None:
    monkeypatch.setattr(parallel, "GATHER_WINDOW", window)
    t = random_tensor((101, 7, 3), torch.float16, seed=3)
    th5.save({"t": t}, tmp_path / "f.h5")
    indexes = [slice(0, 1), slice(1, 3), slice(3, 4), (2,), (2, 1), (2, slice(1, 3)), (slice(1, 3), 1), slice(2, 2),
               (slice(None), slice(None), 1), (slice(0, 4, 2), slice(None, None, 2)), (slice(3, 100, 9), 6, slice(0, 3, 2)),
               (Ellipsis, 2), (slice(None), slice(0, 0))]
    with th5.open(tmp_path / "f.h5") as s:
        for index in indexes:
            ref = t[index].contiguous().view(torch.int16)
            assert torch.equal(s["t"][index].view(torch.int16), ref), index


def test_version1_packs_rewritten_chunked_by_another_tool_read_through_hdf5(tmp_path) -> None:
    """A version-1 pack rewritten by another tool (chunked, unfiltered) is read through HDF5."""
    path = tmp_path / "f.h5"
    shutil.copy(GOLDEN, path)
    with h5py.File(path, "r+") as f:
        data = f["%packed/float32"][()]
        attrs = dict(f["%packed/float32"].attrs)
        del f["%packed/float32"]
        f.create_dataset("%packed/float32", data=data, chunks=(4,))
        f["%packed/float32"].attrs.update(attrs)
    ref = th5.load(GOLDEN)
    out = th5.load(path)
    assert torch.equal(out["optim"]["state"][0]["step"], ref["optim"]["state"][0]["step"])
    assert torch.equal(out["model"]["enc.0.gate"], ref["model"]["enc.0.gate"])


def test_batched_load_into_targets(tmp_path, small_pieces) -> None:
    src = {f"w{i}": torch.randn(i * 13 + 1, 5) for i in range(12)}
    th5.save(src, tmp_path / "f.h5")
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    th5.load_into(dst, tmp_path / "f.h5")
    assert all(torch.equal(dst[k], src[k]) and dst[k].data_ptr() == ptrs[k] for k in src)


def test_truncated_data_is_refused_before_any_target_changes(tmp_path) -> None:
    src = {"a": torch.ones(1000), "b": torch.ones(300, 1000)}
    path = tmp_path / "f.h5"
    th5.save(src, path)
    with th5.open(path) as s:
        end_b = s["b"]._entry.extent.offset + 300 * 1000 * 4
    data = path.read_bytes()
    path.write_bytes(data[: end_b - 10] + data[end_b:])  # drop 10 bytes inside b's data
    dst = {"a": torch.zeros(1000), "b": torch.zeros(300, 1000)}
    with pytest.raises(th5.FormatError, match="f.h5.*"):
        th5.load_into(dst, path)
    assert dst["a"].eq(0).all() and dst["b"].eq(0).all()


@pytest.mark.parametrize("pieces", ["one range", "queued pieces"])
def test_a_file_that_shrinks_after_open_names_the_key(tmp_path, monkeypatch, pieces) -> None:
    """The ranges were checked at open; the bytes are gone when the read runs."""
    if pieces == "queued pieces":
        monkeypatch.setattr(parallel, "PIECE_BYTES", 1000)  # every tensor goes through the read plan's pieces
    path = tmp_path / "f.h5"
    th5.save({"a": torch.ones(100), "b": torch.ones(300, 100)}, path)
    with th5.open(path) as s:
        end_a = s["a"]._entry.extent.offset + 400
        assert s["b"]._entry.extent.offset > end_a
        os.truncate(path, end_a + 8)
        for read in (s.load, lambda: s["b"].read(), lambda: dict(s.items())):
            with pytest.raises(th5.FormatError, match="f.h5: key 'b': cannot read the data.*truncated"):
                read()


def test_mmap_tensors_are_file_backed_and_copy_on_write(tmp_path) -> None:
    src = {"w": torch.randn(64, 32), "t": torch.randn(8, 4).t(), "n": torch.tensor(3), "e": torch.empty(0, 3)}
    path = tmp_path / "f.h5"
    th5.save(src, path)
    before = path.read_bytes()
    out = th5.load(path, mmap=True)
    for k in src:
        assert_same_tensor(out[k], src[k])
    with th5.open(path) as s:
        m = s["w"].read(mmap=True)
        assert torch.equal(m, src["w"])
        m.add_(1)  # private pages: the file is not touched
        with pytest.raises(ValueError, match="mmap"):
            s["w"].read(mmap=True, index=0)
        streamed = dict(s.items(mmap=True))
    assert torch.equal(streamed["w"], src["w"])
    out["w"].mul_(0)
    assert path.read_bytes() == before
    assert torch.equal(th5.load(path)["w"], src["w"])


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64])
def test_empty_gives_a_usable_tensor_of_any_size(dtype: torch.dtype, huge: bool, monkeypatch) -> None:
    monkeypatch.setattr(memory, "HUGEPAGES", huge)
    for n in [0, 3, memory.MAP_MIN_BYTES // dtype.itemsize + 5, memory.HUGEPAGE_MIN_BYTES // dtype.itemsize + 7]:
        for shape in [(n,), (1, n, 1)]:
            t = memory.empty(shape, dtype)
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
            t.fill_(1)
            assert int((t == 1).sum()) == n
            if huge and n * dtype.itemsize >= memory.HUGEPAGE_MIN_BYTES:
                assert t.data_ptr() % (2 * 2**20) == 0  # huge-page aligned


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_empty_maps_every_dtype(dtype: torch.dtype) -> None:
    n = memory.MAP_MIN_BYTES // dtype.itemsize + 3
    t = memory.empty((n,), dtype)
    assert t.dtype == dtype and t.shape == (n,) and t.is_contiguous()
    raw = t.view(torch.uint8)
    raw.fill_(0xA5)  # writable, and exactly n * itemsize bytes
    assert raw.numel() == n * dtype.itemsize and int(raw[-1]) == 0xA5


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_mmap_load_shares_one_mapping_but_no_bytes(tmp_path) -> None:
    src = {f"w{i}": torch.full((1000 + i,), float(i), dtype=torch.float32 if i % 2 else torch.bfloat16) for i in range(6)}
    src["big"] = torch.arange(300_000, dtype=torch.float64)
    path = tmp_path / "f.h5"
    th5.save(src, path)
    before = path.read_bytes()
    a, b = th5.load(path, mmap=True), th5.load(path, mmap=True)
    assert len({t.untyped_storage().data_ptr() for t in a.values()}) == 1  # views of one mapping
    for k in src:
        assert_same_tensor(a[k], src[k])
        a[k].fill_(-1)  # pages are shared with neighbours, bytes are not
    for k in src:
        assert bool((a[k] == -1).all())
        assert_same_tensor(b[k], src[k])  # another load has its own mapping
    with th5.open(path) as s:
        one, two = s["w1"].read(mmap=True), s["w1"].read(mmap=True)
        one.zero_()
        assert torch.equal(two, src["w1"])  # each read maps on its own
    assert path.read_bytes() == before


def test_mmap_of_a_misaligned_dataset_gets_its_own_mapping(tmp_path) -> None:
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.arange(3, dtype="u1"))
        f.create_dataset("b", data=np.arange(1000, dtype="<f8"))
        f.create_dataset("c", data=np.arange(7, dtype="u1"))
        f.create_dataset("d", data=np.arange(1000, dtype="<i4"))
    with h5py.File(path, "r") as f:
        offsets = {k: f[k].id.get_offset() for k in "abcd"}
    out = th5.load(path, mmap=True)
    for k, dt in zip("abcd", (torch.uint8, torch.float64, torch.uint8, torch.int32)):
        n = 3 if k == "a" else 7 if k == "c" else 1000
        assert torch.equal(out[k], torch.arange(n, dtype=dt))
    if offsets["b"] % 8 and offsets["d"] % 4:  # the case this test is for (depends on HDF5's allocator)
        assert out["b"].untyped_storage().data_ptr() != out["d"].untyped_storage().data_ptr()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("huge", [False, True])
def test_empty_memory_is_returned_when_the_tensor_is_dropped(huge: bool, monkeypatch) -> None:
    monkeypatch.setattr(memory, "HUGEPAGES", huge)
    # through malloc, glibc would keep it in its heap once its mmap threshold has risen
    sizes = [memory.MAP_MIN_BYTES * 3, 40 * 2**20, memory.MAP_MIN_BYTES * 5, 24 * 2**20]
    before = _rss()
    for _ in range(3):
        for nbytes in sizes:
            t = memory.empty((nbytes,), torch.uint8)
            t.fill_(7)
            assert _rss() - before >= nbytes // 2  # really backed by touched memory
            del t
    assert _rss() - before < 8 * 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("huge", [False, True])
def test_empty_holds_no_memory_beyond_the_tensor(huge: bool, monkeypatch) -> None:
    # a huge page over a tensor's partial last 2 MiB would hold up to 2 MiB it does not use
    monkeypatch.setattr(memory, "HUGEPAGES", huge)
    nbytes = memory.HUGEPAGE_MIN_BYTES + 2**20 + 4096
    before = _rss()
    kept = [memory.empty((nbytes,), torch.uint8).fill_(1) for _ in range(20)]
    assert _rss() - before < 20 * nbytes + 8 * 2**20
    del kept


def test_foreign_datasets_read_raw_through_hdf5_or_refused(tmp_path) -> None:
    """Foreign files: contiguous data of the canonical type are read raw; HDF5 reads compact,
    converted and HDF5-filtered data; external and unwritten data are refused."""
    (tmp_path / "x.bin").write_bytes(np.arange(10, dtype="<f4").tobytes())
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("c", data=np.arange(10, dtype="<f4"))
        f.create_dataset("k", data=np.arange(10, dtype="<f4"), chunks=(5,))
        f.create_dataset("b", data=np.arange(10, dtype=">f4"))
        f.create_dataset("z", shape=(10,), dtype="<f4")  # never written: no storage
        f.create_dataset("x", shape=(10,), dtype="<f4", external=[(str(tmp_path / "x.bin"), 0, h5py.h5f.UNLIMITED)])
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        dsid = h5py.h5d.create(f.id, b"m", h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple((10,)), dcpl=dcpl)
        dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.arange(10, dtype="<f4"))
    with th5.open(tmp_path / "f.h5") as s:
        for k in "ckbm":
            assert torch.equal(s[k].read(), torch.arange(10, dtype=torch.float32))
            assert torch.equal(s[k].read(mmap=True), s[k].read())
        assert isinstance(s._reader.where(s["c"]._entry), Contiguous)
        assert all(isinstance(s._reader.where(s[k]._entry), HDF5Read) for k in "kbm")
        with pytest.raises(th5.FormatError, match="f.h5: key 'z'.*never written"):
            s["z"].read()
        with pytest.raises(th5.FormatError, match="f.h5: key 'x'.*external files"):
            s["x"].read()


def test_streaming_gives_the_heaps_free_memory_back(tmp_path, monkeypatch) -> None:
    """items() and Writer.write note every tensor they stream; once TRIM_CHECK_BYTES have passed
    and the heap holds TRIM_BYTES free, malloc_trim runs (glibc's dynamic mmap threshold puts
    the caller's freed temporaries in the heap, which keeps them)."""
    import types

    from tensorstore_h5.storage import memory

    free = [0]
    trims: list[int] = []
    fake = (lambda pad: trims.append(pad) or 1, lambda: types.SimpleNamespace(fordblks=free[0]))
    monkeypatch.setattr(memory, "_GLIBC", fake)
    monkeypatch.setattr(memory, "_streamed", 0)
    monkeypatch.setattr(memory, "TRIM_CHECK_BYTES", 4 * 2**20)
    sd = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(8)}  # 4 MiB each
    th5.save(sd, tmp_path / "a.h5")
    with th5.open(tmp_path / "a.h5") as s:
        assert [k for k, _ in s.items()] == list(sd)
    assert trims == []  # the heap held nothing free
    free[0] = memory.TRIM_BYTES
    with th5.open(tmp_path / "a.h5") as s, th5.Writer(tmp_path / "b.h5") as w:
        for k, t in s.items():
            w[k] = t * 2
    assert len(trims) == 16  # one look per 4 MiB streamed: 8 tensors read, 8 written
    monkeypatch.setattr(memory, "TRIM_BYTES", None)
    with th5.open(tmp_path / "a.h5") as s:
        list(s.items())
    assert len(trims) == 16
    if memory._glibc() is not None:  # the real one answers
        trim, info = memory._glibc()
        assert trim(0) in (0, 1) and (info is None or info().arena >= 0)


def test_reads_from_a_local_file_ask_the_kernel_to_read_ahead(tmp_path, monkeypatch) -> None:
    """items() keeps READAHEAD_BYTES of the next tensors handed to the kernel's readahead ahead of
    the one it yields (never far more); load() hands over everything it will read at once;
    mmap loads and READAHEAD_BYTES = 0 hand over nothing."""
    from tensorstore_h5.storage import files

    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(files.RawFile, "willneed", lambda self, ranges: advised.extend(ranges))
    monkeypatch.setattr(files, "READAHEAD_BYTES", 2 * 2**20)
    sd = {f"w{i}": torch.full((512, 256), float(i)) for i in range(12)}  # 512 KiB each
    th5.save(sd, tmp_path / "a.h5")
    with th5.open(tmp_path / "a.h5") as s:
        spans = {k: s._entry(k).extent for k in s.keys()}
        for i, (k, t) in enumerate(s.items()):
            assert torch.equal(t, sd[k])
            covered = {j for j in range(12) if (spans[f"w{j}"].offset, spans[f"w{j}"].nbytes) in advised}
            assert set(range(min(12, i + 4))) <= covered, (i, covered)  # this one and the next 3 at least
            assert max(covered) <= i + 5  # about 2 MiB ahead, not the whole file
    advised.clear()
    th5.load(tmp_path / "a.h5", select="w1*")
    assert sorted(advised) == sorted((spans[k].offset, spans[k].nbytes) for k in ("w1", "w10", "w11"))
    advised.clear()
    th5.load(tmp_path / "a.h5", mmap=True)
    monkeypatch.setattr(files, "READAHEAD_BYTES", 0)
    th5.load(tmp_path / "a.h5")
    with th5.open(tmp_path / "a.h5") as s:
        list(s.items())
    assert advised == []


def test_willneed_takes_any_ranges(tmp_path) -> None:
    from tensorstore_h5.storage import files

    th5.save({"w": torch.ones(1000)}, tmp_path / "a.h5")
    raw = files.RawFile(str(tmp_path / "a.h5"))
    raw.willneed([(0, 100), (50, 10**9), (0, 0)])  # past the end and empty: the kernel's business
    assert files.coalesce([(0, 100), (50, 10**9), (0, 0), (2 * 10**9, 5)], 1 << 20) == [[0, 10**9 + 50], [2 * 10**9, 2 * 10**9 + 5]]
    raw.close()
    raw.willneed([(0, 100)])  # closed: nothing


def _evict(path) -> None:
    """Drop ``path``'s pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT here")
def test_cached_tells_a_cold_file_from_a_warm_one(tmp_path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    _evict(path)
    raw = files.RawFile(str(path))
    try:
        assert not raw.cached([(0, 1 << 20), (3 << 20, 1 << 20)])
        raw.read(0, 4 << 20)  # now in the page cache
        assert raw.cached([(0, 1 << 20), (3 << 20, 1 << 20)])
        assert raw.cached([]) and raw.cached([(5, 0)])  # nothing to probe
    finally:
        raw.close()


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT here")
def test_a_cold_load_keeps_more_reads_in_flight(tmp_path, monkeypatch) -> None:
    sd = {f"w{i}": torch.randn(512, 1024) for i in range(8)}  # 16 MiB: more than one batch
    path = tmp_path / "ckpt.h5"
    th5.save(sd, path)
    threads: list[int | None] = []
    real = parallel.ReadPlan.__init__

    def init(self, raw, threads_=None):
        threads.append(threads_)
        real(self, raw, threads_)

    monkeypatch.setattr(parallel.ReadPlan, "__init__", init)
    _evict(path)
    cold = th5.load(path, progress=False)
    warm = th5.load(path, progress=False)
    assert threads == [parallel.COLD_IO_THREADS, None]
    assert all(torch.equal(cold[k], v) and torch.equal(warm[k], v) for k, v in sd.items())


def test_pwrite_all_finishes_short_writes_and_refuses_a_stalled_one(tmp_path, monkeypatch) -> None:
    from tensorstore_h5.storage import files, memory

    data = torch.arange(1000, dtype=torch.int32)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    real = os.pwrite
    calls = []

    def short(fd_, buf, offset):  # the kernel may write less than asked
        calls.append(len(buf))
        return real(fd_, memoryview(buf)[:1000], offset)

    try:
        monkeypatch.setattr(os, "pwrite", short)
        files.pwrite_all(fd, memory.tensor_buffer(data), 100)
        assert calls == [4000, 3000, 2000, 1000]
        monkeypatch.setattr(os, "pwrite", lambda *a: 0)
        with pytest.raises(OSError, match="short write"):
            files.pwrite_all(fd, b"x", 0)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert (tmp_path / "f").read_bytes()[100:] == data.numpy().tobytes()


def test_tensor_buffer_is_the_tensors_own_memory_and_keeps_it_alive() -> None:
    from tensorstore_h5.storage import memory

    t = torch.zeros(4, dtype=torch.float32)
    view = memory.tensor_buffer(t)
    view[4:8] = torch.tensor([1.5]).numpy().tobytes()
    assert t.tolist() == [0.0, 1.5, 0.0, 0.0] and len(view) == 16
    view = memory.tensor_buffer(torch.full((3,), 7, dtype=torch.int64))  # the only reference to the tensor
    assert bytes(view) == torch.full((3,), 7, dtype=torch.int64).numpy().tobytes()
    assert len(memory.tensor_buffer(torch.empty(0))) == 0
    with pytest.raises(ValueError, match="contiguous"):
        memory.tensor_buffer(torch.zeros(3, 4).t())  # its bytes are not one range


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT here")
def test_a_cold_mapped_load_starts_readahead_at_every_tensor(tmp_path, monkeypatch) -> None:
    sd = {f"w{i}": torch.randn(256, 1024) for i in range(6)}
    path = tmp_path / "ckpt.h5"
    th5.save(sd, path)
    with th5.open(path) as s:
        starts = sorted(s._layout.entry(k).extent.offset for k in sd)
    primed: list[list[int]] = []
    real = files.RawFile.prime
    monkeypatch.setattr(files.RawFile, "prime", lambda self, ranges: (primed.append([a for a, _ in ranges]),
                                                                    real(self, ranges))[1])
    _evict(path)
    cold = th5.load(path, mmap=True)
    assert all(torch.equal(cold[k], v) for k, v in sd.items())  # every page read through the mapping
    warm = th5.load(path, mmap=True)  # the file is in the page cache now: nothing to start
    assert primed == [starts]
    assert all(torch.equal(warm[k], v) for k, v in sd.items())


def test_gc_paused_nests_across_threads_and_restores_the_callers_setting() -> None:
    import gc
    import threading

    assert gc.isenabled()
    inner_started, outer_may_end = threading.Event(), threading.Event()
    seen = []

    def other() -> None:
        with memory.gc_paused():
            inner_started.set()
            outer_may_end.wait(5)
            seen.append(gc.isenabled())

    with memory.gc_paused():
        t = threading.Thread(target=other)
        t.start()
        inner_started.wait(5)
        seen.append(gc.isenabled())
    seen.append(gc.isenabled())  # the other thread's block still runs: still paused
    outer_may_end.set()
    t.join()
    assert seen == [False, False, False] and gc.isenabled()
    gc.disable()
    try:
        with memory.gc_paused():
            pass
        assert not gc.isenabled()  # the caller had it off: left off
    finally:
        gc.enable()


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_block_hashes_cut_any_buffer_into_blocks(n) -> None:
    """One hash per block of ``block`` bytes, the last one shorter, for any buffer type and
    size (the one-block fast path and the sliced path agree with hashing each block alone)."""
    from tensorstore_h5.format import checksum

    data = bytes(range(256)) * (n // 256 + 1)
    data = data[:n]
    expected = [checksum.digest(data[i:i + 4096]) for i in range(0, n, 4096)]
    assert checksum.block_hashes(data, 4096) == expected
    assert checksum.block_hashes(memoryview(np.frombuffer(data, dtype=np.uint8)), 4096) == expected
    if n % 4 == 0:  # a buffer of 4-byte items: blocks are counted in bytes
        assert checksum.block_hashes(np.frombuffer(data, dtype=np.float32), 4096) == expected


def _small_state(n: int = 300) -> dict:
    g = torch.Generator().manual_seed(5)
    return {f"b{i // 10}": {f"p{i % 10}": torch.randn(i % 7 + 1, generator=g) for i in range(i, i + 10)}
            for i in range(0, n, 10)} | {"big": torch.randn(100_000, generator=g), "scalar": torch.tensor(3),
                                        "h": torch.ones(3, dtype=torch.float16)}


def test_small_tensors_are_read_in_windows_into_storages_of_their_own(tmp_path, monkeypatch) -> None:
    """A load reads neighbouring small tensors with one pread per window (ReadPlan.add_small),
    yet each tensor comes back bitwise right, in memory of its own (no view into the window)."""
    sd = _small_state()
    th5.save(sd, tmp_path / "f.h5")
    calls = []
    real = files.RawFile.pread
    monkeypatch.setattr(files.RawFile, "pread", lambda self, at, view: (calls.append(len(view)), real(self, at, view))[1])
    out = th5.load(tmp_path / "f.h5", verify=True)
    assert_same(out, sd)
    small = [t for group in out.values() if isinstance(group, dict) for t in group.values()]
    assert len(small) == 300 and all(t.untyped_storage().nbytes() == t.nbytes for t in small)
    assert len({t.data_ptr() for t in small}) == 300
    assert len(calls) < 20  # 300 small tensors, the big one, the header and layout: not one read each


def test_a_corrupt_small_tensor_is_named_among_its_window(tmp_path) -> None:
    """verify=True names the small tensor whose bytes changed, not a neighbour in its window;
    a file cut inside a window names the first tensor that is missing bytes."""
    sd = _small_state()
    th5.save(sd, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        at = s._entry("b7/p3").extent.offset
        cut = s._entry("b12/p1").extent.offset + 2
    raw = bytearray((tmp_path / "f.h5").read_bytes())
    raw[at] ^= 0xFF
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*'b7/p3'"):
        th5.load(tmp_path / "bad.h5", verify=True)
    with pytest.raises(th5.FormatError, match=r"bad\.h5.*'b7/p3'"):
        th5.load(tmp_path / "bad.h5")  # checked by default
    assert not torch.equal(th5.load(tmp_path / "bad.h5", verify=False)["b7"]["p3"], sd["b7"]["p3"])  # as stored
    with th5.open(tmp_path / "f.h5") as s:  # the same file, as if it ended inside b12/p1
        raw = s._reader.rawfile()
        real = raw.pread

        def short(at, view):
            if at + len(view) > cut:
                raise EOFError(f"file ends at byte {cut}")
            real(at, view)

        raw.pread = short
        plan = parallel.ReadPlan(raw, threads=1)
        for k in ("b12/p0", "b12/p1", "b12/p2"):
            e = s._entry(k)
            out = torch.empty(e.shape, dtype=e.dtype.torch_dtype)
            plan.add_small(e.extent.offset, out, lambda job, k=k: _named(job, k))
        with pytest.raises(KeyError, match="b12/p1"):
            plan.run()


def _named(job, key):
    def run():
        try:
            job()
        except EOFError as e:
            raise KeyError(key) from e
    return run


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4), lambda: torch.randn(5).bfloat16(), lambda: torch.tensor(3.5),
    lambda: torch.tensor([True, False, True]), lambda: torch.nn.Parameter(torch.randn(3)),
    lambda: torch.randn(4, 1).as_strided((4, 1), (1, 5)), lambda: torch.randn(1, 1).as_strided((1, 1), (7, 3)),
    lambda: torch.randn(3, dtype=torch.complex64), lambda: torch.randn(3, dtype=torch.complex64).conj(),
    lambda: torch.randn(2, 3, 4, dtype=torch.float64)[1], lambda: torch.randn(4).to(torch.float8_e4m3fn),
    lambda: torch.empty(2, 0),
], ids=["f32", "bf16", "0-d", "bool", "parameter", "size-1 stride", "1x1 strides", "complex", "conj view",
        "offset view", "float8", "empty"])
def test_tensor_buffer_holds_the_stored_bytes_of_every_kind_of_tensor(make) -> None:
    """Every contiguous tensor, whatever its dtype, grad, strides of size-1 dimensions or
    conjugate bit, gives a writable view of exactly the bytes its storage holds at its offset."""
    import ctypes

    from tensorstore_h5.storage import memory

    t = make()
    n = t.numel() * t.element_size()
    view = memory.tensor_buffer(t)
    assert len(view) == n and not view.readonly and view.format == "B"
    assert bytes(view) == ctypes.string_at(t.data_ptr(), n)
    if n:
        view[0:1] = bytes([ctypes.string_at(t.data_ptr(), 1)[0] ^ 0xFF])  # writes land in the tensor
        assert bytes(view) == ctypes.string_at(t.data_ptr(), n)
