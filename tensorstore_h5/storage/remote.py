"""Byte sources other than a local file: fsspec URLs (``https://``, ``s3://``, ...) and file objects.

A source is a :class:`tensorstore_h5.storage.files.Source` (``path``, ``size``, ``pread``,
``read``, ``close``) and, for remote ones, :meth:`RemoteSource.prefetch`: the reader names
every byte range it is about to read, and the source fetches them in few requests
(neighbouring ranges coalesced, independent ones concurrently), so that a partial load moves
only its own bytes plus the layout. Opening a format-2 file costs one round trip: the
64-byte header, the object's size and its last :data:`TAIL_BYTES` (where the layout lies) are
asked for at the same time; a longer layout, or a server without suffix ranges, costs one more.

Over ``http://`` and ``https://`` the ranges' bytes come by :mod:`tensorstore_h5.storage.httpranges`
(plain keep-alive connections receiving into the caller's memory, see :data:`PLAIN_HTTP`);
every answer that carries layout or tensor bytes has its range checked on either path.

Every request ends within its deadline (:data:`REQUEST_DEADLINE`, :func:`deadline`) and reads
no more of an answer than it asked for, whatever the server sends (bodies without end, a byte
at a time, redirects with bodies): it fails with :class:`RemoteError` naming the URL.

fsspec (and s3fs for ``s3://``) are optional: ``pip install "tensorstore_h5[remote]"``.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextvars
import errno
import io as stdio
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import RemoteError, TensorStoreError
from . import files
from .files import is_fileobj, is_url, local_path  # (what opens a local path needs no remote code)
from .httpranges import (DeadlineError, HTTPStatusError, RangeAnswerError, RangeClient, VersionError, check_answer,
                         parse_content_range)

__all__ = ["RETRIES", "MAX_GAP", "REQUEST_BYTES", "BATCH_BYTES", "FETCH_AHEAD", "TAIL_BYTES", "DIRECT_BYTES",
           "PLAIN_HTTP", "PRESIGN_SECONDS", "CONNECTIONS", "REQUEST_DEADLINE", "REQUEST_MIN_RATE", "deadline",
           "is_url", "is_fileobj", "open_source", "RemoteSource", "FileObjSource", "RemoteError", "upload"]

_T = TypeVar("_T")

RETRIES = 3
"""Times a failed request is tried again (transient errors only: connections dropped or reset,
timeouts, 5xx; not a request that ran out of its :func:`deadline`, nor one that could not connect
at all: see :func:`_connect_failure`)."""

BACKOFF = 0.2
"""Seconds before the first retry (doubling each time)."""

REQUEST_DEADLINE = 120.0
"""Seconds one try of a request may take in all (connect, headers, the whole body, redirects),
plus one second per :data:`REQUEST_MIN_RATE` bytes asked for (see :func:`deadline`). Longer than
a socket wait's timeout (:data:`tensorstore_h5.storage.httpranges.TIMEOUT`, 60 s), so one stall
is still tried again. A try past its deadline fails with :class:`RemoteError` and is not tried
again: a request ends within ``(RETRIES + 1) * deadline(n) + BACKOFF * (2**RETRIES - 1)``
seconds at worst (~25 min for an 8 MiB request with the defaults; ~2 min for one that a server
drips or sends without end, which fails on its first try)."""

REQUEST_MIN_RATE = 32 << 10
"""Bytes per second a request must receive on average, past :data:`REQUEST_DEADLINE`: an
8 MiB request (:data:`REQUEST_BYTES`) has 120 + 256 s. Up to :data:`CONNECTIONS` requests
share the link: on links slower than ~20 Mbit/s lower this or :data:`CONNECTIONS`."""


def deadline(nbytes: int) -> float:
    """Seconds one try of a request for ``nbytes`` bytes may take: :data:`REQUEST_DEADLINE` +
    ``nbytes`` / :data:`REQUEST_MIN_RATE`."""
    return REQUEST_DEADLINE + max(0, nbytes) / REQUEST_MIN_RATE


async def _within(seconds: float, make: Callable[[], Awaitable[_T]]) -> _T:
    """The result of the coroutine ``make()`` makes, cancelled after ``seconds`` (on the event
    loop it runs on). Raises DeadlineError when cancelled, else what the coroutine raises."""
    began = time.monotonic()
    try:
        return await asyncio.wait_for(make(), seconds)
    except asyncio.TimeoutError:
        if time.monotonic() - began >= seconds:
            raise DeadlineError(seconds) from None
        raise  # the request's own timeout: tried again

MAX_GAP = 64 << 10
"""Ranges closer than this many bytes are fetched by one request (the gap is read and dropped).
Requests run concurrently, so a gap saves little time: with 1 MiB, reading the first row of
every tensor of a model of 1 MiB weights moved 8.5 MB for 0.1 MB of rows (Arrow's S3 reads
use 8 KiB)."""

REQUEST_BYTES = 8 << 20
"""Longer ranges are split into requests of this many bytes, fetched concurrently."""

BATCH_BYTES = 64 * 2**20
"""A load of a remote file fetches about this many bytes at a time, the next batches while the
tensors of the current one are filled."""

FIRST_BATCH_BYTES = 8 * 2**20
"""The first batch of a remote load fetches about this many bytes, each next one twice as many
up to :data:`BATCH_BYTES`: the first requests wait for their tensors' memory to be made
(faulted in, ~40 ms for 64 MiB here), later ones get it made while earlier requests are in
flight."""

FETCH_AHEAD = 4
"""Batches a remote load downloads ahead of the one it fills (at most ``FETCH_AHEAD + 1``
batches are held), so that one slow batch does not leave the connection idle."""

TAIL_BYTES = 256 << 10
"""Opening a remote file also fetches its last this many bytes, in the same round trip as its
header: a format-2 file's layout lies there (for up to ~1,500 keys; a longer layout's first
part costs one more request). 0: only the header."""

DIRECT_BYTES = 1 << 20
"""A load streams each contiguous tensor of at least this many bytes straight into the new
tensor's memory (its own requests, no intermediate bytes object); smaller ones are fetched
together, coalesced, and copied."""


PLAIN_HTTP = True
"""Read the bytes of ``http://`` and ``https://`` URLs with :class:`tensorstore_h5.storage.httpranges.RangeClient`
(plain keep-alive connections from :data:`CONNECTIONS` threads, each body received by the kernel
straight into the tensor's memory) rather than through fsspec's aiohttp session (bodies
received as bytes objects on one event-loop thread, then copied). Where ``storage_options``
hold request options other than ``headers`` (``client_kwargs``, ``auth``, ...) or the URL
holds a ``user:password@``, the session is used, which honours them. ``s3://`` objects are read
the same way by a presigned URL (signed by s3fs, locally, for :data:`PRESIGN_SECONDS`), unless
s3fs is asked for requester-pays or additional per-request arguments (encryption keys). Opening
(the header, size and tail) goes through fsspec either way."""

PRESIGN_SECONDS = 3600
"""How long the presigned URL an ``s3://`` object is read by stays good (see :data:`PLAIN_HTTP`);
an answer 403 signs it again."""

CONNECTIONS = 64
"""Requests the plain-HTTP sources (:data:`PLAIN_HTTP`) of the process have in flight at most,
each on a connection and thread of its own (the threads are shared and kept: starting 50 of
them for each open took ~20 ms on 2 cores)."""

_threads: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (CONNECTIONS, pool)
_threads_lock = threading.Lock()


def _request_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of :data:`CONNECTIONS` request threads (a new one after a change of
    :data:`CONNECTIONS`, and in a forked child, whose parent's threads do not exist)."""
    global _threads
    with _threads_lock:
        if _threads is None or _threads[0] != CONNECTIONS:
            if _threads is not None:
                _threads[1].shutdown(wait=False)  # its running requests finish; it takes no more
            _threads = (CONNECTIONS, concurrent.futures.ThreadPoolExecutor(CONNECTIONS, thread_name_prefix="th5-http"))
        return _threads[1]


def _new_threads_after_fork() -> None:
    global _threads, _threads_lock
    _threads, _threads_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_threads_after_fork)


