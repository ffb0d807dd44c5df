"""Small parts our P/D connectors share: config, leases, layout, stats, side channel."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.slow_peers import closed_within, connect_from
from vllm_pd_ext.connectors.common.config import parse_transfer_config
from vllm_pd_ext.connectors.common.layout import LayoutMismatch, block_spans, layout_from_caches
from vllm_pd_ext.connectors.common.leases import LeaseTable
from vllm_pd_ext.connectors.common.side_channel import (
    SideChannelError,
    SideChannelLimits,
    SideChannelServer,
    fetch_handshake,
    post_json,
)
from vllm_pd_ext.connectors.common.stats import (
    MAX_PEERS,
    PdTransferPromMetrics,
    PdTransferStats,
    PeerLabels,
    StatsRecorder,
)
from vllm_pd_ext.transport import backend_names


def test_config_names_the_bad_key():
    assert parse_transfer_config("X", {}).transfer_mode == "read"
    with pytest.raises(ValueError, match="invalid kv_connector_extra_config for X: lease_s"):
        parse_transfer_config("X", {"lease_s": -1})
    with pytest.raises(ValueError, match="backendd: Extra inputs are not permitted"):
        parse_transfer_config("X", {"backendd": "mooncake"})
    with pytest.raises(ValueError, match=r"backend: .*unknown transport backend 'nope'"):
        parse_transfer_config("X", {"backend": "nope"})
    for name in backend_names():
        assert parse_transfer_config("X", {"backend": name}).backend == name
    limits = {"side_channel_limits": {"max_per_source": 2}}
    assert parse_transfer_config("X", limits).side_channel_limits.max_per_source == 2
    with pytest.raises(ValueError, match=r"side_channel_limits\.max_per_source: Input should be"):
        parse_transfer_config("X", {"side_channel_limits": {"max_per_source": 0}})


def test_leases_expire_renew_and_release():
    now = [0.0]
    leases = LeaseTable(10.0, clock=lambda: now[0])
    leases.grant("a")
    leases.grant("b")
    now[0] = 8.0
    assert leases.renew("a") and not leases.renew("zzz")
    now[0] = 12.0
    assert leases.expired() == {"b": None}
    assert "a" in leases and len(leases) == 1
    assert leases.release("a") and not leases.release("a")


def test_the_first_claim_on_a_lease_stands_until_the_lease_ends():
    now = [0.0]
    leases = LeaseTable(10.0, clock=lambda: now[0])
    assert leases.claim("a", "d1") is None  # no lease: nothing to claim
    leases.grant("a")
    assert leases.holder("a") is None
    assert leases.claim("a", "d1") == "d1"
    assert leases.claim("a", "d2") == "d1" and leases.holder("a") == "d1"
    leases.release("a")
    assert leases.holder("a") is None
    leases.grant("b")
    leases.claim("b", "d1", engine="engine-d1")
    assert leases.claim("b", "d2", engine="engine-d2") == "d1"
    leases.grant("c")
    now[0] = 11.0
    # each expired lease with the engine its claimant named (the first claim's)
    assert leases.expired() == {"b": "engine-d1", "c": None} and leases.holder("b") is None


def kv(num_blocks=8, heads=2, shape="cpu", dtype=torch.float16):
    dims = (num_blocks, heads, 16, 64) if shape == "cpu" else (2, num_blocks, 16, heads, 32)
    return {f"l{i}": torch.zeros(dims, dtype=dtype) for i in range(2)}


def test_layout_of_cpu_and_kv_first_caches():
    layout, tensors = layout_from_caches(kv(), num_blocks=8, block_sizes=(16,), model={"m": 1})
    r = layout.views[0]
    assert list(tensors) == ["kv0", "kv1"] and r.layers == ("l0",) and r.region == "kv0"
    assert (r.piece_offsets, r.piece_len, r.block_stride) == (
        (0,),
        2 * 16 * 64 * 2,
        2 * 16 * 64 * 2,
    )
    assert layout.regions[0].size == 8 * r.block_stride and r.offset == 0
    layout2, _ = layout_from_caches(kv(shape="kv"), num_blocks=8, block_sizes=(16,), model={"m": 1})
    r2 = layout2.views[0]
    assert r2.piece_offsets == (0, 8 * 16 * 2 * 32 * 2) and r2.piece_len == 16 * 2 * 32 * 2


def test_block_spans_map_pairs_and_refuse_out_of_range():
    a, _ = layout_from_caches(kv(8, shape="kv"), num_blocks=8, block_sizes=(16,), model={})
    b, _ = layout_from_caches(kv(12, shape="kv"), num_blocks=12, block_sizes=(16,), model={})
    ra, rb = a.views[0], b.views[0]
    spans = block_spans(ra, rb, [(1, 11)])
    np.testing.assert_array_equal(
        spans,
        [
            [ra.block_stride, 11 * rb.block_stride, ra.piece_len],
            [
                ra.piece_offsets[1] + ra.block_stride,
                rb.piece_offsets[1] + 11 * rb.block_stride,
                ra.piece_len,
            ],
        ],
    )
    with pytest.raises(LayoutMismatch, match="out of range"):
        block_spans(ra, rb, [(8, 0)])
    a.check_compatible(b)  # block counts may differ


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"heads": 4}, r"block_shape: \[2, 16, 64\] here, \[4, 16, 64\] remote"),
        ({"dtype": torch.float32}, "dtype"),
        ({"shape": "kv"}, "block_shape"),
    ],
)
def test_layout_mismatch_names_the_difference(other, message):
    mine, _ = layout_from_caches(kv(), num_blocks=8, block_sizes=(16,), model={"m": 1})
    theirs, _ = layout_from_caches(kv(**other), num_blocks=8, block_sizes=(16,), model={"m": 1})
    with pytest.raises(LayoutMismatch, match=message):
        mine.check_compatible(theirs)
    assert mine.fingerprint() != theirs.fingerprint()


def test_layout_mismatch_on_model_and_block_size():
    mine, _ = layout_from_caches(kv(), num_blocks=8, block_sizes=(16,), model={"layers": 2})
    other_model, _ = layout_from_caches(kv(), num_blocks=8, block_sizes=(16,), model={"layers": 3})
    with pytest.raises(LayoutMismatch, match="model layers: 2 here, 3 remote"):
        mine.check_compatible(other_model)
    other_bs, _ = layout_from_caches(kv(), num_blocks=8, block_sizes=(32,), model={"layers": 2})
    with pytest.raises(
        LayoutMismatch, match=r"block sizes per KV cache group \[16\] here, \[32\] remote"
    ):
        mine.check_compatible(other_bs)


def test_stats_take_aggregate_reduce():
    rec = StatsRecorder()
    assert rec.take() is None
    rec.transfer(0.5, 1_000_000)
    rec.failure()
    rec.refused()
    rec.ungranted()
    rec.fallback()
    rec.blocks_held(3)
    first = rec.take()
    assert first is not None
    second = PdTransferStats(data={"seconds": [0.5], "bytes": [3_000_000], "lease_expiries": 2})
    total = first.aggregate(second).reduce()
    assert total == {
        "transfers": 2,
        "MB": 4.0,
        "avg_ms": 500.0,
        "GB/s": 0.004,
        "failures": 1,
        "lease_expiries": 2,
        "unauthenticated": 1,
        "params_refused": 0,
        "ungranted": 1,
        "fallbacks": 1,
        "blocks_held": 3,
        "peers": 1,
    }
    assert PdTransferStats().is_empty()


def _row(transfers=0, nbytes=0, seconds=0.0, failures=0, lease_expiries=0) -> dict[str, Any]:
    return {
        "transfers": transfers,
        "bytes": nbytes,
        "seconds": seconds,
        "failures": failures,
        "lease_expiries": lease_expiries,
    }


def test_stats_count_per_peer_engine_and_aggregate_per_peer():
    rec = StatsRecorder()
    rec.transfer(0.5, 1000, "engine-p")
    rec.transfer(0.25, 3000, "engine-p")
    rec.failure("engine-p")
    rec.failure(None)  # before any handshake named the peer
    rec.lease_expired("engine-d")
    rec.lease_expired()  # nobody had claimed the blocks
    first = rec.take()
    assert first is not None
    assert first.data["peers"] == {
        "engine-p": _row(2, 4000, 0.75, failures=1),
        "unknown": _row(failures=1, lease_expiries=1),
        "engine-d": _row(lease_expiries=1),
    }
    assert first.data["failures"] == 2 and first.data["lease_expiries"] == 2
    json.dumps(first.data)  # plain data: vLLM ships it from the worker to the logger
    rec.transfer(1.0, 500, "engine-q")
    rec.failure("engine-d")
    second = rec.take()
    assert second is not None
    assert second.data["peers"] == {
        "engine-q": _row(1, 500, 1.0),
        "engine-d": _row(failures=1),
    }
    total = first.aggregate(second)
    assert total.data["peers"] == {
        "engine-p": _row(2, 4000, 0.75, failures=1),
        "unknown": _row(failures=1, lease_expiries=1),
        "engine-d": _row(failures=1, lease_expiries=1),
        "engine-q": _row(1, 500, 1.0),
    }
    assert total.reduce()["peers"] == 4 and total.reduce()["transfers"] == 3


def test_per_peer_stats_keep_a_bounded_number_of_peers():
    """Peers past the first MAX_PEERS distinct ones count as "other", in one worker's stats
    and in the sum of several workers' (or intervals') stats."""
    rec = StatsRecorder()
    for i in range(3 * MAX_PEERS):
        rec.transfer(0.001, 10, f"engine-{i}")
    rec.failure("engine-0")  # a peer seen before the bound was reached keeps its series
    first = rec.take()
    assert first is not None
    peers = first.data["peers"]
    assert len(peers) == MAX_PEERS + 1
    assert peers["other"]["transfers"] == 2 * MAX_PEERS
    assert peers["engine-0"] == _row(1, 10, 0.001, failures=1)
    rec.transfer(0.001, 10, f"engine-{3 * MAX_PEERS}")  # later intervals: still "other"
    assert rec.take().data["peers"] == {"other": _row(1, 10, 0.001)}  # type: ignore[union-attr]
    # another worker saw other peers: the sum stays bounded, and no transfer is lost
    other_worker = StatsRecorder()
    for i in range(MAX_PEERS):
        other_worker.transfer(0.001, 10, f"elsewhere-{i}")
    other_worker.lease_expired()
    total = first.aggregate(other_worker.take())
    peers = total.data["peers"]
    assert len(peers) == MAX_PEERS + 2  # + "other" + "unknown"
    assert "elsewhere-0" not in peers and peers["unknown"] == _row(lease_expiries=1)
    assert sum(row["transfers"] for row in peers.values()) == 4 * MAX_PEERS


def _prom_metrics(registry, *, dp_size: int = 1, engines=(0,)) -> PdTransferPromMetrics:
    """Our metrics registered in ``registry`` as vLLM's logger registers them."""
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="eng-a"),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size),
    )
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labelvalues = {i: ["m", str(i)] for i in engines}
    return PdTransferPromMetrics(config, types, ["model_name", "engine"], labelvalues)


