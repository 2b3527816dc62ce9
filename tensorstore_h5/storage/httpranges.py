"""Range GETs of one ``http://`` or ``https://`` object over plain keep-alive connections, each
body received straight into the caller's memory.

:class:`tensorstore_h5.storage.remote.RemoteSource` reads the bytes of http(s) URLs with a
:class:`RangeClient` from its own threads: ``http.client`` hands a response's body to
``socket.recv_into`` (through the socket file's ``readinto``), which writes into the tensor's
memory without the interpreter lock, so several connections receive at once and each byte is
copied once, by the kernel. Connections are kept alive and shared by every client of the
process (per host, up to :data:`IDLE_PER_HOST`). fsspec's aiohttp session receives every body
on one event-loop thread as bytes objects that are then copied (measured in ``bench --remote``).

Every answer is checked: the status, that it is not encoded, that a ``206`` names exactly the
asked range and the object's known size, and that the body is as long as the range; given the
object's ETag when it was opened, requests carry ``If-Match`` so that a replaced object of the
same size is refused (412) rather than read half old, half new. Redirects to http(s) URLs are
followed (at most :data:`REDIRECTS`), without the caller's ``Authorization`` and ``Cookie``
headers once they leave the first origin; a target reached only by permanent redirects (301,
308) is asked directly by the next requests, a temporary one (302, 307: signed, expiring URLs)
again through the first URL; a redirect's body is never read (its connection is closed).

No body is read past what was asked: at most the range's bytes (a longer answer's connection
is closed, not reused), none of a redirect or a refused answer. Given a ``deadline``, a request
ends by then, its status line and headers included, whatever the server sends: each socket
wait is at most :data:`TIMEOUT` and at most the time left, and none starts after it
(:class:`DeadlineError`).
"""

from __future__ import annotations

import atexit
import functools
import http.client
import io
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["RangeClient", "HTTPStatusError", "RangeAnswerError", "VersionError", "DeadlineError", "check_answer",
           "parse_content_range", "close_idle", "REDIRECTS", "TIMEOUT", "IDLE_PER_HOST"]

REDIRECTS = 5
"""Redirects followed for one request before it fails."""

TIMEOUT = 60.0
"""Seconds a connection waits to connect or for the next bytes before it fails (a transient
error: the request is tried again)."""

_REDIRECT = (301, 302, 303, 307, 308)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HTTPStatusError(OSError):
    """An answer whose status is not a success (``status`` holds it)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}".rstrip())
        self.status = status


class RangeAnswerError(OSError):
    """An answer that is not the asked byte range: the whole object instead of a range, another
    range, a body of another length, or an object of another size than when it was opened."""


class VersionError(RangeAnswerError):
    """An answer 412 to a request with ``If-Match``: the object is not the version opened."""


class DeadlineError(OSError):
    """A request whose answer was not complete within its deadline (a server that drips, or
    sends without end). Not a ``TimeoutError``: trying again would take as long."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the answer was not complete within the deadline of {seconds:.3g} s")
        self.seconds = seconds


class _DeadlineIO(socket.SocketIO):
    """The raw reader of one response (status line, headers and body): each socket wait lasts at
    most ``timeout`` seconds and at most until ``deadline`` (``time.monotonic()``); none starts
    after it. Raises DeadlineError past the deadline, ``TimeoutError`` for one wait of ``timeout``."""

    def __init__(self, sock: socket.socket, timeout: float, deadline: float, seconds: float) -> None:
        super().__init__(sock, "rb")
        sock._io_refs += 1  # type: ignore[attr-defined]  # as sock.makefile does: open until this closes
        self._wait, self._deadline, self._seconds = timeout, deadline, seconds

    def readinto(self, b: Any) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeadlineError(self._seconds)
        self._sock.settimeout(min(self._wait, left))
        try:
            return super().readinto(b)  # recv_into: straight into b, without the GIL
        except TimeoutError:
            if time.monotonic() >= self._deadline:
                raise DeadlineError(self._seconds) from None
            raise


