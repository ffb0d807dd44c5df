"""Scheduler side of our P/D connectors (runs in vLLM's EngineCore process).

Reads each request's ``kv_transfer_params`` and turns them into per-step instructions
(:class:`~vllm_pd_ext.connectors.common.metadata.PdTransferMetadata`) for the worker side:

* prefill (``do_remote_decode``): when the request finishes, keep its blocks
  (``delay_free``) and answer the ``kv_transfer_params`` the proxy forwards to decode; in
  WRITE mode also tell the worker, in the step that computes the last prompt tokens, to push
  each layer as it is saved;
* decode (``do_remote_prefill``): report the remote prompt tokens as loadable (asynchronously),
  then hand the worker the (local block, remote block) pairs once blocks are allocated;
  renew the prefill side's lease while the request waits; if the request ends before
  loading, tell the prefill side to free its blocks.

Hybrid models (a KV cache group holding Mamba / linear-attention state): the prefill side
drops the last prompt token before computing, so its state pages hold the state after N-1
tokens; the decode side loads exactly those N-1 tokens (attention blocks and whole state pages
per group) and computes token N itself. A load whose token count is not exactly that is
refused, since a state at the wrong position would corrupt every following token.

Params are checked in full once, when a decode request arrives (``on_new_request``, against
their shapes in :mod:`vllm_pd_ext.transfer_params`). Loads are refused (the prompt is
recomputed locally instead, and the refusal counted) when the params are malformed or
incomplete, of another contract version, name too few blocks, or, for a READ, come from a
prefill of another tensor parallel size (:mod:`~vllm_pd_ext.connectors.common.parallel`) or
carry a prompt hash that differs from this request's prompt; with a fleet key
(:mod:`vllm_pd_ext.fleet_key`) also when they carry no valid signature (a prefill signs the
fields of its answer that a decode side acts on, the proxy a WRITE's) or arrive after they
expired. A WRITE's params name no prompt (the proxy signs them before any prefill runs): the
worker side refuses its KV when the prefill's "written" notice names the hash of another
prompt than this request's (``RecvSpec.prompt_hash``, ``PushSpec.prompt_hash``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.metadata import (
    PdTransferMetadata,
    PushSpec,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from vllm_pd_ext.connectors.common.parallel import total_kv_heads, tp_refusal
from vllm_pd_ext.connectors.common.stats import StatsRecorder
from vllm_pd_ext.connectors.common.tracing import traceparent_of
from vllm_pd_ext.transfer_params import (
    READ,
    WRITE,
    InvalidParams,
    PdExtReadAnswer,
    PdExtWriteDecode,
    ReadSource,
    keeps_for_remote,
    loads_remote,
    mark_loaded,
    mode_of,
    transfer_id_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def prompt_hash(token_ids: Any, n: int) -> str:
    """Short hash of the first ``n`` prompt tokens (both sides must compute the same KV)."""
    arr = np.asarray(list(token_ids)[:n], dtype=np.int64)
    return hashlib.sha256(arr.tobytes()).hexdigest()[:16]


def side_channel_address(vllm_config: VllmConfig, cfg: TransferConfig) -> tuple[str, int]:
    """Host and base port of the prefill workers' side channels (rank r listens on port+r)."""
    kv = vllm_config.kv_transfer_config
    return cfg.side_channel_host or default_host(vllm_config), int(
        cfg.side_channel_port or kv.kv_port
    )


def default_host(vllm_config: VllmConfig) -> str:
    """The address this engine's KV listeners bind and advertise when the config names none:
    ``kv_ip`` where vLLM's config has it, else ``VLLM_HOST_IP`` when set, else 127.0.0.1. The
    listeners authenticate nobody without a fleet key, so they face the network only when
    someone says so."""
    kv_ip = getattr(vllm_config.kv_transfer_config, "kv_ip", None)
    if kv_ip:
        return str(kv_ip)
    return os.environ.get("VLLM_HOST_IP") or LOOPBACK


#: Where the KV listeners bind unless configured otherwise.
LOOPBACK = "127.0.0.1"