def _series(registry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == name
    }


def test_prom_metrics_count_per_peer_and_name_the_engine():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = _prom_metrics(registry)
    # declared from the start, with the "unknown" peer at zero, and the engine's own id
    assert _series(registry, "vllm:pdext_kv_peer_bytes_total") == {
        (("engine", "0"), ("model_name", "m"), ("peer", "unknown")): 0.0
    }
    assert _series(registry, "vllm:pdext_kv_engine_info") == {
        (("engine", "0"), ("engine_id", "eng-a"), ("model_name", "m")): 1.0
    }
    rec = StatsRecorder()
    rec.transfer(0.5, 4096, "eng-p")
    rec.failure("eng-p")
    rec.lease_expired()
    prom.observe(rec.take().data)  # type: ignore[union-attr]
    rec.transfer(0.25, 1024, "eng-p")
    prom.observe(rec.take().data)  # type: ignore[union-attr]

    def peer(name: str, p: str) -> float:
        return _series(registry, name)[(("engine", "0"), ("model_name", "m"), ("peer", p))]

    assert peer("vllm:pdext_kv_peer_bytes_total", "eng-p") == 5120
    assert peer("vllm:pdext_kv_peer_transfers_total", "eng-p") == 2
    assert peer("vllm:pdext_kv_peer_transfer_seconds_total", "eng-p") == 0.75
    assert peer("vllm:pdext_kv_peer_transfer_failures_total", "eng-p") == 1
    assert peer("vllm:pdext_kv_peer_lease_expiries_total", "unknown") == 1
    expiries = _series(registry, "vllm:pdext_kv_peer_lease_expiries_total")
    assert {dict(labels)["peer"] for labels in expiries} == {"unknown"}  # only what moved
    # the per-engine metrics are unchanged
    assert _series(registry, "vllm:pdext_kv_transfer_failures_total") == {
        (("engine", "0"), ("model_name", "m")): 1.0
    }


