"""The prefix index fed by vLLM's KV events: events built with vLLM's own classes and sent by
vLLM's own ZeroMQ publisher (the real peer), read back by our subscriber."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from tests.conftest import requires_vllm
from tests.unit.proxy.helpers import fleet, metric, proxy, wait_until
from vllm_pd_ext.proxy.kv_events import PrefixIndex, Subscriber, decode_batch

pytestmark = requires_vllm

BLOCK = 4
PROMPT = list(range(100, 112))  # three full blocks


def _vllm():
    from vllm.distributed import kv_events

    return kv_events


def block(hashes, parent, tokens, extra=None):
    """A BlockStored event of the first KV cache group's device tier, as vLLM builds it."""
    return _vllm().BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
    )


def stored(hashes, parent, tokens, extra=None):
    """``block``'s event through vLLM's wire encoding and our decoder."""
    return _wire(block(hashes, parent, tokens, extra))


def _wire(*events):
    kv = _vllm()
    batch = kv.KVEventBatch(ts=time.time(), events=list(events))
    (out,) = decode_batch(msgspec.msgpack.encode(batch))[-1:]
    return out


def _index_of_prompt(salt: str | None = None) -> PrefixIndex:
    index = PrefixIndex()
    extras = [(salt,) if salt else None, None, None]
    index.apply(stored([b"h0", b"h1"], None, PROMPT[:8], extras[:2]))
    index.apply(stored([b"h2"], b"h1", PROMPT[8:], extras[2:]))
    return index


def test_a_prompts_blocks_are_found_by_their_tokens_and_salt():
    index = _index_of_prompt(salt="s1")
    assert index.block_size == BLOCK and len(index) == 3
    assert index.cached_blocks(PROMPT, cache_salt="s1") == 3
    assert index.cached_blocks([*PROMPT, 7, 8, 9], cache_salt="s1") == 3  # a partial block
    assert index.cached_blocks(PROMPT, cache_salt="s2") == 0  # another salt: nothing shared
    assert index.cached_blocks(PROMPT) == 0
    assert index.cached_blocks(PROMPT[:4] + [0] * 8, cache_salt="s1") == 1  # diverges after 1
    unsalted = _index_of_prompt()
    assert unsalted.cached_blocks(PROMPT) == 3


def test_removals_and_clears_come_off_the_index():
    index = _index_of_prompt()
    index.apply(_wire(_vllm().BlockRemoved(block_hashes=[b"h1"], medium="GPU")))
    assert index.cached_blocks(PROMPT) == 1  # the chain breaks at the removed block
    index.apply(_wire(_vllm().AllBlocksCleared()))
    assert len(index) == 0 and index.cached_blocks(PROMPT) == 0


def test_what_cannot_be_keyed_or_trusted_is_skipped_and_counted():
    index = PrefixIndex(max_blocks=2)
    index.apply(stored([b"x1"], b"never-seen", PROMPT[:4]))  # parent stored before we listened
    assert index.orphans == 1 and len(index) == 0
    index.apply(stored([b"h0", b"h1", b"h2"], None, PROMPT))  # over max_blocks
    assert len(index) == 2 and index.dropped == 1
    assert index.cached_blocks(PROMPT) == 2
    for bad in (
        {"type": "BlockStored", "block_hashes": [b"a"], "token_ids": [1], "block_size": BLOCK},
        {"type": "BlockStored", "block_hashes": "a", "token_ids": [], "block_size": 0},
        {"type": "BlockRemoved", "block_hashes": [[1]]},
        {"type": "Nonsense"},
        ["not", "a", "map"],
    ):
        index.apply(bad)
    assert index.malformed == 5 and len(index) == 2
    with pytest.raises(ValueError):
        decode_batch(b"\xc1 not msgpack")


def test_other_tiers_and_groups_are_not_the_device_cache():
    index = PrefixIndex()
    event = stored([b"h0"], None, PROMPT[:4])
    index.apply({**event, "medium": "CPU"})
    index.apply({**event, "group_idx": 1})
    assert len(index) == 0
    index.apply(event)
    assert len(index) == 1


