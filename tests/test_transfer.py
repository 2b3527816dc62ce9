"""The staging pipeline, run against CPU targets (and CUDA ones where present)."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import transfer
from tensorstore_h5.reading import store as store_mod
from tensorstore_h5.reading.many import Reader
from tensorstore_h5.reading.tensors import TensorReader
from tensorstore_h5.storage import files, memory, parallel
from tensorstore_h5.transfer import FileFill, Stager

from helpers import assert_same, assert_same_tensor, random_tensor


@pytest.mark.parametrize("nbytes", [1, 999, 1000, 1001, 4567])
def test_blocks_cover_the_tensor_in_order_and_reuse_two_buffers(nbytes) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    stager = Stager("cpu", buffers=2, buffer_bytes=1000)
    seen = []

    def fill(offset: int, buf: torch.Tensor) -> None:
        seen.append((offset, buf.numel(), buf.data_ptr()))
        buf.copy_(src[offset:offset + buf.numel()])

    stager.copy(dest, fill)
    assert torch.equal(dest, src)
    assert [(o, n) for o, n, _ in seen] == stager.iter_blocks(nbytes)
    ptrs = [p for _, _, p in seen]
    assert len(set(ptrs)) == min(2, len(ptrs)) and all(ptrs[i] == ptrs[i % 2] for i in range(len(ptrs)))
    assert sum(stager.uses) == len(seen)


@pytest.fixture()
def staged_cpu(monkeypatch):
    """Send CPU targets through the staging path, as device targets go."""
    monkeypatch.setattr(TensorReader, "staged", staticmethod(lambda dev: True))
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", 1000)


def test_store_reads_through_staging_buffers(tmp_path, staged_cpu) -> None:
    t = random_tensor((300, 7), torch.bfloat16, seed=2)
    th5.save({"t": t, "small": torch.arange(5)}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        out = torch.empty(300, 7, dtype=torch.bfloat16)
        s["t"].read(out=out)
        assert torch.equal(out.view(torch.int16), t.view(torch.int16))
        part = torch.empty(50, 7, dtype=torch.bfloat16)
        s["t"].read(out=part, index=slice(123, 173))
        assert torch.equal(part.view(torch.int16), t[123:173].view(torch.int16))
        small = torch.empty(5, dtype=torch.int64)
        assert s["small"].read(out=small).tolist() == [0, 1, 2, 3, 4]
        stager = s._reader._stagers[torch.device("cpu")]
        assert stager.block_bytes == 1000 and sum(stager.uses) == 5 + 1 + 1  # 4200 B in 5 blocks, 700 B, 40 B
        with pytest.raises(th5.MismatchError):
            s["t"].read(out=torch.empty(300, 7))  # wrong dtype: refused before any copy


def test_staged_blocks_are_read_by_several_threads(tmp_path, monkeypatch) -> None:
    """A contiguous dataset's staging blocks are filled by the I/O threads together, in pieces
    that cover each block once, so a device load is not held to one thread's copy speed."""
    monkeypatch.setattr(TensorReader, "staged", staticmethod(lambda dev: True))
    monkeypatch.setattr("tensorstore_h5.transfer.STAGING_BYTES", 64 * 1024)
    monkeypatch.setattr(parallel, "SPLIT_MIN_BYTES", 8192)
    monkeypatch.setattr(parallel, "IO_THREADS", 4)
    t = random_tensor((1000, 50), torch.float32, seed=9)  # 200,000 bytes: 3 blocks of 65,536 and one of 3,392
    th5.save({"t": t}, tmp_path / "p.h5")
    reads: list[tuple[int, int, str]] = []
    real = files.RawFile.pread

    def pread(self, offset, view):
        reads.append((offset, len(view), threading.current_thread().name))
        real(self, offset, view)

    with th5.open(tmp_path / "p.h5") as s:
        at = s._reader.where(s["t"]._entry).offset
        monkeypatch.setattr(files.RawFile, "pread", pread)
        out = torch.empty(1000, 50)
        s["t"].read(out=out, verify=False)  # (checking reads the bytes once more, before out changes)
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))
    pieces = sorted((o - at, n) for o, n, _ in reads)
    assert [o for o, _ in pieces] == [0] + list(itertools.accumulate(n for _, n in pieces))[:-1]  # no gap, no overlap
    assert sum(n for _, n in pieces) == t.nbytes and all(o % 4096 == 0 for o, _ in pieces)
    assert len(pieces) == 3 * 4 + 1  # 3 full blocks in 4 pieces each, the last 3,392 bytes in one read
    assert len({name for *_, name in reads}) > 1