def test_prom_metrics_name_each_data_parallel_engine_by_its_connectors_id():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    _prom_metrics(registry, dp_size=2, engines=(0, 1))
    info = _series(registry, "vllm:pdext_kv_engine_info")
    assert {dict(labels)["engine_id"] for labels in info} == {"eng-a_dp0", "eng-a_dp1"}


def test_a_client_naming_many_peers_cannot_grow_the_series_without_bound():
    """Every interval names new peers (as a client that reaches the engine's side channel
    could): each engine keeps at most MAX_PEERS peer series (+ "unknown", "other")."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = _prom_metrics(registry, engines=(0, 1))
    for interval in range(5):
        for engine in (0, 1):
            rec = StatsRecorder()  # a fresh worker each time: only the metrics bound it
            for i in range(MAX_PEERS):
                rec.lease_expired(f"forged-{engine}-{interval}-{i}")
            prom.observe(rec.take().data, engine)  # type: ignore[union-attr]
    series = _series(registry, "vllm:pdext_kv_peer_lease_expiries_total")
    for idx in ("0", "1"):
        mine = {dict(k)["peer"]: v for k, v in series.items() if dict(k)["engine"] == idx}
        assert len(mine) == MAX_PEERS + 2
        assert mine["other"] == 4 * MAX_PEERS and sum(mine.values()) == 5 * MAX_PEERS


def test_peer_labels_give_the_longest_idle_peers_place_to_a_new_one():
    """A new peer past the bound reads as "other" while every labelled peer was active within
    the idle time; after it, it takes the place of the one idle longest (not the one labelled
    first), and the evicted id is reported."""
    now = [0.0]
    evicted: list[str] = []
    labels = PeerLabels(limit=2, idle_s=10.0, on_evict=evicted.append, clock=lambda: now[0])
    assert (labels("a"), labels("b"), labels(None)) == ("a", "b", "unknown")
    now[0] = 5.0
    assert labels("a") == "a"  # a is active again: b is now the longest idle
    assert labels("c") == "other" and evicted == []
    now[0] = 10.0  # b idle 10 s, a 5 s
    assert labels("c") == "c" and evicted == ["b"]
    assert labels("b") == "other"  # a (idle 5 s) and c (0 s) hold the labels
    now[0] = 100.0
    assert labels("b") == "b" and evicted == ["b", "a"]


def _peers_after_a_restart() -> set[str]:
    """The peer labels of new metrics after transfers with MAX_PEERS peers, then with one
    more (a decode restarted under a new engine id)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = _prom_metrics(registry)
    rec = StatsRecorder()
    for i in range(MAX_PEERS):
        rec.transfer(0.001, 10, f"old-{i}")
    prom.observe(rec.take().data)  # type: ignore[union-attr]
    rec.transfer(0.001, 10, "restarted")
    prom.observe(rec.take().data)  # type: ignore[union-attr]
    return {dict(k)["peer"] for k in _series(registry, "vllm:pdext_kv_peer_transfers_total")}


