"""Saves run on the worker's save thread after the step: the blocks they read stay put until
the gather is done (finished requests are held through ``finished_sending``, preemptions wait
in ``handle_preemptions``), loads of a CPU row wait for the save writing it, and a failed save
never lets its rows be loaded."""

from __future__ import annotations

import threading

import pytest
import torch
from vllm.v1.request import RequestStatus

from tests.unit.connectors.flexkv.test_round_trip import assert_blocks_hold, prompt, request
from tests.unit.connectors.sched_harness import BLOCK_SIZE, assert_scheduler_empty
from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig
from vllm_pd_ext.connectors.flexkv.metadata import CPU, FlexKVMetadata, LoadItem, LoadJob, SaveItem
from vllm_pd_ext.connectors.flexkv.worker import FlexKVWorker

N = 8


def gate(worker: FlexKVWorker) -> threading.Event:
    """Make the worker's block copies out of the cache wait until the returned event is set."""
    opened = threading.Event()
    copier = worker.copier
    assert copier is not None
    real = copier.gather

    def gated(*args, **kwargs):
        assert opened.wait(10)
        return real(*args, **kwargs)

    copier.gather = gated  # type: ignore[method-assign]
    return opened


@pytest.fixture
def worker():
    cache = torch.randn(N, 2, 4, 8)
    w = FlexKVWorker(
        FlexKVConfig(cpu_capacity_blocks=4),
        namespace="t",
        num_blocks=N,
        block_size=4,
        model={},
        cpu_slots=4,
    )
    w.register_kv_caches({"layer0": cache})
    w.cache = cache  # type: ignore[attr-defined]  # the tests read the cache back
    yield w
    w.shutdown()


def test_finished_request_keeps_its_blocks_until_the_save_is_done(engine_factory):
    e = engine_factory()
    opened = gate(e.worker._worker)
    req = request(prompt(), max_tokens=1)
    e.sched.add_request(req)
    free0 = e.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    for _ in range(4):
        e.step(wait_loads=False)
    # finished, but its blocks are still allocated: the save thread has not read them yet
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.request_id in e.sched.requests and not e.sent
    assert e.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free0
    opened.set()
    e.worker._worker.wait_idle()
    e.step()
    assert e.sent == {req.request_id}
    assert_scheduler_empty(e.sched)
    # and the saved blocks serve the next request from the CPU tier
    e.sched.add_request(request(prompt()))
    e.run_until_done()
    (job,) = [job for m in e.metas for job in m.loads]
    assert [it.tier for it in job.items] == [CPU] * 4
    assert e.hit_sources == {"host": 64}


def test_wait_for_save_returns_before_the_copy(worker):
    opened = gate(worker)
    worker.bind(FlexKVMetadata(saves=[SaveItem(b, f"{b:032x}", "r", slot=b) for b in range(4)]))
    worker.wait_for_save()  # returns although the gather is blocked
    assert worker.get_finished({"r"}) == (set(), set())
    opened.set()
    worker.wait_idle()
    assert worker.get_finished(set()) == ({"r"}, set())
    for b in range(4):
        assert torch.equal(worker.pool[b].view(torch.float32), worker.cache[b].reshape(-1))


def test_preemption_waits_for_the_gather(worker):
    opened = gate(worker)
    worker.bind(FlexKVMetadata(saves=[SaveItem(0, "0" * 32, "r", slot=0)]))
    worker.wait_for_save()
    done = threading.Event()

    def preempt() -> None:
        worker.handle_preemptions(FlexKVMetadata(preempted={"r"}))
        done.set()

    t = threading.Thread(target=preempt)
    t.start()
    assert not done.wait(0.3)  # the forward pass may not overwrite block 0 yet
    want = worker.cache[0].clone()
    opened.set()
    assert done.wait(10)
    t.join()
    worker.cache[0] = -1.0  # what the preempting request writes afterwards
    assert torch.equal(worker.pool[0].view(torch.float32), want.reshape(-1))
    worker.handle_preemptions(FlexKVMetadata(preempted={"other"}))  # nothing to wait for


def test_load_of_a_cpu_row_waits_for_its_save(worker):
    opened = gate(worker)
    worker.bind(FlexKVMetadata(saves=[SaveItem(1, "1" * 32, "r", slot=2)]))
    worker.wait_for_save()
    worker.bind(FlexKVMetadata(loads=[LoadJob("l", (LoadItem(5, "1" * 32, CPU, slot=2),))]))
    worker.start_load_kv()
    assert worker.get_finished(set())[1] == set()
    opened.set()
    worker.wait_idle()
    assert worker.get_finished(set())[1] == {"l"} and not worker.take_load_errors()
    assert torch.equal(worker.cache[5], worker.cache[1])