def _strong_etag(info: dict[str, Any]) -> str | None:
    """The strong ETag in an fsspec ``info`` (``ETag`` over HTTP and S3, ``etag`` elsewhere);
    None for none or a weak one (``W/"..."``), which ``If-Match`` cannot ask for."""
    etag = info.get("ETag") or info.get("etag")
    return etag if isinstance(etag, str) and etag.startswith('"') else None




def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise TensorStoreError("reading and writing URLs needs fsspec: pip install \"tensorstore_h5[remote]\"") from None
    return fsspec


def open_source(target: Any, storage_options: dict[str, Any] | None = None, retries: int | None = None) -> Any:
    """A byte source for a path, a ``file://`` URL (both: :class:`files.RawFile`), another
    fsspec URL (:class:`RemoteSource`) or a readable, seekable binary file object
    (:class:`FileObjSource`)."""
    path = local_path(target)
    if path is not None:
        return files.RawFile(path)
    if is_fileobj(target):
        return FileObjSource(target)
    if is_url(target):
        return RemoteSource(target, storage_options or {}, RETRIES if retries is None else retries)
    raise TypeError(f"expected a path, a URL or a binary file object, got {type(target).__name__}")


def _status(e: BaseException) -> int | None:
    """The HTTP status an error carries (aiohttp's ``status``, botocore's response), if any."""
    if isinstance(e, DeadlineError):
        return None  # its message's seconds are no status
    status = getattr(e, "status", None)
    if status is None and not hasattr(type(e), "status"):  # aiohttp's errors warn on "code"; urllib's carry it
        status = getattr(e, "code", None)
    if isinstance(status, int):
        return status
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    # Otherwise a status in the message, outside any URL (whose port may be 40399).
    m = re.search(r"(?<![\d.])([45]\d\d)(?!\d)", re.sub(r"\w+://\S+", "", str(e)))
    return int(m.group(1)) if m else None


class _Unreachable(OSError):
    """Raised by the botocore hook (:func:`_no_retry_when_unreachable`) instead of letting
    botocore and s3fs try again a request that could not connect; ``reason`` says why, its
    ``__cause__`` is botocore's error."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_NO_NAME = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL", "EAI_ADDRFAMILY")
            if hasattr(socket, name)}
"""getaddrinfo's answers that a name has no address (others, such as ``EAI_AGAIN``, may pass)."""

