"""Where the time of load(device="cuda") goes, on a GPU machine: first and repeated calls,
load_into, staging sizes, ways to pin, a profile, and ("small") the 6,000-tensor optimizer
state of the bench's GPU group. Prints figures only;
python bench/gpu_phases.py [GB [PHASE[@ENV=VALUE] ...]]."""
from __future__ import annotations

import cProfile
import os
import pstats
import subprocess
import sys
import time

import torch

PATH = "/tmp/gpu_phases.h5"
SMALL = "/tmp/gpu_phases_optim.h5"  # phase "small": the bench's optimizer state of 6,000 tensors


def timed(f):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = f()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, r


def profiled(f, top: int) -> None:
    """Run ``f`` once under cProfile and print its ``top`` costliest functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    timed(f)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def child(what: str) -> None:
    import tensorstore_h5 as th5
    from tensorstore_h5.storage import memory, parallel
    from tensorstore_h5 import transfer

    th5._import_all()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    n = os.path.getsize(PATH)
    if what == "alloc":
        s, _ = timed(lambda: [torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(4)])
        print(f"  first pinned 4 x 32 MiB: {s * 1e3:.1f} ms")
        with th5.open(PATH) as st:
            shapes = [(st[k].shape, st[k].dtype) for k in st.keys()]
        s, _ = timed(lambda: [torch.empty(sh, dtype=dt, device="cuda") for sh, dt in shapes])
        print(f"  first cuda empty of every tensor: {s * 1e3:.1f} ms")
        return
    if what == "pinning":  # first-use cost by size, and whether reads run while the main thread pins
        for mib in (1, 8, 32, 64):
            s, _ = timed(lambda: torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True))
            print(f"  first pin of {mib} MiB: {s * 1e3:.1f} ms")
        buf = torch.empty(512 << 20, dtype=torch.uint8)
        buf.fill_(0)
        view = memory.tensor_buffer(buf)
        fd = os.open(PATH, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            parallel.run_jobs([lambda a=a: os.preadv(fd, [view[a:a + (64 << 20)]], a) for a in range(0, 512 << 20, 64 << 20)])
            alone = time.perf_counter() - t0
            jobs = parallel.submit_jobs([lambda a=a: os.preadv(fd, [view[a:a + (64 << 20)]], a) for a in range(0, 512 << 20, 64 << 20)])
            t0 = time.perf_counter()
            pinned = torch.empty(128 << 20, dtype=torch.uint8, pin_memory=True)
            pin = time.perf_counter() - t0
            parallel.wait_all(jobs)
            both = time.perf_counter() - t0
        finally:
            os.close(fd)
        print(f"  read 512 MiB alone {alone * 1e3:.1f} ms; pin 128 MiB {pin * 1e3:.1f} ms while reading, both done "
              f"{both * 1e3:.1f} ms (overlapped if close to max, not the sum) {pinned.numel()}")
        return
    if what == "pinways":  # ways to get 2 x 64 MiB of page-locked memory the first time in a process
        import mmap

        mib = 64 << 20
        s, bufs = timed(lambda: [torch.empty(mib, dtype=torch.uint8, pin_memory=True) for _ in range(2)])
        print(f"  torch pin_memory (cudaHostAlloc) 2 x 64 MiB: {s * 1e3:.1f} ms")
        src = bufs[0]
        dst = torch.empty(mib, dtype=torch.uint8, device="cuda")
        s, _ = timed(lambda: dst.copy_(src, non_blocking=True))
        print(f"    H2D 64 MiB from it: {s * 1e3:.2f} ms")
        cudart = torch.cuda.cudart()
        for how in ("empty+fill", "empty+threads", "mmap+hugepage"):
            t0 = time.perf_counter()
            if how == "mmap+hugepage":
                mm = mmap.mmap(-1, mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                mm.madvise(mmap.MADV_HUGEPAGE)
                buf = torch.frombuffer(mm, dtype=torch.uint8)
            else:
                buf = torch.empty(mib, dtype=torch.uint8)
            if how == "empty+threads":
                step = mib // 8
                parallel.run_jobs([lambda a=a: buf[a:a + step].fill_(0) for a in range(0, mib, step)])
            else:
                buf.fill_(0)
            t1 = time.perf_counter()
            err = cudart.cudaHostRegister(buf.data_ptr(), mib, 0)
            t2 = time.perf_counter()
            s, _ = timed(lambda: dst.copy_(buf, non_blocking=True))
            print(f"  {how}: allocate+touch {1e3 * (t1 - t0):.1f} ms, cudaHostRegister {1e3 * (t2 - t1):.1f} ms "
                  f"(rc {err}), is_pinned {buf.is_pinned()}, H2D 64 MiB {s * 1e3:.2f} ms, "
                  f"equal {bool(torch.equal(dst[:4096].cpu(), buf[:4096]))}")
            cudart.cudaHostUnregister(buf.data_ptr())
        return
    if what.startswith("first"):  # the first load in a fresh process: staging N x M MiB
        cfg, _, pin = what.split(":")[1].partition("/")  # first:2x64/torch pins through torch's pin_memory
        nb, sz = cfg.split("x")
        transfer.STAGING_BUFFERS, transfer.STAGING_BYTES = int(nb), int(sz) << 20
        transfer.PIN_BY_REGISTER = pin != "torch"
        s0, _ = timed(lambda: th5.load(PATH, device="cuda"))
        s1, _ = timed(lambda: th5.load(PATH, device="cuda"))
        print(f"  {what}: first call {s0 * 1e3:.1f} ms ({n / s0 / 1e9:.2f} GB/s), second {s1 * 1e3:.1f} ms")
        return
    if what == "small":  # many small tensors: the first and second load, then where a load's time goes
        m = os.path.getsize(SMALL)
        s0, _ = timed(lambda: th5.load(SMALL, device="cuda"))
        s1, _ = timed(lambda: th5.load(SMALL, device="cuda"))
        print(f"  small (6,000 tensors, {m / 1e9:.2f} GB): first call {s0 * 1e3:.1f} ms ({m / s0 / 1e9:.2f} GB/s), "
              f"second {s1 * 1e3:.1f} ms")
        profiled(lambda: th5.load(SMALL, device="cuda"), 8)
        return
    if what.startswith("load"):
        if ":" in what:
            nb, sz = what.split(":")[1].split("x")
            transfer.STAGING_BUFFERS, transfer.STAGING_BYTES = int(nb), int(sz) << 20
        for i in range(4):
            s, _ = timed(lambda: th5.load(PATH, device="cuda"))
            print(f"  {what} call {i}: {s * 1e3:.1f} ms  {n / s / 1e9:.2f} GB/s")
        profiled(lambda: th5.load(PATH, device="cuda"), 6)
        return
    if what == "into":
        tgt = th5.load(PATH, device="cuda")
        for i in range(3):
            s, _ = timed(lambda: th5.load_into(tgt, PATH))
            print(f"  load_into call {i}: {s * 1e3:.1f} ms  {n / s / 1e9:.2f} GB/s")
        return
    if what == "threads":
        for t in (2, 4, 8, 16):
            parallel.IO_THREADS = t
            s, _ = timed(lambda: th5.load(PATH, device="cuda"))
            print(f"  IO_THREADS={t}: {s * 1e3:.1f} ms  {n / s / 1e9:.2f} GB/s")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(sys.argv[2])
        return
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    import tensorstore_h5 as th5

    per = int(gb * 1e9 / 300 / 4)
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.w": torch.randn(per, generator=g) for i in range(300)}
    th5.save(sd, PATH)
    del sd
    print(f"file {os.path.getsize(PATH) / 1e9:.2f} GB, {os.cpu_count()} cores")
    firsts = [f"first:{c}" for c in ("2x64", "2x64/torch", "2x32") for _ in range(2)]
    whats = sys.argv[2:] or ("alloc", "pinning", "pinways", *firsts, "load", "load:4x64", "into", "threads", "small")
    if any(w.partition("@")[0] == "small" for w in whats):
        from tensorstore_h5.bench.synthetic import bench_optimizer_state

        th5.save(bench_optimizer_state(int(gb * 1e9 / 4)), SMALL)
    for what in whats:  # NAME@ENV=VALUE runs phase NAME with that environment variable set
        print(what)
        what, _, env = what.partition("@")
        environ = dict(os.environ, **dict([env.split("=", 1)])) if env else None
        r = subprocess.run([sys.executable, __file__, "child", what], capture_output=True, text=True, timeout=200,
                           env=environ)
        print(r.stdout[-4000:], r.stderr[-1500:])


if __name__ == "__main__":
    main()
