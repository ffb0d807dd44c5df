"""What our P/D connector classes share: building the scheduler and worker objects from
vLLM's config, so each connector class stays a thin shell over them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.common.config import TransferConfig, parse_transfer_config
from vllm_pd_ext.connectors.common.parallel import Mamba2State, total_kv_heads
from vllm_pd_ext.connectors.common.scheduler import (
    TransferScheduler,
    default_host,
    groups_of,
    side_channel_address,
)
from vllm_pd_ext.connectors.common.worker import TransferWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_facts(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None
) -> dict[str, Any]:
    """What two engines must agree on to exchange KV blocks (goes into the fingerprint)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    facts: dict[str, Any] = {
        "architectures": list(getattr(mc.hf_config, "architectures", None) or []),
        "layers": mc.get_num_layers(pc),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tp_size": pc.tensor_parallel_size,
        "kv_heads": total_kv_heads(vllm_config),
    }
    if kv_cache_config is not None:
        facts["groups"] = [_spec_facts(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    if kv_cache_config is not None and kv_cache_config.has_mamba_layers:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        facts["conv_state_layout"] = str(get_conv_state_layout())
        groups = ssm_groups(getattr(mc, "hf_text_config", None) or mc.hf_config)
        if groups is not None:  # (per-rank state shapes cannot tell 1 group from 2 at TP 2)
            facts["ssm_groups"] = groups
    return facts


#: What hybrid models' configs call the Mamba2 mixers' ``n_groups``.
SSM_GROUPS_NAMES = ("mamba_n_groups", "n_groups", "mamba_ngroups")


def ssm_groups(hf_config: Any) -> int | None:
    """The model's Mamba2 group count, as its config names it (None: it names none)."""
    for name in SSM_GROUPS_NAMES:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _spec_facts(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": type(spec).__name__, "block_size": int(spec.block_size)}
    for name in ("num_kv_heads", "head_size", "sliding_window", "mamba_cache_mode"):
        value = getattr(spec, name, None)
        if value is not None:
            out[name] = value if isinstance(value, int | str) else str(value)
    for name in ("shapes", "dtypes"):
        value = getattr(spec, name, None)
        if value is not None:
            out[name] = [str(v) for v in value]
    if getattr(spec, "dtype", None) is not None:
        out["dtype"] = str(spec.dtype)
    return out


def declared_heads_first(vllm_config: VllmConfig) -> bool | None:
    """Whether the engine's resolved KV cache layout (vLLM's ``KVCacheLayout``) puts each
    block's heads, then its tokens, innermost (None: not resolved here)."""
    try:
        return bool(vllm_config.cache_config.get_resolved_kv_cache_layout().is_block_contiguous)
    except (AttributeError, ValueError):  # not resolved here: the tensors' shapes decide
        return None


def head_major_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> dict[int, int]:
    """KV cache groups whose blocks hold each KV head contiguously (attention split by heads,
    in a head-major layout), with this rank's KV heads: what a decode engine of another TP
    size may read a slice of (``layout.py`` also checks each tensor's shape)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec

    if declared_heads_first(vllm_config) is False:
        return {}
    out = {}
    for i, g in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else ()):
        spec = g.kv_cache_spec
        if isinstance(spec, AttentionSpec) and not isinstance(
            spec, MLAAttentionSpec | SlidingWindowMLASpec
        ):
            out[i] = int(spec.num_kv_heads)
    return out


def mamba2_states(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> dict[int, Mamba2State]:
    """KV cache groups of Mamba2 state pages, with this rank's state as vLLM shapes it: what
    an engine of another TP size may read parts of (``parallel.py``). Other state (Mamba1,
    gated delta nets, linear attention, replicated or ReplaySSM pages) is left out: it moves
    only between engines of the same TP size."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    out = {}
    for i, g in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else ()):
        spec = g.kv_cache_spec
        if (
            not isinstance(spec, MambaSpec)
            or spec.mamba_type != MambaAttentionBackendEnum.MAMBA2
            or spec.tp_replicated
        ):
            continue
        try:
            out[i] = Mamba2State.from_shapes(
                spec.shapes,
                [d.itemsize for d in spec.dtypes],
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                channels_first=is_conv_state_dim_first(),
            )
        except ValueError:
            continue
    return out


def _block_size(vllm_config: VllmConfig) -> int:
    return int(vllm_config.cache_config.block_size)


def block_size_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """The block size of the first KV cache group (the engine's, when the config is unknown)."""
    return groups_of(kv_cache_config, _block_size(vllm_config))[0].block_size


def make_scheduler(
    name: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> TransferScheduler:
    cfg = parse_transfer_config(name, vllm_config.kv_transfer_config.kv_connector_extra_config)
    groups = groups_of(kv_cache_config, _block_size(vllm_config))
    states = mamba2_states(vllm_config, kv_cache_config)
    split = all(i in states for i, g in enumerate(groups) if g.whole)
    return TransferScheduler(vllm_config, cfg, groups, split_state=split)


def make_worker(
    name: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> TransferWorker:
    kv = vllm_config.kv_transfer_config
    cfg: TransferConfig = parse_transfer_config(name, kv.kv_connector_extra_config)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):  # no TP group (tests)
        tp_rank = 0
    host, port = side_channel_address(vllm_config, cfg)
    groups = groups_of(kv_cache_config, _block_size(vllm_config))
    group_of = {}
    if kv_cache_config is not None:
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            group_of.update(dict.fromkeys(g.layer_names, i))
    return TransferWorker(
        cfg,
        engine_id=str(kv.engine_id),
        role=str(kv.kv_role),
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        side_host=host,
        side_port=port,
        kv_ip=default_host(vllm_config),
        num_blocks=int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0,
        block_sizes=tuple(g.block_size for g in groups),
        model=model_facts(vllm_config, kv_cache_config),
        group_of=group_of,
        head_major=head_major_groups(vllm_config, kv_cache_config),
        heads_first=bool(declared_heads_first(vllm_config)),
        states=mamba2_states(vllm_config, kv_cache_config),
        key=fleet_key.load_key(),
    )
