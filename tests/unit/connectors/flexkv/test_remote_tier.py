"""The remote tier on a real Mooncake Store: a real ``mooncake_master`` on 127.0.0.1 and the
real store clients (``mooncake.store``) in our scheduler and worker, over TCP. Two engines
in one process stand for two instances of a fleet: what one saved, the other loads."""

from __future__ import annotations

import pytest

from tests.skips import need
from tests.unit.connectors.flexkv.engine import Engine
from tests.unit.connectors.flexkv.test_round_trip import loads_of, prompt, request, run
from tests.unit.connectors.sched_harness import BLOCK_SIZE, assert_scheduler_empty
from vllm_pd_ext.connectors.flexkv.config import RemoteTierConfig
from vllm_pd_ext.connectors.flexkv.metadata import CPU, REMOTE
from vllm_pd_ext.connectors.flexkv.remote import MooncakeBlockStore
from vllm_pd_ext.connectors.flexkv.store import BlockFileError


def _after_loads(e: Engine, req) -> None:
    """Run ``req`` to the end, noting its first blocks (after the step that planned loads)."""
    e.sched.add_request(req)
    e.step()
    e.first_blocks = {
        req.request_id: list(e.sched.kv_cache_manager.get_block_ids(req.request_id)[0])
    }
    e.run_until_done()


def test_blocks_one_instance_saved_load_on_another_from_the_remote_tier(engine_factory, remote):
    """Instance A computes a prompt and saves its blocks (CPU tier and the store); instance B,
    which never saw it, finds all four full blocks in the store at lookup, loads them and
    computes only the tail; its blocks hold what computing them gives."""
    from tests.unit.connectors.flexkv.test_round_trip import assert_blocks_hold

    a = engine_factory(remote=remote, namespace="share-1")
    run(a, request(prompt(1)))
    a.worker._worker.wait_idle()
    assert a.worker_stats["save_bytes.remote"] > 0
    b = engine_factory(remote=remote, namespace="share-1")
    second = request(prompt(1))
    _after_loads(b, second)
    (job,) = loads_of(b)
    assert [it.tier for it in job.items] == [REMOTE] * 4
    assert b.computed[second.request_id][0] == 4 * BLOCK_SIZE  # the tail only
    assert_blocks_hold(b, second, 4)
    assert b.hit_sources == {"external_unspecified": 4 * BLOCK_SIZE}
    assert b.worker_stats["load_bytes.remote"] > 0
    assert b.worker._worker.stores[REMOTE].staged_reads == 4  # via its registered buffer
    # read from the store, the blocks were promoted: B's next hit is in its CPU tier
    run(b, request(prompt(1)))
    assert [it.tier for it in loads_of(b)[-1].items] == [CPU] * 4
    assert_scheduler_empty(b.sched)


def test_with_a_fleet_key_a_block_forged_in_the_store_is_recomputed_never_loaded(
    engine_factory, remote, monkeypatch
):
    """A store client without the fleet key (anyone who reaches the store) puts blocks 2-3
    of a prompt whose blocks 0-1 instance A saved, well formed with an xxh3-64, holding block
    0's KV. Instance B finds four blocks at lookup, loads 0-1, finds 2 and 3 fail their MAC:
    they are recomputed, never loaded, and the forged objects removed."""
    from tests.unit.connectors.flexkv.test_round_trip import assert_blocks_hold
    from vllm_pd_ext import fleet_key

    monkeypatch.delenv(fleet_key.KEY_FILE_ENV, raising=False)
    monkeypatch.setenv(fleet_key.KEY_ENV, "5a" * 32)
    a = engine_factory(remote=remote, namespace="forge-1")
    run(a, request(prompt(2)[: 2 * BLOCK_SIZE + 3]))  # blocks 0-1 saved, with a MAC
    a.worker._worker.wait_idle()
    store = a.worker._worker.stores[REMOTE]
    assert isinstance(store, MooncakeBlockStore) and store.keyed
    sched = a.conn._scheduler
    keys = sched._keys(request(prompt(2)))
    forger = MooncakeBlockStore(RemoteTierConfig(**remote), sched.namespace)  # no key
    try:
        fp = a.worker._worker.fingerprint
        block0 = bytearray(a.worker._worker.block_bytes)
        store.read_into(keys[0], block0, fp)  # block 0's KV, as A saved it
        for k in keys[2:4]:
            forger.write(k, block0, fp)
        assert forger.exists_many(keys[:4]) == [True] * 4
        b = engine_factory(remote=remote, namespace="forge-1")
        second = request(prompt(2))
        _after_loads(b, second)
        assert b.computed[second.request_id][0] == 2 * BLOCK_SIZE  # blocks 0-1 loaded
        assert_blocks_hold(b, second, 4)  # block 2 holds its own KV, not block 0's
        assert b.worker_stats["corrupt_blocks"] == 2
        b.worker._worker.wait_idle()
        # the forged objects were removed; B's recomputed blocks 2-3, saved with their MAC,
        # load on a third instance
        c = engine_factory(remote=remote, namespace="forge-1")
        third = request(prompt(2))
        _after_loads(c, third)
        assert [it.tier for it in loads_of(c)[-1].items] == [REMOTE] * 4
        assert_blocks_hold(c, third, 4)
        assert c.worker_stats.get("corrupt_blocks", 0) == 0
    finally:
        forger.close()


