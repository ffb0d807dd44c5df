"""PdExtFlexKVConnector end to end in one process: vLLM's real Scheduler drives the
scheduler-side connector, our worker-side connector moves bytes between CPU "KV cache"
tensors, its CPU pool and block files. A fake forward pass writes a value per (token,
position) so every loaded block can be compared with what computing it would give."""

from __future__ import annotations

import itertools
import time

import torch
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.unit.connectors.flexkv.engine import Engine
from tests.unit.connectors.sched_harness import BLOCK_SIZE, assert_scheduler_empty
from vllm_pd_ext.connectors.flexkv.metadata import CPU, SSD

PROMPT = 70  # 4 full blocks + 6 tokens: 4 blocks are loadable, the tail is computed
_ids = itertools.count()


def request(prompt: list[int], salt: str | None = None, max_tokens: int = 2) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        cache_salt=salt,
    )


def prompt(seed: int = 0, n: int = PROMPT) -> list[int]:
    return [100 + (seed * 31 + i * 7) % 500 for i in range(n)]


def run(engine: Engine, req: Request) -> Request:
    engine.sched.add_request(req)
    engine.run_until_done()
    return req


def loads_of(engine: Engine) -> list:
    return [job for m in engine.metas for job in m.loads]


def assert_blocks_hold(engine: Engine, req: Request, n_blocks: int, salt=None) -> None:
    blocks = engine.first_blocks[req.request_id]
    for i in range(n_blocks):
        want = engine.expected_block(req.prompt_token_ids, i, salt)
        assert torch.equal(engine.cache[blocks[i]], want), f"block {i}"


def test_second_request_loads_shared_prefix_from_cpu_in_the_same_step(engine_factory):
    e = engine_factory()
    first = run(e, request(prompt()))
    saves = [s for m in e.metas for s in m.saves]
    assert len(saves) == 4 and all(s.slot >= 0 and not s.ssd for s in saves)
    assert not loads_of(e)
    second = request(prompt())
    e.sched.add_request(second)
    e.first_blocks = {}
    real = e.forward

    def forward(out):  # the first forward pass of `second` already sees the loaded blocks
        if (
            second.request_id not in e.first_blocks
            and second.request_id in out.num_scheduled_tokens
        ):
            e.first_blocks[second.request_id] = list(
                e.sched.kv_cache_manager.get_block_ids(second.request_id)[0]
            )
            assert_blocks_hold(e, second, 4)
        real(out)

    e.forward = forward
    out, _ = e.step(wait_loads=False)
    # a hit wholly in the CPU tier is loaded synchronously: no step spent waiting for it
    assert second.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens[second.request_id] == PROMPT - 4 * BLOCK_SIZE
    (job,) = loads_of(e)
    assert job.sync and job.req_id == second.request_id
    assert [it.tier for it in job.items] == [CPU] * 4
    e.run_until_done()
    # only the tail was computed; the loaded blocks hold what computing them would give
    assert e.computed[second.request_id][0] == 4 * BLOCK_SIZE
    assert_blocks_hold(e, second, 4)
    assert e.hit_sources == {"host": 4 * BLOCK_SIZE}
    assert first.request_id != second.request_id
    # the rows were unpinned after the step: the CPU tier can evict them again
    assert all(e.cpu_entry(k).pins == 0 for k in e.conn._scheduler._keys(request(prompt())))
    assert_scheduler_empty(e.sched)


def test_cpu_hit_loads_asynchronously_when_asked(engine_factory):
    e = engine_factory(sync_load="never")
    run(e, request(prompt()))
    second = request(prompt())
    e.sched.add_request(second)
    out, _ = e.step()
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0
    (job,) = loads_of(e)
    assert not job.sync and [it.tier for it in job.items] == [CPU] * 4
    e.first_blocks = {
        second.request_id: list(e.sched.kv_cache_manager.get_block_ids(second.request_id)[0])
    }
    e.run_until_done()
    assert e.computed[second.request_id][0] == 4 * BLOCK_SIZE
    assert_blocks_hold(e, second, 4)
    assert_scheduler_empty(e.sched)


def test_failed_synchronous_load_is_recomputed(engine_factory):
    e = engine_factory()
    run(e, request(prompt()))
    w = e.worker._worker
    w._bad_slots |= set(range(32))  # as after a failed save: these rows are never loaded
    second = request(prompt())
    e.sched.add_request(second)
    e.first_blocks = {}
    e.step()
    (job,) = loads_of(e)
    assert job.sync
    e.first_blocks[second.request_id] = [it.block_id for it in job.items]
    e.run_until_done()
    # vLLM threw the step's output away and recomputed the prompt from its first block
    assert 0 in e.computed[second.request_id]
    assert_blocks_hold(e, second, 4)
    assert e.worker_stats["failed_blocks"] == 4
    assert_scheduler_empty(e.sched)
    # the failed rows left the index; the recomputed blocks were saved again and load fine
    w._bad_slots.clear()
    third = run(e, request(prompt()))
    assert loads_of(e)[-1].sync
    assert e.computed[third.request_id][0] == 4 * BLOCK_SIZE