def test_pread_split_reports_a_failed_piece_after_all_have_ended(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "SPLIT_MIN_BYTES", 1000)
    monkeypatch.setattr(parallel, "IO_THREADS", 3)
    done = []

    def pread(offset, view):
        if offset == 0:
            raise EOFError("short")
        time.sleep(0.05)
        view[:] = b"x" * len(view)
        done.append(offset)

    buf = bytearray(3 * 8192)
    with pytest.raises(EOFError, match="short"):
        parallel.pread_split(pread, 0, memoryview(buf))
    assert sorted(done) == [8192, 16384]  # the other pieces ran to their end before the error came out
    small = []
    parallel.pread_split(lambda o, v: small.append((o, len(v))), 7, memoryview(bytearray(1999)))
    assert small == [(7, 1999)]  # under two pieces' worth: one read


def test_copy_many_packs_tensors_into_the_buffers_in_order(monkeypatch) -> None:
    """Many tensors share each staging buffer: every byte lands once, in its own tensor; each
    buffer is filled (pieces of one buffer on several threads) before its copies go out."""
    monkeypatch.setattr(parallel, "SPLIT_MIN_BYTES", 100)
    monkeypatch.setattr(parallel, "IO_THREADS", 4)
    sizes = [1, 999, 0, 1000, 1001, 37, 4567, 2, 300]
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    stager = Stager("cpu", buffers=2, buffer_bytes=1000)
    fills, threads, done = [], set(), []

    def fill_of(src):
        def fill(offset: int, buf: torch.Tensor) -> None:
            bufs = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in stager._bufs if b is not None]
            assert any(lo <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= hi for lo, hi in bufs)
            fills.append((id(src), offset, buf.numel()))
            threads.add(threading.current_thread().name)
            buf.copy_(src[offset:offset + buf.numel()])
        return fill

    stager.copy_many([(d, fill_of(s)) for d, s in zip(dests, srcs)], done.append)
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs))
    assert [id(t) for t in done] == [id(d) for d in dests if d.numel()]  # each once, in order
    for s in srcs:  # the pieces of each tensor cover it once
        pieces = sorted((o, n) for i, o, n in fills if i == id(s))
        assert sum(n for _, n in pieces) == s.numel() and all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert sum(stager.uses) == -(-sum(sizes) // 1000) and len(threads) > 1  # full buffers, filled by several threads


def test_copy_many_reads_small_tensors_in_few_jobs(monkeypatch) -> None:
    """Thousands of small tensors share thread-pool jobs (consecutive parts of at most a read
    piece together), each job filling its parts in order. One job a tiny tensor made a load of
    6,000 small tensors to a device mostly hand-offs between threads."""
    monkeypatch.setattr(parallel, "SPLIT_MIN_BYTES", 1000)
    monkeypatch.setattr(parallel, "IO_THREADS", 2)
    submitted: list[int] = []
    real_submit = parallel.submit_jobs
    monkeypatch.setattr(parallel, "submit_jobs", lambda jobs: submitted.append(len(jobs)) or real_submit(jobs))
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in [7] * 3000 + [2500, 3]]
    dests = [torch.zeros_like(s) for s in srcs]
    order: dict[str, list[int]] = {}

    def fill_of(i, src):
        def fill(offset: int, buf: torch.Tensor) -> None:
            order.setdefault(threading.current_thread().name, []).append(i)
            buf.copy_(src[offset:offset + buf.numel()])
        return fill

    Stager("cpu", buffers=2, buffer_bytes=4000).copy_many([(d, fill_of(i, s)) for i, (d, s) in enumerate(zip(dests, srcs))])
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs))
    total = sum(s.numel() for s in srcs)  # 23,503 bytes: 5 full buffers of 4,000 and one of 3,503
    assert len(submitted) == -(-total // 4000) and max(submitted) <= 3, submitted  # a piece is 2,000 bytes
    assert all(seq == sorted(seq) for seq in order.values())  # each job fills its parts in order


def test_copy_many_fills_tensors_of_any_shape_and_dtype_whole_or_split() -> None:
    """0-d, 1-d and n-d tensors of several dtypes, some inside one buffer (sent whole, without a
    slice) and some across buffers: every byte lands in its own tensor."""
    g = torch.Generator().manual_seed(7)
    srcs = [torch.tensor(3.5), torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.arange(40),
            torch.randn(700, generator=g), torch.tensor(True), torch.randint(0, 9, (3, 4, 5), generator=g).to(torch.int16)]
    dests = [torch.empty_like(t) for t in srcs]

    def fill_of(src):
        raw = src.reshape(-1).view(torch.uint8) if src.dim() else src.reshape(1).view(torch.uint8)
        return lambda offset, buf: buf.copy_(raw[offset:offset + buf.numel()])

    Stager("cpu", buffers=2, buffer_bytes=1000).copy_many([(d, fill_of(t)) for d, t in zip(dests, srcs)])
    assert all(torch.equal(d, t) for d, t in zip(dests, srcs))


class _Bytes:
    """A file of ``data`` for FileFill: counts its reads; a read that covers byte ``bad`` fails."""

    def __init__(self, data: bytes, bad: int = -1) -> None:
        self.data, self.bad, self.reads = data, bad, []

    def pread(self, offset: int, view: memoryview) -> None:
        self.reads.append((offset, len(view)))
        if offset <= self.bad < offset + len(view):
            raise OSError(5, "Input/output error")
        view[:] = self.data[offset:offset + len(view)]


def _laid_out(sizes: list[int], gaps: list[int]) -> tuple[bytes, list[int]]:
    """File bytes holding tensors of ``sizes`` after ``gaps`` of filler, and their offsets."""
    g = torch.Generator().manual_seed(11)
    data, offsets = bytearray(), []
    for n, gap in zip(sizes, gaps):
        data += b"\xee" * gap
        offsets.append(len(data))
        data += bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).tolist())
    return bytes(data), offsets


