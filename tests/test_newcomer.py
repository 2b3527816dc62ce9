"""What a newcomer trips on first (issue #33): the command's --version, a listing piped into
`head`, a torch.save file of a pickled module, what dir() of the package shows, the order the
suite runs in, and a URL whose server cannot be reached (it fails at once, naming the URL,
instead of being tried again for half a minute). Commands run as a user runs them: in a
subprocess; servers on 127.0.0.1."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5 import cli
from tensorstore_h5.bench.loopback import RangeServer, free_port
from tensorstore_h5.storage import httpranges, remote

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """The environment of a command: this checkout first on the path, whatever is installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def run(*args: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorstore_h5", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=_env())


# ---------------------------------------------------------------------------- A. the command line


def test_version_prints_the_package_version() -> None:
    r = run("--version")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == f"tensorstore-h5 {th5.__version__}\n"
    assert th5.__version__ and th5.__version__[0].isdigit()  # setup.cfg reads it from here (attr:)
    assert "--version" in run("--help").stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("head") is None, reason="needs bash and head")
@pytest.mark.parametrize("extra", ["", "--json"])
def test_a_listing_piped_into_head_exits_0_without_a_word(tmp_path, extra) -> None:
    """`tensorstore-h5 ls big.h5 | head -2` under `set -o pipefail`: the pipe closes long before
    the listing (~170 KB, over a pipe's buffer) is written; the command stops with status 0
    and prints nothing to stderr (no traceback, no "Exception ignored" at exit)."""
    th5.save({f"layer.{i}.{'x' * 80}": torch.zeros(1) for i in range(1500)}, tmp_path / "big.h5")
    line = f'"$PY" -m tensorstore_h5 ls {extra} big.h5 | head -2'
    r = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**_env(), "PY": sys.executable})
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    assert len(r.stdout.splitlines()) == 2


@pytest.mark.parametrize("saved, named", [("module", "torch.nn.modules.linear.Linear"),
                                          ("namespace", "argparse.Namespace")])
def test_a_pickled_object_is_named_in_one_line(tmp_path, saved, named) -> None:
    """`torch.save(model, ...)` (or a checkpoint holding an argparse.Namespace): one line that
    names the file, says what it holds and what to do, without torch's advice for its own API
    and its terminal escapes."""
    model = torch.nn.Linear(2, 2)
    path = tmp_path / f"{saved}.pt"
    torch.save(model if saved == "module" else {"model": model.state_dict(), "args": argparse.Namespace(lr=1e-3)},
               path)
    r = run("convert", str(path), str(tmp_path / "out.h5"))
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n") and "\x1b" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"tensorstore-h5: error: {path}: holds a pickled {named} object"), r.stderr
    assert "weights_only=False" in r.stderr and "state_dict()" in r.stderr and "trust" in r.stderr
    assert not (tmp_path / "out.h5").exists()
    torch.save(model.state_dict(), tmp_path / "state.pt")  # what the message says to do converts
    assert run("convert", str(tmp_path / "state.pt"), str(tmp_path / "out.h5")).returncode == 0


def test_error_lines_carry_no_terminal_escapes() -> None:
    assert cli._error_text(ValueError("a \x1b[1mbold\x1b[0m word")) == "a bold word"


# ---------------------------------------------------------------------------- B. dir() of the package


