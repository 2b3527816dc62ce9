"""HTTP servers that never finish (issue #30, item 3): an answer whose body has no end, one that
drips a byte every 0.5 s, a redirect whose body has no end, a 200 without a length to a range
request, a Content-Length longer than the range. Each load and open ends within its deadlines
(lowered to DEADLINE s) in bounded memory, with the right tensors or a RemoteError naming the
URL, on both clients. Each case runs in a child process with its address space limited (its
size then + 1 GiB): a client reading without end meets MemoryError there, not in the suite.

The server is this module's own, on 127.0.0.1, with raw sockets: it serves the file honestly
at /plain/x.h5, and at /x.h5 answers the GETs of its scope hostilely ("data": every GET but the
header's ``bytes=0-63``, so that opening reaches the range reads of the client under test;
"all": the header's too, read on fsspec's session whichever the client)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

DEADLINE = 2.0
"""remote.REQUEST_DEADLINE in the children (seconds)."""

DRIP = 0.5
"""Seconds between the bytes of a dripping answer."""

MEMORY = 256 << 20
"""Bytes a child's peak resident size may grow by while loading and opening (the file is 0.5 MB)."""

ROOT = Path(__file__).resolve().parents[1]

_JUNK = b"\xa5" * 65536


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` asked for by a ``Range`` header (``end`` exclusive), None for none."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", (header or "").strip())
    if m is None:
        return None
    if not m.group(1):
        return max(0, size - int(m.group(2))), size
    return int(m.group(1)), min(size, int(m.group(2)) + 1) if m.group(2) else size


class HostileServer:
    """Serves ``data`` at /plain/x.h5 and, at /x.h5, answers the GETs of ``scope`` as ``case``
    says: "endless" (206, the range's bytes, no length, then junk without end), "drip" (206,
    right headers, a byte every :data:`DRIP` s), "redirect" (302 to /plain/x.h5, a body
    without end), "ignored" (200, no length, the file then junk without end), "long" (206,
    Content-Length 1 TiB, the range's bytes then junk without end). HEADs are answered
    honestly."""

    def __init__(self, data: bytes, case: str, scope: str) -> None:
        self.data, self.case, self.scope = data, case, scope
        self.asked: list[tuple[str, str, str, str]] = []  # (method, path, range, user agent) of each request
        self._stopping = threading.Event()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/x.h5"

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        try:
            while not self._stopping.is_set():
                while b"\r\n\r\n" not in buf:
                    got = conn.recv(65536)
                    if not got:
                        return
                    buf += got
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
                self.asked.append((method, path, headers.get("range", ""), headers.get("user-agent", "")))
                if not self._answer(conn, method, path, headers.get("range")):
                    return
        except OSError:  # the client hung up: as it should on a hostile answer
            pass
        finally:
            conn.close()

    def _send(self, conn: socket.socket, status: str, headers: dict[str, str | int]) -> None:
        lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers.items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _without_end(self, conn: socket.socket, first: bytes) -> bool:
        """Send ``first``, then junk until the client hangs up (or the server stops)."""
        conn.sendall(first)
        while not self._stopping.is_set():
            conn.sendall(_JUNK)
        return False

    def _answer(self, conn: socket.socket, method: str, path: str, range_header: str | None) -> bool:
        """Answer one request; False where the connection is done."""
        size = len(self.data)
        asked = _range(range_header, size)
        hostile = method == "GET" and path == "/x.h5" and (self.scope == "all" or range_header != "bytes=0-63")
        if path not in ("/x.h5", "/plain/x.h5"):
            self._send(conn, "404 Not Found", {"Content-Length": 0})
            return True
        if not hostile:
            if method == "HEAD":
                self._send(conn, "200 OK", {"Content-Length": size, "Accept-Ranges": "bytes"})
                return True
            start, end = asked if asked is not None else (0, size)
            if asked is None:
                self._send(conn, "200 OK", {"Content-Length": size})
            else:
                self._send(conn, "206 Partial Content", {"Content-Range": f"bytes {start}-{end - 1}/{size}",
                                                         "Content-Length": end - start})
            conn.sendall(self.data[start:end])
            return True
        start, end = asked if asked is not None else (0, size)
        part = self.data[start:end]
        content_range = f"bytes {start}-{end - 1}/{size}"
        if self.case == "endless":
            self._send(conn, "206 Partial Content", {"Content-Range": content_range, "Connection": "close"})
            return self._without_end(conn, part)
        if self.case == "drip":
            self._send(conn, "206 Partial Content", {"Content-Range": content_range, "Content-Length": len(part)})
            for i in range(len(part)):
                if self._stopping.wait(DRIP):
                    break
                conn.sendall(part[i:i + 1])
            return False
        if self.case == "redirect":
            self._send(conn, "302 Found", {"Location": "/plain/x.h5", "Connection": "close"})
            return self._without_end(conn, b"moved")
        if self.case == "ignored":
            self._send(conn, "200 OK", {"Connection": "close"})
            return self._without_end(conn, self.data)
        if self.case == "long":
            self._send(conn, "206 Partial Content", {"Content-Range": content_range, "Content-Length": 1 << 40})
            return self._without_end(conn, part)
        raise AssertionError(self.case)


_CHILD = r"""
import json, os, resource, sys, time
import torch
import tensorstore_h5 as th5
from tensorstore_h5.storage import remote
import fsspec, aiohttp, fsspec.implementations.http  # imported before the limits: not counted

url, local, client = sys.argv[1:4]
remote.REQUEST_DEADLINE = float(os.environ["TH5_TEST_DEADLINE"])
remote.REQUEST_MIN_RATE = 1 << 40  # the deadline is REQUEST_DEADLINE, whatever the size
remote.PLAIN_HTTP = client == "plain"
remote.CONNECTIONS = 8
remote.BACKOFF = 0.01
expected = th5.load(local)

vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), hard))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def opened():
    with th5.open(url) as s:
        return {k: s[k].read() for k in s.keys()}


for what, run in (("load", lambda: th5.load(url)), ("open", opened)):
    t0 = time.monotonic()
    try:
        out = run()
        result = {"ok": sorted(out) == sorted(expected) and all(torch.equal(out[k], expected[k]) for k in expected)}
    except BaseException as e:
        result = {"error": type(e).__name__, "remote_error": isinstance(e, remote.RemoteError),
                  "message": str(e)[:2000]}
    result.update(what=what, seconds=time.monotonic() - t0,
                  grew=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)
    print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 0.5 MB file: longer than remote.TAIL_BYTES, so that a load reads ranges past the tail."""
    g = torch.Generator().manual_seed(30)
    path = tmp_path_factory.mktemp("hostile") / "x.h5"
    th5.save({f"w{i}": torch.randn(128, 256, generator=g) for i in range(4)}, path)
    return path


CASES = {  # case: what a load and an open end with
    "endless": "ok",      # the range's bytes are read, the rest is not: the connection is dropped
    "drip": "deadline",   # a RemoteError after the deadline, not one 0.5 s read timeout after another
    "redirect": "ok",     # the redirect's body is not read; its target is
    "ignored": "refused",  # a 200 to a range request is refused unread
    "long": "refused",     # a length other than the range's is refused unread
}


@pytest.mark.parametrize("client, scope", [("plain", "data"), ("fsspec", "data"), ("fsspec", "all")],
                         ids=["plain-client", "fsspec-client", "opening"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_server_that_never_finishes_costs_a_deadline_not_a_hang(checkpoint, case, client, scope) -> None:
    server = HostileServer(checkpoint.read_bytes(), case, scope)
    limit = 3 * DEADLINE + 3  # each of load and open: the tail's and the layout's deadlines, and slack
    try:
        env = dict(os.environ, TH5_TEST_DEADLINE=str(DEADLINE), MALLOC_ARENA_MAX="2",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, server.url(), str(checkpoint), client],
                                  capture_output=True, text=True, timeout=2 * limit + 30, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{case}: the child did not end within {e.timeout:.0f} s (stdout: {e.stdout!r:.500})")
        took = time.monotonic() - t0
    finally:
        server.stop()
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["what"] for r in results] == ["load", "open"], (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    for r in results:
        where = f"{case}, {r['what']}: {r}"
        assert r["seconds"] < limit, where
        assert r["grew"] < MEMORY, where
        if CASES[case] == "ok":
            assert r.get("ok") is True, where
        else:
            assert r.get("remote_error") is True and server.url() in r["message"], where
            words = "deadline" if CASES[case] == "deadline" else "ignored the byte range"
            assert words in r["message"], where
    if scope == "data":  # the range reads of the client under test met hostile answers (aiohttp names itself)
        reads = [ua for m, p, r, ua in server.asked if m == "GET" and p == "/x.h5" and r.startswith("bytes=")
                 and not r.startswith("bytes=-") and r != "bytes=0-63"]
        assert reads and all(("aiohttp" in ua) == (client == "fsspec") for ua in reads), server.asked
    print(f"{case} ({client}, {scope}): child {took:.1f} s; " + ", ".join(
        f"{r['what']} {r['seconds']:.2f} s, +{r['grew'] >> 20} MiB" for r in results))