def test_neighbouring_tensors_of_a_file_are_staged_as_they_lie_and_read_together(monkeypatch) -> None:
    """FileFills of one file go into the buffers as they lie (small gaps kept): a run of them
    in one job is one read; a gap over RUN_GAP, or the end of a buffer, starts a new run."""
    monkeypatch.setattr(parallel, "IO_THREADS", 1)
    sizes = [4, 60, 1, 200, 7, 3000, 16, 16]
    gaps = [0, 60, 3, 0, 5, 5000, 44, 0]  # a 5,000-byte gap before the 3,000-byte tensor
    data, offsets = _laid_out(sizes, gaps)
    raw = _Bytes(data)
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    fills = [FileFill(raw, o, lambda job: job()) for o in offsets]
    Stager("cpu", buffers=2, buffer_bytes=4096).copy_many(list(zip(dests, fills)))
    assert all(bytes(d.tolist()) == data[o:o + n] for d, o, n in zip(dests, offsets, sizes))
    starts = [o for o, _ in raw.reads]
    assert starts[0] == offsets[0] and raw.reads[0][1] == offsets[4] + sizes[4] - offsets[0]  # tensors 0-4: one read
    assert starts == [offsets[0], offsets[5]], raw.reads  # and tensors 5-7 (after the long gap) one more


def test_a_failed_read_of_a_run_is_retried_per_tensor_and_names_its_tensor(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "IO_THREADS", 1)
    sizes, gaps = [8, 8, 8, 8], [0, 8, 8, 8]
    data, offsets = _laid_out(sizes, gaps)
    raw = _Bytes(data, bad=offsets[2] + 3)
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]

    def named(i):
        def run(job):
            try:
                job()
            except OSError as e:
                raise ValueError(f"key t{i}: {e}") from e
        return run

    fills = [FileFill(raw, o, named(i)) for i, o in enumerate(offsets)]
    with pytest.raises(ValueError, match="key t2"):
        Stager("cpu", buffers=2, buffer_bytes=4096).copy_many(list(zip(dests, fills)))
    assert raw.reads[0] == (offsets[0], offsets[3] + 8 - offsets[0])  # the run first, then one read each
    assert [o for o, _ in raw.reads[1:]] == offsets[:3]


