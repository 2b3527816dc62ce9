"""The options of ``tensorstore-h5 bench`` (torch-free, so ``bench --help`` answers at once)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_arguments"]


def add_arguments(p: Any) -> None:
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (10**9 bytes)")
    p.add_argument("--keys", type=int, default=300, help="about how many tensors")
    p.add_argument("--repeat", type=int, default=3, help="runs per contender (best and median are reported)")
    p.add_argument("--only", help="comma-separated substrings of contender names")
    p.add_argument("--dir", help="where to put the files (made if missing; default: the temp dir)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds from one worker's exit (or its set-up's removing a file) to the timed operation "
                        "of a read or a write (default: 3 on a VM that reports free memory to its hypervisor, "
                        "else 0; 0: no wait)")
    p.add_argument("--profile", type=int, nargs="?", const=25, default=0, metavar="N",
                   help="run each operation under cProfile and print the N (default 25) costliest functions "
                        "of each contender's fastest run; use with --only")
    p.add_argument("--compression", action="store_true", help="measure the compression presets on real weights instead")
    p.add_argument("--past-ram", action="store_true",
                   help="a checkpoint larger than RAM (28 GB unless --size-gb says otherwise), written key by key, "
                        "then streamed, selected from, row-sliced and converted to safetensors cold, with peak RSS "
                        "(root; needs twice that much disk)")
    p.add_argument("--remote", action="store_true",
                   help="measure loads over HTTP (a loopback server, with and without 20 ms latency) instead; "
                        "0.5 GB unless --size-gb says otherwise")
    p.add_argument("--distributed", action="store_true",
                   help="measure DCP save/load through tensorstore_h5.distributed against FileSystemWriter/Reader, "
                        "1 and 2 ranks (1 GiB of 64 tensors unless --size-gb/--keys say otherwise)")
    p.add_argument("--ranks", default="1,2", help="with --distributed: comma-separated numbers of ranks")
    p.add_argument("--sync-files", action="store_true",
                   help="with --distributed: both writers fsync every file (DCP's default; tensorstore_h5 then writes "
                        "with O_DIRECT)")
    p.add_argument("--cold-loads", action="store_true",
                   help="with --distributed: drop the page cache before every load (root) instead of reading the "
                        "checkpoint's files once")
    p.add_argument("--first-call", action="store_true",
                   help="add the first-call contenders (F.): fresh processes, the library's import included, and CLI "
                        "commands against the interpreter's start")
    p.add_argument("--diff", action="store_true",
                   help="add the diff contenders (D.): th5.diff of two checkpoints and th5.stats of one against "
                        "loading them whole with safetensors and comparing in a loop")
    p.add_argument("--gpu", action="store_true", help="add the CUDA contenders (G.): loads to the GPU against their limits")
    p.add_argument("--cold", action="store_true",
                   help="add the cold-cache contenders (C.; root drops the page cache before each) against the disk's "
                        "O_DIRECT and buffered read limits")