_NO_ROUTE = {errno.ECONNREFUSED: "connection refused", errno.EHOSTUNREACH: "no route to host",
             errno.ENETUNREACH: "network unreachable"}


def _linked(e: BaseException) -> Iterator[BaseException]:
    """``e`` and the errors it wraps: ``__cause__`` and ``__context__``, aiohttp's ``os_error``
    and ``certificate_error``, botocore's ``kwargs["error"]`` (a few levels, each once)."""
    seen: set[int] = set()
    todo = [e]
    while todo and len(seen) < 16:
        c = todo.pop(0)
        if id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        kwargs = getattr(c, "kwargs", None)
        for inner in (c.__cause__, c.__context__, getattr(c, "os_error", None), getattr(c, "certificate_error", None),
                      kwargs.get("error") if isinstance(kwargs, dict) else None):
            if isinstance(inner, BaseException):
                todo.append(inner)


def _connect_failure(e: BaseException) -> tuple[str, bool] | None:
    """Why a request could not connect at all, and whether that lasts, from ``e`` or an error it
    wraps (:func:`_linked`): ``(reason, lasting)``, None for any other error (a connection
    dropped, reset or timed out, an HTTP status).

    Lasting: a host name that does not resolve, a certificate that is not trusted: another try
    fails the same way. Not lasting: a refused connection, no route to the host, a temporary
    failure of name resolution (offline): they fail at once while nothing has answered yet
    (a wrong host or port, or no network: trying again for seconds only hides that), and are
    tried again once the server has answered (a server restarting, DNS flapping mid-load)."""
    for c in _linked(e):
        if isinstance(c, _Unreachable):
            return c.reason, True
        if isinstance(c, ssl.SSLCertVerificationError) or type(c).__name__ == "ClientConnectorCertificateError":
            detail = getattr(c, "verify_message", None) or getattr(c, "reason", None) or ""
            return f"the server's TLS certificate is not trusted{f' ({detail})' if detail else ''}", True
        if isinstance(c, socket.gaierror):
            if c.errno in _NO_NAME:
                return "the host name does not resolve (a typo in it, or no network?)", True
            return f"the host name could not be resolved ({c.strerror or c}: offline?)", False
        if isinstance(c, OSError) and c.errno in _NO_ROUTE:
            return _NO_ROUTE[c.errno], False
        if isinstance(c, OSError) and c.errno is None and str(c).startswith("Multiple exceptions:"):
            codes = {int(n) for n in re.findall(r"\[Errno (\d+)\]", str(c))}  # asyncio, one try per address
            if codes and codes <= set(_NO_ROUTE):
                return _NO_ROUTE[min(codes)], False
    return None


_CALLER: contextvars.ContextVar[RemoteSource | None] = contextvars.ContextVar("tensorstore_h5_remote", default=None)
"""The source whose request runs in this context (fsspec runs its coroutines in the context of
the thread that asks): botocore's retries stop early for it alone (:func:`_hook_botocore`)."""


def _no_retry_when_unreachable(caught_exception: BaseException | None = None, **_: Any) -> None:
    """botocore's ``needs-retry`` hook: for a request of a :class:`RemoteSource` that could not
    connect (:func:`_connect_failure`, before the source has had an answer where that does not
    last), raises :class:`_Unreachable` instead of botocore's retries (up to 4, with backoff) and
    s3fs's (5, each with botocore's): an unreachable S3 endpoint fails at once. Anything else,
    and other users of the same s3fs file system, keep botocore's own retries."""
    src = _CALLER.get()
    if src is None or caught_exception is None:
        return None
    failure = _connect_failure(caught_exception)
    if failure is not None and (failure[1] or not src.answered):
        raise _Unreachable(failure[0]) from caught_exception
    return None


