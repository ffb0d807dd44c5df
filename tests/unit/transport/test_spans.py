"""Span validation and coalescing, descriptors, stats and the backend registry (pure units)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from vllm_pd_ext.transport import (
    PeerMismatch,
    RegionBoundsError,
    TransportDescriptor,
    TransportError,
    backend_class,
    backend_names,
    get_backend,
    register_backend,
)
from vllm_pd_ext.transport.base import Region, decode_payload, encode_payload
from vllm_pd_ext.transport.spans import (
    LOCAL,
    REMOTE,
    as_span_array,
    check_bounds,
    coalesce,
    split_long,
)
from vllm_pd_ext.transport.stats import MAX_KEPT_DURATIONS, TransferStats


def test_as_span_array_accepts_triples_and_arrays() -> None:
    a = as_span_array([(0, 8, 4), (4, 12, 4)])
    assert a.dtype == np.int64 and a.shape == (2, 3)
    assert as_span_array(np.array([[1, 2, 3]], dtype=np.int32)).dtype == np.int64
    assert as_span_array([]).shape == (0, 3)
    assert as_span_array(iter([(1, 2, 3)])).tolist() == [[1, 2, 3]]
    for bad in ([(1, 2)], np.zeros((2, 4), np.int64), np.zeros((2, 3), np.float64), 5):
        with pytest.raises(RegionBoundsError):
            as_span_array(bad)


def test_check_bounds_names_the_first_bad_span() -> None:
    spans = as_span_array([(0, 0, 10), (90, 0, 20)])
    with pytest.raises(RegionBoundsError, match="span 1"):
        check_bounds(spans, 100, 100)
    check_bounds(as_span_array([(0, 90, 10)]), 10, 100)  # exactly at both ends: fine


@pytest.mark.parametrize(
    "span",
    [
        ((1 << 63) - 8, 0, 16),  # local start + length wraps to a negative int64
        (0, (1 << 63) - 8, 16),  # remote start + length wraps
        (8, 0, (1 << 63) - 1),
    ],
)
def test_check_bounds_refuses_spans_whose_end_wraps_around(span) -> None:
    with pytest.raises(RegionBoundsError, match="span 0"):
        check_bounds(as_span_array([span]), 4096, 4096)


def test_check_bounds_refuses_overlap_only_on_the_target_side() -> None:
    spans = as_span_array([(0, 0, 10), (100, 5, 10)])
    check_bounds(spans, 200, 200, target=LOCAL)  # locals are disjoint
    with pytest.raises(RegionBoundsError, match="overlap in the remote"):
        check_bounds(spans, 200, 200, target=REMOTE)
    touching = as_span_array([(0, 0, 10), (20, 10, 10)])
    check_bounds(touching, 200, 200, target=REMOTE)  # adjacent, not overlapping


def test_coalesce_merges_only_runs_adjacent_on_both_sides() -> None:
    spans = as_span_array([(0, 100, 4), (4, 104, 4), (8, 200, 4), (12, 204, 4), (20, 208, 4)])
    assert coalesce(spans).tolist() == [[0, 100, 8], [8, 200, 8], [20, 208, 4]]
    one = as_span_array([(0, 0, 4)])
    assert coalesce(one).tolist() == [[0, 0, 4]]
    # Same bytes, same order, randomised lengths.
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 50, 1000)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    spans = np.stack([starts, starts + 7, lens], axis=1)
    merged = coalesce(spans)
    assert merged.tolist() == [[0, 7, int(lens.sum())]]


def test_split_long_cuts_only_long_spans_and_keeps_bytes() -> None:
    spans = as_span_array([(0, 100, 10), (10, 0, 25), (50, 50, 8)])
    out = split_long(spans, 8)
    assert out.tolist() == [
        [0, 100, 8],
        [8, 108, 2],
        [10, 0, 8],
        [18, 8, 8],
        [26, 16, 8],
        [34, 24, 1],
        [50, 50, 8],
    ]
    assert coalesce(out).tolist() == spans.tolist()
    assert split_long(spans, 100).tolist() == spans.tolist()
    assert split_long(as_span_array([]), 8).shape == (0, 3)
    with pytest.raises(ValueError):
        split_long(spans, 0)


def test_descriptor_bytes_round_trip_and_errors() -> None:
    d = TransportDescriptor(
        backend="mooncake",
        engine_id="127.0.0.1:5",
        address="127.0.0.1:5",
        regions=(Region("a", 4096, 10), Region("b", 8192, 20)),
        extra={"k": "v"},
    )
    assert TransportDescriptor.from_bytes(d.to_bytes()) == d
    assert d.region("b").addr == 8192
    with pytest.raises(PeerMismatch):
        d.region("c")
    with pytest.raises(PeerMismatch, match="version"):
        TransportDescriptor.from_dict({**d.to_dict(), "v": 99})
    with pytest.raises(PeerMismatch, match="malformed"):
        TransportDescriptor.from_dict({"v": 1, "backend": "x"})
    with pytest.raises(PeerMismatch):
        TransportDescriptor.from_bytes(b"[1, 2]")


def test_payload_codec() -> None:
    raw = bytes(range(256))
    assert decode_payload(encode_payload(raw)) == raw
    with pytest.raises(ValueError):
        decode_payload("not base64!")


def test_stats_take_and_totals() -> None:
    s = TransferStats()
    s.record_transfer(nbytes=100, spans=4, posted_spans=1, seconds=0.5, ok=True)
    s.record_transfer(nbytes=50, spans=2, posted_spans=2, seconds=0.1, ok=False)
    s.record_timeout()
    s.record_notification(sent=2, received=1)
    snap = s.take()
    assert (snap.transfers, snap.failures, snap.timeouts, snap.bytes) == (1, 1, 1, 100)
    assert (snap.spans, snap.posted_spans, snap.durations) == (4, 1, [0.5])
    assert (snap.notifications_sent, snap.notifications_received) == (2, 1)
    assert snap.gbps == pytest.approx(100 / 0.5 / 1e9)
    assert s.take().as_dict()["transfers"] == 0
    assert s.totals().bytes == 100 and s.totals().durations == []
    for _ in range(MAX_KEPT_DURATIONS + 5):
        s.record_transfer(nbytes=1, spans=1, posted_spans=1, seconds=0.0, ok=True)
    assert len(s.take().durations) == MAX_KEPT_DURATIONS


def test_every_backend_class_carries_its_registered_name() -> None:
    # the name a descriptor carries on the wire is the one the registry knows it by
    for name in backend_names():
        assert backend_class(name).backend_name == name


def test_registry() -> None:
    assert {"mooncake", "mori"} <= set(backend_names())
    with pytest.raises(TransportError, match="unknown transport backend"):
        get_backend("nope")
    with pytest.raises(ValueError):
        register_backend("mooncake", "x:Y")
    with pytest.raises(ValueError):
        register_backend("another", "no-colon")
    with pytest.raises(ValidationError, match="protocol"):
        get_backend("mooncake", protocol="carrier-pigeon")
    with pytest.raises(ValidationError, match="bogus"):
        get_backend("mori", bogus=1)