def test_the_subscriber_reads_vllms_publisher_and_replays_what_came_before(tmp_path):
    """vLLM's ZmqEventPublisher over ipc: batches published before the subscriber connected
    come through its replay request, later ones live or, when ZeroMQ dropped them before the
    subscription was through, through the replay asked for when it is quiet; the index ends
    as the engine's cache."""
    kv = _vllm()
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    publisher = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="e0")

    def publish(*events) -> None:
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=list(events)))

    async def go() -> tuple[int, int, int]:
        index = PrefixIndex()
        publish(block([b"h0", b"h1"], None, PROMPT[:8]))  # before anyone listens
        sub = Subscriber(index, endpoint, replay, topic="e0", catch_up_s=0.5)
        sub.start()
        try:
            deadline = time.monotonic() + 30
            while index.cached_blocks(PROMPT) < 2:
                assert time.monotonic() < deadline, (sub.batches, index)
                await asyncio.sleep(0.05)
            before = index.cached_blocks(PROMPT)
            # once, just after the start: if the subscription has not reached the publisher
            # yet, ZeroMQ drops it and the quiet-period replay brings it
            publish(block([b"h2"], b"h1", PROMPT[8:]))
            while index.cached_blocks(PROMPT) < 3:
                assert time.monotonic() < deadline, (sub.batches, index)
                await asyncio.sleep(0.05)
            full = index.cached_blocks(PROMPT)
            publish(kv.BlockRemoved(block_hashes=[b"h0"], medium="GPU"))
            while index.cached_blocks(PROMPT):
                assert time.monotonic() < deadline, (sub.batches, index)
                await asyncio.sleep(0.05)
            return before, full, index.malformed
        finally:
            await sub.close()

    try:
        assert asyncio.run(go()) == (2, 3, 0)
    finally:
        publisher.shutdown()


def test_the_proxy_follows_an_instances_kv_events_and_shows_them_in_metrics(engines, tmp_path):
    """An instance whose config names its KV events publisher (vLLM's own, here) gets a
    prefix index that /metrics shows; one without gets none (routed on the estimate)."""
    kv = _vllm()
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    publisher = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    publisher.publish(
        kv.KVEventBatch(
            ts=time.time(),
            events=[block([b"h0", b"h1", b"h2"], None, PROMPT)],
        )
    )
    instances = fleet(engines, prefill=("p1",), decode=("d1",))
    instances[1]["kv_events"] = {"endpoint": endpoint, "replay_endpoint": replay}
    d1, p1 = engines["d1"].url, engines["p1"].url
    try:
        with proxy(engines, instances=instances) as (base, svc):
            wait_until(lambda: metric(base, "vllm_pd_kv_events", instance=d1, figure="blocks") == 3)
            assert metric(base, "vllm_pd_kv_events", instance=d1, figure="malformed") == 0
            assert metric(base, "vllm_pd_kv_events", instance=p1) == 0  # no series
            (decode,) = [i for i in svc.fleet.instances() if i.url == d1]
            assert decode.events is not None
            assert decode.events.index.cached_blocks(PROMPT) == 3
    finally:
        publisher.shutdown()


def test_a_kv_events_endpoint_must_be_a_zeromq_address():
    from pydantic import ValidationError

    from vllm_pd_ext.proxy.config import InstanceConfig

    with pytest.raises(ValidationError, match="tcp:// or ipc://"):
        InstanceConfig(url="http://e:1", kv_events={"endpoint": "http://e:5557"})
    ok = InstanceConfig(url="http://e:1", kv_events={"endpoint": "tcp://e:5557"})
    assert ok.kv_events is not None and ok.kv_events.replay_endpoint is None


def test_a_restarted_engine_resets_the_index(tmp_path):
    """vLLM's publisher stopped and started again on the same endpoints (an engine restart):
    its seq counts from 0 again, so the subscriber forgets what the old engine held and
    keeps what the new one stores."""
    kv = _vllm()
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    old = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    other = list(range(500, 512))
    for _ in range(20):  # seq 0..19
        old.publish(
            kv.KVEventBatch(ts=time.time(), events=[block([b"h0", b"h1", b"h2"], None, PROMPT)])
        )

    async def go() -> tuple[int, int, int]:
        index = PrefixIndex()
        sub = Subscriber(index, endpoint, replay, catch_up_s=0.5)
        sub.start()
        new = None
        try:
            deadline = time.monotonic() + 30
            while index.cached_blocks(PROMPT) < 3 or sub.next_seq != 20:
                assert time.monotonic() < deadline, sub.figures()
                await asyncio.sleep(0.05)
            old.shutdown()
            new = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
            for _ in range(19):  # seq 0..18: any one seen tells the restart
                new.publish(
                    kv.KVEventBatch(ts=time.time(), events=[block([b"n0"], None, other[:4])])
                )
                if sub.restarts:
                    break
                await asyncio.sleep(0.05)
            while not (sub.restarts and index.cached_blocks(other)):
                assert time.monotonic() < deadline, sub.figures()
                await asyncio.sleep(0.05)
            return sub.restarts, index.cached_blocks(PROMPT), index.cached_blocks(other)
        finally:
            await sub.close()
            if new is not None:
                new.shutdown()

    assert asyncio.run(go()) == (1, 0, 1)
