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

Loads are refused (the prompt is recomputed locally instead) when the params are incomplete,
name too few blocks, or carry a prompt hash that differs from this request's prompt.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.metadata import (
    READ,
    WRITE,
    PdTransferMetadata,
    PushSpec,
    RecvSpec,
    RemoteRef,
    SendSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Name the params carry so a decode instance can tell our protocol from another's.
PROTOCOL = "pdext"


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
    """The IP this engine advertises when the config names none (``kv_ip``, else vLLM's
    guess of this host's IP, which honours ``VLLM_HOST_IP``)."""
    kv_ip = getattr(vllm_config.kv_transfer_config, "kv_ip", None)
    if kv_ip:
        return str(kv_ip)
    from vllm.utils.network_utils import get_ip

    return get_ip()


class TransferScheduler:
    """Scheduler-side state of one engine (both roles; a ``kv_both`` engine uses both)."""

    def __init__(self, vllm_config: VllmConfig, cfg: TransferConfig, block_size: int) -> None:
        self.cfg = cfg
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.block_size = block_size
        self.host, self.port = side_channel_address(vllm_config, cfg)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.kv_cache_manager: KVCacheManager | None = None
        self._recv: dict[str, RecvSpec] = {}
        self._send: list[SendSpec] = []
        self._release: list[RemoteRef] = []
        self._write_reqs: dict[str, Request] = {}
        self._pushed: set[str] = set()
        self._waiting_remote: dict[str, RemoteRef] = {}
        self._last_renew = time.monotonic()

    # ---- decode side ----
    def _load_plan(self, request: Request) -> tuple[int, RemoteRef, str] | None:
        """(tokens the remote holds for this prompt, where, mode), or None if not loadable."""
        p = request.kv_transfer_params or {}
        mode = p.get("transfer_mode") or READ
        prompt = request.prompt_token_ids or []
        try:
            remote = RemoteRef(
                engine_id=str(p.get("remote_engine_id") or ""),
                host=str(p["remote_host"]),
                port=int(p["remote_port"]),
                request_id=(str(p["remote_request_id"]) if mode == READ else None),
            )
            if mode == READ:
                n = int(p.get("remote_num_tokens") or len(prompt))
                blocks = p["remote_block_ids"]
                if not isinstance(blocks, list) or len(blocks) * self.block_size < min(
                    n, len(prompt)
                ):
                    raise ValueError(f"{len(blocks)} remote blocks for {n} tokens")
                if not remote.engine_id:
                    raise ValueError("no remote_engine_id")
            elif mode == WRITE:
                n = len(prompt)
                if not p.get("transfer_id"):
                    raise ValueError("no transfer_id")
            else:
                raise ValueError(f"unknown transfer_mode {mode!r}")
        except (KeyError, TypeError, ValueError) as e:
            logger.warning(
                "request %s: unusable kv_transfer_params (%s); computing the prompt locally",
                request.request_id,
                e,
            )
            return None
        n = min(n, len(prompt))
        want = p.get("prompt_hash")
        if want is not None and want != prompt_hash(prompt, n):
            logger.warning(
                "request %s: the prefill instance computed a different prompt (hash %s, "
                "ours %s); computing the prompt locally",
                request.request_id,
                want,
                prompt_hash(prompt, n),
            )
            return None
        return n, remote, mode

    def on_new_request(self, request: Request) -> None:
        """Track a decode request's prefill side (for lease renewals) and WRITE pushes."""
        p = request.kv_transfer_params
        if not p:
            return
        if p.get("do_remote_prefill") and (p.get("transfer_mode") or READ) == READ:
            try:
                self._waiting_remote[request.request_id] = RemoteRef(
                    engine_id=str(p.get("remote_engine_id") or ""),
                    host=str(p["remote_host"]),
                    port=int(p["remote_port"]),
                    request_id=str(p["remote_request_id"]),
                )
            except (KeyError, TypeError, ValueError):
                pass  # nowhere to send renewals; _load_plan refuses the load
        if p.get("do_remote_decode") and self._mode(p) == WRITE and p.get("transfer_id"):
            self._write_reqs[request.request_id] = request

    def _mode(self, p: dict[str, Any]) -> str:
        return p.get("transfer_mode") or self.cfg.transfer_mode

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Remote prompt tokens beyond ``num_computed_tokens``, loaded asynchronously."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
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
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # one transfer per request
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
        group = blocks.blocks[0]
        local = [b.block_id for b in group]
        skip = 0
        while skip < len(group) and group[skip].block_hash is not None:
            skip += 1
        n_blocks = -(-n // self.block_size)
        if mode == READ:
            remote_ids = [int(b) for b in p["remote_block_ids"]]
            pairs = tuple((local[i], remote_ids[i]) for i in range(skip, n_blocks))
        else:
            pairs = tuple((local[i], i) for i in range(skip, n_blocks))
        self._recv[request.request_id] = RecvSpec(
            req_id=request.request_id,
            mode=mode,
            remote=remote,
            pairs=pairs,
            local_block_ids=tuple(local[:n_blocks]),
            transfer_id=p.get("transfer_id"),
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
                ids = self.kv_cache_manager.get_block_ids(req_id)[0]
                n_blocks = -(-req.num_prompt_tokens // self.block_size)
                meta.push.append(
                    PushSpec(
                        req_id, str(req.kv_transfer_params["transfer_id"]), tuple(ids[:n_blocks])
                    )
                )
                self._pushed.add(req_id)
        now = time.monotonic()
        if self._waiting_remote and now - self._last_renew >= self.cfg.lease_s / 3:
            meta.renew = list(self._waiting_remote.values())
            self._last_renew = now
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the blocks and answer where they are. Decode: release an unused hold."""
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        p = request.kv_transfer_params
        self._write_reqs.pop(req_id, None)
        self._pushed.discard(req_id)
        if not p:
            return False, None
        if p.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: the prefill side still
            # holds the prompt's blocks for us.
            p["do_remote_prefill"] = False
            remote = self._waiting_remote.pop(req_id, None)
            if remote is not None:
                self._release.append(remote)
            return False, None
        self._waiting_remote.pop(req_id, None)
        if not p.get("do_remote_decode"):
            return False, None
        if (
            request.status
            not in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            or not block_ids
        ):
            return False, None  # aborted or errored: free now, nothing to hand over
        mode = self._mode(p)
        n = request.num_computed_tokens
        ids = tuple(int(b) for b in block_ids[: -(-n // self.block_size)])
        self._send.append(SendSpec(req_id, mode, ids, p.get("transfer_id")))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_mode": mode,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(ids),
            "remote_num_tokens": n,
            "prompt_hash": prompt_hash(request.prompt_token_ids or [], n),
            "tp_size": self.tp_size,
            "lease_s": self.cfg.lease_s,
            "protocol": PROTOCOL,
        }