def test_cache_salt_isolates_tenants(engine_factory):
    e = engine_factory()
    run(e, request(prompt(), salt="tenant-a"))
    run(e, request(prompt(), salt="tenant-b"))
    run(e, request(prompt()))
    assert not loads_of(e)
    run(e, request(prompt(), salt="tenant-a"))
    (job,) = loads_of(e)
    assert len(job.items) == 4


def test_partial_prefix_and_divergence(engine_factory):
    e = engine_factory()
    run(e, request(prompt()))
    diverged = prompt()[:40] + [9] * 30  # shares 2 full blocks and 8 tokens
    run(e, request(diverged))
    (job,) = loads_of(e)
    assert len(job.items) == 2


def test_ssd_tier_serves_after_cpu_reset_and_promotes(engine_factory, tmp_path):
    e = engine_factory(ssd_dir=str(tmp_path / "ssd"))
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    assert len(e.sched.connector._scheduler.ssd_store.scan()) == 4
    assert e.conn.reset_cache() is True
    second = request(prompt())
    e.sched.add_request(second)
    e.step()
    (job,) = loads_of(e)
    assert [it.tier for it in job.items] == [SSD] * 4
    assert all(it.promote_slot >= 0 for it in job.items)
    e.first_blocks = {
        second.request_id: list(e.sched.kv_cache_manager.get_block_ids(second.request_id)[0])
    }
    e.run_until_done()
    assert_blocks_hold(e, second, 4)
    assert e.hit_sources == {"disk": 4 * BLOCK_SIZE}
    # promoted: the third request is served from the CPU tier again
    run(e, request(prompt()))
    assert [it.tier for it in loads_of(e)[-1].items] == [CPU] * 4
    assert e.hit_sources == {"disk": 64, "host": 64}


def test_corrupt_ssd_block_is_detected_and_recomputed(engine_factory, tmp_path):
    e = engine_factory(ssd_dir=str(tmp_path / "ssd"))
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    sched = e.conn._scheduler
    keys = sched._keys(request(prompt()))
    path = sched.ssd_store.path(keys[2])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))
    e.conn.reset_cache()
    second = request(prompt())
    e.sched.add_request(second)
    e.step()
    e.first_blocks = {
        second.request_id: list(e.sched.kv_cache_manager.get_block_ids(second.request_id)[0])
    }
    e.run_until_done()
    # blocks 0-1 loaded, block 2 failed its checksum: recomputed from position 32 on
    assert e.computed[second.request_id][0] == 2 * BLOCK_SIZE
    assert_blocks_hold(e, second, 4)
    # the recomputed block was saved again, intact this time: a later request loads it all
    e.worker._worker.wait_idle()
    e.conn.reset_cache()
    third = run(e, request(prompt()))
    assert [it.tier for it in loads_of(e)[-1].items] == [SSD] * 4
    assert e.computed[third.request_id][0] == 4 * BLOCK_SIZE
    assert e.worker_stats["corrupt_blocks"] == 1 and e.worker_stats["failed_blocks"] == 1
    assert e.worker_stats["load_bytes.ssd"] > 0
    assert_scheduler_empty(e.sched)


def test_small_cpu_tier_evicts_and_ssd_fills_in(engine_factory, tmp_path):
    e = engine_factory(cpu_capacity_blocks=2, ssd_dir=str(tmp_path / "ssd"))
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    run(e, request(prompt()))
    (job,) = loads_of(e)
    tiers = [it.tier for it in job.items]
    assert tiers.count(CPU) <= 2 and tiers.count(SSD) >= 2


def test_load_failure_under_fail_policy_fails_the_request(engine_factory, tmp_path):
    e = engine_factory(policy="fail", ssd_dir=str(tmp_path / "ssd"), cpu_capacity_blocks=0)
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    sched = e.conn._scheduler
    stored = sched.ssd.keys()
    for key in stored:
        p = sched.ssd_store.path(key)
        p.write_bytes(p.read_bytes()[:-1])
    second = request(prompt())
    e.sched.add_request(second)
    outs = e.run_until_done()
    finished = [o for _, eng in outs for co in eng.values() for o in co.outputs if o.finished]
    assert finished and finished[-1].finish_reason is not None
    assert second.status == RequestStatus.FINISHED_ERROR
    assert_scheduler_empty(e.sched)