def _read_ref(source: PdExtReadAnswer | ReadSource) -> RemoteRef:
    """The prefill side channel a READ answer names, and the id its blocks are held under."""
    return RemoteRef(
        engine_id=source.remote_engine_id,
        host=source.remote_host,
        port=source.remote_port,
        request_id=source.remote_request_id,
        tp_size=source.tp_size if isinstance(source, PdExtReadAnswer) else None,
    )


@dataclass(frozen=True)
class GroupInfo:
    """What the scheduler side needs to know about one KV cache group."""

    block_size: int
    whole: bool  # state pages (Mamba): every block the request holds moves, not per token


def groups_of(
    kv_cache_config: KVCacheConfig | None, default_block_size: int
) -> tuple[GroupInfo, ...]:
    """One :class:`GroupInfo` per KV cache group (one group when the config is unknown)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return (GroupInfo(default_block_size, False),)
    from vllm.v1.kv_cache_interface import MambaSpec

    return tuple(
        GroupInfo(int(g.kv_cache_spec.block_size), isinstance(g.kv_cache_spec, MambaSpec))
        for g in kv_cache_config.kv_cache_groups
    )


def _per_group(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """Block ids as one tuple per group (a flat list is one group)."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return tuple(tuple(int(b) for b in g) for g in block_ids)
    return (tuple(int(b) for b in block_ids or ()),)


