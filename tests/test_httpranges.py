"""The plain-socket HTTP client (tensorstore_h5.storage.httpranges): exact ranges into the caller's
memory, every answer checked, redirects, kept-alive connections, bounded concurrency. All on
127.0.0.1 (the suite's range server)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.bench.loopback import RangeServer
from tensorstore_h5.storage import httpranges, remote
from tensorstore_h5.storage.httpranges import HTTPStatusError, RangeAnswerError, RangeClient, check_answer

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    g = torch.Generator().manual_seed(3)
    model = {f"layers.{i}.weight": torch.randn(512, 1024, generator=g) for i in range(12)}  # 2 MiB each
    th5.save(model, root / "model.h5")
    (root / "blob.bin").write_bytes(os.urandom(3 * 2**20 + 17))
    return root, model


@pytest.fixture()
def server(root):
    srv = RangeServer(root[0])
    yield srv
    srv.stop()


def _idle(server: RangeServer) -> list:
    """The idle connections kept for ``server``."""
    return [c for key, conns in httpranges._idle.items() if key[2] == server.port for c in conns]


def _plain_source(store: th5.Store) -> remote.RemoteSource:
    src = store._reader.rawfile()
    assert isinstance(src, remote.RemoteSource) and src._client is not None, "not read by the plain client"
    return src


def test_ranges_land_exactly_in_the_callers_memory(root, server) -> None:
    blob = (root[0] / "blob.bin").read_bytes()
    client = RangeClient(server.url("blob.bin"))
    out = bytearray(len(blob) + 10)
    view = memoryview(out)
    assert client.get_into(5, view[3:3 + 2**20], size=len(blob)) == len(blob)
    assert out[3:3 + 2**20] == blob[5:5 + 2**20] and out[:3] == b"\0\0\0" and out[3 + 2**20:] == bytes(len(out) - 3 - 2**20)
    tail = bytearray(17)
    client.get_into(len(blob) - 17, memoryview(tail))
    assert bytes(tail) == blob[-17:]
    assert len(_idle(server)) == 1  # one connection, kept alive between the two requests
    again = RangeClient(server.url("blob.bin"))  # another client of the same host takes it
    again.get_into(0, memoryview(tail))
    assert bytes(tail) == blob[:17] and len(server.requests) == 3 and len(_idle(server)) == 1
    httpranges.close_idle()
    assert not _idle(server)


def test_every_answer_is_checked() -> None:
    assert check_answer(206, "", "bytes 10-19/100", 10, 10, 20, 100) == 100
    assert check_answer(200, "", None, 100, 0, 100, 100) == 100  # the whole object asked: a 200 is right
    with pytest.raises(RangeAnswerError, match="ignored the byte range"):
        check_answer(200, "", None, 100, 10, 20, 100)
    with pytest.raises(RangeAnswerError, match="another byte range"):
        check_answer(206, "", "bytes 11-20/100", 10, 10, 20, 100)
    with pytest.raises(RangeAnswerError, match="another byte range"):
        check_answer(206, "", None, 10, 10, 20, 100)
    with pytest.raises(RangeAnswerError, match="ended early"):
        check_answer(206, "", "bytes 10-15/100", 6, 10, 20, 100)
    with pytest.raises(RangeAnswerError, match="ended early"):
        check_answer(206, "", "bytes 10-19/100", 4, 10, 20, 100)
    with pytest.raises(RangeAnswerError, match="changed while being read: 90 bytes now, 100 when opened"):
        check_answer(206, "", "bytes 10-19/90", 10, 10, 20, 100)
    with pytest.raises(HTTPStatusError, match="404") as e:
        check_answer(404, "Not Found", None, 9, 10, 20, 100)
    assert e.value.status == 404


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_redirects_are_followed_and_only_permanent_ones_remembered(root, server, status) -> None:
    """A 301/308 target is asked directly afterwards; a 302/307 one (a signed URL that
    expires) again through the first URL."""
    _, model = root
    server.behaviour.redirect["/moved.h5"] = "/model.h5"
    server.behaviour.redirect_status = status
    with th5.open(server.url("moved.h5")) as s:
        src = _plain_source(s)
        first = s.load(select="layers.[0-3].weight")
        permanent = status in (301, 308)
        assert src._client.url == server.url("model.h5" if permanent else "moved.h5")
        server.reset()
        server.behaviour.redirect["/moved.h5"] = "/model.h5"
        server.behaviour.redirect_status = status
        second = s.load(select="layers.[4-7].weight")
    assert sorted(server.paths) == (["/model.h5"] * 4 if permanent else ["/model.h5"] * 4 + ["/moved.h5"] * 4)
    for out in (first, second):
        assert len(out) == 4 and all(torch.equal(out[k], model[k]) for k in out)


def test_redirects_keep_credentials_on_their_origin_and_refuse_other_schemes(root, server) -> None:
    other = RangeServer(root[0])  # another port: another origin
    try:
        secret = {"Authorization": "Bearer SECRET", "Cookie": "s=1", "X-Trace": "7"}
        server.behaviour.redirect["/same.bin"] = "/blob.bin"
        server.behaviour.redirect["/away.bin"] = other.url("blob.bin")
        out = bytearray(16)
        RangeClient(server.url("same.bin"), secret).get_into(0, memoryview(out))
        assert server.headers[-1]["Authorization"] == "Bearer SECRET" and server.paths[-1] == "/blob.bin"
        RangeClient(server.url("away.bin"), secret).get_into(0, memoryview(out))
        got = other.headers[-1]
        assert "Authorization" not in got and "Cookie" not in got and got["X-Trace"] == "7"
        assert bytes(out) == (root[0] / "blob.bin").read_bytes()[:16]
        server.behaviour.redirect["/ftp.bin"] = "ftp://127.0.0.1/blob.bin"
        with pytest.raises(HTTPStatusError, match="refused"):
            RangeClient(server.url("ftp.bin")).get_into(0, memoryview(out))
        server.behaviour.redirect["/loop.bin"] = "/loop.bin"
        with pytest.raises(HTTPStatusError, match="redirects"):
            RangeClient(server.url("loop.bin")).get_into(0, memoryview(out))
    finally:
        other.stop()


def test_a_connection_the_server_closed_after_answering_is_replaced(root, server, monkeypatch) -> None:
    """The server ends each kept-alive connection after its answer without saying so: the next
    request on it finds it closed (RemoteDisconnected) and goes again on a new connection."""
    _, model = root
    monkeypatch.setattr(remote, "RETRIES", 0)  # a second try would hide the replacement
    server.behaviour.close_after = True
    with th5.open(server.url("model.h5")) as s:
        _plain_source(s)
        for i in range(3):
            time.sleep(0.05)  # the server's close has arrived
            assert torch.equal(s[f"layers.{i}.weight"][:4], model[f"layers.{i}.weight"][:4])


def test_an_idle_connection_the_server_closed_is_replaced_without_a_retry(root, server, monkeypatch) -> None:
    _, model = root
    monkeypatch.setattr(remote, "RETRIES", 0)  # a second try would hide the replacement
    with th5.open(server.url("model.h5")) as s:
        _plain_source(s)
        assert torch.equal(s["layers.1.weight"][:4], model["layers.1.weight"][:4])
        idle = _idle(server)
        assert idle, "the connection was not kept alive"
        for conn in idle:
            conn.sock.shutdown(2)  # as a server that timed it out: the next request on it fails
        assert torch.equal(s["layers.2.weight"][:4], model["layers.2.weight"][:4])


def test_requests_in_flight_are_bounded_by_connections(root, server, monkeypatch) -> None:
    """With remote.CONNECTIONS = 2, 8 requests answered after 0.1 s each take 4 waves."""
    monkeypatch.setattr(remote, "CONNECTIONS", 2)
    with th5.open(server.url("model.h5")) as s:
        server.reset()
        server.behaviour.latency = 0.1
        t0 = time.perf_counter()
        parts = s.read_many({f"layers.{i}.weight": slice(0, 2) for i in range(8)})
        took = time.perf_counter() - t0
    assert len(parts) == 8 and len(server.requests) == 8 and took >= 4 * 0.1, took


def test_request_headers_reach_the_server_and_session_options_choose_fsspec(root, server) -> None:
    _, model = root
    with th5.open(server.url("model.h5"), storage_options={"headers": {"Authorization": "Bearer abc"}}) as s:
        _plain_source(s)
        server.reset()
        assert torch.equal(s["layers.3.weight"].read(), model["layers.3.weight"])
    assert server.headers and all(h.get("Authorization") == "Bearer abc" for h in server.headers)
    with th5.open(server.url("model.h5"), storage_options={"client_kwargs": {"trust_env": False}}) as s:
        assert s._reader.rawfile()._client is None  # only fsspec's session honours these
        assert torch.equal(s["layers.4.weight"].read(), model["layers.4.weight"])
    server.reset()
    with th5.open(server.url("model.h5").replace("://", "://user:pw@")) as s:  # credentials in the URL: fsspec sends them
        assert s._reader.rawfile()._client is None
        assert torch.equal(s["layers.5.weight"].read(), model["layers.5.weight"])
    assert server.headers and all(h.get("Authorization", "").startswith("Basic ") for h in server.headers)


def test_a_forked_child_does_not_use_its_parents_connections_or_locks(root, server) -> None:
    """A data-loader worker forked after (or during) a load makes its own connections and
    threads: two processes reading answers from one socket would take each other's bytes, and
    a lock held by another thread of the parent at the fork would never be released."""
    blob = (root[0] / "blob.bin").read_bytes()
    RangeClient(server.url("blob.bin")).get_into(0, memoryview(bytearray(8)))
    assert len(_idle(server)) == 1
    key = ("http", "127.0.0.1", server.port)
    read, write = os.pipe()
    with httpranges._idle_lock, remote._threads_lock:  # as if a request thread held them at the fork
        pid = os.fork()
        if pid == 0:  # the child: read through a source's threads, say what it got, and leave at once
            try:
                idle = httpranges._take_idle(key)
                out = bytearray(100)
                src = remote.RemoteSource.__new__(remote.RemoteSource)
                src.path, src.retries, src.size, src._lock = server.url("blob.bin"), 0, len(blob), __import__("threading").Lock()
                src.stats, src._client = {"requests": 0, "bytes": 0}, RangeClient(server.url("blob.bin"))
                src.etag = None
                src._fetch_plain([(5, memoryview(out))])
                os.write(write, b"ok" if idle is None and bytes(out) == blob[5:105] else b"wrong")
            finally:
                os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child hung on a lock or on its parent's threads")
        time.sleep(0.01)
    answer = os.read(read, 16)
    os.close(read)
    assert answer == b"ok" and len(_idle(server)) == 1  # the parent's connection stays the parent's


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key, and the key: (cert file, key file)."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_https_ranges_arrive_exactly_and_an_unknown_certificate_is_refused(root, tmp_path, monkeypatch) -> None:
    import ssl

    cert, key = _self_signed(tmp_path)
    srv = RangeServer(root[0], tls=(cert, key))
    try:
        blob = (root[0] / "blob.bin").read_bytes()
        monkeypatch.setattr(RangeClient, "_ssl", None)  # the system's certificate authorities
        with pytest.raises(ssl.SSLCertVerificationError):
            RangeClient(srv.url("blob.bin")).get_into(0, memoryview(bytearray(8)))
        monkeypatch.setattr(RangeClient, "_ssl", ssl.create_default_context(cafile=cert))  # as SSL_CERT_FILE would
        out = bytearray(2**20 + 3)
        RangeClient(srv.url("blob.bin")).get_into(1000, memoryview(out), size=len(blob))
        assert out == blob[1000:1000 + len(out)] and srv.scheme == "https"
    finally:
        srv.stop()
        httpranges.close_idle()


def test_a_server_that_stalls_times_out_and_is_tried_a_bounded_number_of_times(root, server, monkeypatch) -> None:
    monkeypatch.setattr(httpranges, "TIMEOUT", 0.3)
    monkeypatch.setattr(remote, "RETRIES", 1)
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    with th5.open(server.url("model.h5")) as s:
        _plain_source(s)
        server.behaviour.latency = 2.0
        t0 = time.perf_counter()
        with pytest.raises(th5.TensorStoreError, match=r"model\.h5: key 'layers\.0\.weight': .*after 2 tries.*timed out"):
            s["layers.0.weight"][:2]
    assert time.perf_counter() - t0 < 1.9  # two tries of 0.3 s, not the server's 2 s