def _hook_botocore(fs: Any) -> None:
    """Register :func:`_no_retry_when_unreachable` on the botocore client of an s3fs file
    system (once per client; nothing for other file systems, or where s3fs holds no client)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if not protocols & {"s3", "s3a"}:
        return
    try:
        events = fs.s3.meta.events  # made on first use (no request is sent)
        events.register_first("needs-retry.s3", _no_retry_when_unreachable, unique_id="tensorstore_h5.unreachable")
    except Exception:  # noqa: BLE001 - another s3fs or botocore: its own retries stay, nothing else changes
        pass


def _transient(e: BaseException) -> bool:
    """Errors worth another try: connections dropped, reset or refused, timeouts, server errors;
    not a request past its deadline (another try would take as long). (A connection that could
    not be made is decided before, by :func:`_connect_failure`.)"""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, DeadlineError)):
        return False
    if _connect_failure(e) is not None:
        return True  # not lasting, and the server has answered before: it may be back
    text = f"{type(e).__name__} {e}"
    if isinstance(e, (ConnectionError, TimeoutError, EOFError, ssl.SSLEOFError, ssl.SSLZeroReturnError)) or any(
            s in text for s in ("Connection", "Disconnected", "Timeout", "ClientPayloadError", "IncompleteRead",
                                "reset by peer", "SlowDown", "InternalError", "ServiceUnavailable")):
        return True  # dropped, cut short or throttled: the next try may work
    status = _status(e)
    return status is not None and (status >= 500 or status in (408, 429))


class RemoteSource(files.Source):
    """An object behind an fsspec URL, read by byte ranges.

    ``stats`` counts requests and bytes received (for tests and the benchmark).
    """

    remote = True

    local = False

    def __init__(self, url: str, storage_options: dict[str, Any], retries: int = RETRIES) -> None:
        fsspec = _fsspec()
        self.path = url
        self.retries = retries
        try:
            self._fs, self._key = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as e:
            raise RemoteError(f"{url}: cannot open this URL ({e}); for s3:// install s3fs "
                              "(pip install \"tensorstore_h5[remote]\")") from e
        self._cache: list[tuple[int, bytes]] = []  # prefetched (start, data), sorted by start
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "bytes": 0}
        self.size = -1
        self.etag: str | None = None  # the version opened (a strong ETag), asked for by If-Match
        self.identity = (0, hash(url))
        self.answered = False  # whether a request has had an answer: see _connect_failure
        self._client = self._plain_client()

    @property
    def populate(self) -> bool:
        """Whether memory that :meth:`fetch` streams into is better made with its pages (see
        :func:`tensorstore_h5.storage.memory.empty`): where fsspec's event loop receives, its faults
        would be taken holding the GIL; the plain client's are taken in ``recv_into``,
        without it, on many threads at once (0.5 GB loads ~10 % faster than populated)."""
        return self._client is None

    def _plain_client(self) -> RangeClient | None:
        """A :class:`RangeClient` for an http(s) URL whose request options it can honour, or for
        an ``s3://`` object by a presigned URL (see :data:`PLAIN_HTTP`), else None."""
        if not PLAIN_HTTP:
            return None
        if self._presigns():
            try:
                return RangeClient(self._presign())
            except Exception:  # noqa: BLE001 - no presigned URL (no credentials...): s3fs reads it
                return None
        if not self._streams():
            return None
        fs = self._fs
        options = dict(fs.kwargs)
        headers = options.pop("headers", None) or {}
        if options or fs.client_kwargs or not all(isinstance(v, str) for v in headers.values()):
            return None
        if "@" in self.path.split("://", 1)[-1].split("/", 1)[0]:  # user:password@host: aiohttp sends them
            return None
        try:
            return RangeClient(str(fs.encode_url(self._key)), headers)
        except ValueError:
            return None

    def _presigns(self) -> bool:
        """True for an S3 object read by presigned URLs: s3fs without options that need headers
        on each request (requester pays, server-side encryption with the caller's key)."""
        protocols = {self._fs.protocol} if isinstance(self._fs.protocol, str) else set(self._fs.protocol)
        if not protocols & {"s3", "s3a"}:
            return False
        fs = self._fs
        return not getattr(fs, "req_kw", None) and not getattr(fs, "s3_additional_kwargs", None)

    def _presign(self) -> str:
        """A URL that GETs the S3 object for :data:`PRESIGN_SECONDS` (s3fs signs it locally)."""
        return str(self._fs.url(self._key, expires=PRESIGN_SECONDS))

    # -- requests

    def _on_loop(self, nbytes: int, make: Callable[[], Awaitable[_T]]) -> _T:
        """The result of the coroutine ``make()`` makes, run on fsspec's event loop and cancelled
        past :func:`deadline` (``nbytes``) with DeadlineError."""
        from fsspec.asyn import sync

        return sync(self._fs.loop, _within, deadline(nbytes), make)

    def _bounded(self, nbytes: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """The file system's method ``name`` called with ``args``: for an asynchronous file system
        (fsspec's HTTP, s3fs) its coroutine, within :meth:`_on_loop`; others' plain method,
        unbounded."""
        fs = self._fs
        _hook_botocore(fs)
        token = _CALLER.set(self)
        try:
            if getattr(fs, "async_impl", False) and callable(getattr(fs, f"_{name}", None)):
                out = self._on_loop(nbytes, lambda: getattr(fs, f"_{name}")(*args, **kwargs))
            else:
                out = getattr(fs, name)(*args, **kwargs)
        finally:
            _CALLER.reset(token)
        self.answered = True
        return out

    def _info(self) -> dict[str, Any]:
        """The object's fsspec ``info`` (size, ETag), within :func:`deadline`."""
        return self._bounded(0, "info", self._key)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, tried again after transient errors (:data:`RETRIES`, :data:`BACKOFF`); a
        request that cannot connect fails at once (:func:`_connect_failure`). Raises RemoteError
        naming the URL."""
        delay = BACKOFF
        for attempt in range(self.retries + 1):
            token = _CALLER.set(self)
            try:
                out = fn()
                self.answered = True
                return out
            except BaseException as e:  # noqa: BLE001 - classified below, re-raised as RemoteError
                if isinstance(e, (KeyboardInterrupt, SystemExit, RemoteError)):
                    raise
                failure = _connect_failure(e)
                if failure is not None and (failure[1] or not getattr(self, "answered", False)):
                    shown = e.__cause__ if isinstance(e, _Unreachable) and e.__cause__ is not None else e
                    tries = f" (after {attempt + 1} tries)" if attempt else ""
                    raise RemoteError(f"{self.path}: {what}: cannot connect: {failure[0]}{tries}; not tried again "
                                      f"({type(shown).__name__}: {shown})") from e
                if attempt == self.retries or not _transient(e):
                    status = _status(e)
                    kind = "not found" if isinstance(e, FileNotFoundError) or status == 404 else \
                        "access denied" if isinstance(e, PermissionError) or status in (401, 403) else "request failed"
                    tries = f" after {attempt + 1} tries" if attempt else ""
                    raise RemoteError(f"{self.path}: {what}: {kind}{tries} ({type(e).__name__}: {e})") from e
                time.sleep(delay)
                delay *= 2
            finally:
                _CALLER.reset(token)
        raise AssertionError

    def head(self, head: int) -> bytes:
        """The object's first ``head`` bytes. Its size and its last :data:`TAIL_BYTES` (where
        a format-2 file keeps its layout) are asked for at the same time, the tail kept for
        the reads that follow (until :meth:`use` or :meth:`release`): opening costs one round
        trip."""
        result: dict[str, Any] = {}

        def ask(name: str, fn: Callable[[], Any]) -> threading.Thread:
            def run() -> None:
                try:
                    result[name] = fn()
                except BaseException as e:  # noqa: BLE001 - raised in the calling thread
                    result.setdefault("error", e)
            t = threading.Thread(target=run, daemon=True)
            t.start()
            return t

        asked = [ask("info", lambda: self._call("size", self._info))]
        tail_of = self._tail_reader() if TAIL_BYTES > head else None
        if tail_of is not None:
            asked.append(ask("tail", tail_of))
        data = self._get(0, head, allow_short=True)
        for t in asked:
            t.join()
        if "error" in result:
            raise result["error"]
        size = result["info"].get("size")
        if type(size) is not int and not (isinstance(size, str) and size.isdigit()):
            raise RemoteError(f"{self.path}: the server gives no size of the object (no Content-Length or "
                              f"Content-Range total; got {size!r}), which a ranged read needs")
        self.size = int(size)
        self.etag = _strong_etag(result["info"])
        tail = result.get("tail")
        if tail is not None:
            with self._lock:
                self.stats["requests"] += 1
                self.stats["bytes"] += len(tail)
            if len(tail) == min(TAIL_BYTES, self.size):  # else not the tail of this object: not kept
                self.use([(self.size - len(tail), tail)])
        return data[:min(head, self.size)]

    def _tail_reader(self) -> Callable[[], bytes | None] | None:
        """A function fetching the object's last :data:`TAIL_BYTES` by a suffix range request
        (None from it where that fails: the tail is only a head start), for the file systems
        known to answer one: HTTP (a server that answers otherwise is hung up on unread) and
        S3. None elsewhere."""
        protocols = {self._fs.protocol} if isinstance(self._fs.protocol, str) else set(self._fs.protocol)

        def guarded(fn: Callable[[], bytes | None]) -> Callable[[], bytes | None]:
            def run() -> bytes | None:
                try:
                    return fn()
                except Exception:  # noqa: BLE001 - the header's and size's requests report errors
                    return None
            return run

        if self._streams():
            return guarded(lambda: self._on_loop(TAIL_BYTES, self._http_tail))
        if protocols & {"s3", "s3a"}:
            return guarded(lambda: self._bounded(TAIL_BYTES, "cat_file", self._key, start=-TAIL_BYTES))
        return None

    async def _http_tail(self) -> bytes | None:
        """``Range: bytes=-TAIL_BYTES`` over fsspec's session; None unless answered 206 with
        the object's last bytes (its ``Content-Range`` ending at its size, at most
        :data:`TAIL_BYTES` of them, all received). Reads no more than the named range."""
        async with await self._http_get(f"bytes=-{TAIL_BYTES}") as r:
            named = parse_content_range(r.headers.get("Content-Range"))
            if r.status != 206 or named is None or named[1] != named[2] or not 0 < named[1] - named[0] <= TAIL_BYTES \
                    or r.content_length not in (None, named[1] - named[0]) or \
                    r.headers.get("Content-Encoding", "identity") not in ("", "identity"):
                return None  # leaving the block unread closes the connection: no whole object downloaded
            data = bytearray(named[1] - named[0])
            return bytes(data) if await self._read_body(r, memoryview(data)) == len(data) else None

    @staticmethod
    async def _read_body(r: Any, view: memoryview) -> int:
        """Copy the body of the aiohttp response ``r`` into ``view`` as it arrives, no more than
        ``len(view)`` bytes; a body not ended there is not read on: its connection is closed
        (not reused). Returns the bytes received (fewer where the body ended early)."""
        got = 0
        while got < len(view):
            chunk = await r.content.read(len(view) - got)  # at most what is still asked for
            if not chunk:
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        if not r.content.is_eof():
            r.close()  # more than asked for may follow (or a drip): the connection goes, unread
        return got

    async def _http_get(self, byte_range: str) -> Any:
        """The response (an async context manager) of a GET of the object with ``Range:
        byte_range``, on fsspec's session, with the file system's own request options."""
        fs = self._fs
        kw = dict(fs.kwargs)
        headers = {k: v for k, v in (kw.pop("headers", None) or {}).items() if k.lower() not in ("range", "accept-encoding")}
        headers.update({"Range": byte_range, "Accept-Encoding": "identity"})  # ranges of the stored bytes, not of gzip
        if self.etag is not None and not byte_range.startswith("bytes=-"):
            headers["If-Match"] = self.etag  # the version opened, or 412
        session = await fs.set_session()
        return session.get(fs.encode_url(self._key), headers=headers, **kw)

    def _get(self, start: int, end: int, allow_short: bool = False) -> bytes:
        """Bytes ``start..end`` by one request; ``allow_short``: fewer where the object ends
        before ``end`` (its header, before its size is known). Over HTTP every answer's range is
        checked (see :func:`tensorstore_h5.storage.httpranges.check_answer`). Raises RemoteError
        naming the URL."""
        if not allow_short and (self._client is not None or self._streams()):
            buf = bytearray(end - start)
            self.fetch([], [(start, memoryview(buf))])
            return bytes(buf)
        if self._streams():  # the header, before the size is known: on fsspec's session, either client
            buf = bytearray(end - start)
            n = self._call(f"bytes {start}..{end}", lambda: self._on_loop(
                end - start, lambda: self._stream_into(start, memoryview(buf), True)))
            return bytes(buf[:n])
        data = self._call(f"bytes {start}..{end}", lambda: self._bounded(end - start, "cat_file", self._key,
                                                                          start=start, end=end))
        with self._lock:
            self.stats["requests"] += 1
            self.stats["bytes"] += len(data)
        if len(data) > end - start:
            raise RemoteError(f"{self.path}: the server ignored the byte range {start}..{end} (sent {len(data)} bytes); "
                              "tensorstore_h5 needs HTTP range requests")
        if len(data) < end - start and not allow_short:
            raise RemoteError(f"{self.path}: the object ends before byte {end} ({len(data)} of {end - start} bytes "
                              "received): truncated or changed while being read")
        return data

    # -- the source interface

    def pread(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset``: from the prefetched ranges where they
        hold them, each gap between them with one request."""
        n, done = len(view), 0
        with self._lock:
            cache = self._cache
        while done < n:
            at = offset + done
            i = bisect.bisect_right(cache, at, key=lambda c: c[0]) - 1
            if i >= 0 and at < cache[i][0] + len(cache[i][1]):
                start, data = cache[i]
                take = min(n - done, start + len(data) - at)
                view[done:done + take] = memoryview(data)[at - start:at - start + take]  # no temporary copy
            else:  # up to the next prefetched range, or the end
                take = min(n - done, (cache[i + 1][0] if i + 1 < len(cache) else offset + n) - at)
                view[done:done + take] = self._get(at, at + take)
            done += take

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Fetch ``(offset, nbytes)`` ranges for the reads that follow (see :meth:`fetch`).
        Replaces what was prefetched before."""
        self.use(self.fetch(ranges))

    def fetch(self, ranges: Sequence[tuple[int, int]], into: Sequence[tuple[int, memoryview]] = ()
              ) -> list[tuple[int, bytes]]:
        """The bytes of ``(offset, nbytes)`` ranges as sorted ``(start, data)`` pieces, for
        :meth:`use`: neighbouring ranges (closer than :data:`MAX_GAP`) by one request, long
        ones split at :data:`REQUEST_BYTES`, all requests concurrent. Safe from any thread.

        ``into``: ``(offset, view)`` pairs filled in place with the bytes at ``offset``, by
        requests of their own (split at :data:`REQUEST_BYTES`) running with the others; over
        HTTP each response streams straight into its view, elsewhere it is copied in.

        Raises RemoteError (naming the URL) when a request fails for good or a server
        ignores or cuts a range."""
        merged = [[s, min(b, s + REQUEST_BYTES)] for a, b in files.coalesce(ranges, MAX_GAP)
                  for s in range(a, b, REQUEST_BYTES)]
        direct = [(at + a, view[a:a + REQUEST_BYTES]) for at, view in into for a in range(0, len(view), REQUEST_BYTES)]
        if not merged and not direct:
            return []
        what = f"{len(merged) + len(direct)} byte ranges"
        if self._client is not None or self._streams():  # GETs whose answers' ranges are checked
            fetched = [bytearray(b - a) for a, b in merged]
            into = [(a, memoryview(buf)) for (a, _), buf in zip(merged, fetched)] + list(direct)
            if self._client is not None:
                self._fetch_plain(into)
            else:  # fsspec's HTTP: our own GETs on its session
                self._call(what, lambda: self._stream_ranges(into))
        else:
            both = merged + [[a, a + len(v)] for a, v in direct]
            fetched = self._call(what, lambda: self._cat_ranges(both))
            for (_, view), data in zip(direct, fetched[len(merged):]):
                view[:] = data
            fetched = fetched[:len(merged)]
        return sorted(zip((a for a, _ in merged), fetched))

    def _fetch_plain(self, into: list[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, view)`` of ``into`` with the bytes at ``offset`` by concurrent
        requests of the plain-HTTP client (each tried again on its own after a transient
        error). Waits for every request; raises the first failure."""
        workers = _request_threads()
        futures = [workers.submit(self._get_into, a, view) for a, view in into]
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for f in futures:
                f.cancel()  # those not started; the running ones are waited for: they write into our views
            concurrent.futures.wait(futures)
        for f in futures:
            if not f.cancelled():
                f.result()

    def _get_into(self, start: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``start`` by one plain-HTTP request (tried again after
        transient errors). Raises RemoteError naming the URL."""
        end = start + len(view)
        client = self._client
        assert client is not None

        def get() -> None:
            until = time.monotonic() + deadline(len(view))  # one try's deadline, its second request included

            def once() -> None:
                client.get_into(start, view, self.size if self.size >= 0 else None, self.etag,
                                deadline=max(0.0, until - time.monotonic()))

            try:
                try:
                    once()
                except HTTPStatusError as e:
                    if e.status != 403 or not self._presigns():
                        raise
                    client.url = self._presign()  # expired: signed again (a key without access fails again)
                    once()
                except VersionError:
                    self._after_412(_strong_etag(self._call("size", self._info)))
                    once()
            except RangeAnswerError as e:
                raise self._answer_error(e) from e

        self._call(f"bytes {start}..{end}", get)
        with self._lock:
            self.stats["requests"] += 1
            self.stats["bytes"] += len(view)

    def _after_412(self, etag: str | None) -> None:
        """After a 412 to ``If-Match``, with ``etag`` the object's strong ETag now: raises VersionError
        where it is no longer the one opened; where it still is, the server's preconditions
        are not to be trusted (servers behind one name whose ETags differ): later requests go
        without ``If-Match``, checked by the object's size alone."""
        if etag != self.etag:
            raise VersionError(f"the object changed while being read: its ETag is {etag}, it was {self.etag} "
                               "when opened")
        self.etag = None

    def _answer_error(self, e: RangeAnswerError) -> RemoteError:
        """The error to raise for an answer that is not the asked range, naming the URL."""
        needs = "; tensorstore_h5 needs HTTP range requests" if "ignored" in str(e) else ""
        return RemoteError(f"{self.path}: {e}{needs}")

    def _streams(self) -> bool:
        """True where responses can stream into memory of ours: fsspec's HTTP file system."""
        try:
            from fsspec.implementations.http import HTTPFileSystem
        except ImportError:  # pragma: no cover - fsspec without aiohttp cannot open http:// either
            return False
        return isinstance(self._fs, HTTPFileSystem)

    def _stream_ranges(self, into: list[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, view)`` of ``into`` with the bytes at ``offset``, all requests
        concurrent on fsspec's event loop, each within its :func:`deadline`. Raises the first
        request's error (DeadlineError for one past its deadline)."""
        from fsspec.asyn import sync

        async def run() -> list[Any]:
            asked = (_within(deadline(len(view)), lambda a=a, view=view: self._stream_into(a, view)) for a, view in into)
            return await asyncio.gather(*asked, return_exceptions=True)

        for result in sync(self._fs.loop, run):
            if isinstance(result, BaseException):
                raise result

    async def _stream_into(self, start: int, view: memoryview, allow_short: bool = False) -> int:
        """One range GET on fsspec's session whose body is copied, as it arrives, into ``view``
        (no more than ``len(view)`` bytes of it read); the answer's range is checked
        (:func:`tensorstore_h5.storage.httpranges.check_answer`). ``allow_short``: an answer that
        says the object ends before ``start + len(view)`` fills only that part. Returns the bytes
        filled. Raises RemoteError naming the URL for another range or a body cut short."""
        end = start + len(view)
        for again in (False, True):  # again: after a 412 from a server whose preconditions are not to be trusted
            r = await (await self._http_get(f"bytes={start}-{end - 1}")).__aenter__()
            try:
                if allow_short:  # the object's own end, where it says it ends before the range does
                    named = parse_content_range(r.headers.get("Content-Range"))
                    if r.status == 206 and named is not None and named[0] == start and named[1] == named[2]:
                        end = min(end, named[1])
                    elif r.status == 200 and start == 0 and r.content_length is not None:
                        end = min(end, r.content_length)
                check_answer(r.status, r.reason or "", r.headers.get("Content-Range"), r.content_length, start, end,
                             self.size if self.size >= 0 else None, r.headers.get("Content-Encoding"))
                break
            except VersionError as e:
                r.release()
                if again:
                    raise self._answer_error(e) from None
                try:
                    self._after_412(_strong_etag(await self._fs._info(self._key)))
                except VersionError as changed:
                    raise self._answer_error(changed) from None
            except RangeAnswerError as e:
                r.close()  # unread: the connection is dropped
                raise self._answer_error(e) from None
            except BaseException:
                r.close()
                raise
        async with r:
            got = await self._read_body(r, view[:end - start])
        with self._lock:
            self.stats["requests"] += 1
            self.stats["bytes"] += got
        if got != end - start:
            raise RemoteError(f"{self.path}: the server ended early for bytes {start}..{end} ({got} bytes received)")
        return got

    def use(self, pieces: list[tuple[int, bytes]]) -> None:
        """Serve reads from ``pieces`` (from :meth:`fetch`), dropping what was there before."""
        with self._lock:
            self._cache = pieces

    def _cat_ranges(self, merged: list[list[int]]) -> list[bytes]:
        """The bytes of ``merged``'s ranges by the file system's ``cat_ranges`` (an asynchronous
        one's within the :func:`deadline` of all their bytes). Raises the first range's error."""
        out = self._bounded(sum(b - a for a, b in merged), "cat_ranges", [self._key] * len(merged),
                            [a for a, _ in merged], [b for _, b in merged], on_error="return")
        for (a, b), data in zip(merged, out):
            if isinstance(data, BaseException):
                raise data
        return self._check(merged, out)

    def _check(self, merged: list[list[int]], out: list[bytes]) -> list[bytes]:
        """``out``, the bodies of ``merged``'s requests, counted in :attr:`stats`. Raises
        RemoteError for a body longer (the range ignored) or shorter than its range."""
        result = []
        for (a, b), data in zip(merged, out):
            with self._lock:
                self.stats["requests"] += 1
                self.stats["bytes"] += len(data)
            if len(data) != b - a:
                what = "ignored the byte range" if len(data) > b - a else "ended early"
                raise RemoteError(f"{self.path}: the server {what} for bytes {a}..{b} ({len(data)} bytes received)")
            result.append(data)
        return result

    def release(self) -> None:
        """Drop the prefetched bytes."""
        with self._lock:
            self._cache = []

    def close(self) -> None:
        """Drop the prefetched bytes (idle connections and request threads stay for the next
        source, see :data:`tensorstore_h5.storage.httpranges.IDLE_PER_HOST`)."""
        self.release()

    def _fileno(self) -> int:
        raise ValueError(f"{self.path}: a remote object has no file descriptor")


class FileObjSource(files.Source):
    """A readable, seekable binary file object, read by byte ranges (under a lock: the
    object has one position)."""

    local = False

    def __init__(self, f: Any) -> None:
        self._f = f
        self.path = self.name_of(f)
        self._lock = threading.Lock()
        try:
            here = f.tell()
            self.size = f.seek(0, os.SEEK_END)
            f.seek(here)
        except (OSError, ValueError, stdio.UnsupportedOperation) as e:
            raise TypeError(f"{self.path}: the file object must be readable and seekable ({e})") from e
        self.identity = (0, id(f))
        self.stats = {"requests": 0, "bytes": 0}

    def pread(self, offset: int, view: memoryview) -> None:
        with self._lock:
            self._f.seek(offset)
            done = 0
            while done < len(view):
                got = self._f.readinto(view[done:]) if hasattr(self._f, "readinto") else None
                if got is None:
                    chunk = self._f.read(len(view) - done)
                    got = len(chunk)
                    view[done:done + got] = chunk
                if not got:
                    raise EOFError(f"{self.path}: ends at byte {offset + done}, {len(view) - done} bytes short (truncated?)")
                done += got
            self.stats["requests"] += 1
            self.stats["bytes"] += len(view)

    @staticmethod
    def name_of(f: Any) -> str:
        """What messages call a file object: its name, or its type."""
        name = getattr(f, "name", None)
        return name if isinstance(name, str) else f"<{type(f).__name__}>"

    def fetch(self, ranges: Sequence[tuple[int, int]], into: Sequence[tuple[int, memoryview]] = ()
              ) -> list[tuple[int, bytes]]:
        """Nothing to fetch ahead (reads go where the bytes lie); ``into``'s views are read now."""
        for offset, view in into:
            self.pread(offset, view)
        return []

    def use(self, pieces: list[tuple[int, bytes]]) -> None:
        pass

    populate = False  # nothing is streamed into new memory: fetch reads each view in place

    def close(self) -> None:
        pass  # the caller owns the file object

    def _fileno(self) -> int:
        raise ValueError(f"{self.path}: a file object has no file descriptor tensorstore_h5 maps")


class HDF5FileObject(stdio.RawIOBase):
    """A source as the read-only file object h5py takes (format-1 and foreign files over a URL)."""

    def __init__(self, source: Any) -> None:
        self._src = source
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._src.size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._src.size - self._pos))
        if n:
            self._src.pread(self._pos, memoryview(b).cast("B")[:n])
        self._pos += n
        return n