def test_prom_metrics_remove_an_aged_out_peers_series(monkeypatch):
    """A decode restarted with a new engine id after MAX_PEERS others were seen gets its own
    series once an old peer has been idle long enough: the old peer's series are removed, so
    the series stay bounded and the new peer is not hidden under "other"."""
    from vllm_pd_ext.connectors.common import stats

    monkeypatch.setattr(stats, "PEER_IDLE_S", 0.0)  # every labelled peer counts as idle
    peers = _peers_after_a_restart()
    assert "restarted" in peers and "old-0" not in peers and "other" not in peers
    assert len(peers) == MAX_PEERS + 1  # + "unknown"


def test_prom_metrics_under_several_api_servers_keep_their_peers(monkeypatch, tmp_path):
    """prometheus_client's multi-process mode cannot remove a series: there no peer ages out
    (a new one past the bound is "other"), so the series stay bounded."""
    from vllm_pd_ext.connectors.common import stats

    monkeypatch.setattr(stats, "PEER_IDLE_S", 0.0)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    peers = _peers_after_a_restart()
    assert "restarted" not in peers and "old-0" in peers and "other" in peers


def test_side_channel_routes_and_errors(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # must be ignored
    offers: list[Any] = []
    routes = {"/write_target": offers.append, "/cancel": lambda body: {"settled": False}}
    server = SideChannelServer("127.0.0.1", 0, lambda: {"v": 1}, routes)
    try:
        assert fetch_handshake("127.0.0.1", server.port, 2.0) == {"v": 1}
        answer = post_json("127.0.0.1", server.port, "/write_target", {"transfer_id": "t"}, 2.0)
        assert offers == [{"transfer_id": "t"}] and answer == {"ok": True}
        answer = post_json("127.0.0.1", server.port, "/cancel", {"transfer_id": "t"}, 2.0)
        assert answer == {"ok": True, "settled": False}  # what the route returned, too
        with pytest.raises(SideChannelError, match="404"):
            post_json("127.0.0.1", server.port, "/nope", {}, 2.0)
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/write_target", data=b"[1]", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=2)
        assert e.value.code == 400 and "not a JSON object" in json.loads(e.value.read())["error"]
    finally:
        server.close()
    with pytest.raises(SideChannelError, match=r"/handshake to 127\.0\.0\.1"):
        fetch_handshake("127.0.0.1", server.port, 1.0)


KEY = bytes(range(32))


def _raw(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    """A request written by hand: (status, answer headers, JSON body)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {}, method=method
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=5) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def test_keyed_side_channel_serves_tagged_requests_and_tags_its_answers():
    offers: list[Any] = []
    server = SideChannelServer(
        "127.0.0.1", 0, lambda: {"v": 1}, {"/write_target": offers.append}, key=KEY
    )
    try:
        assert fetch_handshake("127.0.0.1", server.port, 2.0, KEY) == {"v": 1}
        post_json("127.0.0.1", server.port, "/write_target", {"transfer_id": "t"}, 2.0, KEY)
        assert offers == [{"transfer_id": "t"}]
        assert server.refused == 0
    finally:
        server.close()


def test_keyed_side_channel_refuses_what_is_not_tagged_with_its_key():
    """Without the header, with another key's tags, with the head or the body changed after
    tagging, with a replayed header, with a stale timestamp and with an older header format:
    401 each time, the route never runs, and each refusal is counted."""
    from vllm_pd_ext.connectors.common import side_channel

    offers: list[Any] = []
    refusals: list[int] = []
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: {"secret": "layout"},
        {"/write_target": offers.append},
        key=KEY,
        on_refused=lambda: refusals.append(1),
    )
    body = json.dumps({"transfer_id": "t"}).encode()

    def signed() -> dict[str, str]:
        return side_channel._signed_headers(KEY, "POST", "/write_target", body)

    _, stamp, nonce, _, _ = signed()[side_channel.AUTH_HEADER].split(".")
    stale = str(int(stamp) - 120_000)
    stale_head = side_channel._head_tag(KEY, "POST", "/write_target", stale, nonce, len(body))
    stale_body = side_channel._body_tag(KEY, stale_head, body)
    good = signed()
    attempts = {
        "no header": ("POST", {}, body),
        "other key": (
            "POST",
            side_channel._signed_headers(bytes(32), "POST", "/write_target", body),
            body,
        ),
        "altered head": ("POST", signed(), json.dumps({"transfer_id": "longer"}).encode()),
        "altered body": ("POST", signed(), json.dumps({"transfer_id": "e"}).encode()),
        "stale": (
            "POST",
            {side_channel.AUTH_HEADER: f"v2.{stale}.{nonce}.{stale_head}.{stale_body}"},
            body,
        ),
        "older format": (
            "POST",
            {side_channel.AUTH_HEADER: f"{stamp}.{nonce}.{stale_head}"},
            body,
        ),
        "handshake untagged": ("GET", {}, None),
    }
    try:
        for what, (method, headers, data) in attempts.items():
            path = "/handshake" if method == "GET" else "/write_target"
            status, _, answer = _raw(server.port, method, path, data, headers)
            assert status == 401 and "unauthenticated" in answer["error"], what
            assert "secret" not in json.dumps(answer), what
        assert _raw(server.port, "POST", "/write_target", body, good)[0] == 200
        status, _, answer = _raw(server.port, "POST", "/write_target", body, good)  # replayed
        assert status == 401 and "replayed" in answer["error"]
        assert offers == [{"transfer_id": "t"}]
        assert len(refusals) == server.refused == len(attempts) + 1
    finally:
        server.close()


def test_an_untagged_post_is_refused_before_its_body_is_read():
    """Someone without the key declares an 8 MiB body and sends none of it: the answer is 401
    at once (the server neither waits for nor holds the body)."""
    import socket

    server = SideChannelServer("127.0.0.1", 0, dict, {"/write_target": print}, key=KEY)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"POST /write_target HTTP/1.1\r\nHost: x\r\nContent-Length: 8000000\r\n\r\n")
            s.settimeout(5)  # below the server's 10 s idle timeout: a waiting server fails this
            assert s.recv(64).startswith(b"HTTP/1.0 401")
        assert server.refused == 1
    finally:
        server.close()


def test_a_keyed_client_trusts_no_answer_without_the_servers_tag():
    """A server without the key (or an impostor) answers: the client refuses the answer."""
    server = SideChannelServer("127.0.0.1", 0, lambda: {"v": 1}, {"/renew": lambda body: None})
    try:
        with pytest.raises(SideChannelError, match="no valid fleet-key tag"):
            fetch_handshake("127.0.0.1", server.port, 2.0, KEY)
        with pytest.raises(SideChannelError, match="no valid fleet-key tag"):
            post_json("127.0.0.1", server.port, "/renew", {"req": "r"}, 2.0, KEY)
    finally:
        server.close()
    keyed = SideChannelServer("127.0.0.1", 0, lambda: {"v": 1}, key=bytes(32))
    try:
        with pytest.raises(SideChannelError, match="401"):
            fetch_handshake("127.0.0.1", keyed.port, 2.0, KEY)
    finally:
        keyed.close()


def test_side_channel_port_in_use_is_a_clear_error():
    server = SideChannelServer("127.0.0.1", 0, dict)
    try:
        with pytest.raises(
            SideChannelError, match=r"set kv_connector_extra_config\.side_channel_port"
        ):
            SideChannelServer("127.0.0.1", server.port, dict)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("host", "warned"),
    [
        ("127.0.0.1", False),
        ("::1", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("10.1.2.3", True),
    ],
)
def test_an_unauthenticated_listener_beyond_loopback_is_warned_about(caplog, host, warned):
    from vllm_pd_ext.connectors.common.side_channel import warn_if_exposed

    with caplog.at_level("WARNING"):
        warn_if_exposed(host, "the KV side channel")
    lines = [r.getMessage() for r in caplog.records if "without authentication" in r.getMessage()]
    assert len(lines) == int(warned)


def test_kv_listeners_bind_loopback_unless_configured(tiny_qwen, monkeypatch):
    """Without kv_ip, VLLM_HOST_IP or a host in the connector's config, the side channel and
    the data server bind 127.0.0.1, never this host's routable address."""
    from tests.unit.connectors.sched_harness import make_vllm_config
    from vllm_pd_ext.connectors.common.scheduler import default_host

    config = make_vllm_config(tiny_qwen, "kv_producer")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    assert default_host(config) == "127.0.0.1"
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    assert default_host(config) == "10.9.8.7"


#: What a slow client sends of a request head before it stops.
PARTIAL_HEAD = b"GET /handshake HTTP/1.1\r\nX-Slow: "


def test_side_channel_bounds_its_connections_and_closes_idle_ones():
    """Each connection costs a thread: when every slot is past its head (here: waiting for a
    body that never comes) a new connection is closed unanswered, and a connection idle in its
    body is closed after the idle timeout."""
    import socket
    import time

    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: {"v": 1},
        {"/renew": print},
        limits=SideChannelLimits(max_connections=2, idle_timeout_s=0.5),
    )
    try:
        held = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"POST /renew HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
            held.append(s)
        deadline = time.monotonic() + 10
        while server.slots.held() < 2 or server.slots.in_head():  # both wait for their bodies
            assert time.monotonic() < deadline, "the server never read those heads"
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert closed_within(extra, 10)  # closed unanswered: both slots are busy
        assert server.slots.refused == 1
        for s in held:  # the idle ones are closed by the server
            assert closed_within(s, 10)
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come free just after the server closed those connections
            try:
                assert fetch_handshake("127.0.0.1", server.port, 2.0) == {"v": 1}
                break
            except SideChannelError:
                assert time.monotonic() < deadline, "the side channel never served again"
                time.sleep(0.05)
    finally:
        server.close()


def test_a_trickling_client_is_closed_at_the_head_deadline():
    """A client that sends its head one byte at a time, each well within the idle timeout,
    is closed once the head deadline (counted from the connection's start) has passed."""
    import socket

    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: {"v": 1},
        limits=SideChannelLimits(head_timeout_s=0.5, idle_timeout_s=30),
    )
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /handshake HTTP/1.1\r\n")
            assert closed_within(s, 10, trickle=b"X-Slow: " + b"a" * 200)
        assert server.slots.closed == 1
        assert fetch_handshake("127.0.0.1", server.port, 2.0) == {"v": 1}
    finally:
        server.close()