def test_dir_lists_the_public_api_only() -> None:
    """dir(th5), before and after the names that need torch are bound: ``__all__``, the
    submodules the docs use, dunders; not the helpers __init__ imports nor the submodules the
    package imported along the way (they stay attributes). Each name listed resolves."""
    code = """
import json, tensorstore_h5 as th5
before = dir(th5)
th5.load
print(json.dumps([before, dir(th5), th5.api.__name__]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr
    import json

    before, after, api = json.loads(r.stdout)
    def plain(names) -> set[str]:
        return {n for n in names if not (n.startswith("__") and n.endswith("__"))}

    public = plain(th5.__all__) | {"distributed", "storage", "transfer"}
    for listed in (before, after, dir(th5)):
        assert listed == sorted(listed) and set(th5.__all__) <= set(listed)
        assert plain(listed) == public, plain(listed) ^ public
        assert not {"Any", "TYPE_CHECKING", "annotations", "api", "reading", "writing", "errors"} & set(listed)
    assert api == "tensorstore_h5.api"
    for name in dir(th5):
        getattr(th5, name)


# ---------------------------------------------------------------------------- C. the suite's order


def test_the_fuzzer_runs_last() -> None:
    """tests/hostile/test_fuzz.py (60 s without output) is collected first by name; the suite runs
    it last, whatever the order it is given in."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/hostile/test_fuzz.py", "tests/test_tree.py"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    fuzz = [i for i, line in enumerate(ids) if line.startswith("tests/hostile/test_fuzz.py::")]
    assert fuzz and ids[0].startswith("tests/test_tree.py::"), ids[:3]
    assert fuzz == list(range(len(ids) - len(fuzz), len(ids))), ids[-4:]
    assert any(i.startswith("tests/hostile/test_fuzz.py::test_fuzz_for_a_bounded_time") for i in ids)  # (one per surface)


# ---------------------------------------------------------------------------- D. servers that cannot be reached



@pytest.fixture(params=["plain", "fsspec"])
def client(request, monkeypatch):
    """Each test with the plain-socket client (remote.PLAIN_HTTP) and with fsspec's session; any
    retry of a request would wait 10 s (remote.BACKOFF): a test that ends sooner had none."""
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    monkeypatch.setattr(remote, "PLAIN_HTTP", request.param == "plain")
    monkeypatch.setattr(remote, "BACKOFF", 10.0)
    return request.param


def _resolver_seconds(host: str) -> float:
    """How long this machine's resolver takes to say that ``host`` does not exist (skips where
    it does not say so: no DNS at all answers a temporary failure, after its own timeouts)."""
    t0 = time.perf_counter()
    try:
        socket.getaddrinfo(host, 80)
    except socket.gaierror as e:
        if e.errno == socket.EAI_AGAIN:
            pytest.skip(f"this machine's resolver does not answer ({e})")
        return time.perf_counter() - t0
    pytest.skip(f"{host} resolves here")


def _fails_at_once(url: str, words: str, limit: float, save: bool = False, **options) -> th5.TensorStoreError:
    """``th5.load(url)`` (``save``: ``th5.save``) fails within ``limit`` seconds with a
    RemoteError that names the URL, says ``words`` and that it was not tried again."""
    t0 = time.perf_counter()
    with pytest.raises(remote.RemoteError) as info:
        if save:
            th5.save({"w": torch.zeros(3)}, url, **options)
        else:
            th5.load(url, **options)
    took = time.perf_counter() - t0
    message = str(info.value)
    assert message.startswith(f"{url}: ") and words in message and "not tried again" in message, message
    assert took < limit, (took, message)
    return info.value


def test_a_host_that_does_not_resolve_fails_at_once(client) -> None:
    dns = _resolver_seconds("nonexistent.invalid")  # .invalid never resolves (RFC 6761)
    _fails_at_once("http://nonexistent.invalid/x.h5", "the host name does not resolve", 1.5 + 2 * dns)


def test_a_refused_connection_fails_at_once(client) -> None:
    url = f"http://127.0.0.1:{free_port()}/x.h5"  # a port nobody listens on
    _fails_at_once(url, "connection refused", 1.5)


