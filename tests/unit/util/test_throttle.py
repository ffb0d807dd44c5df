"""The log throttle: at most one True per interval."""

from __future__ import annotations

from vllm_pd_ext.util.throttle import Throttle


def test_ready_at_most_once_per_interval():
    now = [100.0]
    throttle = Throttle(10.0, clock=lambda: now[0])
    assert throttle.ready()
    assert not throttle.ready()
    now[0] = 109.9
    assert not throttle.ready()
    now[0] = 110.0
    assert throttle.ready() and not throttle.ready()
