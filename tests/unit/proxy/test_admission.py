"""Admission control on its own: slots, the bounded queue and what it reports."""

from __future__ import annotations

import asyncio

import pytest

from vllm_pd_ext.proxy.admission import Admission
from vllm_pd_ext.proxy.errors import ProxyError


def test_queue_reports_its_length_and_bounds_it():
    async def go():
        seen: list[int] = []
        adm = Admission(1, 1, queue_timeout_s=10, on_queued=seen.append)
        await adm.acquire()  # a free slot: nothing queues, nothing reported
        quiet = list(seen)
        waiting = asyncio.ensure_future(adm.acquire())
        for _ in range(100):  # bounded: until it queues
            if adm.queued:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ProxyError) as full:
            await adm.acquire()  # queue full: 429, not queued
        adm.release()
        await asyncio.wait_for(waiting, 5)
        adm.release()
        return quiet, seen, full.value, adm.in_flight, adm.queued

    quiet, seen, full, in_flight, queued = asyncio.run(go())
    assert quiet == [] and seen == [1, 0]
    assert full.status == 429 and full.retry_after == 1
    assert in_flight == 0 and queued == 0


def test_queue_timeout_is_503_and_leaves_no_one_queued():
    async def go():
        seen: list[int] = []
        adm = Admission(1, 4, queue_timeout_s=0.05, on_queued=seen.append)
        await adm.acquire()
        with pytest.raises(ProxyError) as late:
            await adm.acquire()
        return seen, late.value, adm.queued

    seen, late, queued = asyncio.run(go())
    assert late.status == 503 and late.code == "queue_timeout"
    assert seen == [1, 0] and queued == 0