def test_an_untrusted_certificate_fails_at_once(client, tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    th5.save({"w": torch.zeros(4)}, tmp_path / "w.h5")
    srv = RangeServer(tmp_path, tls=(cert, key))
    try:
        _fails_at_once(srv.url("w.h5"), "certificate is not trusted", 1.5)
    finally:
        srv.stop()


@pytest.mark.parametrize("endpoint", ["http://nonexistent.invalid", "refused"])
def test_an_s3_endpoint_that_cannot_be_reached_fails_at_once(endpoint) -> None:
    """botocore tries a request that cannot connect 5 times, s3fs each of those 5 times, and the
    source 4 times (the README's example took 29-43 s to fail offline); now a source's own
    requests fail at once, loads and saves."""
    pytest.importorskip("aiohttp")
    s3fs = pytest.importorskip("s3fs")
    if endpoint == "refused":
        endpoint = f"http://127.0.0.1:{free_port()}"
    else:
        _resolver_seconds("nonexistent.invalid")
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    s3fs.S3FileSystem(**options).s3  # the botocore client, made beforehand: loading it takes ~0.5 s
    words = "does not resolve" if "invalid" in endpoint else "connection refused"
    _fails_at_once("s3://bucket/ckpt.h5", words, 2.0, storage_options=options)
    _fails_at_once("s3://bucket/new.h5", words, 2.0, save=True, storage_options=options)  # the upload


class _FailFirst(dict):
    """``Behaviour.status`` of a RangeServer answering ``status`` to the first ``n`` requests."""

    def __init__(self, status: int, n: int) -> None:
        super().__init__()
        self.status, self.n, self.answered = status, n, 0
        self._lock = threading.Lock()

    def get(self, key, default=None):  # noqa: ANN001, ANN201 - dict.get's signature
        with self._lock:
            if self.n > 0:
                self.n -= 1
                self.answered += 1
                return self.status
        return default


@pytest.fixture()
def served(tmp_path):
    g = torch.Generator().manual_seed(0)
    obj = {f"layers.{i}.weight": torch.randn(64, 128, generator=g) for i in range(4)}
    th5.save(obj, tmp_path / "small.h5")
    srv = RangeServer(tmp_path)
    yield srv, obj
    srv.stop()


def test_503_twice_then_data_is_tried_again_and_read(client, served, monkeypatch) -> None:
    srv, obj = served
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    with th5.open(srv.url("small.h5")) as s:
        srv.behaviour.status = _FailFirst(503, 2)
        assert torch.equal(s["layers.2.weight"][3:9], obj["layers.2.weight"][3:9])
        assert srv.behaviour.status.answered == 2
        srv.behaviour.status = _FailFirst(503, 2)
        out = s.load()
    assert srv.behaviour.status.answered == 2 and all(torch.equal(out[k], v) for k, v in obj.items())


def test_a_server_that_answered_then_refuses_is_tried_again(client, served, monkeypatch) -> None:
    """A refusal after the server has answered (restarting) is retried, as a dropped connection
    is; the error then says how many tries were made."""
    srv, obj = served
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    monkeypatch.setattr(remote, "TAIL_BYTES", 0)  # no tensor's bytes come with the layout
    srv.behaviour.close_after = True  # no connection kept open: once stopped, the server refuses
    with th5.open(srv.url("small.h5")) as s:
        srv.stop()
        httpranges.close_idle()
        with pytest.raises(remote.RemoteError, match=rf"small\.h5: .*after {remote.RETRIES + 1} tries"):
            s["layers.1.weight"].read()


def test_which_connection_errors_are_tried_again() -> None:
    lasting = [socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
               ssl.SSLCertVerificationError(1, "certificate verify failed")]
    not_lasting = [socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
                   ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
                   OSError(errno.EHOSTUNREACH, "No route to host"), OSError(errno.ENETUNREACH, "Network is unreachable"),
                   OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 1), "
                           "[Errno 111] Connect call failed ('127.0.0.1', 1)")]
    other = [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), TimeoutError("timed out"),
             OSError("Multiple exceptions: [Errno 111] a, [Errno 110] b")]
    for e in lasting + not_lasting:
        wrapped = RuntimeError("wrapped")  # as aiohttp and botocore wrap them
        wrapped.__cause__ = e
        for error in (e, wrapped):
            assert remote._connect_failure(error) == (remote._connect_failure(e)[0], e in lasting), error
    assert all(remote._connect_failure(e) is None for e in other)
    assert remote._transient(other[0]) and remote._transient(other[1]) and remote._transient(not_lasting[1])


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
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)
