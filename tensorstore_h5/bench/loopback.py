"""A loopback HTTP server for the remote tests and ``tensorstore-h5 bench --remote``: the files
of a directory, with byte ranges, counting every request and byte it sends, with added latency,
and misbehaving on request (errors, ignored ranges, dropped connections, short answers).
127.0.0.1 only, on a free port; :meth:`RangeServer.stop` stops it.

:class:`ServerProcess` runs one in a process of its own (``python -m tensorstore_h5.bench.loopback``),
driven through a control path: a server inside the measuring process would take turns with
the client for its interpreter lock, which no real server does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["Behaviour", "RangeServer", "ServerProcess", "CONTROL", "free_port"]

CONTROL = "/_control"
"""The path of a server started with ``control=True``: GET answers its counts as JSON, POST
``{"latency": seconds}`` or ``{"reset": true}`` changes it. Neither is counted nor delayed."""


@dataclass
class Behaviour:
    """What the server does; change it between requests from a test."""

    latency: float = 0.0           # seconds before each answer
    ignore_range: bool = False     # answer 200 with the whole file
    status: dict[str, int] = field(default_factory=dict)  # path -> status to answer (403, 404, 500)
    drop_next: int = 0             # close the connection mid-body on this many requests
    short: bool = False            # send fewer bytes than the range asks for
    suffix: bool = True            # answer suffix ranges (bytes=-N); False: the whole file, as some servers do
    redirect: dict[str, str] = field(default_factory=dict)  # path -> location to answer redirect_status with
    redirect_status: int = 302
    shift_range: int = 0           # answer the range this many bytes later than asked (and say so)
    encoding: str = ""             # a Content-Encoding to label answers with (the bytes stay the stored ones)
    chunked: bool = False          # send bodies with Transfer-Encoding: chunked instead of a Content-Length
    etag: bool = True              # send ETags and honour If-Match (412 for another version)
    refuse_if_match: bool = False  # answer 412 to every If-Match, as servers behind one name whose ETags differ
    close_after: bool = False      # close each connection after its answer, without saying so (as a server
                                   # whose keep-alive timeout ran out between two requests)


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # clients open many connections at once (the default 5 made them retry SYNs for seconds)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-response (a cancelled read, a test's abort) is normal here."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class RangeServer:
    """Serves the files under ``root`` (see the module); ``control``: also the :data:`CONTROL` path."""

    def __init__(self, root: str | Path, control: bool = False, tls: tuple[str, str] | None = None) -> None:
        """``tls``: (certificate file, key file) to serve ``https://`` with."""
        self.root = Path(root)
        self.scheme = "https" if tls else "http"
        self.behaviour = Behaviour()
        self.requests: list[tuple[str, str, int]] = []  # (method, range header, bytes sent)
        self.paths: list[str] = []  # the path of each request, in the order of requests
        self.headers: list[dict[str, str]] = []  # the headers of each request
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # TCP_NODELAY, as servers set it: headers and body go in two
            # writes, and Nagle's algorithm held the second until the client's delayed ACK (~40 ms)

            def log_message(self, *args: object) -> None:
                pass

            def _file(self) -> Path | None:
                path = self.root / self.path.lstrip("/").split("?")[0]
                return path if path.is_file() else None

            @property
            def root(self) -> Path:
                return server.root

            def _answer(self, body: bytes, status: int, headers: dict[str, str], send_body: bool,
                        length: int | None = None) -> None:
                b = server.behaviour
                if b.latency:
                    time.sleep(b.latency)
                drop = False
                if send_body:
                    with server._lock:
                        drop = b.drop_next > 0
                        if drop:
                            b.drop_next -= 1
                sent = 0 if not send_body else len(body) // 2 if drop else len(body)
                with server._lock:  # counted before anything is sent (headers included: a HEAD is done
                    # when they arrive): the client may be done before this thread goes on
                    server.requests.append((self.command, self.headers.get("Range", ""), sent))
                    server.paths.append(self.path)
                    server.headers.append(dict(self.headers))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if b.encoding and status in (200, 206):
                    self.send_header("Content-Encoding", b.encoding)
                if b.chunked and send_body:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                if send_body:
                    if b.chunked:
                        for at in range(0, sent, 65536):
                            part = body[at:min(sent, at + 65536)]
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        if not drop:
                            self.wfile.write(b"0\r\n\r\n")
                    else:
                        self.wfile.write(body[:sent])
                    self.wfile.flush()
                    if drop:
                        self.connection.shutdown(2)
                        self.close_connection = True
                if b.close_after:
                    self.close_connection = True

            def _serve(self, send_body: bool) -> None:
                b = server.behaviour
                status = b.status.get(self.path)
                if status:
                    self._answer(b"denied", status, {}, send_body)
                    return
                if self.path in b.redirect:
                    self._answer(b"moved", b.redirect_status, {"Location": b.redirect[self.path]}, send_body)
                    return
                f = self._file()
                if f is None:
                    self._answer(b"not found", 404, {}, send_body)
                    return
                st = f.stat()
                size = st.st_size
                etag = f'"{st.st_mtime_ns:x}-{size:x}"'  # as servers make them: changes when the file does
                if b.etag and self.headers.get("If-Match") not in (None, "*", etag) or \
                        b.refuse_if_match and self.headers.get("If-Match"):
                    self._answer(b"precondition failed", 412, {"ETag": etag}, send_body)
                    return
                found = {"Accept-Ranges": "bytes", **({"ETag": etag} if b.etag else {})}  # headers of a 200 or 206
                asked = self.headers.get("Range", "")
                last = re.fullmatch(r"bytes=-(\d+)", asked)
                if last is not None and b.suffix and size:  # the last N bytes (RFC 9110)
                    asked = f"bytes={max(0, size - int(last.group(1)))}-"
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", asked)
                if m is None or b.ignore_range:
                    self._answer(f.read_bytes() if send_body else b"", 200, found, send_body, size)
                    return
                start = int(m.group(1)) + b.shift_range
                end = min(size - 1, int(m.group(2)) + b.shift_range) if m.group(2) else size - 1
                if start >= size:
                    self._answer(b"", 416, {"Content-Range": f"bytes */{size}"}, send_body)
                    return
                with open(f, "rb") as fh:  # only the range: the files are large
                    fh.seek(start)
                    part = fh.read(end + 1 - start)
                if b.short:
                    part = part[: max(0, len(part) - 7)]
                self._answer(part, 206, {"Content-Range": f"bytes {start}-{start + len(part) - 1}/{size}",
                                         **found}, send_body)

            def _control(self) -> bool:
                """Answer a request to the control path; False for any other request."""
                if not control or self.path != CONTROL:
                    return False
                if self.command == "POST":
                    asked = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    if asked.get("reset"):
                        server.reset()
                    if "latency" in asked:
                        server.behaviour.latency = float(asked["latency"])
                with server._lock:
                    body = json.dumps({"bytes_sent": sum(n for _, _, n in server.requests),
                                       "requests": len(server.requests)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return True

            def do_GET(self) -> None:  # noqa: N802
                if not self._control():
                    self._serve(True)

            def do_POST(self) -> None:  # noqa: N802
                if not self._control():
                    self.close_connection = True  # its body is left unread
                    self._answer(b"read only", 405, {}, True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(False)

        self._server = _Server(("127.0.0.1", 0), Handler)
        if tls:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{name}"

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.paths.clear()
            self.headers.clear()
        self.behaviour = Behaviour()

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, _, n in self.requests)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A :class:`RangeServer` of ``root`` in a child process, driven over its control path; the
    child ends with :meth:`stop`, or when this process ends (it serves until its stdin closes)."""

    def __init__(self, root: str | Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tensorstore_h5.bench.loopback", str(root)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line.strip().isdigit():
            self._proc.kill()
            raise RuntimeError(f"the loopback server did not start (it printed {line!r})")
        self.port = int(line)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def control(self, **asked: object) -> dict[str, int]:
        """POST ``asked`` (``latency=``, ``reset=True``) when given; the server's counts."""
        data = json.dumps(asked).encode() if asked else None
        with urllib.request.urlopen(urllib.request.Request(self.url(CONTROL.lstrip("/")), data=data), timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorstore_h5.bench.loopback ROOT``: serve ROOT with the control path on a free port
    of 127.0.0.1, print the port, and serve until standard input closes."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m tensorstore_h5.bench.loopback DIRECTORY", file=sys.stderr)
        return 2
    server = RangeServer(args[0], control=True)
    print(server.port, flush=True)
    try:
        sys.stdin.read()  # until the parent closes it, or ends
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