def test_a_block_is_read_only_whole_and_checked(remote):
    """Straight on the store: a round trip gives the bytes back; a block of another length
    or KV layout fails the checks; a missing one is FileNotFoundError; a save replaces."""
    cfg = RemoteTierConfig(**remote)
    store = MooncakeBlockStore(cfg, "direct-1")
    reader = MooncakeBlockStore(cfg, "direct-1", segment=False)
    try:
        key, payload = "ab" * 16, bytearray(range(256)) * 4
        assert store.write(key, [payload[:100], payload[100:]], "layout-a") > len(payload)
        out = bytearray(len(payload))
        reader.read_into(key, [memoryview(out)[:512], memoryview(out)[512:]], "layout-a")
        assert out == payload
        with pytest.raises(BlockFileError, match="written with KV layout"):
            reader.read_into(key, bytearray(len(payload)), "layout-b")
        assert reader.exists(key)  # another layout's block is no damage: left
        with pytest.raises(BlockFileError, match="payload bytes, expected"):
            reader.read_into(key, bytearray(len(payload) - 1), "layout-a")
        with pytest.raises(FileNotFoundError):
            reader.read_into("cd" * 16, bytearray(8), "layout-a")
        assert reader.exists_many([key, "cd" * 16, key]) == [True, False, True]
        # a save replaces what is there (a plain put would keep a bad object for good)
        store.write(key, payload[:1000], "layout-a")
        out = bytearray(1000)
        reader.read_into(key, out, "layout-a")
        assert out == payload[:1000]
    finally:
        reader.close()
        store.close()


def test_a_batch_read_through_the_registered_buffer_is_checked_like_any_other(remote):
    """A worker's client reads a batch through its registered staging buffer: good blocks
    come back whole; a block with a flipped payload byte, one a byte too long (it does not
    fit its slot: read as before) and a missing one are refused, exactly as a client
    without the buffer (``get_batch``) refuses them."""
    cfg = RemoteTierConfig(**remote)
    store = MooncakeBlockStore(cfg, "staged-1")
    staged = MooncakeBlockStore(cfg, "staged-1")
    plain = MooncakeBlockStore(cfg, "staged-1", segment=False)  # registers no buffer
    size = 3000
    keys = [f"{i:02x}" * 16 for i in range(5)]
    payloads = {k: bytes((i + j) % 251 for j in range(size)) for i, k in enumerate(keys)}

    def damage() -> None:
        for k in keys[:4]:
            store.write(k, payloads[k], "layout-a")
        flipped = bytearray(store._store.get(store.name(keys[1])))
        flipped[-1] ^= 1  # a payload byte
        assert store._store.upsert_parts(store.name(keys[1]), bytes(flipped)) == 0
        longer = bytes(store._store.get(store.name(keys[2]))) + b"x"
        assert store._store.upsert_parts(store.name(keys[2]), longer) == 0

    def outcome(reader: MooncakeBlockStore) -> dict[str, str]:
        seen = {}
        with reader.fetching(dict.fromkeys(keys, size)) as got:
            for k in keys:
                out = bytearray(size)
                try:
                    reader.check_into(k, got.get(k, b""), out, "layout-a")
                    seen[k] = "ok" if out == payloads[k] else "wrong bytes"
                except BlockFileError as e:
                    seen[k] = str(e).rpartition(": ")[2]
                except FileNotFoundError:
                    seen[k] = "missing"
        return seen

    try:
        expected = {
            keys[0]: "ok",
            keys[1]: "checksum mismatch",
            keys[2]: "payload of 3001 bytes, expected exactly 3000",
            keys[3]: "ok",
            keys[4]: "missing",
        }
        damage()
        assert outcome(staged) == expected
        assert staged.staged_reads == 3  # the too-long one came by get_batch
        damage()
        assert outcome(plain) == expected
        assert plain.staged_reads == 0
    finally:
        plain.close()
        staged.close()
        store.close()


