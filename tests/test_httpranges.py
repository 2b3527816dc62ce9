"""The plain-socket HTTP client (tensorstore_h5.httpranges): exact ranges into the caller's
memory, every answer checked, redirects, kept-alive connections, bounded concurrency. All on
127.0.0.1 (the suite's range server)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import httpranges, remote
from tensorstore_h5.httpranges import HTTPStatusError, RangeAnswerError, RangeClient, check_answer
from tensorstore_h5.loopback import RangeServer

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
    src = store._rawfile()
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


def test_the_client_follows_a_redirect_and_then_asks_its_target(root, server) -> None:
    _, model = root
    server.behaviour.redirect["/moved.h5"] = "/model.h5"
    with th5.open(server.url("moved.h5")) as s:
        src = _plain_source(s)
        first = s.load(select="layers.[0-3].weight")
        assert src._client.url == server.url("model.h5")
        server.reset()
        server.behaviour.redirect["/moved.h5"] = "/model.h5"
        second = s.load(select="layers.[4-7].weight")
    assert server.paths == ["/model.h5"] * 4, server.paths  # no request to the old location any more
    for out in (first, second):
        assert len(out) == 4 and all(torch.equal(out[k], model[k]) for k in out)
    server.behaviour.redirect["/loop.h5"] = "/loop.h5"
    client = RangeClient(server.url("loop.h5"))
    with pytest.raises(HTTPStatusError, match="redirects"):
        client.get_into(0, memoryview(bytearray(8)))


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
        assert s._rawfile()._client is None  # only fsspec's session honours these
        assert torch.equal(s["layers.4.weight"].read(), model["layers.4.weight"])


def test_a_forked_child_does_not_use_its_parents_connections(root, server) -> None:
    """A data-loader worker forked after a load makes its own connections: two processes
    reading answers from one socket would take each other's bytes."""
    RangeClient(server.url("blob.bin")).get_into(0, memoryview(bytearray(8)))
    assert len(_idle(server)) == 1
    key = ("http", "127.0.0.1", server.port)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer whether it was handed an idle connection, and leave at once
        os.write(write, b"none" if httpranges._take_idle(key) is None else b"took")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert answer == b"none" and len(_idle(server)) == 1  # the parent's connection stays the parent's


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
