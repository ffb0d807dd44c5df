"""The tiered cache with hybrid models: vLLM's real Scheduler in hybrid prefix-caching mode
(``mamba_cache_mode`` "align") with a Mamba state group beside an attention group (as for
GraniteMoeHybrid) or alone (pure Mamba2), and a fake forward pass that checks the state it
starts from and writes the state after each step into the block vLLM keeps it in.

A second engine sharing the block directory (or the same engine after its device prefix cache
is dropped) must start from the saved state: the fake forward records any step that starts
from a state other than the one computed from the prompt's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.unit.connectors.sched_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    make_vllm_config,
    runner_output,
)
from vllm_pd_ext.connectors.flexkv.connector import PdExtFlexKVConnector
from vllm_pd_ext.connectors.flexkv.keys import group_key
from vllm_pd_ext.connectors.flexkv.metadata import CPU, REMOTE

HEADS, HEAD, STATE = 2, 8, 24
PROMPT = [5 + (i * 7) % 41 for i in range(5 * BLOCK_SIZE + 9)]  # 5 full blocks and a tail
HIT = 5 * BLOCK_SIZE  # the last block boundary before the last prompt token


_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)
init_none_hash(sha256)


def make_request(prompt: list[int], max_tokens: int = 3, rid: str = "r") -> Request:
    """A request whose block hashes vLLM's prefix cache (align mode) keys its blocks by."""
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=_HASHER,
    )


def slot_value(token: int, pos: int) -> float:
    return float(token) + pos / 1024


def state_value(tokens: list[int]) -> torch.Tensor:
    """The state after ``tokens``: depends on every token and its position."""
    acc = sum((i + 1) * t for i, t in enumerate(tokens)) % 100_003
    return torch.arange(STATE, dtype=torch.float32) + float(acc) + len(tokens) / 4096


