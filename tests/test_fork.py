"""Forked children (DataLoader workers with the fork start method, multiprocessing pools) read
through what the parent opened: the library's threads and locks are made anew in the child.
Each case runs in a subprocess with a time limit, since the failure it guards against is a
hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs fork")

_PRELUDE = """
import gc, multiprocessing, sys, threading
import torch
import tensorstore_h5 as th5
path = sys.argv[1]
torch.manual_seed(0)
sd = {f"w{i}": torch.randn(256, 1024) for i in range(8)}
th5.save(sd, path, compression="zstd")
"""


def _run(tmp_path: Path, body: str, timeout: float = 90) -> str:
    script = tmp_path / "child.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "c.h5")], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s: {e.stdout} {e.stderr}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dataloader_fork_workers_read_a_compressed_store_the_parent_read(tmp_path: Path) -> None:
    out = _run(tmp_path, """
        from torch.utils.data import DataLoader, Dataset
        store = th5.open(path)
        h = store["w0"]
        assert torch.equal(h[...], sd["w0"]) and torch.equal(h.read(), sd["w0"]) and torch.equal(h[3:9], sd["w0"][3:9])

        class Rows(Dataset):
            def __len__(self): return 8
            def __getitem__(self, i): return store[f"w{i}"][2:5], store[f"w{i}"].read()

        loader = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        for b, (rows, whole) in enumerate(loader):
            for j in range(2):
                i = 2 * b + j
                assert torch.equal(rows[j], sd[f"w{i}"][2:5]) and torch.equal(whole[j], sd[f"w{i}"])
        print("ok", b + 1)
    """)
    assert out.split() == ["ok", "4"]


def test_fork_pool_loads_after_the_parent_loaded(tmp_path: Path) -> None:
    out = _run(tmp_path, """
        th5.load(path)  # the I/O threads are running now

        def child(k):
            got = th5.load(path, select=[f"w{k}"])[f"w{k}"]
            return bool(torch.equal(got, sd[f"w{k}"]))

        with multiprocessing.get_context("fork").Pool(2) as pool:
            print(pool.map(child, range(8)))
    """)
    assert out.strip() == str([True] * 8)


def test_fork_while_another_thread_pauses_gc_leaves_the_child_collecting(tmp_path: Path) -> None:
    # A thread of the parent is inside a load (the collector paused) when the fork happens: in
    # the child that thread does not exist and its pause must not last forever.
    out = _run(tmp_path, """
        from tensorstore_h5.storage import memory
        inside, leave = threading.Event(), threading.Event()

        def loading():
            with memory.gc_paused():
                inside.set()
                leave.wait()

        t = threading.Thread(target=loading)
        t.start()
        inside.wait()
        assert not gc.isenabled()
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=lambda: q.put((gc.isenabled(), bool(torch.equal(th5.load(path)["w1"], sd["w1"])))))
        p.start()
        print(q.get(timeout=60))
        p.join()
        leave.set()
        t.join()
        print(gc.isenabled())
    """)
    assert out.split("\n")[:2] == ["(True, True)", "True"]

