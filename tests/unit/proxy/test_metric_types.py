"""The lock-free metric types expose what prometheus_client's own types would."""

from __future__ import annotations

import random

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_pd_ext.proxy import metric_types

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1, 2.5)


def _build(module, registry):
    return (
        module.Counter("t_requests", "Requests", ["route", "outcome"], registry=registry),
        module.Counter("t_plain", "A counter without labels", registry=registry),
        module.Gauge("t_in_flight", "In flight", registry=registry),
        module.Gauge("t_healthy", "Healthy", ["instance"], registry=registry),
        module.Histogram("t_itl_seconds", "Gaps", ["decision"], buckets=BUCKETS, registry=registry),
        module.Histogram("t_leg_seconds", "Leg", buckets=BUCKETS, registry=registry),
    )


def _exposition(registry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_same_exposition_as_prometheus_client():
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours, theirs = _build(metric_types, ours_reg), _build(prometheus_client, theirs_reg)
    rng = random.Random(7)
    for _ in range(500):
        route = rng.choice(["chat", "completions"])
        outcome = rng.choice(["ok", "client_gone"])
        gap = rng.choice([0.0005, 0.001, 0.005, 0.5, 2.5, 3.0, rng.random() * 3])
        for requests, plain, in_flight, healthy, itl, leg in (ours, theirs):
            requests.labels(route, outcome).inc()
            plain.inc(2)
            in_flight.inc()
            in_flight.dec(0.5)
            healthy.labels(route).set(gap)
            itl.labels(outcome).observe(gap)
            leg.observe(gap)
    assert _exposition(ours_reg) == _exposition(theirs_reg)


def test_bucket_bounds_are_inclusive_like_prometheus():
    reg = CollectorRegistry()
    h = metric_types.Histogram("t_h", "h", buckets=(0.1, 1), registry=reg)
    h.observe(0.1)
    h.observe(1.0)
    h.observe(1.5)
    text = generate_latest(reg).decode()
    assert 't_h_bucket{le="0.1"} 1.0' in text
    assert 't_h_bucket{le="1.0"} 2.0' in text
    assert 't_h_bucket{le="+Inf"} 3.0' in text
    assert "t_h_count 3.0" in text


def test_wrong_label_count_and_duplicate_names_are_refused():
    reg = CollectorRegistry()
    c = metric_types.Counter("t_c", "c", ["a", "b"], registry=reg)
    with pytest.raises(ValueError):
        c.labels("only-one")
    with pytest.raises(ValueError):
        metric_types.Counter("t_c", "again", registry=reg)