class HybridEngine:
    """Scheduler + worker connector in one process with a Mamba group (``attention``: and
    a full-attention group)."""

    def __init__(self, model: Path, extra: dict, attention: bool = True) -> None:
        cfg = make_vllm_config(
            model, "kv_both", connector="PdExtFlexKVConnector", enable_prefix_caching=True
        )
        cfg.cache_config.mamba_cache_mode = "align"
        cfg.kv_transfer_config.kv_connector_extra_config = dict(extra)
        mc = cfg.model_config
        attn = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=mc.get_num_kv_heads(cfg.parallel_config),
            head_size=mc.get_head_size(),
            dtype=torch.float32,
        )
        mamba = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((STATE,),),
            dtypes=(torch.float32,),
            page_size_padded=attn.page_size_bytes,
            mamba_cache_mode="align",
        )
        groups = [KVCacheGroupSpec(["mamba0"], mamba)]
        if attention:
            groups.append(KVCacheGroupSpec(["attn1"], attn))
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.sched = Scheduler(
            vllm_config=cfg,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            log_stats=True,
        )
        self.attention = attention
        self.state = torch.full((NUM_BLOCKS, STATE), -1.0)
        self.cache = torch.full((NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD), -1.0)
        caches = {"mamba0": self.state}
        if attention:
            caches["attn1"] = self.cache
        self.worker = PdExtFlexKVConnector(cfg, KVConnectorRole.WORKER, kcc)
        self.worker.register_kv_caches(caches)
        self.runs = 0
        self.loads: list = []  # every load job the scheduler side sent, in order
        self.failed: set[str] = set()  # requests whose load the worker reported failed
        self.computed: dict[str, list[int]] = {}
        self.wrong_state: list[tuple[str, int]] = []  # (request, position) started wrongly
        self.wrong_kv: list[tuple[str, int]] = []

    @property
    def scheduler_side(self):
        return self.sched.connector._scheduler

    def forward(self, out) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            ids = self.sched.kv_cache_manager.get_block_ids(rid)
            tokens = list(req.all_token_ids)
            if start > 0:  # the state the step starts from
                if not torch.equal(
                    self.state[ids[0][(start - 1) // BLOCK_SIZE]], state_value(tokens[:start])
                ):
                    self.wrong_state.append((rid, start))
                if self.attention:  # and the attention KV it attends to
                    for pos in range(start):
                        got = self.cache[ids[1][pos // BLOCK_SIZE], 0, pos % BLOCK_SIZE, 0]
                        if float(got) != slot_value(tokens[pos], pos):
                            self.wrong_kv.append((rid, pos))
                            break
            end = start + n
            for pos in range(start, end):
                if self.attention:
                    blk = ids[1][pos // BLOCK_SIZE]
                    self.cache[blk, :, pos % BLOCK_SIZE, :] = slot_value(tokens[pos], pos)
                self.computed.setdefault(rid, []).append(pos)
            self.state[ids[0][(end - 1) // BLOCK_SIZE]] = state_value(tokens[:end])

    def step(self) -> None:
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        self.loads += meta.loads
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.forward(out)
        self.worker.wait_for_save()
        assert self.worker._worker is not None
        self.worker._worker.wait_idle()
        res = self.worker.get_transfer_results(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        assert not invalid  # several KV cache groups: failures go per request
        self.failed |= res.failed_recving
        self.worker.clear_connector_metadata()
        mro = runner_output(
            out,
            sending=res.finished_sending or None,
            recving=res.finished_recving or None,
            failed=res.failed_recving or None,
        )
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            mro.kv_connector_output = mro.kv_connector_output or KVConnectorOutput()
            mro.kv_connector_output.kv_connector_stats = stats
        self.sched.update_from_output(out, mro)

    def run(self, prompt: list[int], max_tokens: int = 3) -> str:
        self.runs += 1
        req = make_request(prompt, max_tokens, rid=f"req-{self.runs}")
        self.sched.add_request(req)
        for _ in range(40):
            if not self.sched.requests:
                return req.request_id
            self.step()
        raise AssertionError(f"requests left: {list(self.sched.requests)}")

    def shutdown(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def engines(tiny_qwen, tmp_path):
    made: list[HybridEngine] = []

    def make(attention: bool = True, **extra) -> HybridEngine:
        extra.setdefault("cpu_capacity_blocks", 32)
        extra.setdefault("shared_dir", str(tmp_path / "shared"))
        e = HybridEngine(tiny_qwen, extra, attention)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def _prefix_keys(engine: HybridEngine, prompt: list[int]) -> list[str]:
    return engine.scheduler_side._keys(make_request(prompt, rid="keys"))


@pytest.mark.parametrize("attention", [True, False], ids=["attention+mamba", "mamba-only"])
def test_second_engine_starts_from_the_saved_state(engines, attention):
    a = engines(attention)
    first = a.run(PROMPT)
    assert a.computed[first][: len(PROMPT)] == list(range(len(PROMPT)))
    keys = _prefix_keys(a, PROMPT)
    shared = a.scheduler_side.shared_store
    # the state after 5 blocks (where the prefill chunk stopped) under block 4's state key,
    # and every attention block of the prefix
    assert shared.exists(group_key(keys[4], 0))
    assert not shared.exists(group_key(keys[3], 0))  # no state kept mid-chunk
    if attention:
        assert all(shared.exists(group_key(k, 1)) for k in keys[:5])

    b = engines(attention)
    rid = b.run(PROMPT)
    assert b.computed[rid][0] == HIT  # loaded 5 blocks and the state after them
    assert not b.wrong_state and not b.wrong_kv


@pytest.mark.parametrize("attention", [True, False], ids=["attention+mamba", "mamba-only"])
def test_cpu_tier_hit_after_the_device_cache_is_dropped(engines, attention):
    a = engines(attention, shared_dir=None)
    a.run(PROMPT)
    assert a.sched.kv_cache_manager.reset_prefix_cache()  # vLLM's device cache only
    rid = a.run(PROMPT)
    assert a.computed[rid][0] == HIT
    assert not a.wrong_state and not a.wrong_kv
    keys = _prefix_keys(a, PROMPT)
    assert a.scheduler_side.tier_of(group_key(keys[4], 0)) == CPU


def test_a_missing_state_page_is_a_miss_for_the_whole_prefix(engines):
    a = engines()
    a.run(PROMPT)
    keys = _prefix_keys(a, PROMPT)
    a.scheduler_side.shared_store.delete(group_key(keys[4], 0))
    b = engines()
    rid = b.run(PROMPT)
    assert b.computed[rid][0] == 0  # attention blocks alone are not loaded
    assert not b.wrong_state and not b.wrong_kv


def test_a_missing_attention_block_is_a_miss_for_the_whole_prefix(engines):
    a = engines()
    a.run(PROMPT)
    keys = _prefix_keys(a, PROMPT)
    a.scheduler_side.shared_store.delete(group_key(keys[2], 1))
    b = engines()
    rid = b.run(PROMPT)
    # no state was kept before block 4: nothing usable before the hole either
    assert b.computed[rid][0] == 0
    assert not b.wrong_state and not b.wrong_kv


def test_a_corrupt_state_page_is_recomputed(engines):
    a = engines()
    a.run(PROMPT)
    keys = _prefix_keys(a, PROMPT)
    path = a.scheduler_side.shared_store.path(group_key(keys[4], 0))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    b = engines()
    rid = b.run(PROMPT)
    assert b.failed == {rid}
    assert not b.wrong_state and not b.wrong_kv  # the bad page was never used
    assert b.computed[rid][: len(PROMPT)] == list(range(len(PROMPT)))  # all recomputed
    assert path.read_bytes() != bytes(data)  # deleted, then saved again by the recompute


@pytest.mark.parametrize("attention", [True, False], ids=["attention+mamba", "mamba-only"])
def test_the_remote_tier_serves_a_hybrid_prefix(engines, remote, attention):
    a = engines(attention, shared_dir=None, remote=remote, namespace=f"hybrid-{attention}")
    a.run(PROMPT)
    b = engines(attention, shared_dir=None, remote=remote, namespace=f"hybrid-{attention}")
    rid = b.run(PROMPT)  # another instance on the same store
    assert b.computed[rid][0] == HIT
    assert not b.wrong_state and not b.wrong_kv
    keys = _prefix_keys(b, PROMPT)
    assert b.scheduler_side.tier_of(group_key(keys[4], 0)) == CPU  # promoted on the hit
    (job,) = b.loads
    assert {it.tier for it in job.items} == {REMOTE}


def test_a_state_page_missing_from_the_store_is_a_miss_for_the_whole_prefix(engines, remote):
    a = engines(shared_dir=None, remote=remote, namespace="hybrid-hole")
    a.run(PROMPT)
    keys = _prefix_keys(a, PROMPT)
    store = a.scheduler_side.remote_store
    store.delete(group_key(keys[4], 0))
    assert store.exists_many([group_key(k, 1) for k in keys[:5]]) == [True] * 5
    b = engines(shared_dir=None, remote=remote, namespace="hybrid-hole")
    rid = b.run(PROMPT)
    assert b.computed[rid][0] == 0  # the attention blocks alone are not loaded
    assert not b.wrong_state and not b.wrong_kv and not b.failed


def test_a_hybrid_model_without_its_states_at_block_boundaries_is_refused(tiny_qwen):
    cfg = make_vllm_config(tiny_qwen, "kv_both", connector="PdExtFlexKVConnector")
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    mamba = MambaSpec(
        block_size=512, shapes=((STATE,),), dtypes=(torch.float32,), mamba_cache_mode="none"
    )
    attn = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32
    )
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m"], mamba), KVCacheGroupSpec(["a"], attn)],
    )
    with pytest.raises(ValueError, match="mamba_cache_mode 'align'"):
        PdExtFlexKVConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_a_sliding_window_group_is_refused(tiny_qwen):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cfg = make_vllm_config(tiny_qwen, "kv_both", connector="PdExtFlexKVConnector")
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32
    )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64
    )
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["w"], window)],
    )
    with pytest.raises(ValueError, match="disable-hybrid-kv-cache-manager"):
        PdExtFlexKVConnector(cfg, KVConnectorRole.WORKER, kcc)
