"""Scheduler side of the tiered KV cache (runs in vLLM's EngineCore process).

Owns the index of every tier (:class:`~vllm_pd_ext.connectors.flexkv.index.TierIndex` for
the CPU pool and the SSD directory; the shared directory is looked up on disk) and turns
vLLM's scheduling into per-step instructions for the worker side:

* lookup: the longest run of the request's block keys, after the local prefix-cache hit,
  that some tier holds *ready* (CPU pool rows written, block files renamed into place);
  the last prompt token is always left to compute;
* load: after vLLM allocates blocks, each hit block is read from the fastest tier holding
  it (CPU, then SSD, then shared); blocks read from a file are promoted into the CPU pool.
  A hit wholly in the CPU tier loads synchronously (``sync_load``, default "cpu"): the
  worker copies it in ``start_load_kv`` of the step that computes the rest of the prompt, so
  its entries are unpinned as soon as that step's metadata is built (the worker runs steps in
  order: any later save into those rows comes after the copy). Other loads are asynchronous:
  entries they read are pinned until the worker reports the request in
  ``finished_recving``. Blocks the worker reports as failed are dropped from the index;
* save: in the step that completes a full prompt block, the worker is told to copy it into a
  CPU pool row (evicting LRU-with-frequency) and to write its files (SSD write-through, shared
  directory); the copy runs on a worker thread after the step, so a request that had blocks
  saved keeps them after it finishes until the worker reports the copy done
  (``request_finished`` returns True, the worker answers in ``finished_sending``).

Hybrid models (vLLM's hybrid allocator; a group of Mamba / linear-attention state pages
beside attention groups, or state groups only): every group's block at prefix position
``i`` has its own key (:func:`~vllm_pd_ext.connectors.flexkv.keys.group_key` of the
position's key) and is stored, checked and evicted like any block. vLLM's hybrid prefix
caching (``mamba_cache_mode`` "align") ends prefill chunks on block boundaries and keeps,
in a state group's block ``i``, the state after ``(i + 1) * block_size`` tokens: when a
step ends on such a boundary the state page of that block is saved under that position's
key. A hit of ``n`` blocks needs every attention group's blocks ``0..n-1`` and every state
group's page at block ``n - 1``; the longest such ``n`` is loaded, or nothing: a prefix
is never loaded with a group missing.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_pd_ext.connectors.common.scheduler import GroupInfo
from vllm_pd_ext.connectors.flexkv.config import FlexKVConfig, GiB
from vllm_pd_ext.connectors.flexkv.index import TierIndex
from vllm_pd_ext.connectors.flexkv.keys import cache_namespace, group_key, request_keys
from vllm_pd_ext.connectors.flexkv.metadata import (
    CPU,
    REMOTE,
    SHARED,
    SSD,
    FlexKVMetadata,
    LoadItem,
    LoadJob,
    SaveItem,
)
from vllm_pd_ext.connectors.flexkv.remote import MooncakeBlockStore
from vllm_pd_ext.connectors.flexkv.remote_base import RemoteBlockStore
from vllm_pd_ext.connectors.flexkv.stats import FlexKVRecorder
from vllm_pd_ext.connectors.flexkv.store import DirQuota, FileStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Tier -> vLLM's cache-hit source label (``vllm:prompt_tokens_by_source`` etc.).
HIT_SOURCE = {
    CPU: CacheHitSource.HOST,
    SSD: CacheHitSource.DISK,
    SHARED: CacheHitSource.DISK,
    REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,  # vLLM's name for a remote store
}
#: How the scheduler's start-up line begins (``%s``: the cache's namespace).
START_LINE = "tiered KV cache: namespace %s"
#: vLLM's null block (an unallocated position of a state group under prefix caching).
NULL_BLOCK = 0
#: A pending SSD write whose file has not appeared after this long is given up.
PENDING_GIVE_UP_S = 60.0
_SHARED_KNOWN_MAX = 1 << 16


@dataclass
class _Tracked:
    """A request whose full prompt blocks we save as they are computed."""

    request: Request
    keys: list[str]
    saved_upto: int = 0
    saving: bool = False  # a save of its blocks was sent to the worker: free them only after


@dataclass
class _Plan:
    """A load in flight."""

    items: tuple[LoadItem, ...]
    failed: set[int] = field(default_factory=set)
    sync: bool = False
    req_id: str = ""


class FlexKVScheduler:
    """Scheduler-side state of one engine."""

    def __init__(
        self,
        cfg: FlexKVConfig,
        *,
        block_size: int,
        block_bytes: int,
        model: dict[str, Any],
        tp_size: int = 1,
        groups: tuple[GroupInfo, ...] = (),
    ) -> None:
        """``groups``: the KV cache groups (:func:`~vllm_pd_ext.connectors.common.scheduler.
        groups_of`), all of ``block_size``; omitted, one attention group."""
        self.cfg = cfg
        self.block_size = block_size
        self.groups = groups or (GroupInfo(block_size, False),)
        #: Groups whose blocks hold KV per token, and groups of state pages (Mamba).
        self.attn_groups = tuple(i for i, g in enumerate(self.groups) if not g.whole)
        self.state_groups = tuple(i for i, g in enumerate(self.groups) if g.whole)
        self.hybrid = len(self.groups) > 1 or bool(self.state_groups)
        self.tp_size = tp_size
        self.namespace = cache_namespace(model, block_size, cfg.namespace)
        self.stats = FlexKVRecorder()
        self.kv_cache_manager: KVCacheManager | None = None
        self.cpu = TierIndex(CPU, cfg.cpu_slots(block_bytes), cfg.eviction_window)
        self.ssd: TierIndex | None = None
        self.ssd_store: FileStore | None = None
        self.shared_store: FileStore | None = None
        self._shared_known: set[str] = set()
        self._ssd_deletes: list[str] = []
        self._clear_ssd = False
        if cfg.ssd_dir:
            self.ssd_store = FileStore(cfg.ssd_dir, self.namespace)
            self.ssd = TierIndex(SSD, cfg.ssd_blocks(block_bytes), cfg.eviction_window)
            for key in self.ssd_store.scan():  # a restarted engine keeps its SSD tier
                _, evicted = self.ssd.add(key, ready=True)
                self._ssd_deletes.extend(evicted)
        self.shared_quota: DirQuota | None = None
        self._shared_evicted = 0
        if cfg.shared_dir:
            self.shared_store = FileStore(cfg.shared_dir, self.namespace)
            self.shared_quota = DirQuota(self.shared_store, int(cfg.shared_capacity_gb * GiB))
        #: The remote tier: the master is asked once per lookup for the run of keys after the
        #: local tiers'; keys it had (or we put) are remembered (a bounded set).
        self.remote_store: RemoteBlockStore | None = None
        self._remote_known: set[str] = set()
        if cfg.remote is not None:
            self.remote_store = MooncakeBlockStore(
                cfg.remote, self.namespace, segment=False, stats=self.stats
            )
        self._tracked: dict[str, _Tracked] = {}
        self._matched_from: dict[str, int] = {}
        self._plans: dict[str, _Plan] = {}
        self._sources: dict[str, dict[CacheHitSource, int]] = {}
        self._loads: list[LoadJob] = []
        self._sync_sent: list[_Plan] = []  # synchronous loads of the metadata being built
        self._sync_recent: deque[_Plan] = deque(maxlen=8)  # settled: their failures may follow
        self._sync_next: dict[str, bool] = {}  # req id -> its lookup said "load synchronously"
        logger.info(
            START_LINE + ", CPU %d blocks, SSD %s, shared %s, remote %s",
            self.namespace,
            self.cpu.capacity,
            f"{self.ssd.capacity} blocks in {self.ssd_store.dir}"
            if self.ssd and self.ssd_store
            else "off",
            self.shared_store.dir if self.shared_store else "off",
            f"Mooncake Store at {cfg.remote.master}" if cfg.remote else "off",
        )

    @staticmethod
    def namespace_in_log(text: str) -> str | None:
        """The namespace an engine's log says its tiered cache uses (its last start-up
        line), or None (tools and tests name its blocks in a shared tier or store by it)."""
        found = re.findall(re.escape(START_LINE).replace("%s", "([0-9a-f]{16})"), text)
        return found[-1] if found else None

    # ---- lookup ----
    def _keys(self, request: Request) -> list[str]:
        t = self._tracked.get(request.request_id)
        if t is not None:
            return t.keys
        return request_keys(request, self.namespace, self.block_size)

    def tier_of(self, key: str) -> str | None:
        """The fastest tier holding ``key`` ready to load, or None."""
        if self.cpu.ready(key) is not None:
            return CPU
        if self.ssd is not None and self.ssd_store is not None:
            e = self.ssd.get(key)
            if e is not None:
                if e.ready:
                    return SSD
                if self.ssd_store.exists(key, self.tp_size):
                    self.ssd.mark_ready(key)
                    return SSD
        if self.shared_store is not None:
            if key in self._shared_known:
                return SHARED
            if self.shared_store.exists(key, self.tp_size):
                if len(self._shared_known) >= _SHARED_KNOWN_MAX:
                    self._shared_known.clear()
                self._shared_known.add(key)
                return SHARED
        if key in self._remote_known:
            return REMOTE
        return None

    def _ask_remote(self, keys: list[str]) -> None:
        """Learn which of ``keys`` (a prefix run, in order) the remote tier holds: the
        leading run it has joins ``_remote_known``."""
        if self.remote_store is None or not keys:
            return
        known = self._remote_known
        for key, there in zip(keys, self.remote_store.exists_many(keys, self.tp_size), strict=True):
            if not there:
                break
            if len(known) >= _SHARED_KNOWN_MAX:
                known.clear()
            known.add(key)

    def _ask_remote_each(self, keys: list[str]) -> None:
        """Learn which of ``keys`` (not a run: state pages at some positions) the remote
        tier holds."""
        if self.remote_store is None or not keys:
            return
        known = self._remote_known
        for key, there in zip(keys, self.remote_store.exists_many(keys, self.tp_size), strict=True):
            if there:
                if len(known) >= _SHARED_KNOWN_MAX:
                    known.clear()
                known.add(key)

    def _hybrid_match(self, keys: list[str], start: int, usable: int) -> tuple[int, bool]:
        """(blocks loadable from ``start`` on, whether all of them are in the CPU tier) for a
        hybrid model: the longest ``n`` with every attention group's blocks up to ``n`` and
        every state group's page at ``n - 1`` in some tier."""
        end = start
        asked = False
        while end < usable:
            attn = [group_key(keys[end], g) for g in self.attn_groups]
            if any(self.tier_of(k) is None for k in attn) and not asked:
                asked = True  # the rest of the run: one question to the store
                self._ask_remote(
                    [group_key(k, g) for k in keys[end:usable] for g in self.attn_groups]
                )
            if any(self.tier_of(k) is None for k in attn):
                break
            end += 1
        states = {i: [group_key(keys[i], g) for g in self.state_groups] for i in range(start, end)}
        if any(self.tier_of(k) is None for ks in states.values() for k in ks):
            self._ask_remote_each(
                [k for ks in states.values() for k in ks if self.tier_of(k) is None]
            )
        for n in range(end, start, -1):
            tiers = [self.tier_of(k) for k in states[n - 1]]
            if all(t is not None for t in tiers):
                attn_tiers = [
                    self.tier_of(group_key(keys[i], g))
                    for i in range(start, n)
                    for g in self.attn_groups
                ]
                return n - start, all(t == CPU for t in tiers + attn_tiers)
        return 0, False

    def _usable_blocks(self, request: Request, keys: list[str]) -> int:
        # Leave at least one prompt token for the engine to compute.
        return min(len(keys), max(0, (request.num_prompt_tokens - 1) // self.block_size))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` (block-aligned), loaded async."""
        keys = self._keys(request)
        usable = self._usable_blocks(request, keys)
        start = num_computed_tokens // self.block_size
        n = 0
        all_cpu = True
        asked = False
        if self.hybrid:
            n, all_cpu = self._hybrid_match(keys, start, usable)
        while not self.hybrid and start + n < usable:
            tier = self.tier_of(keys[start + n])
            if tier is None and not asked:  # the rest of the run: one question to the store
                asked = True
                self._ask_remote(keys[start + n : usable])
                tier = self.tier_of(keys[start + n])
            if tier is None:
                break
            all_cpu = all_cpu and tier == CPU
            n += 1
        rid = request.request_id
        self._matched_from[rid] = num_computed_tokens
        if n < self.cfg.min_match_blocks:
            return 0, False
        policy = self.cfg.sync_load
        # vLLM takes a failed load of a model with several KV cache groups only per request
        # (``failed_recving``), which only an asynchronous load can report
        sync = not self.hybrid and (policy == "all" or (policy == "cpu" and all_cpu))
        self._sync_next[rid] = sync
        return (start + n) * self.block_size - num_computed_tokens, not sync

    # ---- load ----
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Track the request for saving; plan its load into the blocks just allocated."""
        rid = request.request_id
        keys = self._keys(request)
        if rid not in self._tracked and keys:
            self._tracked[rid] = _Tracked(request, keys)
        num_computed = self._matched_from.pop(rid, None)
        sync = self._sync_next.pop(rid, False)
        if num_computed is None:
            return  # second call after the load, or not our request
        start = num_computed // self.block_size
        lookups = self._usable_blocks(request, keys) - start
        if lookups > 0:
            self.stats.add("lookup_blocks", lookups)
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()
        end = start + num_external_tokens // self.block_size
        items: list[LoadItem] = []
        per_tier: Counter[str] = Counter()
        pos_tier: Counter[str] = Counter()  # prefix positions by the tier that supplies them
        for i in range(start, end):
            for g in self.attn_groups:
                item = self._load_item(group_key(keys[i], g), block_ids[g][i], g)
                items.append(item)
                per_tier[item.tier] += 1
                if g == self.attn_groups[0]:
                    pos_tier[item.tier] += 1
        for g in self.state_groups:  # the state after the last loaded block, whole
            item = self._load_item(group_key(keys[end - 1], g), block_ids[g][end - 1], g)
            items.append(item)
            per_tier[item.tier] += 1
            if not self.attn_groups and g == self.state_groups[0]:
                pos_tier[item.tier] += end - start
        per_tier.pop("missing", None)
        for tier, n in per_tier.items():
            self.stats.add("hit_blocks", n, tier)
        sources: Counter[CacheHitSource] = Counter()
        for tier, n in pos_tier.items():
            if tier in HIT_SOURCE:
                sources[HIT_SOURCE[tier]] += n * self.block_size
        missing = num_external_tokens - sum(sources.values())
        if missing:
            sources[CacheHitSource.EXTERNAL_UNSPECIFIED] += missing
        self._sources[rid] = dict(sources)
        plan = _Plan(tuple(items), sync=sync, req_id=rid)
        if sync:
            self._sync_sent.append(plan)
        else:
            self._plans[rid] = plan
        self._loads.append(LoadJob(rid, tuple(items), sync=sync))

    def _load_item(self, key: str, block_id: int, group: int) -> LoadItem:
        """How to load ``key`` into ``block_id`` (of ``group``) from the fastest tier holding
        it, pinning what it reads; tier "missing" when it vanished since the lookup (the
        worker reports the block failed)."""
        tier = self.tier_of(key)
        if tier is None:
            return LoadItem(block_id, key, "missing", group=group)
        if tier == CPU:
            e = self.cpu.ready(key)
            assert e is not None  # tier_of found it ready
            self.cpu.pin(key)
            self.cpu.touch(key)
            return LoadItem(block_id, key, CPU, slot=e.slot, group=group)
        if tier == SSD:
            assert self.ssd is not None  # tier_of said SSD
            self.ssd.pin(key)
            self.ssd.touch(key)
        return LoadItem(block_id, key, tier, promote_slot=self._promotion_slot(key), group=group)

    def _promotion_slot(self, key: str) -> int:
        """A CPU pool row to keep a block read from a file in (pending until loaded)."""
        if self.cpu.capacity == 0 or key in self.cpu:
            return -1
        e, evicted = self.cpu.add(key, ready=False)
        if evicted:
            self.stats.add("evicted_blocks", len(evicted), CPU)
        if e is None:
            return -1
        self.cpu.pin(key)
        return e.slot

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` split by the tier that supplies them."""
        sources = self._sources.pop(request.request_id, None)
        if not sources or sum(sources.values()) != num_external_tokens:
            return (
                {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
                if num_external_tokens
                else {}
            )
        return {s: n for s, n in sources.items() if n}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Settle finished loads: unpin, commit or drop promotions, forget failed blocks."""
        invalid = output.invalid_block_ids or set()
        for rid in getattr(output, "failed_recving", None) or ():
            plan = self._plans.get(rid)  # a hybrid load fails whole: forget all it read
            if plan is not None:
                plan.failed |= {it.block_id for it in plan.items}
        if invalid:
            for plan in self._plans.values():
                plan.failed |= {it.block_id for it in plan.items if it.block_id in invalid}
            for plan in self._sync_recent:  # already settled: drop the rows that failed
                t = self._tracked.get(plan.req_id)
                for it in plan.items:
                    if it.block_id in invalid:
                        self._forget_failed(it)
                        if t is not None and it.key in t.keys:  # vLLM recomputes: save again
                            t.saved_upto = min(t.saved_upto, t.keys.index(it.key))
        for rid in output.finished_recving or ():
            finished = self._plans.pop(rid, None)
            if finished is not None:
                self._settle(finished)

    def _forget_failed(self, it: LoadItem) -> None:
        """Drop a block whose synchronous load failed from the index (if still that row)."""
        if it.tier == CPU:
            e = self.cpu.get(it.key)
            if e is not None and e.slot == it.slot and not e.pins:
                self.cpu.remove(it.key)
        elif (
            it.tier == SSD
            and self.ssd is not None
            and self.ssd_store is not None
            and not self.ssd_store.exists(it.key)
        ):
            self.ssd.remove(it.key)
        elif it.tier == SHARED:
            self._shared_known.discard(it.key)
        elif it.tier == REMOTE:
            self._remote_known.discard(it.key)
        if it.promote_slot >= 0:
            e = self.cpu.get(it.key)
            if e is not None and e.slot == it.promote_slot and not e.pins:
                self.cpu.remove(it.key)

    def _settle(self, plan: _Plan) -> None:
        for it in plan.items:
            failed = it.block_id in plan.failed
            if it.tier == CPU:
                self.cpu.unpin(it.key)
                if failed:
                    self.cpu.remove(it.key)
            elif it.tier == SSD:
                assert self.ssd is not None  # only planned with an SSD tier
                self.ssd.unpin(it.key)
                if failed:
                    self.ssd.remove(it.key)  # the worker deleted a corrupt file
            elif it.tier == SHARED and failed:
                self._shared_known.discard(it.key)
            elif it.tier == REMOTE and failed:
                self._remote_known.discard(it.key)
            if it.promote_slot >= 0:
                self.cpu.unpin(it.key)
                if failed:
                    self.cpu.remove(it.key)
                else:
                    self.cpu.mark_ready(it.key)

    # ---- save ----
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FlexKVMetadata:
        """This step's loads, the saves of prompt blocks it completes, SSD deletions."""
        saves: list[SaveItem] = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(rid)
            if t is None:
                continue
            req = t.request
            end = min(req.num_computed_tokens + n_sched, req.num_prompt_tokens)
            full = min(end // self.block_size, len(t.keys))
            # a state page is kept only where a step ends on a block boundary
            state_at = full - 1 if self.state_groups and end % self.block_size == 0 else -1
            if full <= t.saved_upto and state_at < 0:
                continue
            block_ids = self._block_ids(rid, scheduler_output)
            planned = self._plan_saves(rid, t, block_ids, full, state_at)
            saves += planned
            t.saving = t.saving or bool(planned)
            t.saved_upto = max(t.saved_upto, full)
        meta = FlexKVMetadata(
            loads=self._loads,
            saves=saves,
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            ssd_deletes=self._ssd_deletes,
            clear_ssd=self._clear_ssd,
        )
        self._loads, self._ssd_deletes, self._clear_ssd = [], [], False
        # Synchronous loads run in this step, before any save planned from now on
        for plan in self._sync_sent:
            self._settle(plan)
            self._sync_recent.append(plan)
        self._sync_sent = []
        return meta

    def _block_ids(self, rid: str, scheduler_output: SchedulerOutput) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group."""
        if self.kv_cache_manager is not None:
            return tuple(list(g) for g in self.kv_cache_manager.get_block_ids(rid))
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return tuple([] for _ in self.groups)
        return tuple(list(g) for g in state.resolve_block_ids(rid))

    def _plan_saves(
        self,
        rid: str,
        t: _Tracked,
        block_ids: tuple[list[int], ...],
        full: int,
        state_at: int,
    ) -> list[SaveItem]:
        """Saves of the attention groups' blocks ``t.saved_upto..full - 1`` and, when
        ``state_at`` >= 0, of every state group's page at block ``state_at``."""
        out: list[SaveItem] = []
        for g in self.attn_groups:
            ids = block_ids[g] if g < len(block_ids) else []
            for i in range(t.saved_upto, min(full, len(ids))):
                item = self._plan_save(rid, ids[i], group_key(t.keys[i], g), g)
                if item is not None:
                    out.append(item)
        for g in self.state_groups if state_at >= 0 else ():
            ids = block_ids[g] if g < len(block_ids) else []
            if state_at < len(ids) and ids[state_at] != NULL_BLOCK:
                item = self._plan_save(
                    rid, ids[state_at], group_key(t.keys[state_at], g), g, state=True
                )
                if item is not None:
                    out.append(item)
        return out

    def _plan_save(
        self, rid: str, block_id: int, key: str, group: int = 0, *, state: bool = False
    ) -> SaveItem | None:
        slot = -1
        if self.cpu.capacity and key not in self.cpu:
            e, evicted = self.cpu.add(key, ready=True)  # written in this step's wait_for_save
            if evicted:
                self.stats.add("evicted_blocks", len(evicted), CPU)
            slot = e.slot if e is not None else -1
        to_ssd = False
        if self.ssd is not None and key not in self.ssd:
            e, evicted = self.ssd.add(key, ready=False)
            if e is None:
                self._reap_pending_ssd()
                e, more = self.ssd.add(key, ready=False)
                evicted += more
            if evicted:
                self._ssd_deletes.extend(evicted)
                self.stats.add("evicted_blocks", len(evicted), SSD)
            to_ssd = e is not None
        to_shared = (
            self.shared_store is not None
            and key not in self._shared_known
            and not self.shared_store.exists(key, self.tp_size)
        )
        if to_shared:
            self._shared_quota_tick()
        # the worker's put leaves an object that is there already (blocks never change)
        to_remote = self.remote_store is not None and key not in self._remote_known
        if slot < 0 and not to_ssd and not to_shared and not to_remote:
            return None
        return SaveItem(
            block_id,
            key,
            rid,
            slot=slot,
            ssd=to_ssd,
            shared=to_shared,
            remote=to_remote,
            group=group,
            state=state,
        )

    def _shared_quota_tick(self) -> None:
        """Start a quota pass on the shared tier when one is due; forget which blocks were
        seen there then (other instances' passes may have deleted some) and after our passes
        that deleted files (counted)."""
        quota = self.shared_quota
        if quota is None:
            return
        evicted = quota.evicted
        if evicted != self._shared_evicted:
            self.stats.add("evicted_blocks", evicted - self._shared_evicted, SHARED)
            self._shared_evicted = evicted
            self._shared_known.clear()
        if quota.maybe_enforce():
            self._shared_known.clear()

    def _reap_pending_ssd(self) -> None:
        """Settle SSD writes the scheduler has not seen land: ready if the file is there,
        dropped if it never appeared (write failed or was dropped)."""
        assert self.ssd is not None and self.ssd_store is not None
        now = time.monotonic()
        for key in self.ssd.pending_older_than(0.0):
            entry = self.ssd.get(key)
            if self.ssd_store.exists(key, self.tp_size):
                self.ssd.mark_ready(key)
            elif entry is not None and now - entry.since > PENDING_GIVE_UP_S:
                self.ssd.remove(key)

    # ---- lifecycle ----
    def request_finished(self, request: Request) -> bool:
        """Forget a finished request (a load still in flight is settled when it reports).

        True when a save of its blocks was sent to the worker: vLLM then keeps the blocks
        until the worker reports the request in ``finished_sending`` (its saves have copied
        them out), so a background copy never reads a block that was handed to someone else.
        """
        rid = request.request_id
        t = self._tracked.pop(rid, None)
        self._matched_from.pop(rid, None)
        self._sync_next.pop(rid, None)
        self._sources.pop(rid, None)
        return t is not None and t.saving

    def reset_cache(self) -> bool:
        """Drop the CPU tier (and the SSD tier when ``reset_clears_disk``)."""
        dropped = self.cpu.clear()
        if self.cfg.reset_clears_disk and self.ssd is not None:
            dropped += self.ssd.clear()
            self._clear_ssd = True
        self._shared_known.clear()
        logger.info("tiered KV cache reset: %d entries dropped", len(dropped))
        return True