class _Response(http.client.HTTPResponse):
    """A response read through :class:`_DeadlineIO` (the ``response_class`` of a request with a
    deadline)."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: str | None = None, url: str | None = None,
                 *, timeout: float, deadline: float, seconds: float) -> None:
        super().__init__(sock, debuglevel, method, url)
        self.fp.close()  # the file http.client made (the socket stays open: the connection holds it)
        self.fp = io.BufferedReader(_DeadlineIO(sock, timeout, deadline, seconds), io.DEFAULT_BUFFER_SIZE)


def parse_content_range(header: str | None) -> tuple[int, int, int | None] | None:
    """``(start, end, total)`` of a ``Content-Range: bytes a-b/total`` header (``end`` is
    ``b + 1``; ``total`` None for ``*``); None for another or no header."""
    m = _CONTENT_RANGE.fullmatch((header or "").strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)) + 1, None if m.group(3) == "*" else int(m.group(3))


def check_answer(status: int, reason: str, content_range: str | None, length: int | None, start: int, end: int,
                 size: int | None, encoding: str | None = None) -> int:
    """The object's size from an answer (``status``, its ``Content-Range``, ``Content-Length``
    and ``Content-Encoding`` headers, None where absent) to a GET of bytes ``start..end``;
    ``size``: the object's size when it was opened, None if unknown.

    Raises HTTPStatusError for a status other than 200/206, RangeAnswerError for an answer
    that is not exactly that range of the object's own bytes: encoded (gzip: the range would
    be of the encoded bytes), the whole object (a server ignoring ``Range``), another range, a
    body of another length, or an object of another size."""
    if status == 412:  # only asked for with If-Match: the object is not the version opened
        raise VersionError(f"the object changed while being read: bytes {start}..{end} are no longer those of "
                           "the version opened (HTTP 412)")
    if status not in (200, 206):
        raise HTTPStatusError(status, reason)
    if encoding not in (None, "", "identity"):
        raise RangeAnswerError(f"the server answered bytes {start}..{end} with Content-Encoding {encoding!r}, "
                               "not the stored bytes")
    if status == 200:  # the whole object: right only where the range is the whole object
        if start != 0 or length != end or (size is not None and size != end):
            raise RangeAnswerError(f"the server ignored the byte range for bytes {start}..{end} (status 200, "
                                   f"{length if length is not None else 'unknown'} bytes)")
        return end
    named = parse_content_range(content_range)
    total = (named[2] if named[2] is not None else size) if named is not None else None
    if named is not None and size is not None and total != size:
        raise RangeAnswerError(f"the object changed while being read: {total} bytes now, {size} when opened")
    if named is None or named[:2] != (start, end):
        short = named is not None and named[0] == start and named[1] < end
        what = "ended early" if short else "answered another byte range"
        raise RangeAnswerError(f"the server {what} for bytes {start}..{end} (Content-Range: {content_range})")
    if length is not None and length != end - start:
        what = "ended early" if length < end - start else "ignored the byte range"
        raise RangeAnswerError(f"the server {what} for bytes {start}..{end} (Content-Length {length})")
    return total if total is not None else -1


_SECRET_HEADERS = ("authorization", "cookie", "proxy-authorization")
"""Headers not sent on after a redirect to another origin (as browsers and aiohttp do)."""

_OWN_HEADERS = ("range", "accept-encoding", "if-match")
"""Headers the client sets itself: a caller's are dropped."""


IDLE_PER_HOST = 64
"""Idle keep-alive connections kept per host (shared by every :class:`RangeClient` of the
process, as a browser's are: opening many files of one server reuses them)."""

_idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
_idle_lock = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the parent's sockets are forgotten, not closed (the parent still
    uses them), and the lock is new (another thread of the parent may have held it)."""
    global _idle, _idle_lock
    _idle, _idle_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _take_idle(key: tuple[str, str, int]) -> http.client.HTTPConnection | None:
    with _idle_lock:
        conns = _idle.get(key)
        return conns.pop() if conns else None


def _give_back(key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
    with _idle_lock:
        conns = _idle.setdefault(key, [])
        if len(conns) < IDLE_PER_HOST:
            conns.append(conn)
            return
    conn.close()


def close_idle() -> None:
    """Close every idle connection (they are also closed at exit)."""
    with _idle_lock:
        conns = [c for cs in _idle.values() for c in cs]
        _idle.clear()
    for conn in conns:
        conn.close()


atexit.register(close_idle)


class RangeClient:
    """Range GETs of the object at ``url`` (``http://`` or ``https://``) with ``headers`` added to
    every request, each socket operation waiting at most ``timeout`` seconds (default
    :data:`TIMEOUT`); safe to call from many threads (each request takes an idle connection to the
    host, kept alive from earlier requests of any client, or makes one)."""

    _ssl: ssl.SSLContext | None = None  # one for the process: loading the system's certificates takes ~10 ms

    def __init__(self, url: str, headers: Mapping[str, str] | None = None, timeout: float | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url}: not an http:// or https:// URL")
        self.url = url
        self._headers = dict(headers or {})
        self._timeout = TIMEOUT if timeout is None else timeout

    def _connection(self, parts: urllib.parse.SplitResult, new: bool, deadline: float, seconds: float
                    ) -> tuple[tuple[str, str, int], http.client.HTTPConnection, bool]:
        """An idle connection to the URL's host (unless ``new``), else a new one; and whether it
        was idle. Its connect and sends wait at most :attr:`_timeout` and until ``deadline``
        (``time.monotonic()``; ``seconds``: the whole deadline, for messages), its answer is read
        through :class:`_DeadlineIO`. Raises DeadlineError past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineError(seconds)
        wait = min(self._timeout, left)
        https = parts.scheme == "https"
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if https else 80))
        conn = None if new else _take_idle(key)
        idle = conn is not None
        if conn is not None:
            conn.timeout = wait
            if conn.sock is not None:
                conn.sock.settimeout(wait)
        else:
            if https and RangeClient._ssl is None:
                RangeClient._ssl = ssl.create_default_context()
            conn = (http.client.HTTPSConnection(key[1], key[2], timeout=wait, context=RangeClient._ssl) if https
                    else http.client.HTTPConnection(key[1], key[2], timeout=wait))
        conn.response_class = functools.partial(  # type: ignore[assignment]
            _Response, timeout=self._timeout, deadline=deadline, seconds=seconds)
        return key, conn, idle

    def get_into(self, start: int, view: memoryview, size: int | None = None, etag: str | None = None,
                 deadline: float | None = None) -> int:
        """Fill ``view`` with the object's bytes from ``start`` on; ``size``: the object's size
        when it was opened (an answer naming another is refused); ``etag``: its strong ETag then
        (asked for with ``If-Match``: a replaced object answers 412, refused); ``deadline``:
        seconds the whole call may take, redirects included (None: no limit, but each socket
        wait's ``timeout``). Returns the object's size. Reads no more than ``len(view)`` bytes of
        any answer, and no byte of a redirect's.

        Raises HTTPStatusError (a status other than 200/206, redirects past
        :data:`REDIRECTS`), RangeAnswerError (another range or length than asked: a server
        that ignores ranges, ends early or whose object changed), DeadlineError (``deadline``
        passed), and the connection's own errors (``OSError``: refused, reset, timed out,
        ``http.client.IncompleteRead`` for a body cut short) for the caller to try again."""
        end = start + len(view)
        seconds = math.inf if deadline is None else deadline
        until = time.monotonic() + seconds
        url = self.url
        headers = {k: v for k, v in self._headers.items() if k.lower() not in _OWN_HEADERS}
        headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        if etag is not None:
            headers["If-Match"] = etag
        origin = urllib.parse.urlsplit(url)[:2]
        permanent = True  # every redirect so far 301 or 308: the target may be kept
        for _ in range(REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            for fresh in (False, True):  # an idle connection the server has since closed: once more on a new one
                key, conn, idle = self._connection(parts, fresh, until, seconds)
                try:
                    conn.request("GET", target, headers=headers)
                    r = conn.getresponse()
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    conn.close()
                    if idle and not fresh:
                        continue
                    raise
                except TimeoutError:  # connecting or sending, at most until the deadline
                    conn.close()
                    if time.monotonic() >= until:
                        raise DeadlineError(seconds) from None
                    raise
                except BaseException:
                    conn.close()
                    raise
                break
            keep = False
            try:
                if r.status in _REDIRECT and r.getheader("Location"):  # its body is not read: the connection goes
                    url = urllib.parse.urljoin(url, r.getheader("Location", ""))
                    moved = urllib.parse.urlsplit(url)
                    if moved.scheme not in ("http", "https") or not moved.hostname:
                        raise HTTPStatusError(r.status, f"redirect to {url!r} refused (not an http or https URL)")
                    if moved[:2] != origin:  # another origin: the caller's credentials stay with the first
                        headers = {k: v for k, v in headers.items() if k.lower() not in _SECRET_HEADERS}
                    permanent = permanent and r.status in (301, 308)
                    continue
                total = check_answer(r.status, r.reason, r.getheader("Content-Range"), r.length, start, end, size,
                                     r.getheader("Content-Encoding"))
                got = 0
                while got < len(view):
                    n = r.readinto(view[got:])  # the body lands in view: recv_into, without the GIL
                    if not n:
                        raise http.client.IncompleteRead(b"", len(view) - got)
                    got += n
                keep = not r.will_close and r.length == 0  # else more than asked may follow: not reused
            finally:
                if keep:
                    _give_back(key, conn)
                else:
                    r.close()  # unread or not all read: the socket is closed, not drained
                    conn.close()
            if url != self.url and permanent:
                self.url = url  # moved for good: later requests go straight to the target
            return total
        raise HTTPStatusError(310, f"more than {REDIRECTS} redirects")

