"""An in-process engine loop: vLLM's real Scheduler plus our worker-side connector on CPU
tensors, with a fake forward pass that writes a deterministic value per (token, position)
into each computed slot. What a load puts in a block can then be compared with what the
forward pass would have computed there."""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.unit.connectors.sched_harness import (
    BLOCK_SIZE,
    make_scheduler,
    make_vllm_config,
    runner_output,
)
from vllm_pd_ext.connectors.flexkv.connector import PdExtFlexKVConnector

HEADS, HEAD = 2, 8


def flexkv_config(model, extra: dict[str, Any], policy: str = "recompute"):
    cfg = make_vllm_config(model, "kv_both", connector="PdExtFlexKVConnector", policy=policy)
    cfg.kv_transfer_config.kv_connector_extra_config = dict(extra)
    return cfg


def slot_value(token: int, pos: int, salt: str | None) -> float:
    return float(token) + pos / 1024 + (hash(salt) % 7 if salt else 0)


class Engine:
    """Scheduler + worker connector in one process; ``step()`` runs one engine step."""

    def __init__(self, vllm_config) -> None:
        self.sched = make_scheduler(vllm_config)
        self.conn = self.sched.connector
        kcc = self.sched.kv_cache_config
        spec = kcc.kv_cache_groups[0].kv_cache_spec
        self.cache = torch.full(
            (kcc.num_blocks, spec.num_kv_heads, BLOCK_SIZE, 2 * spec.head_size), -1.0
        )
        self.worker = PdExtFlexKVConnector(vllm_config, KVConnectorRole.WORKER, kcc)
        self.worker.register_kv_caches({"layer0": self.cache})
        self.recving: set[str] = set()
        self.sent: set[str] = set()  # requests reported in finished_sending
        self.invalid: set[int] = set()
        self.metas: list = []
        self.computed: dict[str, list[int]] = {}  # req id -> positions computed by forward
        self.hit_sources: dict[str, int] = {}
        self.worker_stats: dict[str, float] = {}  # everything the worker reported
        self.first_blocks: dict[str, list[int]] = {}  # req id -> its blocks, set by the tests

    def cpu_entry(self, key: str):
        return self.conn._scheduler.cpu.get(key)

    def block_of(self, rid: str, pos: int) -> int:
        return self.sched.kv_cache_manager.get_block_ids(rid)[0][pos // BLOCK_SIZE]

    def forward(self, out) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            for pos in range(start, start + n):
                tok = req.all_token_ids[pos]
                b = self.block_of(rid, pos)
                self.cache[b, :, pos % BLOCK_SIZE, :] = slot_value(tok, pos, req.cache_salt)
                self.computed.setdefault(rid, []).append(pos)

    def step(self, wait_loads: bool = True):
        out = self.sched.schedule()
        stats = self.sched.connector_prefix_cache_stats
        for source, n in (stats.hits_by_source if stats else {}).items():
            self.hit_sources[source.value] = self.hit_sources.get(source.value, 0) + n
        stats.hits_by_source = {}
        meta = out.kv_connector_metadata
        self.metas.append(meta)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # synchronous loads end here, before the forward
        self.forward(out)
        self.worker.wait_for_save()
        if wait_loads:
            assert self.worker._worker is not None
            self.worker._worker.wait_idle()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        self.sent |= sending or set()
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        mro = runner_output(
            out, sending=sending or None, recving=recving or None, invalid=invalid or None
        )
        from vllm.v1.outputs import KVConnectorOutput

        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            for k, v in stats.data.items():
                self.worker_stats[k] = self.worker_stats.get(k, 0) + v
            mro.kv_connector_output = mro.kv_connector_output or KVConnectorOutput()
            mro.kv_connector_output.kv_connector_stats = stats
        eng = self.sched.update_from_output(out, mro)
        return out, eng

    def run_until_done(self, max_steps: int = 50) -> list:
        outs: list[Any] = []
        for _ in range(max_steps):
            if not self.sched.requests:
                return outs
            outs.append(self.step())
            time.sleep(0)
        raise AssertionError(f"requests left: {list(self.sched.requests)}")

    def expected_block(self, token_ids: list[int], block: int, salt: str | None) -> torch.Tensor:
        t = torch.empty_like(self.cache[0])
        for i in range(BLOCK_SIZE):
            pos = block * BLOCK_SIZE + i
            t[:, i, :] = slot_value(token_ids[pos], pos, salt)
        return t