def test_a_keyed_client_is_served_while_one_address_holds_what_it_may(caplog):
    """Twenty connections from one address that never finish their heads get at most
    ``max_per_source`` slots (the rest are refused, in one log line); a real client from
    another address is served."""
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: {"v": 1},
        key=KEY,
        limits=SideChannelLimits(max_connections=8, max_per_source=4, head_timeout_s=60),
    )
    attackers = connect_from("127.0.0.2", server.port, 20, PARTIAL_HEAD)
    try:
        with caplog.at_level("WARNING"):
            assert fetch_handshake("127.0.0.1", server.port, 5.0, KEY) == {"v": 1}
        refused = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert server.slots.refused == 16 and len(refused) == 1
        assert "4 connections from that address already" in refused[0].getMessage()
    finally:
        for s in attackers:
            s.close()
        server.close()


def test_when_full_the_oldest_connection_still_sending_its_head_makes_room():
    """Connections from several addresses take every slot and never finish their heads: a
    real client is still served, and the oldest of them is closed to make room for it."""
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: {"v": 1},
        key=KEY,
        limits=SideChannelLimits(max_connections=4, max_per_source=1, head_timeout_s=60),
    )
    attackers = [
        s for i in range(4) for s in connect_from(f"127.0.0.{2 + i}", server.port, 1, PARTIAL_HEAD)
    ]
    try:
        assert fetch_handshake("127.0.0.1", server.port, 5.0, KEY) == {"v": 1}
        assert closed_within(attackers[0], 10)
        assert server.slots.closed == 1 and server.slots.refused == 0
    finally:
        for s in attackers:
            s.close()
        server.close()