class TransferScheduler:
    """Scheduler-side state of one engine (both roles; a ``kv_both`` engine uses both)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        cfg: TransferConfig,
        groups: tuple[GroupInfo, ...],
        *,
        split_state: bool = False,
    ) -> None:
        self.cfg = cfg
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.groups = groups
        #: Trailing prompt tokens the prefill side leaves to the decode side (hybrid: 1).
        self.backoff = 1 if any(g.whole for g in groups) else 0
        #: State pages that do not move between engines of different TP sizes (only Mamba2's
        #: are split by heads here: ``split_state``).
        self.unsplit_state = bool(self.backoff) and not split_state
        self.host, self.port = side_channel_address(vllm_config, cfg)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        #: The model's KV heads (all ranks'), when known: decides which TP sizes may differ.
        self.kv_heads = total_kv_heads(vllm_config)
        self.kv_cache_manager: KVCacheManager | None = None
        self._recv: dict[str, RecvSpec] = {}
        self._send: list[SendSpec] = []
        self._release: list[RemoteRef] = []
        self._write_reqs: dict[str, Request] = {}
        self._pushed: set[str] = set()
        self._waiting_remote: dict[str, RemoteRef] = {}
        self._last_renew = time.monotonic()
        #: Params refused on arrival (the scheduler side's share of the connector's stats).
        self.stats = StatsRecorder()
        #: Signs this prefill's answers; a decode side loads only what carries its signature.
        self.key = fleet_key.load_key()
        if self.key is None:
            logger.warning(
                "no fleet key (%s / %s): kv_transfer_params are neither signed nor checked, "
                "so whoever can send this engine a request can point its connector anywhere",
                fleet_key.KEY_FILE_ENV,
                fleet_key.KEY_ENV,
            )

    def _blocks_for(
        self, group_blocks: Sequence[Sequence[int]], n_tokens: int
    ) -> tuple[tuple[int, ...], ...]:
        """The blocks of each group that hold the first ``n_tokens`` (state groups: all)."""
        out = []
        for g, ids in zip(self.groups, group_blocks, strict=True):
            out.append(tuple(ids) if g.whole else tuple(ids[: -(-n_tokens // g.block_size)]))
        return tuple(out)

    # ---- decode side ----
    def _load_plan(
        self, request: Request, now: float | None = None
    ) -> tuple[int, RemoteRef, str] | None:
        """(prompt tokens to load, where, mode), or None if the load must not happen. ``now``
        (wall clock, on arrival): also refuse params that have expired."""
        p = request.kv_transfer_params or {}
        mode = mode_of(p, READ)
        prompt = request.prompt_token_ids or []
        want = len(prompt) - self.backoff
        try:
            if want <= 0:
                raise InvalidParams("prompt too short to split")
            if mode == READ:
                answer = PdExtReadAnswer.check(p, self.key, now)
                refusal = tp_refusal(
                    answer.tp_size, self.tp_size, kv_heads=self.kv_heads, state=self.unsplit_state
                )
                if refusal is not None:
                    raise InvalidParams(refusal)
                remote = _read_ref(answer)
                n = answer.remote_num_tokens
                if self.backoff and n != want:
                    raise InvalidParams(
                        f"the prefill side computed {n} tokens; this hybrid model needs "
                        f"exactly {want} (its state must stop one token short)"
                    )
                n = min(n, want)
                blocks = _per_group(answer.remote_block_ids)
                if len(blocks) != len(self.groups):
                    raise InvalidParams(f"{len(blocks)} block groups, {len(self.groups)} here")
                for g, ids in zip(self.groups, blocks, strict=True):
                    if not g.whole and len(ids) * g.block_size < n:
                        raise InvalidParams(f"{len(ids)} remote blocks for {n} tokens")
                    if g.whole and not ids:
                        raise InvalidParams("no remote state block")
                if answer.prompt_hash != prompt_hash(prompt, n):
                    raise InvalidParams(
                        f"the prefill instance computed a different prompt (hash "
                        f"{answer.prompt_hash}, ours {prompt_hash(prompt, n)})"
                    )
            elif mode == WRITE:
                write = PdExtWriteDecode.check(p, self.key, now)
                remote = RemoteRef(
                    engine_id=write.remote_engine_id or "",
                    host=write.remote_host,
                    port=write.remote_port,
                )
                n = want
            else:
                raise InvalidParams(f"unknown transfer_mode {mode!r}")
        except InvalidParams as e:
            logger.warning(
                "request %s: unusable kv_transfer_params (%s); computing the prompt locally",
                request.request_id,
                e,
            )
            return None
        return n, remote, mode

    def on_new_request(self, request: Request) -> None:
        """Track a decode request's prefill side (for lease renewals) and WRITE pushes; on a
        hybrid model's prefill side, leave the last prompt token to the decode side."""
        p = request.kv_transfer_params
        if not p:
            return
        if loads_remote(p):
            # Checked in full once, on arrival (expiry included): params refused here are
            # never acted on, and a forged READ gets no renewals or releases where it says.
            plan = self._load_plan(request, now=time.time())
            if plan is None:
                mark_loaded(p)
                self.stats.params_refused()
                if (source := self._authentic_source(p)) is not None:
                    self._release.append(source)  # the prefill frees its blocks now
            elif plan[2] == READ:
                self._waiting_remote[request.request_id] = plan[1]
        if keeps_for_remote(p):
            self._truncate_for_prefill(request)
            if self._mode(p) == WRITE and transfer_id_of(p):
                self._write_reqs[request.request_id] = request

    def _authentic_source(self, p: dict[str, Any]) -> RemoteRef | None:
        """The prefill a refused READ names, when the params are this fleet's (always, without
        a key): it may free the blocks at once. A forgery's host is never contacted."""
        if self.key is not None and not fleet_key.verify(
            self.key, p, PdExtReadAnswer.signed_fields()
        ):
            return None
        try:
            source = ReadSource.parse(p)
        except InvalidParams:
            return None
        return _read_ref(source)

    def _truncate_for_prefill(self, request: Request) -> None:
        p = request.kv_transfer_params
        if not self.backoff or p.get("_pdext_truncated") or request.prompt_token_ids is None:
            return
        if request.num_prompt_tokens <= self.backoff:
            return
        del request.prompt_token_ids[-self.backoff :]
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        p["_pdext_truncated"] = True

    def _mode(self, p: dict[str, Any]) -> str:
        return mode_of(p, self.cfg.transfer_mode)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Remote prompt tokens beyond ``num_computed_tokens``, loaded asynchronously."""
        if not loads_remote(request.kv_transfer_params):
            return 0, False
        plan = self._load_plan(request)
        if plan is None:
            return 0, False
        count = plan[0] - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of a decode request into its freshly allocated blocks (once)."""
        p = request.kv_transfer_params
        if not p or not loads_remote(p):
            return
        mark_loaded(p)  # one transfer per request
        remote = self._waiting_remote.pop(request.request_id, None)
        plan = self._load_plan(request)
        if plan is None:
            if remote is not None:
                self._release.append(remote)
            return
        n, remote, mode = plan
        if num_external_tokens <= 0:
            if mode == READ:
                self._release.append(remote)  # nothing to pull (local hit): free P now
            return
        local = self._blocks_for([[b.block_id for b in grp] for grp in blocks.blocks], n)
        cached = [
            sum(1 for b in grp if b.block_hash is not None and not b.is_null)
            for grp in blocks.blocks
        ]
        answer = PdExtReadAnswer.parse(p) if mode == READ else None
        if answer is not None:
            remote_ids = self._blocks_for(_per_group(answer.remote_block_ids), n)
        else:
            remote_ids = tuple(tuple(range(len(ids))) for ids in local)  # offered by position
        pairs = tuple(
            tuple(
                (a, b)
                for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
                if i >= skip and a != 0 and b >= 0 and (mode == WRITE or b != 0)
            )
            for mine, theirs, skip in zip(local, remote_ids, cached, strict=True)
        )
        self._recv[request.request_id] = RecvSpec(
            req_id=request.request_id,
            mode=mode,
            remote=remote,
            pairs=pairs,
            local_block_ids=local,
            transfer_id=transfer_id_of(p),
            lease_s=answer.lease_s if answer is not None else None,
            # WRITE: the prefill's "written" notice must name the prompt loaded here
            prompt_hash=prompt_hash(request.prompt_token_ids or [], n) if mode == WRITE else None,
            traceparent=traceparent_of(request),
        )

    # ---- both ----
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdTransferMetadata:
        """This step's instructions; resets the pending lists."""
        meta = PdTransferMetadata(
            recv=list(self._recv.values()), send=self._send, release=self._release
        )
        self._recv, self._send, self._release = {}, [], []
        for req_id, req in self._write_reqs.items():
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if (
                n
                and req_id not in self._pushed
                and (req.num_computed_tokens + n >= req.num_prompt_tokens)
            ):
                assert self.kv_cache_manager is not None
                ids = self._blocks_for(
                    self.kv_cache_manager.get_block_ids(req_id), req.num_prompt_tokens
                )
                tid = str(transfer_id_of(req.kv_transfer_params))
                computed = prompt_hash(req.prompt_token_ids or [], req.num_prompt_tokens)
                meta.push.append(PushSpec(req_id, tid, ids, computed, traceparent_of(req)))
                self._pushed.add(req_id)
        now = time.monotonic()
        if self._waiting_remote and now - self._last_renew >= self.cfg.lease_s / 3:
            meta.renew = list(self._waiting_remote.values())
            self._last_renew = now
        return meta

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the blocks and answer where they are. Decode: release an unused hold.

        ``block_ids`` is a flat list (one group) or one list per group.
        """
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        p = request.kv_transfer_params
        self._write_reqs.pop(req_id, None)
        self._pushed.discard(req_id)
        if not p:
            return False, None
        if loads_remote(p):
            # Finished (aborted) before its blocks were allocated: the prefill side still
            # holds the prompt's blocks for us.
            mark_loaded(p)
            remote = self._waiting_remote.pop(req_id, None)
            if remote is not None:
                self._release.append(remote)
            return False, None
        self._waiting_remote.pop(req_id, None)
        if not keeps_for_remote(p):
            return False, None
        groups = _per_group(block_ids)
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not any(groups):
            return False, None  # aborted or errored: free now, nothing to hand over
        mode = self._mode(p)
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        ids = self._blocks_for(groups, n)
        self._send.append(SendSpec(req_id, mode, ids, transfer_id_of(p), traceparent_of(request)))
        answer = PdExtReadAnswer(
            remote_engine_id=self.engine_id,
            remote_request_id=req_id,
            remote_host=self.host,
            remote_port=self.port,
            remote_block_ids=list(ids[0]) if len(ids) == 1 else [list(g) for g in ids],
            remote_num_tokens=n,
            prompt_hash=prompt_hash(request.prompt_token_ids or [], n),
            tp_size=self.tp_size,
            lease_s=self.cfg.lease_s,
            expires_at=time.time() + self.cfg.lease_s,
            transfer_mode=mode,
        )
        return True, answer.signed(self.key)
