"""The mutation fuzzer's HTTP surface (issue #30): a loopback server that serves a valid
format-2 file and answers some of the requests for it hostilely, read through every public
read path of a URL in the fuzzer's limited worker, with either client (the plain one,
``remote.PLAIN_HTTP = True``, and fsspec's aiohttp session).

The server (threads of the fuzzing process, raw sockets on 127.0.0.1) serves each case at
``/c<n>/x.h5``; which requests a case answers hostilely (all, the n-th, each with a
probability, only range GETs past the header, only HEADs) and how:

- ``status``: another status (1xx, 204, 206 without a range, 3xx without Location, 4xx, 5xx, 999);
- ``content-range``: the body of the range asked for, named as another range, another total,
  ``*``, malformed; or another range's bytes, named as such;
- ``length``: Content-Length missing, shorter, longer, doubled, negative, not a number, huge;
- ``short`` / ``long``: a body cut short (closed, or left hanging), or followed by junk or by a
  smuggled second answer on the kept-alive connection;
- ``drip`` / ``stall``: the body a few bytes at a time, or nothing after the headers (or
  before them), until the client gives up (the server stops after 3 deadlines);
- ``redirect``: to itself (a loop), to an honest copy, to another file of the same size, a
  chain longer than the client follows, relative, scheme-relative, to a closed port, to a
  scheme that is not HTTP, without a target; with bodies;
- ``headers``: a damaged status line, header lines without a colon, with NUL or non-Latin-1
  bytes, folded, too long, too many, Content-Encoding gzip, a doubled Content-Range;
- ``chunked``: Transfer-Encoding chunked, honest or with chunk sizes that lie, garbage sizes, no
  last chunk, also with a Content-Length;
- ``reset``: part of the body, then a connection reset; or no answer at all;
- ``other-bytes``: right headers, the bytes of another file of the same size or of the same
  file a few bytes off;
- ``head``: the HEAD's size wrong (shorter, longer, 0, negative, huge, missing), a weak,
  changing or missing ETag, 412 to ``If-Match``.

The worker reads each case through two of the public calls (:data:`CALLS`, drawn per case,
as is the client: a hostile answer costs up to a deadline per request, so a case does not run
them all): ``th5.load(url)``, ``th5.open(url)`` (keys, then of three tensors a whole read, a
row slice or a row slice with ``verify=True``), ``read_many`` with and without ``verify``,
``items`` and ``th5.load_into``; with ``remote.REQUEST_DEADLINE`` lowered to :data:`DEADLINE`
(and ``BACKOFF``, ``CONNECTIONS``), and random ``TAIL_BYTES``, ``MAX_GAP``, ``REQUEST_BYTES`` and
``DIRECT_BYTES``, so that the header, tail, layout and data requests all meet the answers. How
a request is answered is drawn from the request itself (method, range, how often it was
asked), not from the order of concurrent requests, so a kept case replays the same answers.

The property: every call raises a TensorStoreError (``RemoteError`` for the server's doing)
naming the URL, within :data:`CALL_LIMIT` (a few deadlines: one per stage of a read, times the
tries of a transient error), or returns exactly the saved values. A case whose answers can be
self-consistent lies (another file's bytes under the right headers, a smuggled answer, a lying
chunked body, a redirect to another file) may give other values only where the library does
not promise to notice: an unchecked slice (SECURITY.md: checksums are checked on every read
of whole tensors, on slices with ``verify=True``); checked reads must still be exact (or, for
every request lied to alike, the other file's values). No crash, no hang, no memory that no
read filled (canary), and the worker's peak resident memory grows by less than :data:`MEMORY`.

    python tests/hostile/fuzz.py run --surface http --seconds 300 --out findings/
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEADLINE = float(os.environ.get("TH5_FUZZ_HTTP_DEADLINE", "1.0"))
"""``remote.REQUEST_DEADLINE`` in the worker (seconds; the library's default is 120)."""
CALL_LIMIT = 20 * DEADLINE + 5
"""Seconds one public call may take: a few stages (open, layout, data), each request at most
(RETRIES + 1) tries of at most a deadline each (a transient error after a slow partial answer)."""
CALLS = ("load", "open", "read_many", "read_many(verify)", "items", "load_into")
"""The public calls of a case: two of them, drawn per case (see :func:`check_case`)."""
MEMORY = 256 << 20
"""Bytes the worker's peak resident size may grow by in one case (the file is ~60 KB)."""
ETAG = '"th5-fuzz-etag"'
_JUNK = b"\xa5" * 4096

LYING = ("other-bytes", "smuggle", "chunked-lie", "redirect-other")
"""Answers that can be self-consistent lies: a slice read without checksums may return their bytes."""


# ---------------------------------------------------------------------------- the served files


def seed_object(which: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7 if which == "x" else 8)
    smooth = torch.randn(128, 64, generator=g) * 0.02
    return {"w": torch.randn(48, 96, generator=g), "v": torch.randn(300, generator=g),
            "b": torch.randn(32, 32, generator=g).to(torch.bfloat16), "c": smooth.clone(),
            "z": smooth[:64].to(torch.bfloat16), "s": torch.tensor(7), "e": torch.empty(0, 3),
            "t": torch.randn(24, 16, generator=g).t(), "n": 5}


def make_files(d: Path) -> tuple[Path, Path]:
    """The served file ``x.h5`` and another of the same size, ``other.h5`` (other values)."""
    import tensorstore_h5 as th5

    paths = []
    for which in ("x", "other"):
        p = d / f"{which}.h5"
        th5.save(seed_object(which), p, compression=lambda k, t: {"c": "lz4", "z": "zstd"}.get(k), chunk_bytes=8192)
        paths.append(p)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------- hostile answers


_STATUSES = ["100 Continue", "101 Switching Protocols", "200 OK", "204 No Content", "206 Partial Content",
             "301 Moved Permanently", "302 Found", "304 Not Modified", "400 Bad Request", "401 Unauthorized",
             "403 Forbidden", "404 Not Found", "408 Request Timeout", "412 Precondition Failed",
             "416 Range Not Satisfiable", "429 Too Many Requests", "500 Internal Server Error", "502 Bad Gateway",
             "503 Service Unavailable", "504 Gateway Timeout", "599 X", "999 Weird", "0 Zero", "-1 Neg"]
MODES = {"status": 3, "content-range": 3, "length": 3, "short": 2, "long": 1, "smuggle": 1, "drip": 1, "stall": 1,
         "redirect": 2, "redirect-other": 1, "headers": 3, "chunked": 1, "chunked-lie": 2, "reset": 2,
         "other-bytes": 2, "head": 3}
TARGETS = {"all": 2, "nth": 4, "prob": 3, "data": 3, "head": 1}


def new_spec(rng: random.Random) -> dict[str, Any]:
    """A case: how the server answers, and which requests."""
    modes = list(MODES)
    mode = rng.choices(modes, [MODES[m] for m in modes])[0]
    target = rng.choices(list(TARGETS), list(TARGETS.values()))[0]
    if mode == "head":
        target = "head"
    return {"mode": mode, "target": target, "n": rng.randrange(12), "p": rng.choice([0.2, 0.5, 0.8]),
            "seed": rng.randrange(2**31)}


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` asked for by a ``Range`` header (``end`` exclusive), None for none."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", (header or "").strip())
    if m is None:
        return None
    if not m.group(1):
        return max(0, size - int(m.group(2) or 0)), size
    return int(m.group(1)), min(size, int(m.group(2)) + 1) if m.group(2) else size


class Request:
    def __init__(self, method: str, path: str, headers: dict[str, str]) -> None:
        self.method, self.path, self.headers = method, path, headers


class FuzzServer:
    """Serves ``data`` (and ``other``, a file of the same size) for every case registered with
    :meth:`add`: ``/c<n>/x.h5`` answered as the case's spec says, ``/c<n>/plain.h5`` and
    ``/c<n>/other.h5`` honestly, ``/c<n>/hop<k>`` a redirect chain to the honest copy."""

    def __init__(self, data: bytes, other: bytes) -> None:
        self.data, self.other = data, other
        self.cases: dict[str, dict[str, Any]] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        closed = socket.create_server(("127.0.0.1", 0))
        self.closed_port = closed.getsockname()[1]  # a port nothing listens on
        closed.close()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def add(self, name: str, spec: dict[str, Any]) -> str:
        with self._lock:
            self.cases[name] = spec
            self.counts[name] = 0
        return f"http://127.0.0.1:{self.port}/{name}/x.h5"

    def drop(self, name: str) -> None:
        with self._lock:
            self.cases.pop(name, None)
            for k in [k for k in self.counts if k.split(" ", 1)[0] == name]:
                del self.counts[k]

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
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
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buf = b""
        try:
            conn.settimeout(15)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                while b"\r\n\r\n" not in buf:
                    got = conn.recv(65536)
                    if not got:
                        return
                    buf += got
                    if len(buf) > 1 << 20:
                        return
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if len(parts) < 2:
                    return
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
                if not self._answer(conn, Request(parts[0], parts[1], headers)):
                    return
        except OSError:  # the client hung up: as it should on many hostile answers
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    # -- answers

    def _send(self, conn: socket.socket, status: str, headers: list[tuple[str, Any]], body: bytes = b"",
              version: str = "HTTP/1.1") -> None:
        lines = [f"{version} {status}"] + [f"{k}: {v}" for k, v in headers]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)

    def _honest(self, conn: socket.socket, req: Request, data: bytes) -> bool:
        size = len(data)
        if req.method == "HEAD":
            self._send(conn, "200 OK", [("Content-Length", size), ("Accept-Ranges", "bytes"), ("ETag", ETAG)])
            return True
        if req.headers.get("if-match") not in (None, ETAG):
            self._send(conn, "412 Precondition Failed", [("Content-Length", 0)])
            return True
        asked = _range(req.headers.get("range"), size)
        if asked is None:
            self._send(conn, "200 OK", [("Content-Length", size), ("ETag", ETAG)], data)
            return True
        start, end = asked
        if start >= size:
            self._send(conn, "416 Range Not Satisfiable", [("Content-Range", f"bytes */{size}"), ("Content-Length", 0)])
            return True
        self._send(conn, "206 Partial Content", [("Content-Range", f"bytes {start}-{end - 1}/{size}"),
                                                 ("Content-Length", end - start), ("ETag", ETAG)], data[start:end])
        return True

    def _hold(self, conn: socket.socket, first: bytes = b"", drip: bytes = b"", every: float = 0.05) -> bool:
        """Send ``first``, then ``drip`` a few bytes at a time (or nothing), until the client
        hangs up or 3 deadlines pass."""
        conn.sendall(first)
        until = time.monotonic() + 3 * DEADLINE + 1
        i = 0
        while time.monotonic() < until and not self._stopping.is_set():
            if self._stopping.wait(every):
                break
            if drip:
                conn.sendall(drip[i:i + 7] or _JUNK[:7])
                i += 7
        return False

    def _answer(self, conn: socket.socket, req: Request) -> bool:
        m = re.fullmatch(r"/(c\d+)/(x\.h5|plain\.h5|other\.h5|hop(\d+))", req.path)
        with self._lock:
            spec = self.cases.get(m.group(1)) if m else None
            if spec is not None:
                k = self.counts[m.group(1)]
                self.counts[m.group(1)] = k + 1
                ident = f"{req.method} {m.group(2)} {req.headers.get('range')}"  # the request, whichever case
                seen = f"{m.group(1)} {ident}"
                again = self.counts[seen] = self.counts.get(seen, -1) + 1  # the same request asked again
        if spec is None:
            self._send(conn, "404 Not Found", [("Content-Length", 0)])
            return True
        name = m.group(2)
        if name == "plain.h5":
            return self._honest(conn, req, self.data)
        if name == "other.h5":
            return self._honest(conn, req, self.other)
        if m.group(3) is not None:
            hop = int(m.group(3))
            where = f"/{m.group(1)}/plain.h5" if hop <= 0 else f"/{m.group(1)}/hop{hop - 1}"
            self._send(conn, "302 Found", [("Location", where), ("Content-Length", 0)])
            return True
        # Decided by the request itself (and how often it was asked), not by the order of
        # concurrent requests: a kept case answers the same way when it is run again.
        rng = random.Random(f"{spec['seed']}|{ident}|{again}")
        if not self._hostile(spec, req, k, rng):
            return self._honest(conn, req, self.data)
        return _ANSWERS[spec["mode"]](self, conn, req, rng, m.group(1))

    def _hostile(self, spec: dict[str, Any], req: Request, k: int, rng: random.Random) -> bool:
        """Whether request number ``k`` of the case is answered hostilely."""
        target = spec["target"]
        if target == "head":  # the requests for the size (a HEAD, fsspec's GET without a range), and If-Match
            return req.method == "HEAD" or "range" not in req.headers or \
                spec["mode"] == "head" and "if-match" in req.headers
        if req.method == "HEAD" and spec["mode"] != "status":
            return False
        if target == "all":
            return True
        if target == "nth":
            return k == spec["n"]
        if target == "data":
            r = req.headers.get("range", "")
            return r.startswith("bytes=") and r != "bytes=0-63" and not r.startswith("bytes=-")
        return rng.random() < spec["p"]


def _asked(server: FuzzServer, req: Request) -> tuple[int, int]:
    size = len(server.data)
    asked = _range(req.headers.get("range"), size)
    return asked if asked is not None else (0, size)


def _status(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    status = rng.choice(_STATUSES)
    body = server.data[start:end] if rng.random() < 0.5 else b"<html>error</html>"
    headers: list[tuple[str, Any]] = [("Content-Length", len(body))]
    if rng.random() < 0.5:
        headers.append(("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}"))
    if status.startswith("100") or status.startswith("101"):
        conn.sendall(f"HTTP/1.1 {status}\r\n\r\n".encode())
        if rng.random() < 0.5:  # then the real answer (a client must skip a 100)
            return server._honest(conn, req, server.data)
        return False
    server._send(conn, status, headers, b"" if req.method == "HEAD" else body)
    return rng.random() < 0.5


def _content_range(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    size = len(server.data)
    d = rng.choice([-64, -1, 1, 7, 4096])
    named = rng.choice([
        f"bytes {start + d}-{end - 1 + d}/{size}", f"bytes {start}-{end - 1 + d}/{size}", f"bytes {start}-{end - 1}/*",
        f"bytes {start}-{end - 1}/{size + d}", f"bytes {start}-{end - 1}/{2**70}", f"bytes={start}-{end - 1}/{size}",
        f"bytes {end - 1}-{start}/{size}", f"items {start}-{end - 1}/{size}", f"bytes -{start}-{end - 1}/{size}",
        f"bytes  {start}-{end - 1}/{size}", "", "bytes */" + str(size), f"bytes {start}-{end - 1}/{size}, bytes 0-1/2",
        f"bytes {start}-{end - 1}/{size}\x00", f"bytes {start:+d}-{end - 1}/{size}"])
    body = server.data[start:end]
    if rng.random() < 0.3:  # another range, named as such, its own bytes
        a = max(0, min(size - 1, start + d))
        b = max(a + 1, min(size, end + d))
        named, body = f"bytes {a}-{b - 1}/{size}", server.data[a:b]
    server._send(conn, "206 Partial Content", [("Content-Range", named), ("Content-Length", len(body))], body)
    return rng.random() < 0.5


def _length(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    body = server.data[start:end]
    n = len(body)
    cr = ("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}")
    choice = rng.choice(["missing", "short", "long", "double", "negative", "nan", "huge", "spaces", "plus"])
    value: dict[str, list[Any]] = {"missing": [], "short": [max(0, n - rng.choice([1, 7, n]))],
                                   "long": [n + rng.choice([1, 7, 4096])], "double": [n, n + 1], "negative": [-n],
                                   "nan": ["abc"], "huge": [2**64 + n], "spaces": [f" {n} "], "plus": [f"+{n}"]}
    server._send(conn, "206 Partial Content", [cr] + [("Content-Length", v) for v in value[choice]], body)
    if choice in ("missing", "long"):
        return False  # the end of the body is the connection's end
    return rng.random() < 0.5


def _short(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    body = server.data[start:end]
    cut = rng.randrange(max(1, len(body)))
    server._send(conn, "206 Partial Content", [("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}"),
                                               ("Content-Length", len(body))], body[:cut])
    if rng.random() < 0.3:
        return server._hold(conn)
    return False


def _long(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    junk = _JUNK[:rng.randrange(1, 4096)]
    server._send(conn, "206 Partial Content", [("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}"),
                                               ("Content-Length", end - start)], server.data[start:end] + junk)
    return rng.random() < 0.7  # kept alive: the junk comes first on the next answer


def _smuggle(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    """The answer, then a second complete answer on the kept-alive connection, for a range the
    next request may ask (that request gets it, then its own answer follows as junk)."""
    start, end = _asked(server, req)
    size = len(server.data)
    server._send(conn, "206 Partial Content", [("Content-Range", f"bytes {start}-{end - 1}/{size}"),
                                               ("Content-Length", end - start), ("ETag", ETAG)], server.data[start:end])
    a = rng.randrange(size)
    b = min(size, a + rng.choice([64, 4096, 65536]))
    src = server.other if rng.random() < 0.5 else server.data
    server._send(conn, "206 Partial Content", [("Content-Range", f"bytes {a}-{b - 1}/{size}"),
                                               ("Content-Length", b - a), ("ETag", ETAG)], src[a:b])
    return True


def _drip(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    head = (f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end - 1}/{len(server.data)}\r\n"
            f"Content-Length: {end - start}\r\n\r\n").encode()
    if rng.random() < 0.3:  # the headers themselves a byte at a time
        return server._hold(conn, b"", head + server.data[start:end], every=0.1)
    return server._hold(conn, head, server.data[start:end], every=rng.choice([0.01, 0.05, 0.2]))


def _stall(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    head = (f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end - 1}/{len(server.data)}\r\n"
            f"Content-Length: {end - start}\r\n\r\n").encode()
    return server._hold(conn, rng.choice([b"", b"HTTP/1.1 2", head, head + server.data[start:start + 10]]))


def _redirect(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    where = rng.choice([f"/{case}/x.h5", f"/{case}/plain.h5", "plain.h5", f"//127.0.0.1:{server.port}/{case}/plain.h5",
                        f"http://127.0.0.1:{server.closed_port}/{case}/plain.h5", "ftp://127.0.0.1/x", "",
                        "http://[::1",
                        f"/{case}/hop{rng.choice([1, 3, 4, 5, 6, 9])}", "javascript:alert(1)", "/nowhere",
                        f"http://127.0.0.1:{server.port}/{case}/plain.h5#frag", f"/{case}/plain.h5?x=\x01"])
    status = rng.choice(["301 Moved Permanently", "302 Found", "303 See Other", "307 Temporary Redirect",
                         "308 Permanent Redirect"])
    headers: list[tuple[str, Any]] = [("Location", where)] if where or rng.random() < 0.5 else []
    if rng.random() < 0.3:
        server._send(conn, status, headers + [("Connection", "close")])
        return server._hold(conn, b"", _JUNK * 4, every=0.01)  # a body that the client must not read
    server._send(conn, status, headers + [("Content-Length", 5)], b"moved")
    return rng.random() < 0.5


def _redirect_other(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    status = rng.choice(["301 Moved Permanently", "302 Found", "307 Temporary Redirect", "308 Permanent Redirect"])
    server._send(conn, status, [("Location", f"/{case}/other.h5"), ("Content-Length", 0)])
    return True


def _headers(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    body = server.data[start:end]
    size = len(server.data)
    good = [("Content-Range", f"bytes {start}-{end - 1}/{size}"), ("Content-Length", len(body))]
    lines = [f"{k}: {v}".encode() for k, v in good]
    status = b"HTTP/1.1 206 Partial Content"
    choice = rng.choice(["status", "no-colon", "nul", "latin", "fold", "long", "many", "gzip", "double-range",
                         "space-name", "bare-lf"])
    if choice == "status":
        status = rng.choice([b"HTTP/1.1 206", b"HTTP/1.0 206 Partial Content", b"HTTP/2 206 X", b"ICY 206 OK",
                             b"HTTP/1.1 2O6 X", b"", b"\x00\xff", b"HTTP/1.1 206 Partial\x00Content", b"HTTP/9.9 206 X",
                             b"http/1.1 206 x", b" HTTP/1.1 206 X"])
    elif choice == "no-colon":
        lines.insert(rng.randrange(len(lines) + 1), b"garbage line without colon")
    elif choice == "nul":
        lines.append(b"X-Nul: a\x00b")
    elif choice == "latin":
        lines.append(b"X-Bytes: \xff\xfe\x80")
    elif choice == "fold":
        lines.insert(1, b" folded-continuation")
    elif choice == "long":
        lines.append(b"X-Long: " + b"a" * rng.choice([70000, 200000]))
    elif choice == "many":
        lines += [f"X-H{i}: {i}".encode() for i in range(rng.choice([101, 2000]))]
    elif choice == "gzip":
        lines.append(b"Content-Encoding: " + rng.choice([b"gzip", b"br", b"identity, gzip", b"x"]))
    elif choice == "double-range":
        lines.append(f"Content-Range: bytes 0-{end - start - 1}/{size}".encode())
    elif choice == "space-name":
        lines.append(b"Content-Length : 1")
    if choice == "bare-lf":
        conn.sendall(status + b"\n" + b"\n".join(lines) + b"\n\n" + body)
    else:
        conn.sendall(status + b"\r\n" + b"\r\n".join(lines) + b"\r\n\r\n" + body)
    return rng.random() < 0.3


def _chunked(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str,
             lie: bool = False) -> bool:
    start, end = _asked(server, req)
    body = server.data[start:end]
    headers: list[tuple[str, Any]] = [("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}"),
                                      ("Transfer-Encoding", "chunked")]
    if rng.random() < 0.3:
        headers.append(("Content-Length", len(body)))
    out = bytearray()
    i = 0
    while i < len(body):
        n = rng.choice([1, 7, 100, 4096, 65536])
        piece = body[i:i + n]
        size = len(piece)
        if lie and rng.random() < 0.3:
            size = rng.choice([size + 1, max(0, size - 1), size * 2, 0])
        ext = rng.choice(["", ";x=1", ";" + "e" * 100]) if rng.random() < 0.2 else ""
        out += f"{size:x}{ext}\r\n".encode() + piece + b"\r\n"
        i += n
    if lie and rng.random() < 0.5:
        out += rng.choice([b"zz\r\n", b"-1\r\n", b"ffffffffffffffffff\r\n", b"", b"0\r\n"])
    else:
        out += b"0\r\n\r\n"
    server._send(conn, "206 Partial Content", headers, bytes(out))
    return False


def _chunked_lie(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    return _chunked(server, conn, req, rng, case, lie=True)


def _reset(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    if rng.random() < 0.7:
        body = server.data[start:end]
        cut = rng.randrange(max(1, len(body)))
        server._send(conn, "206 Partial Content", [("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}"),
                                                   ("Content-Length", len(body))], body[:cut])
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    return False


def _other_bytes(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    start, end = _asked(server, req)
    size = len(server.data)
    if rng.random() < 0.5:
        body = server.other[start:end]
    else:
        d = rng.choice([-8, -1, 1, 64])
        body = (server.data + bytes(128))[max(0, start + d):max(0, start + d) + end - start].ljust(end - start, b"\0")
    server._send(conn, "206 Partial Content" if req.headers.get("range") else "200 OK",
                 [("Content-Range", f"bytes {start}-{end - 1}/{size}"), ("Content-Length", len(body)), ("ETag", ETAG)],
                 body)
    return True


def _head(server: FuzzServer, conn: socket.socket, req: Request, rng: random.Random, case: str) -> bool:
    size = len(server.data)
    if req.method != "HEAD" and "range" not in req.headers:  # fsspec's GET for the size: none, or another
        choice = rng.choice(["none", "chunked", "wrong", "honest"])
        if choice == "none":
            server._send(conn, "200 OK", [("Connection", "close")], server.data)
            return False
        if choice == "chunked":
            server._send(conn, "200 OK", [("Transfer-Encoding", "chunked")],
                         b"%x\r\n%s\r\n0\r\n\r\n" % (size, server.data))
            return True
        if choice == "wrong":
            server._send(conn, "200 OK", [("Content-Length", rng.choice([size - 1, size + 1, 0]))], server.data)
            return False
        return server._honest(conn, req, server.data)
    if req.method != "HEAD":  # a GET with If-Match: the ETag "changed"
        server._send(conn, "412 Precondition Failed", [("Content-Length", 0), ("ETag", '"changed"')])
        return True
    length = rng.choice([size - 1, size + 1, size - 4096, 0, -1, 2**63, 2**70, "x", None, size, size * 2])
    etag = rng.choice([ETAG, 'W/"weak"', '"changed"', None, "unquoted"])
    headers: list[tuple[str, Any]] = [("Accept-Ranges", rng.choice(["bytes", "none"]))]
    if length is not None:
        headers.append(("Content-Length", length))
    elif rng.random() < 0.5:
        headers.append(("Transfer-Encoding", "chunked"))
    if etag is not None:
        headers.append(("ETag", etag))
    if rng.random() < 0.2:
        headers.append(("Content-Encoding", "gzip"))
    server._send(conn, "200 OK", headers)
    return True


_ANSWERS = {"status": _status, "content-range": _content_range, "length": _length, "short": _short, "long": _long,
            "smuggle": _smuggle, "drip": _drip, "stall": _stall, "redirect": _redirect,
            "redirect-other": _redirect_other, "headers": _headers, "chunked": _chunked, "chunked-lie": _chunked_lie,
            "reset": _reset, "other-bytes": _other_bytes, "head": _head}


def new_knobs(rng: random.Random) -> dict[str, Any]:
    """The client's settings for a case: either client, and request sizes that make the
    header, tail, layout and data reads separate requests (or not)."""
    return {"client": rng.choice(["plain", "fsspec"]), "calls": rng.sample(CALLS, 2), "seed": rng.randrange(2**31),
            "TAIL_BYTES": rng.choice([0, 512, 4096, 65536, 256 << 10]),
            "MAX_GAP": rng.choice([0, 4096, 64 << 10]), "REQUEST_BYTES": rng.choice([4096, 65536, 8 << 20]),
            "DIRECT_BYTES": rng.choice([4096, 1 << 20])}


# ---------------------------------------------------------------------------- the worker side


_expected: dict[str, Any] = {}


def prepare() -> None:
    """In the worker, before its limit: import fsspec and aiohttp, set the deadlines low, and
    start the threads the reads use (their stacks count once)."""
    import logging

    import aiohttp  # noqa: F401
    import fsspec  # noqa: F401
    import fsspec.implementations.http  # noqa: F401

    from tensorstore_h5.storage import httpranges, remote

    logging.disable(logging.CRITICAL)
    remote.REQUEST_DEADLINE = DEADLINE
    remote.REQUEST_MIN_RATE = 1 << 40  # the deadline is REQUEST_DEADLINE, whatever the size
    remote.BACKOFF = 0.01
    remote.CONNECTIONS = 8
    httpranges.TIMEOUT = 30.0
    remote._request_threads()
    fsspec.filesystem("http").loop  # noqa: B018 - fsspec's event loop thread


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_case(case: dict[str, Any]) -> dict[str, Any]:
    """Every read path on the case's URL; ``{"problems": [...], "stats": {...}}``."""
    import torch

    import tensorstore_h5 as th5
    from tensorstore_h5.storage import remote

    from helpers import bits
    from hostile.fuzz import CANARY, _plant_canary
    from hostile.hostile_files import flat

    url = case["url"]
    knobs = case["knobs"]
    remote.PLAIN_HTTP = knobs["client"] == "plain"
    for name in ("TAIL_BYTES", "MAX_GAP", "REQUEST_BYTES", "DIRECT_BYTES"):
        setattr(remote, name, knobs[name])
    for which in ("local", "other"):
        if case[which] not in _expected:
            _expected[case[which]] = flat(th5.load(case[which]))
    saved, other = _expected[case["local"]], _expected[case["other"]]
    lying = case["mode"] in LYING
    problems: list[str] = []
    stats = {"exact": 0, "other": 0, "lie": 0, "refused": 0, "calls": 0, "slowest": 0.0}
    base = _maxrss()

    def same(value: Any, ref: Any) -> bool:
        return isinstance(ref, torch.Tensor) and value.shape == ref.shape and value.dtype == ref.dtype and \
            torch.equal(bits(value.detach().contiguous()), bits(ref.contiguous()))

    def judge(name: str, key: str, value: Any, sel: Any, checked: bool) -> None:
        if not isinstance(value, torch.Tensor):
            if key in saved and not isinstance(saved[key], torch.Tensor) and value != saved[key] and \
                    value != other.get(key):
                problems.append(f"{name}: {key}: value {value!r} is not the saved {saved[key]!r}")
            return
        raw = bytes(bits(value.detach().contiguous()).numpy())
        if CANARY[:8] in raw:
            problems.append(f"{name}: {key}: holds memory that no read filled (canary)")
            return
        ref = saved.get(key)
        if ref is None:
            problems.append(f"{name}: {key}: not a saved key")
            return
        part = ref if sel is None else ref[sel]
        if same(value, part):
            stats["exact"] += 1
        elif key in other and same(value, other[key] if sel is None else other[key][sel]) and lying:
            stats["other"] += 1  # every request lied to alike: the other file, whole and consistent
        elif lying and not checked and value.shape == part.shape and value.dtype == part.dtype:
            stats["lie"] += 1  # an unchecked slice of bytes a lying server sent: not promised to be noticed
        else:
            how = "checked " if checked else ""
            problems.append(f"{name}: {key}: {how}read returned {tuple(value.shape)} {value.dtype} that is not what "
                            f"was saved")

    def failed(name: str, e: BaseException) -> None:
        if isinstance(e, th5.TensorStoreError):
            stats["refused"] += 1
            if url not in str(e):
                problems.append(f"{name}: error without the URL: {type(e).__name__}: {e}"[:600])
        else:
            import traceback

            where = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))[-700:]
            problems.append(f"{name}: {type(e).__name__}: {e}"[:400] + f"\n    {where}")

    def zeros() -> dict[str, Any]:
        return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in saved.items() if isinstance(v, torch.Tensor)}

    def timed(name: str, fn: Any, limit: float = CALL_LIMIT) -> Any:
        """``fn()`` (None where it raised), its time checked against ``limit``."""
        _plant_canary()
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            failed(name, e)
            return None
        finally:
            took = time.monotonic() - t0
            stats["calls"] += 1
            stats["slowest"] = max(stats["slowest"], round(took, 2))
            if took > limit:
                problems.append(f"{name}: took {took:.1f} s, more than {limit:.0f} s (deadline {DEADLINE} s)")

    rng = random.Random(case["seed"])

    def opened() -> list[tuple[str, str, Any, Any, bool]]:
        """Keys, then of a few tensors a whole read, a row slice or a checked row slice, each timed."""
        out = []
        with th5.open(url) as s:
            keys = s.keys()
            for key in rng.sample(keys, min(len(keys), 3)):
                h = timed(f"open [{key}]", lambda key=key: s[key])
                if h is None:
                    continue
                if not isinstance(h, th5.TensorHandle):
                    out.append(("open", key, h, None, True))
                    continue
                half = (slice(1, max(2, h.shape[0] // 2 + 1)),) if h.ndim and h.shape[0] > 1 else None
                what, sel, checked = rng.choice([("whole", None, True), ("rows", half, False),
                                                 ("rows(verify)", half, True)])
                if sel is None:
                    what, checked = "whole", True
                got = timed(f"open {what} {key}", lambda h=h, sel=sel, checked=checked:
                            h[...] if sel is None else h.read(index=sel, verify=True if checked else None))
                if got is not None:
                    out.append((f"open {what}", key, got, sel, checked))
        return out

    def many(verify: bool | None) -> list[tuple[str, str, Any, Any, bool]]:
        with th5.open(url) as s:
            sels = {k: (slice(0, max(1, v.shape[0] // 2)),) for k, v in saved.items()
                    if isinstance(v, torch.Tensor) and v.ndim and v.shape[0]}
            got = s.read_many(sels, verify=verify)
        return [(f"read_many(verify={verify})", k, v, sels[k], verify is True) for k, v in got.items()]

    def items() -> list[tuple[str, str, Any, Any, bool]]:
        with th5.open(url) as s:
            return [("items", k, v, None, True) for k, v in s.items()]

    def load_into() -> list[tuple[str, str, Any, Any, bool]]:
        target = zeros()
        th5.load_into(target, url, strict=False)
        return [("load_into", k, v, None, True) for k, v in target.items()]

    calls = {"load": lambda: [("load", k, v, None, True) for k, v in flat(th5.load(url)).items()],
             "open": opened, "read_many": lambda: many(None), "read_many(verify)": lambda: many(True),
             "items": items, "load_into": load_into}
    for name in case["calls"]:
        limit = 7 * CALL_LIMIT if name == "open" else CALL_LIMIT  # open: its keys and 3 reads, each timed too
        for what, key, value, sel, checked in timed(name, calls[name], limit) or []:
            judge(what, key, value, sel, checked)
    grew = _maxrss() - base
    if grew > MEMORY:
        problems.append(f"the worker's peak memory grew by {grew >> 20} MiB")
    return {"problems": problems, "stats": stats}


# ---------------------------------------------------------------------------- the driver


def run(seconds: float, out: Path, seed: int, worker: Any = None) -> list[tuple[str, list[str]]]:
    """Fuzz HTTP answers for ``seconds``; findings are kept in ``out`` as ``http-*.json`` (the
    case) beside ``http-x.h5`` and ``http-other.h5`` (the files served)."""
    from hostile import fuzz

    fuzz._setup_path()
    rng = random.Random(seed)
    findings: list[tuple[str, list[str]]] = []
    out.mkdir(parents=True, exist_ok=True)
    w = worker or fuzz.Worker()
    totals: dict[str, Any] = {}
    modes: dict[str, int] = {}
    n = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        local, other = make_files(Path(tmp))
        server = FuzzServer(local.read_bytes(), other.read_bytes())
        end = start + seconds
        try:
            while time.monotonic() < end:
                n += 1
                spec, knobs = new_spec(rng), new_knobs(rng)
                result = _one(server, w, f"c{n}", spec, knobs, local, other)
                modes[spec["mode"]] = modes.get(spec["mode"], 0) + 1
                for k, v in result.get("stats", {}).items():
                    totals[k] = max(totals.get(k, 0), v) if k == "slowest" else totals.get(k, 0) + v
                if result["problems"]:
                    name = f"http-{spec['mode']}-{seed}-{n}"
                    if not (out / "http-x.h5").exists():
                        (out / "http-x.h5").write_bytes(local.read_bytes())
                        (out / "http-other.h5").write_bytes(other.read_bytes())
                    (out / f"{name}.json").write_text(json.dumps({"spec": spec, "knobs": knobs,
                                                                  "problems": result["problems"]}, indent=1))
                    findings.append((name, [f"spec: {spec}, knobs: {knobs}", *result["problems"]]))
        finally:
            server.stop()
            if worker is None:
                w.stop()
    took = time.monotonic() - start
    print(f"fuzz http: {n} cases in {took:.0f} s ({n / max(took, 1e-9):.1f}/s, seed {seed}), {len(findings)} findings "
          f"in {out}; reads: {totals}; modes: {modes}")
    return findings


def _one(server: FuzzServer, w: Any, name: str, spec: dict[str, Any], knobs: dict[str, Any], local: Path,
         other: Path) -> dict[str, Any]:
    url = server.add(name, spec)
    try:
        return w.ask({"surface": "http", "url": url, "mode": spec["mode"], "knobs": knobs, "calls": knobs["calls"],
                      "seed": knobs["seed"], "local": str(local), "other": str(other)}, 8 * CALL_LIMIT + 10)
    finally:
        server.drop(name)


def check_saved(paths: list[Path], worker: Any) -> list[tuple[str, list[str]]]:
    """Re-run kept HTTP cases (``http-*.json``, beside ``http-x.h5`` and ``http-other.h5``)."""
    out = []
    for p in paths:
        case = json.loads(p.read_text())
        local, other = p.parent / "http-x.h5", p.parent / "http-other.h5"
        server = FuzzServer(local.read_bytes(), other.read_bytes())
        try:
            result = _one(server, worker, "c1", case["spec"], case["knobs"], local, other)
        finally:
            server.stop()
        out.append((p.name, result["problems"]))
    return out