def test_a_forged_header_with_a_large_body_is_refused_before_the_body_is_read():
    """Someone without the key sends a well-formed header (tagged under another key) that
    declares an 8 MiB body, and 1 KiB of it: the 401 comes while the rest is unsent, so the
    server neither waited for nor held the body (its idle timeout, 60 s, is far beyond the
    10 s this client waits)."""
    import socket

    from vllm_pd_ext.connectors.common import side_channel

    server = SideChannelServer(
        "127.0.0.1",
        0,
        dict,
        {"/write_target": print},
        key=KEY,
        limits=SideChannelLimits(idle_timeout_s=60),
    )
    body = b" " * side_channel.DEFAULT_LIMITS.max_body_bytes
    forged = side_channel._signed_headers(bytes(32), "POST", "/write_target", body)
    head = (
        "POST /write_target HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {len(body)}\r\n{side_channel.AUTH_HEADER}: "
        f"{forged[side_channel.AUTH_HEADER]}\r\n\r\n"
    )
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(head.encode() + body[:1024])
            s.settimeout(10)
            assert s.recv(64).startswith(b"HTTP/1.0 401")
        assert server.refused == 1
    finally:
        server.close()


def test_a_request_head_is_bounded():
    """A head of endless header lines is cut off at ``max_head_bytes``: the connection is
    closed without an answer and the server goes on serving."""
    import socket

    server = SideChannelServer(
        "127.0.0.1", 0, lambda: {"v": 1}, limits=SideChannelLimits(head_timeout_s=60)
    )
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /handshake HTTP/1.1\r\n")
            line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
            try:
                # 20 KB: beyond max_head_bytes, and too few lines for http.server's own limit
                for _ in range(20):
                    s.sendall(line)
                s.settimeout(10)
                closed = s.recv(64) == b""  # closed, unanswered
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            assert closed
        assert fetch_handshake("127.0.0.1", server.port, 2.0) == {"v": 1}
    finally:
        server.close()
