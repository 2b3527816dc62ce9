"""Remote checkpoints and file objects: only the bytes needed move, in few round trips, and
every failure names the URL. Everything runs on 127.0.0.1 (an HTTP server of the suite's own,
an S3 endpoint from moto)."""

from __future__ import annotations

import io as stdio
import shutil
import time
from pathlib import Path

import pytest
import torch

import tensorstore_h5 as th5
from tensorstore_h5.storage import remote

from helpers import assert_same
from tensorstore_h5.bench.loopback import RangeServer, ServerProcess, free_port
from tensorstore_h5.reading.many import Reader

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

GOLDEN_V1 = Path(__file__).parent / "data" / "v1.h5"


def _model(n: int = 100, rows: int = 512, cols: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    big = _model()  # 100 tensors of 2 MiB: a 210 MB file
    th5.save(big, root / "big.h5")
    small = _model(8, 64, 128)
    th5.save(small, root / "small.h5")
    smooth = {k: (v * 0.01).to(torch.bfloat16) for k, v in _model(4, 2048, 256).items()}
    th5.save(smooth, root / "zstd.h5", compression="zstd", chunk_bytes=64 * 1024)
    shutil.copy(GOLDEN_V1, root / "v1.h5")
    server = RangeServer(root)
    yield server, {"big": big, "small": small, "zstd": smooth}
    server.stop()


@pytest.fixture()
def server(served):
    srv, _ = served
    srv.reset()
    yield srv
    srv.reset()


@pytest.fixture(autouse=True, params=["plain", "fsspec"])
def client(request, monkeypatch):
    """Every test twice: bytes over HTTP read by the plain-socket client (remote.PLAIN_HTTP),
    and by fsspec's aiohttp session."""
    monkeypatch.setattr(remote, "PLAIN_HTTP", request.param == "plain")
    return request.param


def test_open_and_keys_in_one_round_trip(served, server) -> None:
    """Header, size and the file's last remote.TAIL_BYTES (holding the layout) are asked for
    at once; a layout longer than the tail costs one request for the part before it; a server
    without suffix ranges costs one more request, for the layout."""
    _, objs = served
    with th5.open(server.url("big.h5")) as s:
        assert s.keys() == list(objs["big"]) and s.format_version == 2
        assert s["layers.3.weight"].shape == (512, 1024)
    gets = [r for m, r, _ in server.requests if m == "GET"]
    assert len(server.requests) <= 3 and sorted(gets) == ["bytes=-262144", "bytes=0-63"], server.requests
    many = {f"k{i}": torch.tensor([i]) for i in range(3000)}  # a layout of ~400 KB
    th5.save(many, server.root / "many.h5")
    server.reset()
    with th5.open(server.url("many.h5")) as s:
        assert s.keys() == list(many)
    gets = [(r, n) for m, r, n in server.requests if m == "GET"]
    assert len(gets) == 3 and gets[2][1] < 400_000, gets  # only the part before the tail
    server.reset()
    server.behaviour.suffix = False
    with th5.open(server.url("big.h5")) as s:
        assert s.keys() == list(objs["big"])
    deadline = time.monotonic() + 10  # the refused tail is logged once its headers are out: maybe after the open
    while len([r for m, r, _ in server.requests if m == "GET"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    gets = [r for m, r, _ in server.requests if m == "GET"]
    assert len(gets) == 3 and gets.count("bytes=-262144") == 1, server.requests  # header, tail (refused), layout


def test_selecting_1_percent_moves_the_selected_bytes_plus_the_layout(served, server) -> None:
    _, objs = served
    out = th5.load(server.url("big.h5"), select=["layers.42.weight"])
    assert torch.equal(out["layers.42.weight"], objs["big"]["layers.42.weight"])
    selected = objs["big"]["layers.42.weight"].nbytes
    with th5.open(server.url("big.h5")) as s:
        layout = s._layout  # noqa: F841 - opened again only to read its size below
    layout_bytes = sum(n for m, rng, n in server.requests[:3] if m == "GET")
    sent = server.bytes_sent - layout_bytes  # the second open's bytes
    assert selected <= sent <= selected + layout_bytes + 64 * 1024, (sent, selected, layout_bytes)
    print(f"select 1%: {sent} bytes sent for {selected} selected (layout and header {layout_bytes})")


def test_row_slices_and_compressed_slices_fetch_only_their_ranges(served, server) -> None:
    _, objs = served
    with th5.open(server.url("big.h5")) as s:
        server.reset()
        rows = s["layers.7.weight"][100:110]
        assert torch.equal(rows, objs["big"]["layers.7.weight"][100:110])
        assert server.bytes_sent == 10 * 1024 * 4 and len(server.requests) == 1
    with th5.open(server.url("zstd.h5")) as s:
        chunked = s._reader.chunked(s["layers.1.weight"]._entry)
        server.reset()
        part = s["layers.1.weight"][300:340]
        assert torch.equal(part, objs["zstd"]["layers.1.weight"][300:340])
        touched = {k for k in range(len(chunked.chunks)) if chunked.span(k)[0] < 340 * 512
                   and chunked.span(k)[0] + chunked.span(k)[1] > 300 * 512}
        assert server.bytes_sent <= sum(chunked.chunks[k][1] for k in range(min(touched), max(touched) + 1))
        assert len(server.requests) == 1  # neighbouring chunks in one request


def test_slices_of_many_tensors_come_in_one_round_trip(served, server) -> None:
    _, objs = served
    with th5.open(server.url("big.h5")) as s:
        server.reset()
        parts = s.read_many({k: slice(0, 5) for k in list(objs["big"])[:50]})
        assert all(torch.equal(parts[k], objs["big"][k][:5]) for k in parts) and len(parts) == 50
        assert server.bytes_sent == 50 * 5 * 1024 * 4 and len(server.requests) == 50  # concurrent, one each
        local = th5.open(server.root / "big.h5")
        assert torch.equal(local.read_many({"layers.1.weight": (3, slice(2, 9))})["layers.1.weight"],
                           objs["big"]["layers.1.weight"][3, 2:9])
        local.close()


def test_every_read_path_over_http_returns_what_was_saved(served, server) -> None:
    _, objs = served
    url = server.url("small.h5")
    assert_same(th5.load(url, verify=True), objs["small"])
    with th5.open(url) as s:
        assert_same(dict(s.items()), objs["small"])
    target = {k: torch.zeros_like(v) for k, v in objs["small"].items()}
    assert th5.load_into(target, url) == th5.LoadResult([], [])
    assert_same(target, objs["small"])
    assert_same(th5.load(server.url("zstd.h5"), verify=True), objs["zstd"])
    assert_same(th5.load(server.url("v1.h5")), th5.load(GOLDEN_V1))  # format 1, through h5py's file-object reads
    out = th5.load(url, mmap=True)  # nothing to map remotely: read
    assert_same(out, objs["small"])


def test_a_full_remote_load_fetches_in_batches_of_bounded_size(served, server, monkeypatch) -> None:
    _, objs = served
    monkeypatch.setattr(remote, "BATCH_BYTES", 16 * 2**20)
    out = th5.load(server.url("big.h5"))
    assert all(torch.equal(out[k], v) for k, v in objs["big"].items())
    body = [n for m, _, n in server.requests if m == "GET"][2:]
    assert max(body) <= 16 * 2**20 + remote.MAX_GAP and len(body) >= 200 * 2**20 // (17 * 2**20)


@pytest.mark.parametrize("streamed", [True, False])
def test_the_next_batches_download_while_the_current_one_is_read(served, server, monkeypatch, streamed) -> None:
    """Reading batch k waits until the fetch of batch k + FETCH_AHEAD has begun: a load that
    fetched and then read, batch after batch, would time out here. No more than FETCH_AHEAD
    batches are fetched ahead of the one in use. ``streamed``: the 2 MiB tensors stream into
    their own memory (remote.DIRECT_BYTES), else they are fetched and copied."""
    import threading

    _, objs = served
    monkeypatch.setattr(remote, "BATCH_BYTES", 64 * 2**20)
    monkeypatch.setattr(remote, "FIRST_BATCH_BYTES", 64 * 2**20)  # no growing batches here: see the next test
    monkeypatch.setattr(remote, "DIRECT_BYTES", 1 << 20 if streamed else 1 << 40)
    assert remote.FETCH_AHEAD >= 1
    fetches: list[int] = []
    held: list[int] = []
    ahead: list[int] = []
    begun = threading.Event()
    real_fetch, real_use, real_leaf = remote.RemoteSource.fetch, remote.RemoteSource.use, Reader.read_leaf

    def fetch(self, ranges, into=()):
        fetches.append(sum(n for _, n in ranges) + sum(len(v) for _, v in into))
        assert all(len(v) == 2 * 2**20 for _, v in into) and (len(into) > 0) == streamed
        ahead.append(len(fetches) - len(held))  # started, not yet in use (this one included)
        if len(fetches) >= 1 + remote.FETCH_AHEAD:
            begun.set()
        return real_fetch(self, ranges, into)

    def use(self, pieces):
        held.append(sum(len(d) for _, d in pieces))
        return real_use(self, pieces)

    def read_leaf(self, entry, *args):
        if len(held) == 1:  # a tensor of the first batch
            assert begun.wait(10), "the batches after the first were not being fetched while it was read"
        return real_leaf(self, entry, *args)

    monkeypatch.setattr(remote.RemoteSource, "fetch", fetch)
    monkeypatch.setattr(remote.RemoteSource, "use", use)
    monkeypatch.setattr(Reader, "read_leaf", read_leaf)
    out = th5.load(server.url("big.h5"))
    assert all(torch.equal(out[k], v) for k, v in objs["big"].items())
    assert len(fetches) == 4 and max(fetches) <= 64 * 2**20 + 2 * 2**20 and max(held) <= 64 * 2**20 + remote.MAX_GAP
    assert max(ahead) <= remote.FETCH_AHEAD + 1, ahead
    gets = [n for m, _, n in server.requests if m == "GET"][2:]  # after the header and the layout
    data = sum(v.nbytes for v in objs["big"].values())
    if streamed:  # one request per tensor, for its bytes alone
        assert len(gets) == len(objs["big"]) and sum(gets) == data
    else:  # coalesced: the datasets' data lie back to back (any alignment padding comes along)
        assert data <= sum(gets) <= data + 64 * 1024 and len(gets) < len(objs["big"])


def test_the_first_batches_of_a_load_grow_to_the_batch_size(served, server, monkeypatch) -> None:
    """The first batch fetches about FIRST_BATCH_BYTES, each next one twice as many up to
    BATCH_BYTES, so that the first requests do not wait for 64 MiB of new tensors to be made;
    the tensors come back right."""
    _, objs = served
    monkeypatch.setattr(remote, "BATCH_BYTES", 64 * 2**20)
    monkeypatch.setattr(remote, "FIRST_BATCH_BYTES", 8 * 2**20)
    fetches: list[int] = []
    real_fetch = remote.RemoteSource.fetch

    def fetch(self, ranges, into=()):
        fetches.append(sum(n for _, n in ranges) + sum(len(v) for _, v in into))
        return real_fetch(self, ranges, into)

    monkeypatch.setattr(remote.RemoteSource, "fetch", fetch)
    out = th5.load(server.url("big.h5"))
    assert all(torch.equal(out[k], v) for k, v in objs["big"].items())
    mib = [-(-n // 2**20) for n in fetches]  # 2 MiB tensors fill each batch exactly
    # the first FETCH_AHEAD batches go out at once (in any order), each next one as one is used
    ahead = remote.FETCH_AHEAD
    assert sorted(mib[:ahead]) == [min(64, 8 << k) for k in range(ahead)] and set(mib[ahead:]) <= {8, 16, 32, 64}, mib
    assert max(fetches) <= 64 * 2**20 and sum(fetches) == sum(v.nbytes for v in objs["big"].values())


def test_large_tensors_stream_into_their_own_memory_exactly(served, server) -> None:
    """Tensors of at least remote.DIRECT_BYTES come by requests of their own, straight into
    the new tensor: strided, aliased, bfloat16 and small neighbours all come back as saved."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 700, generator=g)  # 2.9 MB: one request
    sd = {"w": w, "t": torch.randn(900, 600, generator=g).t(), "alias": w, "view": w[:512],
          "bf": torch.randn(1000, 1000, generator=g).to(torch.bfloat16), "big": torch.randn(3, 1024, 1024, generator=g),
          "small": torch.arange(10), "step": 7}
    th5.save(sd, server.root / "mixed.h5")
    url = server.url("mixed.h5")
    with th5.open(url) as s:
        server.reset()
        out = s.load(verify=True)
    assert_same(out, sd)
    assert out["alias"] is out["w"] and out["t"].stride() == sd["t"].stride()
    gets = sorted(int(r.split("=")[1].split("-")[0]) for m, r, _ in server.requests if m == "GET")
    direct = sum(-(-v.nbytes // remote.REQUEST_BYTES) for k, v in sd.items() if k in ("w", "t", "bf", "big", "view"))
    assert len(gets) == direct + 1, server.requests  # each large one alone ("big" in 2 of 8 MiB); "small" with the rest


def test_streamed_tensors_fail_as_fetched_ones_do(served, server, monkeypatch) -> None:
    """Errors of the streaming path: a range ignored, a body cut short, connections dropped
    (retried, then refused), a status; each names the URL and the batch's keys."""
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    url = server.url("big.h5")
    with th5.open(url) as s:
        server.behaviour.ignore_range = True
        with pytest.raises(th5.TensorStoreError, match=r"big\.h5: keys 'layers\.0\.weight', .*ignored the byte range"):
            s.load(select="layers.[0-3].*")
        server.reset()
        server.behaviour.short = True
        with pytest.raises(th5.TensorStoreError, match=r"big\.h5: keys 'layers\.0\.weight', .*ended early"):
            s.load(select="layers.[0-3].*")
        server.reset()
        server.behaviour.drop_next = 2
        out = s.load(select="layers.[0-3].*")
        assert all(torch.equal(out[f"layers.{i}.weight"], served[1]["big"][f"layers.{i}.weight"]) for i in range(4))
        server.behaviour.drop_next = 100
        with pytest.raises(th5.TensorStoreError, match=rf"big\.h5: keys .*after {remote.RETRIES + 1} tries"):
            s.load(select="layers.[0-3].*")
        server.reset()
        server.behaviour.status["/big.h5"] = 403
        with pytest.raises(th5.TensorStoreError, match=r"big\.h5: keys .*access denied"):
            s.load(select="layers.[0-3].*")


def test_a_streamed_tensor_with_damaged_bytes_is_refused_with_verify(served, server) -> None:
    _, objs = served
    damaged = server.root / "damaged.h5"
    shutil.copy(server.root / "big.h5", damaged)
    with th5.open(damaged) as s:
        offset = s._reader.where(s["layers.5.weight"]._entry).offset
    with open(damaged, "r+b") as f:
        f.seek(offset + 12345)
        f.write(b"\x00\x01\x02")
    with pytest.raises(th5.FormatError, match=r"damaged\.h5: key 'layers\.5\.weight'.*checksum"):
        th5.load(server.url("damaged.h5"), select="layers.[4-6].*", verify=True)
    out = th5.load(server.url("damaged.h5"), select="layers.4.weight", verify=True)
    assert torch.equal(out["layers.4.weight"], objs["big"]["layers.4.weight"])


def test_damaged_bytes_are_refused_by_default_over_a_url(served, server) -> None:
    """Checksums are checked by default over a URL too: a load, a handle read, and load_into,
    which checks each fetched batch before its targets change (no byte fetched twice)."""
    _, objs = served
    damaged = server.root / "damaged_small.h5"
    shutil.copy(server.root / "small.h5", damaged)
    with th5.open(damaged) as s:
        offset = s._reader.where(s["layers.0.weight"]._entry).offset
    with open(damaged, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\x00\x01\x02")
    url = server.url("damaged_small.h5")
    with pytest.raises(th5.FormatError, match=r"damaged_small\.h5: key 'layers\.0\.weight'.*checksum"):
        th5.load(url)
    with th5.open(url) as s, pytest.raises(th5.FormatError, match="checksum"):
        s["layers.0.weight"].read()
    targets = {k: torch.zeros_like(v) for k, v in objs["small"].items()}
    server.reset()
    with pytest.raises(th5.FormatError, match=r"key 'layers\.0\.weight'.*checksum"):
        th5.load_into(targets, url)
    assert all(not t.any() for t in targets.values())  # one batch: checked before any target changed
    th5.load_into(targets, url, verify=False)
    assert torch.equal(targets["layers.1.weight"], objs["small"]["layers.1.weight"])


@pytest.mark.parametrize("status, words", [(404, "not found"), (403, "access denied"), (500, "request failed after")])
def test_http_errors_name_the_url(served, server, status, words, monkeypatch) -> None:
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    server.behaviour.status["/small.h5"] = status
    with pytest.raises(th5.TensorStoreError, match=f"{server.url('small.h5')}.*{words}"):
        th5.load(server.url("small.h5"))


def test_a_server_that_ignores_ranges_or_ends_early_is_refused(served, server) -> None:
    server.behaviour.ignore_range = True
    with pytest.raises(th5.TensorStoreError, match="small.h5: .*ignored the byte range"):
        th5.open(server.url("small.h5"))
    server.reset()
    with th5.open(server.url("small.h5")) as s:
        server.behaviour.short = True
        with pytest.raises(th5.TensorStoreError, match="small.h5: key 'layers.1.weight': .*(ended early|ends before)"):
            s["layers.1.weight"].read()


def test_dropped_connections_are_retried_a_bounded_number_of_times(served, server, monkeypatch) -> None:
    _, objs = served
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    with th5.open(server.url("small.h5")) as s:
        server.behaviour.drop_next = 2
        assert torch.equal(s["layers.2.weight"].read(), objs["small"]["layers.2.weight"])
        server.behaviour.drop_next = remote.RETRIES + 1
        with pytest.raises(th5.TensorStoreError, match=f"small.h5: key 'layers.3.weight': .*after {remote.RETRIES + 1} tries"):
            s["layers.3.weight"].read()
        server.behaviour.drop_next = remote.RETRIES + 1
        with pytest.raises(th5.TensorStoreError, match=r"small.h5: keys 'layers.0.weight', .* and \d+ more: .*after"):
            s.load()  # the keys of the batch whose download failed
        server.behaviour.drop_next = remote.RETRIES + 1
        with pytest.raises(th5.TensorStoreError, match=r"small.h5: keys 'layers.1.weight', 'layers.2.weight': .*after"):
            s.read_many({"layers.1.weight": slice(0, 2), "layers.2.weight": 3})


def test_latency_costs_a_few_round_trips(served, server) -> None:
    latency = 0.2
    server.behaviour.latency = latency
    t0 = time.perf_counter()  # a new client: connections kept alive from earlier tests may have been dropped
    with th5.open(server.url("big.h5"), storage_options={"skip_instance_cache": True}) as s:
        s.keys()
        opened = time.perf_counter() - t0
        t1 = time.perf_counter()
        s.load(select=["layers.0.weight"])
        selected = time.perf_counter() - t1
    assert opened < 2 * latency + 0.3, opened  # one round trip (and the slack of a busy machine)
    assert selected < 2 * latency + 0.5, selected  # one


def test_an_answer_for_other_bytes_or_a_changed_object_is_refused(served, server) -> None:
    """Trust: an answer whose Content-Range names other bytes than asked, an object replaced
    since it was opened by one of the same size (its ETag, asked for by If-Match, answers
    412), or, from a server without ETags, by one of another size, is refused naming the URL
    and the keys; nothing loads."""
    _, objs = served
    with th5.open(server.url("small.h5")) as s:
        server.behaviour.shift_range = 1
        with pytest.raises(th5.TensorStoreError, match=r"small\.h5: keys? 'layers\.0\.weight'.*another byte range"):
            s.load()
    server.reset()
    replaced = {k: v + 1 for k, v in objs["small"].items()}  # the same shapes: a file of the same size
    shutil.copy(server.root / "small.h5", server.root / "changing.h5")
    with th5.open(server.url("changing.h5")) as s:
        time.sleep(0.01)  # another modification time, so another ETag
        th5.save(replaced, server.root / "changing.h5")
        assert (server.root / "changing.h5").stat().st_size == (server.root / "small.h5").stat().st_size
        with pytest.raises(th5.TensorStoreError, match=r"changing\.h5: keys 'layers\.0\.weight'.*changed while being "
                                                       r"read: its ETag is .*, it was .* when opened"):
            s.load()
    with th5.open(server.url("small.h5")) as s:  # a 412 though the ETag is the one opened: If-Match is dropped
        server.behaviour.refuse_if_match = True
        assert s._reader.rawfile().etag is not None
        assert_same(s.load(verify=True), objs["small"])
        assert s._reader.rawfile().etag is None
    server.reset()
    server.behaviour.etag = False
    shutil.copy(server.root / "small.h5", server.root / "changing.h5")
    with th5.open(server.url("changing.h5")) as s:
        assert s._reader.rawfile().etag is None
        th5.save({"other": torch.zeros(9)}, server.root / "changing.h5")  # replaced by a shorter object
        with pytest.raises(th5.TensorStoreError, match=r"changing\.h5: .*changed while being read: 4[0-9]+ bytes now"):
            s.load()


def test_request_headers_reach_the_server_and_session_options_choose_fsspec(served, server, client) -> None:
    _, objs = served
    options = {"headers": {"Authorization": "Bearer abc"}}
    with th5.open(server.url("small.h5"), storage_options=options) as s:
        assert (s._reader.rawfile()._client is not None) == (client == "plain")
        server.reset()
        assert torch.equal(s["layers.3.weight"].read(), objs["small"]["layers.3.weight"])
    assert server.headers and all(h.get("Authorization") == "Bearer abc" for h in server.headers)
    with th5.open(server.url("small.h5"), storage_options={"client_kwargs": {"trust_env": False}}) as s:
        assert s._reader.rawfile()._client is None  # only fsspec's session honours these
        assert torch.equal(s["layers.4.weight"].read(), objs["small"]["layers.4.weight"])


def test_streaming_over_a_url_fetches_ahead_instead_of_a_round_trip_per_tensor(served, server) -> None:
    """items() and walk() over a URL: the batches download ahead of the caller, so 8 tensors
    (one batch) cost about one round trip, not 8; values, aliases and order as saved."""
    _, objs = served
    url = server.url("small.h5")
    with th5.open(url) as s:
        server.behaviour.latency = 0.2
        t0 = time.perf_counter()
        got = dict(s.items())
        streamed = time.perf_counter() - t0
        t0 = time.perf_counter()
        leaves = [x for x in s.walk() if isinstance(x, th5.tree.Leaf)]
        walked = time.perf_counter() - t0
    assert_same(got, objs["small"]) and list(got) == list(objs["small"])
    assert [x.path for x in leaves] == list(objs["small"]) and all(torch.equal(x.value, objs["small"][x.path]) for x in leaves)
    assert streamed < 3 * 0.2 + 0.3 and walked < 3 * 0.2 + 0.3, (streamed, walked)  # not 8 x 0.2 s
    asked: list[str] = []
    with th5.open(server.url("big.h5")) as s:  # 2 MiB tensors: streamed, whose device is looked up first
        server.behaviour.latency = 0
        out = dict(s.items(select="layers.[0-3].*", device=lambda k: asked.append(k) or "cpu"))
    assert sorted(asked) == sorted(out) and len(out) == 4  # a device= callable is asked once per key


def test_file_objects_read_and_write(tmp_path, served) -> None:
    _, objs = served
    buf = stdio.BytesIO()
    th5.save(objs["small"], buf, metadata={"to": "bytes"})
    assert buf.getvalue()[:8] == b"\x89TSH5\r\n\x1a"
    buf.seek(0)
    with th5.open(buf) as s:
        assert s.metadata == {"to": "bytes"} and torch.equal(s["layers.5.weight"][3:4], objs["small"]["layers.5.weight"][3:4])
    assert_same(th5.load(stdio.BytesIO(buf.getvalue()), verify=True), objs["small"])
    with open(GOLDEN_V1, "rb") as f:
        assert_same(th5.load(f), th5.load(GOLDEN_V1))
    assert not [p for p in tmp_path.iterdir()]  # nothing written beside


def test_file_urls_are_local_paths(tmp_path) -> None:
    th5.save({"a": torch.arange(3)}, f"file://{tmp_path}/f.h5")
    assert (tmp_path / "f.h5").exists() and th5.load(f"file://{tmp_path}/f.h5")["a"].tolist() == [0, 1, 2]


def test_saving_to_plain_http_fails_clearly_and_leaves_nothing(served, server) -> None:
    with pytest.raises(th5.TensorStoreError, match="http://127.0.0.1.*new.h5"):
        th5.save({"a": torch.ones(2)}, server.url("new.h5"))
    assert not (server.root / "new.h5").exists()


def test_a_missing_extra_is_named(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_fsspec(name, *args, **kwargs):
        if name == "fsspec":
            raise ImportError("No module named 'fsspec'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fsspec)
    with pytest.raises(th5.TensorStoreError, match=r'pip install "tensorstore_h5\[remote\]"'):
        th5.open("https://example.invalid/ckpt.h5")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import os

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                                          "region_name": "us-east-1"}}
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    import s3fs

    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="ckpts")
    fs = s3fs.S3FileSystem(**options)
    yield options, fs
    server.stop()


def test_s3_save_load_select_through_moto(s3) -> None:
    options, fs = s3
    obj = _model(6, 64, 256)
    th5.save(obj, "s3://ckpts/model.h5", storage_options=options, metadata={"where": "s3"})
    assert fs.exists("ckpts/model.h5") and not [p for p in fs.ls("ckpts") if p.endswith(".partial")]
    assert_same(th5.load("s3://ckpts/model.h5", storage_options=options, verify=True), obj)
    part = th5.load("s3://ckpts/model.h5", storage_options=options, select="layers.3.*")
    assert list(part) == ["layers.3.weight"] and torch.equal(part["layers.3.weight"], obj["layers.3.weight"])
    with th5.open("s3://ckpts/model.h5", storage_options=options) as s:
        assert s.metadata == {"where": "s3"} and torch.equal(s["layers.5.weight"][7], obj["layers.5.weight"][7])
        # read by a presigned URL and the plain client, or through s3fs
        assert (s._reader.rawfile()._client is not None) == remote.PLAIN_HTTP


def test_s3_presigned_reads_sign_again_after_a_403_and_keep_per_request_options_on_s3fs(s3, served, server,
                                                                                        client) -> None:
    """An expired presigned URL answers 403: the read signs a new one and goes on. Requester
    pays needs a header on each request: s3fs reads such objects."""
    if client != "plain":
        pytest.skip("presigned URLs are the plain client's")
    options, fs = s3
    obj = _model(3, 64, 256)
    th5.save(obj, "s3://ckpts/presigned.h5", storage_options=options)
    with th5.open("s3://ckpts/presigned.h5", storage_options=options) as s:
        src = s._reader.rawfile()
        server.behaviour.status["/expired"] = 403
        src._client.url = server.url("expired")  # as a signature past its time answers
        assert torch.equal(s["layers.2.weight"][5:9], obj["layers.2.weight"][5:9])
        assert "X-Amz-Signature" in src._client.url or "Signature" in src._client.url, src._client.url
        assert server.paths == ["/expired"]  # asked once, then signed again
    with th5.open("s3://ckpts/presigned.h5", storage_options={**options, "requester_pays": True}) as s:
        assert s._reader.rawfile()._client is None


def test_a_failed_s3_save_leaves_no_object(s3) -> None:
    options, fs = s3
    with pytest.raises(th5.UnsupportedTypeError):
        th5.save({"a": object()}, "s3://ckpts/bad.h5", storage_options=options)
    with pytest.raises(th5.TensorStoreError, match="s3://no-such-bucket/x.h5"):
        th5.save({"a": torch.ones(3)}, "s3://no-such-bucket/x.h5", storage_options=options)
    assert not fs.exists("ckpts/bad.h5")
    with pytest.raises(th5.TensorStoreError, match="s3://ckpts/absent.h5: .*not found"):
        th5.load("s3://ckpts/absent.h5", storage_options=options)


def test_error_kinds_come_from_the_status_not_from_digits_in_the_url() -> None:
    class ClientError(Exception):
        pass

    url = "http://127.0.0.1:40399/x.h5"  # a port with 403 and 404 in it
    assert remote._status(ClientError(f"500, message='Internal Server Error', url='{url}'")) == 500
    assert remote._status(ClientError(f"Server disconnected, url='{url}'")) is None
    assert remote._transient(ClientError(f"500, message='Internal Server Error', url='{url}'"))
    assert not remote._transient(ClientError("An error occurred (403) when calling GetObject: Forbidden"))
    assert remote._transient(ClientError(f"Connection reset by peer: {url}"))


def test_pread_takes_prefetched_bytes_and_fetches_only_the_gaps() -> None:
    src = remote.RemoteSource.__new__(remote.RemoteSource)
    src._lock, src.path = __import__("threading").Lock(), "mem://x"
    data = bytes(range(256)) * 2
    src._cache = [(100, data[100:150]), (200, data[200:250])]
    asked = []

    def get(start, end, allow_short=False):
        asked.append((start, end))
        return data[start:end]

    src._get = get
    out = bytearray(170)
    src.pread(90, memoryview(out))
    assert bytes(out) == data[90:260] and asked == [(90, 100), (150, 200), (250, 260)]
    asked.clear()
    inside = bytearray(30)
    src.pread(210, memoryview(inside))
    assert bytes(inside) == data[210:240] and asked == []


def test_the_benchmarks_server_runs_in_a_process_of_its_own(tmp_path) -> None:
    """bench --remote serves from a child process (ServerProcess), driven over its control path."""
    import os

    import fsspec

    data = os.urandom(100_000)
    (tmp_path / "a.bin").write_bytes(data)
    server = ServerProcess(tmp_path)
    try:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        assert fs.cat_file(server.url("a.bin"), start=10, end=1010) == data[10:1010]
        assert server.control() == {"bytes_sent": 1000, "requests": 1}  # the control requests are not counted
        assert server.control(reset=True, latency=0.2) == {"bytes_sent": 0, "requests": 0}
        t0 = time.perf_counter()
        fs.cat_file(server.url("a.bin"), start=0, end=10)
        assert time.perf_counter() - t0 >= 0.2
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError, match="405"):
            urllib.request.urlopen(urllib.request.Request(server.url("a.bin"), data=b"x"), timeout=10)  # read only
    finally:
        server.stop()
    assert server._proc.returncode == 0


def test_cli_verify_reads_a_url_in_few_requests_and_finds_damage(served, server, capsys) -> None:
    """`tensorstore-h5 verify URL`: checksums and HDF5 metadata checked through the URL, the
    metadata fetched at once (a request per h5py read cost 316 requests for 300 keys)."""
    from tensorstore_h5 import cli

    many = {f"l{i}": torch.full((10, 10), float(i)) for i in range(300)}
    th5.save(many, server.root / "verify.h5")
    server.reset()
    assert cli.main(["verify", server.url("verify.h5")]) == 0
    assert "OK, 300 keys" in capsys.readouterr().out and len(server.requests) <= 12, len(server.requests)
    damaged = server.root / "verify-damaged.h5"
    shutil.copy(server.root / "verify.h5", damaged)
    with th5.open(damaged) as s:
        end = max(o + n for e in (s._entry(k) for k in s.keys()) for o, n in s._reader.ranges(e))
    data = bytearray(damaged.read_bytes())
    at = data.index(b"TREE", end) if b"TREE" in data[end:] else data.index(b"OHDR", end)
    data[at:at + 4] = b"XXXX"  # an HDF5 metadata block after the data
    damaged.write_bytes(bytes(data))
    assert cli.main(["verify", server.url("verify-damaged.h5")]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_encoded_answers_are_refused_and_chunked_ones_read(served, server) -> None:
    """A range of gzip-encoded bytes is not a range of the file: refused, on either client,
    though the request asks for identity even where the caller's headers said otherwise. A
    chunked body is the stored bytes: read, and one cut short is tried again."""
    _, objs = served
    url = server.url("small.h5")
    with th5.open(url, storage_options={"headers": {"Accept-Encoding": "gzip"}}) as s:
        server.reset()
        server.behaviour.encoding = "gzip"
        with pytest.raises(th5.TensorStoreError, match=r"small\.h5: .*Content-Encoding 'gzip'"):
            s.load()
        assert server.headers and all(h.get("Accept-Encoding") == "identity" for h in server.headers), server.headers
    server.reset()
    server.behaviour.chunked = True
    assert_same(th5.load(url, verify=True), objs["small"])
    server.behaviour.drop_next = 1
    assert_same(th5.load(url, verify=True), objs["small"])


def test_sparse_rows_move_their_own_bytes_not_the_gaps_between_them(served, server) -> None:
    """The first row of each of 40 tensors of 1 MiB: 40 concurrent requests of 4 KiB, not one
    request of ~40 MiB spanning the gaps (they were closer than the old 1 MiB MAX_GAP)."""
    g = torch.Generator().manual_seed(9)
    sd = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(40)}
    th5.save(sd, server.root / "sparse.h5")
    with th5.open(server.url("sparse.h5")) as s:
        server.reset()
        rows = s.read_many({k: 0 for k in sd})
    assert all(torch.equal(rows[k], sd[k][0]) for k in sd)
    row_bytes = 40 * 1024 * 4
    assert row_bytes <= server.bytes_sent <= row_bytes + 40 * remote.MAX_GAP // 16, server.bytes_sent
