from __future__ import annotations

import errno
import os

import h5py
import numpy as np
import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.storage import files

from helpers import assert_same


def _files(d) -> list[str]:
    return sorted(os.listdir(d))


def test_failed_save_leaves_earlier_file_intact(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    th5.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(th5.UnsupportedTypeError, match="ckpt.h5: .*builtins.object.*'b/c'"):
        th5.save({"a": torch.zeros(3), "b": {"c": object()}}, path)
    assert path.read_bytes() == before and _files(tmp_path) == ["ckpt.h5"]


def test_exception_inside_writer_discards_partial_file(tmp_path) -> None:
    path = tmp_path / "ckpt.h5"
    th5.save({"old": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="boom"):
        with th5.Writer(path) as w:
            w["new"] = torch.zeros(1000)
            assert len(_files(tmp_path)) == 2  # the partial file sits beside the target
            raise RuntimeError("boom")
    assert _files(tmp_path) == ["ckpt.h5"]
    assert list(th5.load(path)) == ["old"]


def test_bad_value_in_writer_writes_nothing_of_it(tmp_path) -> None:
    path = tmp_path / "w.h5"
    with th5.Writer(path) as w:
        w["a"] = torch.ones(2)
        with pytest.raises(th5.UnsupportedTypeError, match="'b/x'"):
            w["b"] = {"t": torch.ones(2), "x": {1, 2}}
        w["c"] = 3
    with th5.open(path) as s:
        assert s.keys() == ["a", "c"]


def test_writer_streams_nested_keys_and_values(tmp_path) -> None:
    path = tmp_path / "w.h5"
    t = torch.randn(4, 4)
    with th5.Writer(path, metadata={"step": 10}) as w:
        w["model/enc.weight"] = t
        w["model/enc.bias"] = torch.zeros(4)
        w["optim"] = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
        w["epoch"] = 3
        w["tied"] = t
    out = th5.load(path)
    assert list(out) == ["model", "optim", "epoch", "tied"]
    assert out["tied"] is out["model"]["enc.weight"]
    assert_same(out["optim"]["param_groups"], [{"lr": 0.1, "betas": (0.9, 0.99)}])
    with th5.open(path) as s:
        assert s.metadata == {"step": 10}


def test_writer_rejects_repeated_and_malformed_keys(tmp_path) -> None:
    with th5.Writer(tmp_path / "w.h5") as w:
        w["a"] = 1
        with pytest.raises(ValueError, match="already written"):
            w["a"] = 2
        with pytest.raises(ValueError, match="invalid key path"):
            w["bad%zz"] = 1
        with pytest.raises(ValueError, match="not a dict"):
            w["a/b"] = 1
        with pytest.raises(ValueError, match="must not be empty"):
            w[""] = 1


def test_closed_writer_refuses_writes(tmp_path) -> None:
    w = th5.Writer(tmp_path / "w.h5")
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w["a"] = 1


def test_abandoned_writer_removes_its_partial_file(tmp_path) -> None:
    w = th5.Writer(tmp_path / "w.h5")
    w["a"] = torch.ones(3)
    del w
    import gc

    gc.collect()
    assert _files(tmp_path) == []


def test_shared_storage_is_written_once_as_a_hard_link(tmp_path) -> None:
    emb = torch.randn(100, 8)
    sd = {"embed": emb, "head": emb, "view": emb[10:20], "other": emb.clone()}
    path = tmp_path / "tied.h5"
    th5.save(sd, path)
    with h5py.File(path) as f:
        assert f["embed"].id == f["head"].id  # the same object
        assert f["embed"].id != f["view"].id
    out = th5.load(path)
    assert out["embed"].data_ptr() == out["head"].data_ptr()
    assert out["view"].data_ptr() != out["embed"].data_ptr()  # partial overlaps are separate data
    assert torch.equal(out["view"], emb[10:20])
    only_head = th5.load(path, select="head")
    assert torch.equal(only_head["head"], emb)


@pytest.mark.parametrize("encoded", [True, False], ids=["hdf5meta", "libhdf5"])
def test_non_contiguous_and_device_tensors_are_written_in_blocks(tmp_path, device, monkeypatch, encoded) -> None:
    from tensorstore_h5.storage import files, libhdf5
    from tensorstore_h5.writing import writer

    monkeypatch.setattr(writer, "ENCODE_METADATA", encoded)
    calls = []
    if encoded:  # the data goes out by pwrite, block by block, before the layout and metadata
        real_pwrite = files.pwrite_all
        monkeypatch.setattr(files, "pwrite_all", lambda fd, data, at: (calls.append(memoryview(data).nbytes // 256),
                                                                    real_pwrite(fd, data, at))[1])
    else:
        real = libhdf5.write_hdf5
        monkeypatch.setattr(libhdf5, "write_hdf5", lambda *a, **k: (calls.append(a[2].shape[0]), real(*a, **k))[1])
    t = torch.randn(64, 33, device=device).t()  # 33 x 64, non-contiguous
    monkeypatch.setattr(libhdf5, "BLOCK_BYTES", 10 * 64 * 4)
    th5.save({"t": t}, tmp_path / "b.h5")
    # 33 rows of 256 bytes in blocks of 10 rows: 4 writes, the last one partial
    assert calls[:4] == [10, 10, 10, 3]
    out = th5.load(tmp_path / "b.h5")["t"]
    assert torch.equal(out, t.cpu()) and out.stride() == t.stride()


def test_parameters_keep_requires_grad(tmp_path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    th5.save({"p": p, "q": q, "t": torch.ones(1)}, tmp_path / "p.h5")
    out = th5.load(tmp_path / "p.h5")
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert isinstance(out["q"], torch.nn.Parameter) and not out["q"].requires_grad
    assert type(out["t"]) is torch.Tensor


# -- saving over an existing file: its pages are released as the new file grows


def _resident_pages(fd: int) -> int | None:
    """Pages of the file behind ``fd`` that are in the page cache (mincore), None off Linux."""
    import ctypes
    import mmap

    size = os.fstat(fd).st_size
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: mapping it faults nothing in
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            if mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                return None
        finally:
            del anchor
        return sum(v & 1 for v in vec)
    finally:
        mm.close()


def _cached_file(path, nbytes: int) -> int:
    """Write ``nbytes`` to ``path``, flush them to disk (clean pages can be dropped) and read
    them back into the cache; returns an open descriptor."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, 1 << 20):
        pass
    return fd


def _drops_cache(tmp_path) -> bool:
    """Whether this file system drops clean pages on POSIX_FADV_DONTNEED (tmpfs does not)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = _cached_file(tmp_path / "probe.bin", 1 << 20)
    try:
        before = _resident_pages(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after = _resident_pages(fd)
    finally:
        os.close(fd)
        os.unlink(tmp_path / "probe.bin")
    return before is not None and after is not None and before > 200 and after < 20


def test_save_over_a_file_releases_its_cached_pages(tmp_path) -> None:
    if not _drops_cache(tmp_path):
        pytest.skip("no mincore / this file system keeps clean pages on POSIX_FADV_DONTNEED")
    path = tmp_path / "ckpt.h5"
    old = _cached_file(path, 8 << 20)
    try:
        assert _resident_pages(old) >= 2000
        new = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB in all
        th5.save(new, path)
        assert _resident_pages(old) < 100  # the replaced inode, still open here
        assert_same(th5.load(path), new)
    finally:
        os.close(old)


def test_save_over_a_file_keeps_its_pages_when_release_is_off(tmp_path, monkeypatch) -> None:
    if not _drops_cache(tmp_path):
        pytest.skip("no mincore / this file system keeps clean pages on POSIX_FADV_DONTNEED")
    monkeypatch.setattr(th5.writer, "RELEASE_REPLACED", False)
    path = tmp_path / "ckpt.h5"
    old = _cached_file(path, 8 << 20)
    try:
        th5.save({"w": torch.randn(2048, 1024)}, path)
        assert _resident_pages(old) >= 2000
    finally:
        os.close(old)


def test_released_ranges_follow_the_bytes_written(tmp_path, monkeypatch) -> None:
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise")
    path = tmp_path / "ckpt.h5"
    th5.save({"x": torch.ones(10)}, path)
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    mib = 1 << 20
    sd = {"a": torch.randn(256, 1024), "b": torch.zeros(3, dtype=torch.int64), "c": torch.randn(1024, 384).t(),
          "d": torch.randn(64, 1024), "arr": np.arange(500, dtype="float64")}
    th5.save(sd, path)
    # back to back from 0, each ending on a 2 MiB boundary at or past the bytes written so far:
    # a (1 MiB) -> 2 MiB; c (1.5) -> 2.5 -> 4 MiB; d (0.25) and arr (4000 B) stay under 4 MiB;
    # the 24-byte "b" is packed, not a dataset of its own
    assert calls == [(0, 2 * mib), (2 * mib, 2 * mib)]
    calls.clear()
    th5.save(sd, tmp_path / "new.h5")  # nothing to replace: nothing released
    assert calls == []


def test_failed_save_over_a_released_file_leaves_it_intact(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ckpt.h5"
    old = {f"w{i}": torch.randn(128, 1024) for i in range(4)}
    th5.save(old, path)
    before = path.read_bytes()
    real = th5.io.pwrite_all
    count = [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if count[0] == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(th5.io, "pwrite_all", failing)
    with pytest.raises(OSError, match="ckpt.h5: cannot write key 'w2' \\(no space left on the device\\).*nothing"):
        th5.save({f"w{i}": torch.zeros(128, 1024) for i in range(4)}, path)
    assert path.read_bytes() == before and _files(tmp_path) == ["ckpt.h5"]
    assert_same(th5.load(path), old)


def test_save_over_a_directory_fails_and_leaves_it(tmp_path) -> None:
    (tmp_path / "d.h5").mkdir()
    with pytest.raises(OSError):
        th5.save({"a": torch.ones(3)}, tmp_path / "d.h5")
    assert (tmp_path / "d.h5").is_dir() and _files(tmp_path) == ["d.h5"]


# ---------------------------------------------------------------------------- O_DIRECT writes


def _direct_state() -> dict[str, torch.Tensor]:
    """Tensors whose data start at unaligned offsets and span the bounce buffer: a head and a
    tail written buffered around a direct middle, some under the direct minimum."""
    g = torch.Generator().manual_seed(11)
    return {"small": torch.randn(7, generator=g), "a": torch.randn(2**18 + 3, generator=g),  # 1 MiB + 12 B
            "b16": torch.randn(3 * 2**20 + 1, generator=g).to(torch.bfloat16),
            "big": torch.randn(5 * 2**20 + 5, generator=g),  # ~20 MiB: three bounce-buffer rounds
            "under": torch.randn(2**18 - 1, generator=g), "t": torch.randn(1024, 700, generator=g).t()}


def _failing_direct_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> set[int]:
    """Make every write to an O_DIRECT descriptor that DirectWrites opens fail with errno
    ``code``; returns the set those descriptors are added to."""
    real_pwrite, real_open = os.pwrite, files.DirectWrites.open
    direct_fds: set[int] = set()

    def track(cls, path, fd):
        d = real_open(path, fd)
        if d is not None:
            direct_fds.add(d._dfd)
        return d

    def failing(fd, data, offset):
        if fd in direct_fds:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(files.DirectWrites, "open", classmethod(track))
    monkeypatch.setattr(os, "pwrite", failing)
    return direct_fds


def test_direct_writes_round_trip_and_bypass_the_buffered_descriptor(tmp_path, monkeypatch) -> None:
    made = []
    real_open = files.DirectWrites.open
    monkeypatch.setattr(files.DirectWrites, "open", classmethod(lambda cls, p, fd: made.append(real_open(p, fd)) or made[-1]))
    sd = _direct_state()
    th5.save(sd, tmp_path / "d.h5", direct=True)
    assert len(made) == 1
    if made[0] is None:
        pytest.skip("this file system refuses O_DIRECT")
    large = sum(v.nbytes for k, v in sd.items() if k in ("a", "b16", "big", "t"))  # 1 MiB or more ("t" in row blocks)
    assert large - 4 * 2 * files.DIRECT_ALIGN <= made[0].direct_bytes <= large
    assert_same(th5.load(tmp_path / "d.h5", verify=True), sd)
    assert th5.load(tmp_path / "d.h5", mmap=True)["big"].equal(sd["big"])


def test_direct_is_the_default_with_sync_only(tmp_path, monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(files.DirectWrites, "open", classmethod(lambda cls, p, fd: asked.append(p)))
    th5.save({"x": torch.ones(3)}, tmp_path / "a.h5")
    assert asked == []
    th5.save({"x": torch.ones(3)}, tmp_path / "b.h5", sync=True)
    assert len(asked) == 1
    th5.save({"x": torch.ones(3)}, tmp_path / "c.h5", sync=True, direct=False)
    assert len(asked) == 1


def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path, monkeypatch) -> None:
    """O_DIRECT refused when opening (tmpfs), or by the first direct write (EINVAL): the save
    still writes every byte, buffered."""
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    sd = _direct_state()
    monkeypatch.setattr(os, "open", refuse)
    th5.save(sd, tmp_path / "a.h5", direct=True)
    monkeypatch.setattr(os, "open", real_open)
    assert_same(th5.load(tmp_path / "a.h5", verify=True), sd)
    with monkeypatch.context() as m:
        _failing_direct_writes(m, errno.EINVAL)
        th5.save(sd, tmp_path / "b.h5", direct=True)
    assert_same(th5.load(tmp_path / "b.h5", verify=True), sd)


def test_a_failed_direct_write_fails_the_save_and_keeps_the_earlier_file(tmp_path, monkeypatch) -> None:
    th5.save({"old": torch.ones(2)}, tmp_path / "f.h5")
    with monkeypatch.context() as m:
        direct_fds = _failing_direct_writes(m, errno.EIO)
        with pytest.raises(th5.WriteError):
            th5.save(_direct_state(), tmp_path / "f.h5", direct=True)
    if direct_fds:
        assert_same(th5.load(tmp_path / "f.h5"), {"old": torch.ones(2)})
        assert sorted(os.listdir(tmp_path)) == ["f.h5"]