def test_checksummed_tensors_are_cut_at_block_ends_and_checked_in_the_buffers(monkeypatch) -> None:
    """A FileFill with hashes is cut only where a checksum block ends (the buffer it would
    straddle goes part-full), and each block is checked in the staging buffer after its read:
    a flipped byte fails with the tensor's own ``run`` (which names its key)."""
    from tensorstore_h5.format import checksum

    monkeypatch.setattr(parallel, "IO_THREADS", 1)
    sizes, block = [300, 900, 100], 256
    data, offsets = _laid_out(sizes, [0, 0, 0])

    def copy(raw, named=lambda i: (lambda job: job())):
        dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        fills = [FileFill(raw, o, named(i), checksum.block_hashes(data[o:o + n], block), block)
                 for i, (o, n) in enumerate(zip(offsets, sizes))]
        Stager("cpu", buffers=2, buffer_bytes=1000).copy_many(list(zip(dests, fills)))
        return dests

    raw = _Bytes(data)
    dests = copy(raw)
    assert all(bytes(d.tolist()) == data[o:o + n] for d, o, n in zip(dests, offsets, sizes))
    # 300 B, then 2 of the 900-byte tensor's blocks fit the 700 B left (not 700 B): 812 B;
    # its last 388 B and the 100-byte tensor fill the next buffer
    assert raw.reads == [(0, 812), (812, 488)]
    plain = _Bytes(data)
    Stager("cpu", buffers=2, buffer_bytes=1000).copy_many(
        [(torch.zeros(n, dtype=torch.uint8), FileFill(plain, o, lambda job: job())) for o, n in zip(offsets, sizes)])
    assert plain.reads == [(0, 1000), (1000, 300)]  # without hashes a buffer is filled to its end

    def named(i):
        def run(job):
            try:
                job()
            except checksum.ChecksumError as e:
                raise ValueError(f"key t{i}: {e}") from e
        return run

    flipped = bytearray(data)
    flipped[offsets[1] + 600] ^= 1  # the 900-byte tensor's third block, in the second buffer
    with pytest.raises(ValueError, match=r"key t1: bytes 812\.\.1068 of the file"):
        copy(_Bytes(bytes(flipped)), named)
    with pytest.raises(ValueError, match="checksum blocks of 2048 bytes"):
        Stager("cpu", buffers=2, buffer_bytes=1000).copy_many(
            [(torch.zeros(10, dtype=torch.uint8), FileFill(raw, 0, lambda job: job(), [0], 2048))])
    with pytest.raises(ValueError, match="need a block size"):
        FileFill(raw, 0, lambda job: job(), [0])


def test_staging_buffers_are_only_as_large_as_the_staged_bytes() -> None:
    """A few small tensors pin a small buffer, not the full staging size; a later, larger
    load through the same stager grows it up to the buffer size, never past it."""
    stager = Stager("cpu", buffers=2, buffer_bytes=8 * 2**20)
    small = [torch.zeros(1000, dtype=torch.uint8) for _ in range(3)]
    stager.copy_many([(d, lambda off, buf: buf.fill_(7)) for d in small])
    assert all(bool((d == 7).all()) for d in small)
    assert [b.numel() if b is not None else None for b in stager._bufs] == [2**20, None]
    src = torch.randint(0, 256, (20 * 2**20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    big = torch.zeros_like(src)
    stager.copy_many([(big, lambda off, buf: buf.copy_(src[off:off + buf.numel()]))])
    assert [b.numel() for b in stager._bufs] == [8 * 2**20, 8 * 2**20] and torch.equal(big, src)
    one = torch.zeros(3 * 2**20 + 5, dtype=torch.uint8)
    fresh = Stager("cpu", buffers=2, buffer_bytes=8 * 2**20)
    fresh.copy(one, lambda off, buf: buf.fill_(1))
    assert bool((one == 1).all()) and fresh._bufs[0].numel() == 4 * 2**20 and fresh._bufs[1] is None


def test_copy_many_keeps_several_buffers_in_flight(monkeypatch) -> None:
    """The reads of the next buffers run while one buffer's read is still going (no barrier
    per buffer): here the first buffer's fill waits until the second buffer's has started."""
    monkeypatch.setattr(parallel, "IO_THREADS", 4)
    second_started = threading.Event()
    srcs = [torch.full((1000,), i, dtype=torch.uint8) for i in range(6)]
    dests = [torch.zeros(1000, dtype=torch.uint8) for _ in srcs]

    def fill_of(i):
        def fill(offset: int, buf: torch.Tensor) -> None:
            if i == 1:
                second_started.set()
            if i == 0:
                assert second_started.wait(10), "the second buffer's read did not start while the first one's ran"
            buf.copy_(srcs[i][offset:offset + buf.numel()])
        return fill

    Stager("cpu", buffers=3, buffer_bytes=1000).copy_many([(d, fill_of(i)) for i, d in enumerate(dests)])
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs))


