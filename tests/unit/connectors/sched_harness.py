"""vLLM's real Scheduler on CPU with our connector: our equivalent of vLLM's test utils.

Builds a ``VllmConfig`` for a tiny local model, a ``Scheduler`` with one full-attention KV
cache group, requests with given ``kv_transfer_params``, and model-runner outputs that carry
a ``KVConnectorOutput`` (finished sending / receiving, invalid blocks) as a worker would.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 64
EOS = 2
_ids = itertools.count()


def make_vllm_config(
    model: Path,
    role: str,
    extra: dict[str, Any] | None = None,
    policy: str = "recompute",
    max_num_seqs: int = 8,
    connector: str = "PdExtMoRIIOConnector",
    enable_prefix_caching: bool = False,
) -> VllmConfig:
    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=1024,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(model=str(model), max_model_len=512, dtype="float32"),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role=role,
            engine_id=f"engine-{role}",
            kv_connector_extra_config={"side_channel_host": "127.0.0.1", **(extra or {})},
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
    )


def make_scheduler(
    vllm_config: VllmConfig, hybrid: bool = False, mamba_type: str = "MAMBA2"
) -> Scheduler:
    """A Scheduler with one full-attention group, or (``hybrid``) a Mamba2 state group (or
    one of another ``mamba_type``, same shapes) and a full-attention group as vLLM's hybrid
    allocator builds them for GraniteMoeHybrid."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    mc = vllm_config.model_config
    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        dtype=torch.float32,
    )
    groups = [KVCacheGroupSpec(["layer1"], attention)]
    if hybrid:
        mamba = MambaSpec(
            block_size=vllm_config.model_config.max_model_len,
            shapes=((3, 544), (8, 64, 16)),
            dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=attention.page_size_bytes,
            mamba_type=MambaAttentionBackendEnum[mamba_type],
        )
        groups.insert(0, KVCacheGroupSpec(["layer0"], mamba))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.model_config.max_model_len if hybrid else BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_request(
    num_tokens: int,
    params: dict[str, Any] | None,
    max_tokens: int = 4,
    prompt: list[int] | None = None,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.extra_args = {"kv_transfer_params": params} if params is not None else None
    req = Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=prompt if prompt is not None else [7 + i % 50 for i in range(num_tokens)],
        sampling_params=sp,
        pooling_params=None,
        arrival_time=0.0,
    )
    if params is not None:
        req.kv_transfer_params = params
    return req


def runner_output(
    scheduler_output,
    *,
    token: int = 11,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
    failed: set[str] | None = None,
) -> ModelRunnerOutput:
    """What the worker would return for ``scheduler_output`` (one token per scheduled request)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv_out = None
    if sending or recving or invalid or failed:
        kv_out = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid or set(),
            failed_recving=failed or set(),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_out,
    )


def step(scheduler: Scheduler, **kv) -> tuple[Any, dict]:
    """One schedule + update round; returns (scheduler output, engine core outputs)."""
    out = scheduler.schedule()
    engine_out = scheduler.update_from_output(out, runner_output(out, **kv))
    return out, engine_out


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, no held block: everything was released."""
    assert not scheduler.requests, list(scheduler.requests)
    assert not scheduler.running and not len(scheduler.waiting)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # minus the null block