def test_sync_load_all_reads_ssd_in_the_same_step_and_promotes(engine_factory, tmp_path):
    e = engine_factory(ssd_dir=str(tmp_path / "ssd"), sync_load="all")
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    e.conn.reset_cache()
    second = request(prompt())
    e.sched.add_request(second)
    e.step(wait_loads=False)
    assert second.status == RequestStatus.RUNNING  # no step spent waiting for the load
    (job,) = loads_of(e)
    assert job.sync and [it.tier for it in job.items] == [SSD] * 4
    assert all(it.promote_slot >= 0 for it in job.items)
    e.first_blocks = {second.request_id: [it.block_id for it in job.items]}
    assert_blocks_hold(e, second, 4)
    e.run_until_done()
    assert e.computed[second.request_id][0] == 4 * BLOCK_SIZE
    assert e.hit_sources == {"disk": 64}
    run(e, request(prompt()))  # promoted: the CPU tier serves it now
    assert [it.tier for it in loads_of(e)[-1].items] == [CPU] * 4
    assert_scheduler_empty(e.sched)


def test_saves_to_the_shared_tier_keep_it_within_its_quota(engine_factory, tmp_path):
    """A shared tier with room for six block files: after three 4-block prompts the
    scheduler's quota passes (due at every save here) have deleted the oldest files, counted
    what they deleted, and a prompt whose files are gone is recomputed, not loaded."""
    from vllm_pd_ext.connectors.flexkv.store import HEADER_BYTES

    file_bytes = HEADER_BYTES + BLOCK_SIZE * 2 * 2 * 8 * 4  # heads x (K+V) x head dim x fp32
    e = engine_factory(
        cpu_capacity_blocks=0,
        shared_dir=str(tmp_path / "shared"),
        shared_capacity_gb=6 * file_bytes / (1 << 30),
    )
    sched = e.conn._scheduler
    assert sched.shared_quota is not None
    sched.shared_quota.interval_s = 0.0
    for seed in range(3):
        run(e, request(prompt(seed)))
        e.worker._worker.wait_idle()
        deadline = time.monotonic() + 30
        while sched.shared_quota._running.locked():  # the pass a save started
            assert time.monotonic() < deadline, "the quota pass never ended"
            time.sleep(0.01)
    assert sched.shared_quota.passes >= 3  # started by the saves themselves
    sched.shared_quota.enforce()  # the last prompt's files landed after its saves' passes
    files = [p for p in sched.shared_store.dir.rglob("*.r0")]
    assert sum(p.stat().st_size for p in files) <= 6 * file_bytes
    assert sched.shared_quota.evicted >= 6
    first = run(e, request(prompt(0)))  # its blocks were the oldest: deleted
    assert e.computed[first.request_id][0] == 0


def test_with_a_fleet_key_a_forged_block_file_is_recomputed_never_loaded(
    engine_factory, tmp_path, monkeypatch
):
    """Someone without the fleet key puts another block's KV under block 2's name as a
    well-formed file (header, xxh3-64 and all): the load treats it as missing, block 2 on
    is recomputed and saved again with a MAC, and a later request loads every block."""
    from vllm_pd_ext import fleet_key
    from vllm_pd_ext.connectors.flexkv.store import FileStore

    monkeypatch.delenv(fleet_key.KEY_FILE_ENV, raising=False)
    monkeypatch.setenv(fleet_key.KEY_ENV, "5a" * 32)
    e = engine_factory(ssd_dir=str(tmp_path / "ssd"))
    run(e, request(prompt()))
    e.worker._worker.wait_idle()
    sched, store = e.conn._scheduler, e.worker._worker.stores[SSD]
    assert store.keyed
    keys = sched._keys(request(prompt()))
    block0 = store.path(keys[0]).read_bytes()[store.header_bytes :]
    forger = FileStore(tmp_path / "ssd", sched.namespace)  # no key
    forger.write(keys[2], bytearray(block0), e.worker._worker.fingerprint)
    e.conn.reset_cache()
    second = request(prompt())
    e.sched.add_request(second)
    e.step()
    e.first_blocks = {
        second.request_id: list(e.sched.kv_cache_manager.get_block_ids(second.request_id)[0])
    }
    e.run_until_done()
    assert e.computed[second.request_id][0] == 2 * BLOCK_SIZE  # blocks 0-1 loaded
    assert_blocks_hold(e, second, 4)  # block 2 holds its own KV, not block 0's
    assert e.worker_stats["corrupt_blocks"] == 1
    e.worker._worker.wait_idle()
    e.conn.reset_cache()
    third = run(e, request(prompt()))
    assert [it.tier for it in loads_of(e)[-1].items] == [SSD] * 4
    assert e.computed[third.request_id][0] == 4 * BLOCK_SIZE
    assert_scheduler_empty(e.sched)