def test_copy_many_error_waits_for_every_read_in_flight(monkeypatch) -> None:
    """A failing fill raises out of copy_many only once no other read into the staging
    buffers is still running, and the tensors of later buffers are not written after it."""
    monkeypatch.setattr(parallel, "IO_THREADS", 4)
    running, ended = [0], []
    lock = threading.Lock()

    def fill_of(i):
        def fill(offset: int, buf: torch.Tensor) -> None:
            with lock:
                running[0] += 1
            try:
                if i == 1:
                    raise OSError("disk gone")
                time.sleep(0.05)
                buf.fill_(i)
            finally:
                with lock:
                    running[0] -= 1
                    ended.append(i)
        return fill

    dests = [torch.zeros(1000, dtype=torch.uint8) for _ in range(8)]
    with pytest.raises(OSError, match="disk gone"):
        Stager("cpu", buffers=3, buffer_bytes=1000).copy_many([(d, fill_of(i)) for i, d in enumerate(dests)])
    assert running[0] == 0
    n = len(ended)
    time.sleep(0.2)
    assert len(ended) == n  # nothing still running or queued
    assert all(not d.any() for d in dests[1:])  # no buffer after the failed one was copied out


def test_device_loads_fill_many_tensors_per_buffer(tmp_path, device_cpu) -> None:
    """load(device=...) sends every contiguous tensor of a local file through shared staging
    buffers (1000 bytes here): 60 small tensors fill a handful of buffers, not 60; aliases,
    strided and compressed tensors still come back as saved; verify checks them."""
    g = torch.Generator().manual_seed(8)
    sd = {f"p{i}": torch.randn(i + 1, 3, generator=g) for i in range(60)}
    sd.update({"alias": sd["p7"], "t": torch.randn(20, 30, generator=g).t(), "empty": torch.empty(0, 4),
               "z": torch.zeros(700), "step": 3})
    th5.save(sd, tmp_path / "m.h5", compression=lambda p, t: "lz4" if p == "z" else None)
    with th5.open(tmp_path / "m.h5") as s:
        out = s.load(device="cpu", verify=True)
        stager = s._reader._stagers[torch.device("cpu")]
        contiguous = sum(v.nbytes for k, v in sd.items() if k.startswith("p")) + sd["t"].nbytes
        assert sum(stager.uses) <= -(-contiguous // 1000) + 2 + 3  # + the compressed one's blocks
    assert_same(out, sd)
    assert out["alias"] is out["p7"] and device_cpu == []


def test_load_into_device_targets_fills_many_per_buffer(tmp_path, staged_cpu, monkeypatch) -> None:
    """load_into with device targets (the CPU standing in): contiguous targets of the stored
    dtype share staging buffers and keep their memory; a transposed target and one of another
    dtype take the per-tensor path; a damaged file changes no target, checked first."""
    g = torch.Generator().manual_seed(9)
    sd = {f"p{i}": torch.randn(i + 1, 5, generator=g) for i in range(40)}
    sd["w"] = torch.randn(30, 20, generator=g)
    th5.save(sd, tmp_path / "i.h5")
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    target["w"] = torch.zeros(20, 30).t()  # not contiguous
    target["p3"] = torch.zeros(4, 5, dtype=torch.float64)  # cast like copy_
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    packed = []
    real = Stager.copy_many

    def copy_many(self, parts, done=None):
        parts = list(parts)
        real(self, parts, done)
        packed.append((len(parts), sum(self.uses)))

    monkeypatch.setattr(Stager, "copy_many", copy_many)
    assert th5.load_into(target, tmp_path / "i.h5") == th5.LoadResult([], [])
    assert all(torch.equal(target[k].to(v.dtype), v) and target[k].data_ptr() == ptrs[k] for k, v in sd.items())
    data = sum(v.nbytes for k, v in sd.items() if k not in ("w", "p3"))
    with th5.open(tmp_path / "i.h5") as s:
        offset = s["p20"]._entry.extent.offset
        first, last = s["p0"]._entry.extent, s["p39"]._entry.extent
    span = last.offset + last.nbytes - first.offset  # staged as they lie: padding (and p3) between them too
    (count, uses), = packed
    assert count == 39 and -(-data // 1000) <= uses <= -(-span // 1000)  # 39 targets in full buffers, "w", "p3" apart
    with open(tmp_path / "i.h5", "r+b") as f:
        f.seek(offset + 4)
        f.write(b"\xff\xff")
    fresh = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(th5.FormatError, match="key 'p20'.*checksum"):
        th5.load_into(fresh, tmp_path / "i.h5", verify=True)
    assert not any(v.any() for v in fresh.values())  # nothing changed


def test_a_device_load_that_fails_names_the_key(tmp_path, device_cpu) -> None:
    path = tmp_path / "f.h5"
    th5.save({"a": torch.ones(100), "b": torch.ones(300, 100)}, path)
    with th5.open(path) as s:
        os.truncate(path, s["a"]._entry.extent.offset + 408)
        with pytest.raises(th5.FormatError, match="f.h5: key 'b': cannot read the data.*truncated"):
            s.load(device="cpu")


@pytest.mark.cuda
def test_cuda_targets(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    smooth = (torch.randn(3000, 64) * 0.02).to(torch.bfloat16)
    sd = {"w": torch.randn(1000, 300), "b": torch.randn(300), "t": torch.randn(30, 40).t(), "step": torch.tensor(3),
          "lz4": smooth, "zstd": smooth.float(), "expanded": torch.arange(9.0).expand(4, 9)}
    th5.save(sd, tmp_path / "g.h5", compression=lambda p, t: p if p in ("lz4", "zstd") else None)
    out = th5.load(tmp_path / "g.h5", device="cuda")
    for k in sd:
        assert out[k].is_cuda and out[k].stride() == sd[k].stride(), k  # the layout, on the device
        assert_same_tensor(out[k].cpu(), sd[k], layout=False)  # .cpu() makes "expanded" contiguous
    target = {k: torch.empty_like(v, device="cuda") for k, v in sd.items() if v.is_contiguous()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    th5.load_into(target, tmp_path / "g.h5", strict=False)
    assert all(torch.equal(target[k].cpu(), sd[k]) and target[k].data_ptr() == ptrs[k] for k in target)
    with th5.open(tmp_path / "g.h5") as s:
        rows = torch.zeros(100, 64, dtype=torch.bfloat16, device="cuda")
        s["lz4"].read(out=rows[10:60], index=slice(2000, 2050))  # a slice into part of a CUDA tensor
        assert torch.equal(rows[10:60].cpu(), smooth[2000:2050]) and not rows[:10].any() and not rows[60:].any()
        streamed = dict(s.items(device={"lz4": "cuda", "*": "cpu"}))
        assert streamed["lz4"].is_cuda and not streamed["w"].is_cuda
        with pytest.raises(th5.MismatchError):
            s["w"].read(out=torch.empty(1000, 300, dtype=torch.float16, device="cuda"))


@pytest.fixture()
def device_cpu(staged_cpu, monkeypatch):
    """Treat the CPU as a device: load(device="cpu") takes the device branch, through staging."""
    real_target = Reader.target
    monkeypatch.setattr(Reader, "target", lambda self, device, key: torch.device("cpu") if device == "cpu"
                        else real_target(self, device, key))
    temps = []
    real = memory.empty
    monkeypatch.setattr(memory, "empty", lambda shape, dtype, *a: temps.append(tuple(shape)) or real(shape, dtype, *a))
    return temps


def test_strided_and_compressed_tensors_stage_without_host_copies(tmp_path, device_cpu) -> None:
    base = random_tensor((120, 90), torch.bfloat16, seed=4)
    smooth = (torch.randn(400, 30) * 0.02).to(torch.float16)
    sd = {"t": base.t(), "expanded": torch.arange(50.0).expand(7, 50), "stepped": base[::2, ::3],
          "lz4": smooth, "zstd": smooth.float(), "lz4_t": smooth.t()}
    th5.save(sd, tmp_path / "f.h5", compression=lambda p, t: "zstd" if p == "zstd" else "lz4", chunk_bytes=4096)
    out = th5.load(tmp_path / "f.h5", device="cpu")
    for k, v in sd.items():
        assert_same_tensor(out[k], v)  # strides restored ("stepped" has gaps: it comes back contiguous)
    assert device_cpu == []  # no full-size host temporary: every byte went through the staging buffers


def test_hdf5_only_datasets_stage_by_whole_rows_and_chunks(tmp_path, device_cpu) -> None:
    import h5py

    t = torch.randn(300, 16)
    with h5py.File(tmp_path / "o.h5", "w") as f:
        f.create_dataset("gzip", data=t.numpy(), chunks=(20, 16), compression="gzip")  # 1280-byte chunks
        f.create_dataset("be", data=t.numpy().astype(">f4"))  # converted by HDF5
        f.create_dataset("cols", data=t.numpy(), chunks=(300, 4), compression="gzip")
    with th5.open(tmp_path / "o.h5") as s:
        for key in ("gzip", "be", "cols"):
            out = torch.empty(300, 16)
            s[key].read(out=out)
            assert torch.equal(out, t), key
            part = torch.empty(45, 16)
            s[key].read(out=part, index=slice(17, 62))
            assert torch.equal(part, t[17:62]), key
        rows = [(s[k]._entry, s._reader.where(s[k]._entry)) for k in ("gzip", "cols")]
        assert s._reader._hdf5_rows(*rows[0], store_mod.select_index((), (300, 16)), 1000)[1] == 64  # chunk > buffer
        assert s._reader._hdf5_rows(*rows[0], store_mod.select_index((), (300, 16)), 4000)[1] == 1280  # whole chunks
        assert s._reader._hdf5_rows(*rows[1], store_mod.select_index((), (300, 16)), 4000)[1] == 64  # whole rows
        assert s._reader._hdf5_rows(*rows[0], store_mod.select_index((slice(None), 3), (300, 16)), 4000)[0] is None
        assert device_cpu == []  # every row range went through the staging buffers
        out = torch.empty(300)
        s["gzip"].read(out=out, index=(slice(None), 3))  # not a row range: HDF5 reads the column
        assert torch.equal(out, t[:, 3])


def test_out_of_device_memory_names_the_key(monkeypatch) -> None:
    from tensorstore_h5 import transfer

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(transfer.torch, "empty", oom)
    with pytest.raises(th5.TensorStoreError, match=r"model/embed\.weight.*cuda:0"):
        transfer.device_empty((50000, 4096), torch.bfloat16, "cuda:0", "model/embed.weight")


class _FakeKvikio:
    """Just enough of kvikio's API: CuFile(path).pread(buf, size, offset).get()."""

    def __init__(self, compat: bool = False, fail: bool = False) -> None:
        import types

        self.reads: list[tuple[int, int]] = []
        self.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)
        fake = self

        class CuFile:
            def __init__(self, path: str, mode: str) -> None:
                self._f = open(path, "rb")

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self._f.close()

            def pread(self, buf: torch.Tensor, size: int, offset: int):
                if fail:
                    raise RuntimeError("cuFile error")
                fake.reads.append((offset, size))
                self._f.seek(offset)
                data = self._f.read(size)
                buf[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                return types.SimpleNamespace(get=lambda: len(data))

        self.CuFile = CuFile


@pytest.mark.parametrize("mode", ["gds", "compat", "failing"])
def test_gpudirect_storage_through_kvikio_or_silent_fallback(tmp_path, staged_cpu, monkeypatch, mode) -> None:
    from tensorstore_h5 import transfer

    fake = _FakeKvikio(compat=mode == "compat", fail=mode == "failing")
    monkeypatch.setattr(transfer, "_kvikio_module", fake)
    monkeypatch.setattr(transfer, "gds_device", lambda dev: True)
    t = random_tensor((256, 33), torch.float32, seed=8)
    th5.save({"t": t, "c": (torch.randn(500, 40) * 0.02)}, tmp_path / "f.h5", compression=lambda p, _: "lz4" if p == "c" else None)
    with th5.open(tmp_path / "f.h5") as s:
        out = torch.empty(256, 33)
        s["t"].read(out=out)
        assert torch.equal(out.view(torch.int32), t.view(torch.int32))
        c = torch.empty(500, 40)
        s["c"].read(out=c)  # compressed: never through GDS
        assert torch.equal(c, s["c"].read())
        staged = sum(s._reader._stagers[torch.device("cpu")].uses)
    if mode == "gds":
        assert len(fake.reads) == 1 and fake.reads[0][1] == t.nbytes and staged == 80_000 // 1000 + (80_000 % 1000 > 0)
    else:
        assert fake.reads == [] and staged > 80


def test_gds_off_ignores_kvikio(monkeypatch) -> None:
    from tensorstore_h5 import transfer

    monkeypatch.setattr(transfer, "_kvikio_module", _FakeKvikio())
    assert transfer._kvikio() is not None
    monkeypatch.setattr(transfer, "GDS", False)
    assert transfer._kvikio() is None


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record their calls (``fail``: register returns an error)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_register_pinned_faults_in_and_registers_the_memory_or_says_none(monkeypatch) -> None:
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buf = transfer._register_pinned(3 << 20)
    assert buf is not None and buf.numel() == 3 << 20 and buf.dtype == torch.uint8 and not bool(buf.any())
    assert cudart.registered == [(buf.data_ptr(), 3 << 20, 0)]
    buf[:10] = 7  # writable, and its memory stays mapped while the tensor lives
    assert buf[:10].tolist() == [7] * 10
    cudart.fail = True
    assert transfer._register_pinned(1 << 20) is None

    class NoBinding:
        def cudaHostRegister(self, *args):
            raise RuntimeError("CUDA driver is too old")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: NoBinding())
    assert transfer._register_pinned(1 << 20) is None  # then torch's pinned memory is used


def test_pinned_pool_reuses_buffers_and_keeps_few_sizes(monkeypatch) -> None:
    """Buffers come back to the pool and are reused by the smallest fit; a new buffer is a power
    of two of bytes, and making one unregisters the free buffers smaller than it."""
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = transfer._PinnedPool()
    M = 1 << 20
    a = pool.take(3 * M)
    assert a.numel() == 4 * M and pool.made == 1
    pool.give([a, None])
    assert pool.take(M) is a and pool.made == 1  # reused, not pinned again
    big = pool.take(64 * M)  # none free: a new one
    pool.give([a])
    c = pool.take(5 * M)  # the 4 MiB one does not fit: released, an 8 MiB one made
    assert c.numel() == 8 * M and cudart.unregistered == [a.data_ptr()] and pool.made == 3
    pool.give([big, c])
    assert pool.take(6 * M) is c and pool.take(9 * M) is big


def test_pinned_pool_falls_back_to_torch_pinned_memory(monkeypatch) -> None:
    made = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        made.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(fail=True))
    monkeypatch.setattr(torch, "empty", empty)
    buf = transfer._PinnedPool().take(5000)
    assert buf.numel() == 8192 and made == [True]
    monkeypatch.setattr(transfer, "PIN_BY_REGISTER", False)
    transfer._PinnedPool().take(100)
    assert made == [True, True]


def test_a_dropped_stager_gives_its_buffers_back_to_the_pool(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart())
    pool = transfer._PinnedPool()
    stager = Stager("cpu", buffers=2, buffer_bytes=4 << 20)
    stager._pool = pool  # as a CUDA stager takes its buffers
    src = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    dest = torch.zeros_like(src)
    stager.copy_many([(dest, lambda off, buf: buf.copy_(src[off:off + buf.numel()]))])
    assert torch.equal(dest, src) and pool.made == 2
    bufs = {b.data_ptr() for b in stager._bufs}
    del stager
    gc.collect()
    assert {b.data_ptr() for b in pool._free} == bufs
    again = Stager("cpu", buffers=2, buffer_bytes=4 << 20)
    again._pool = pool
    again.copy_many([(torch.zeros(5 << 20, dtype=torch.uint8), lambda off, buf: buf.fill_(1))])
    assert pool.made == 2  # the next load reuses them


def test_closing_a_store_gives_its_staging_buffers_back(tmp_path, staged_cpu, monkeypatch) -> None:
    """Store.close drops its stagers, so the next store reuses the page-locked buffers even
    while the closed store object is still referenced."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart())
    pool = transfer._PinnedPool()
    real = transfer.Stagers.__missing__

    def missing(self, device):
        stager = real(self, device)
        stager._pool = pool  # as CUDA stagers take theirs
        return stager

    monkeypatch.setattr(transfer.Stagers, "__missing__", missing)
    t = torch.arange(3000.0)
    th5.save({"t": t}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        out = torch.empty(3000)
        s["t"].read(out=out)
        assert torch.equal(out, t) and pool.made >= 1 and not pool._free
    assert len(pool._free) == pool.made  # returned at close, while `s` is still referenced
    with th5.open(tmp_path / "f.h5") as s:
        s["t"].read(out=out)
    assert len(pool._free) == pool.made  # the second store took them from the pool, made none