def test_a_store_that_stops_answering_is_skipped_until_it_answers_again(tmp_path):
    """The master dies: the first call that fails marks the store down (counted, logged),
    and from then on its blocks are misses with no call made (each would take seconds to
    fail), until the background probe finds a master again on the same address; then saves
    and loads work again (the new master knows no old object: those are misses)."""
    need("mooncake", why="the remote tier's store is Mooncake Store")
    from tests.unit.proxy.helpers import wait_until
    from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
    from vllm_pd_ext.util.mooncake_master import mooncake_master

    stats = FlexKVRecorder()
    key, payload = "ef" * 16, bytearray(b"kv" * 512)
    with mooncake_master(tmp_path / "master-1.log") as m:
        cfg = RemoteTierConfig(master=m.master, segment_gb=1 / 16, buffer_mb=16)
        store = MooncakeBlockStore(cfg, "down-1", stats=stats)
        store.write(key, payload, "layout-a")
        assert store.exists(key)
    try:
        assert store.exists_many([key, key]) == [False, False]  # the master is gone
        assert not store.up
        with pytest.raises(OSError, match="the store is down"):
            store.read_into(key, bytearray(len(payload)), "layout-a")
        with pytest.raises(OSError, match="the store is down"):
            store.write(key, payload, "layout-a")
        taken = stats.take()
        assert taken is not None and taken.data == {"remote_down": 1}  # counted once
        with mooncake_master(tmp_path / "master-2.log", rpc_port=m.rpc_port):
            wait_until(lambda: store.up, timeout=60)
            assert not store.exists(key)  # the new master never knew it
            wait_until(lambda: _writes(store, key, payload), timeout=30)
            out = bytearray(len(payload))
            store.read_into(key, out, "layout-a")
            assert out == payload
    finally:
        store.close()


def _writes(store: MooncakeBlockStore, key: str, payload: bytearray) -> bool:
    """Whether a save succeeds (a client remounts its memory on a new master shortly after
    it reconnects; until then a put finds no room)."""
    try:
        store.write(key, payload, "layout-a")
    except OSError:
        return False
    return True


def test_a_master_that_does_not_answer_at_start_leaves_the_tier_down_until_it_does(tmp_path):
    """No master at the configured address when the instance starts: the store client is
    not set up (its set-up would wait 90 s, then fail the engine's start); the tier is down
    from the start (counted), every block a miss; once a master answers there, the probe sets
    the client up and saves and loads work."""
    need("mooncake", why="the remote tier's store is Mooncake Store")
    from tests.unit.proxy.helpers import wait_until
    from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
    from vllm_pd_ext.util.mooncake_master import mooncake_master
    from vllm_pd_ext.util.vllm_process import free_port

    stats = FlexKVRecorder()
    port = free_port()
    cfg = RemoteTierConfig(master=f"127.0.0.1:{port}", segment_gb=1 / 16, buffer_mb=16)
    store = MooncakeBlockStore(cfg, "late-1", stats=stats)
    key, payload = "a1" * 16, bytearray(b"kv" * 256)
    try:
        assert not store.up
        assert store.exists_many([key]) == [False]
        with pytest.raises(OSError, match="the store is down"):
            store.write(key, payload, "layout-a")
        taken = stats.take()
        assert taken is not None and taken.data == {"remote_down": 1}
        with mooncake_master(tmp_path / "master.log", rpc_port=port):
            wait_until(lambda: store.up, timeout=60)
            wait_until(lambda: _writes(store, key, payload), timeout=30)
            out = bytearray(len(payload))
            store.read_into(key, out, "layout-a")
            assert out == payload
    finally:
        store.close()