def upload(local: str, target: Any, storage_options: dict[str, Any] | None = None, retries: int | None = None) -> None:
    """Copy the finished file ``local`` to ``target`` (a URL or a writable binary file object).

    Object stores (s3, gs, az) make an object visible only once its upload completes, so a
    failed save leaves none; other file systems get a temporary name beside the target,
    renamed into place. Raises RemoteError naming the URL.
    """
    if is_fileobj(target):
        with open(local, "rb") as f:
            while True:
                block = f.read(8 << 20)
                if not block:
                    break
                target.write(block)
        if hasattr(target, "flush"):
            target.flush()
        return
    fsspec = _fsspec()
    fs, key = fsspec.core.url_to_fs(target, **(storage_options or {}))
    src = RemoteSource.__new__(RemoteSource)
    src.path, src.retries, src.answered = target, RETRIES if retries is None else retries, False
    _hook_botocore(fs)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}:
        src._call("upload", lambda: fs.put_file(local, key))
        return
    tmp = f"{key}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        src._call("upload", lambda: fs.put_file(local, tmp))
        src._call("rename", lambda: fs.mv(tmp, key))
    except BaseException:
        try:
            fs.rm(tmp)
        except Exception:  # noqa: BLE001 - best effort; the upload's own error is raised
            pass
        raise