def test_failed_save_is_never_loaded(worker):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    worker.copier.gather = broken
    worker.bind(FlexKVMetadata(saves=[SaveItem(1, "1" * 32, "r", slot=2)]))
    worker.wait_for_save()
    worker.wait_idle()
    assert worker.get_finished({"r"})[0] == {"r"}  # blocks are released all the same
    worker.bind(FlexKVMetadata(loads=[LoadJob("l", (LoadItem(5, "1" * 32, CPU, slot=2),))]))
    worker.start_load_kv()
    worker.wait_idle()
    assert worker.get_finished(set())[1] == {"l"}
    assert worker.take_load_errors() == {5}


@pytest.mark.parametrize("picks", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 2, 0, 3], [2], []])
def test_scatter_puts_each_picked_row_in_its_block(worker, picks):
    rows = torch.randn(4, worker.block_bytes // 4)
    blocks = [7, 4, 5, 6][: len(picks)]
    before = worker.cache.clone()
    worker.scatter(blocks, rows.view(torch.uint8), picks)
    for b, p in zip(blocks, picks, strict=True):
        assert torch.equal(worker.cache[b].reshape(-1), rows[p])
    untouched = [b for b in range(N) if b not in blocks]
    assert torch.equal(worker.cache[untouched], before[untouched])


def test_preemption_reaches_the_worker_and_saved_blocks_stay_right(engine_factory):
    """Three 300-token requests decoding 200 tokens each outgrow the 64-block cache: vLLM's
    scheduler preempts; the preempted ids reach the worker before the forward pass that reuses
    their blocks, and every block the cache kept holds what computing it gives."""
    e = engine_factory(cpu_capacity_blocks=64)
    seen: list[set[str]] = []
    real = e.worker._worker.handle_preemptions

    def spy(meta):
        seen.append(set(meta.preempted))
        real(meta)

    e.worker._worker.handle_preemptions = spy
    prompts = [prompt(seed=i, n=300) for i in range(3)]
    for p in prompts:
        e.sched.add_request(request(p, max_tokens=200))
    e.run_until_done(max_steps=1000)
    preempted = set().union(*seen)
    assert preempted, "no preemption happened"
    assert_scheduler_empty(e.sched)
    for p in prompts:
        again = request(p)
        e.sched.add_request(again)
        e.step()
        e.first_blocks = {
            again.request_id: list(e.sched.kv_cache_manager.get_block_ids(again.request_id)[0])
        }
        e.run_until_done()
        assert e.computed[again.request_id][0] == (300 - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert_blocks_hold(e, again, (300 - 1) // BLOCK_SIZE)


@pytest.mark.parametrize("in_place", [True, False])
def test_file_load_in_place_or_staged_restores_bytes_and_promotes(tmp_path, in_place):
    """Block files land in the cache's pieces directly (CPU caches) or through row buffers
    (the GPU path, forced here); either way bytes match and the promoted CPU row holds them."""
    cache = torch.randn(N, 2, 4, 8)
    w = FlexKVWorker(
        FlexKVConfig(cpu_capacity_blocks=4, ssd_dir=str(tmp_path)),
        namespace="t",
        num_blocks=N,
        block_size=4,
        model={},
        cpu_slots=4,
    )
    try:
        w.register_kv_caches({"layer0": cache})
        assert w.copier is not None
        if not in_place:
            w.copier._np = None
        assert w.copier.in_place is in_place
        keys = [f"{b:032x}" for b in range(3)]
        w.bind(FlexKVMetadata(saves=[SaveItem(b, keys[b], "r", ssd=True) for b in range(3)]))
        w.wait_for_save()
        w.wait_idle()
        items = tuple(
            LoadItem(4 + b, keys[b], "ssd", promote_slot=b if b < 2 else -1) for b in range(3)
        )
        w.bind(FlexKVMetadata(loads=[LoadJob("l", items)]))
        w.start_load_kv()
        w.wait_idle()
        assert w.get_finished(set())[1] == {"l"} and not w.take_load_errors()
        assert torch.equal(cache[4:7], cache[0:3])
        assert w.pool is not None
        for b in range(2):
            assert torch.equal(w.pool[b].view(torch.float32), cache[b].reshape(-1))
    finally:
        w.shutdown()


def test_copy_code_imports_without_vllm():
    """The CPU tier's copy code (and block files) load where vLLM is not installed (GPU
    benchmark machines): importing them must not import vLLM."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import vllm_pd_ext.connectors.flexkv.copier, vllm_pd_ext.connectors.flexkv.store\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
