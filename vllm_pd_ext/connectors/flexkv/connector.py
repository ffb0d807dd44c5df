"""PdExtFlexKVConnector: a tiered KV cache (CPU memory, SSD, shared directory) with prefix reuse.

A thin ``KVConnectorBase_V1`` shell: the scheduler role delegates to
:class:`~vllm_pd_ext.connectors.flexkv.scheduler.FlexKVScheduler` (index, lookups, load and
save plans), the worker role to :class:`~vllm_pd_ext.connectors.flexkv.worker.FlexKVWorker`
(CPU pool, block copies, file I/O). Settings come from ``kv_connector_extra_config``
(:class:`~vllm_pd_ext.connectors.flexkv.config.FlexKVConfig`).

Hybrid attention + SSM models run with vLLM's hybrid KV cache manager on (``SupportsHMA``)
and its hybrid prefix caching (``mamba_cache_mode`` "align", vLLM's default when prefix
caching is on): every KV cache group is cached, state pages at the block boundaries where
vLLM keeps them (see :mod:`~vllm_pd_ext.connectors.flexkv.scheduler`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_pd_ext.connectors.common.delegating import DelegatingConnector
from vllm_pd_ext.connectors.common.layout import layer_groups
from vllm_pd_ext.connectors.common.scheduler import GroupInfo, groups_of
from vllm_pd_ext.connectors.flexkv.blocks import model_facts
from vllm_pd_ext.connectors.flexkv.config import parse_flexkv_config
from vllm_pd_ext.connectors.flexkv.keys import cache_namespace
from vllm_pd_ext.connectors.flexkv.metadata import FlexKVMetadata
from vllm_pd_ext.connectors.flexkv.scheduler import FlexKVScheduler
from vllm_pd_ext.connectors.flexkv.stats import FlexKVPromMetrics, FlexKVStats
from vllm_pd_ext.connectors.flexkv.worker import FlexKVWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def block_size_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """The scheduler's block size (of the first KV cache group when known)."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)


def block_bytes_of(kv_cache_config: KVCacheConfig | None) -> int:
    """Bytes of one KV block of a group across its layers, the widest group's (what one
    CPU-tier row holds)."""
    if kv_cache_config is None:
        return 1
    return max(
        (
            int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
            for g in kv_cache_config.kv_cache_groups
        ),
        default=1,
    )


def cached_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> tuple[GroupInfo, ...]:
    """The KV cache groups the tiered cache keeps; raises ``ValueError`` for a hybrid model
    whose state pages vLLM does not keep at block boundaries (prefix caching off), whose
    groups have different block sizes, or with a group of another kind (sliding window...:
    its skipped blocks are null, vLLM's hybrid allocator must be off for it)."""
    groups = groups_of(kv_cache_config, int(vllm_config.cache_config.block_size))
    if len(groups) == 1 and not groups[0].whole:
        return groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    assert kv_cache_config is not None  # several groups come from it
    for g in kv_cache_config.kv_cache_groups:
        if type(g.kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec, MambaSpec):
            raise ValueError(
                f"PdExtFlexKVConnector caches full-attention and Mamba KV cache groups, not "
                f"{type(g.kv_cache_spec).__name__} (layers {g.layer_names[:2]}...); run this "
                f"model with --disable-hybrid-kv-cache-manager"
            )
    mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
    if any(g.whole for g in groups) and mode != "align":
        raise ValueError(
            f"PdExtFlexKVConnector caches a hybrid model's SSM state only where vLLM's prefix "
            f"caching keeps it (mamba_cache_mode 'align', on with --enable-prefix-caching); "
            f"this engine has mamba_cache_mode {mode!r}"
        )
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ValueError(
            f"PdExtFlexKVConnector needs one block size for all KV cache groups, got "
            f"{sorted(sizes)}"
        )
    return groups


class PdExtFlexKVConnector(DelegatingConnector, SupportsHMA):
    """Tiered KV cache: CPU memory, local SSD and a shared directory, LRU-with-frequency."""

    _cache_hit_source = CacheHitSource.HOST
    _metadata_type = FlexKVMetadata
    _stats_type = FlexKVStats
    _prom_type = FlexKVPromMetrics

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        name = type(self).__name__
        cfg = parse_flexkv_config(name, vllm_config.kv_transfer_config.kv_connector_extra_config)
        model = model_facts(vllm_config)
        block_size = block_size_of(vllm_config, kv_cache_config)
        block_bytes = block_bytes_of(kv_cache_config)
        groups = cached_groups(vllm_config, kv_cache_config)
        self._scheduler: FlexKVScheduler | None = None
        self._worker: FlexKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = FlexKVScheduler(
                cfg,
                block_size=block_size,
                block_bytes=block_bytes,
                model=model,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                groups=groups,
            )
        else:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                tp_rank = get_tensor_model_parallel_rank()
            except (AssertionError, ImportError, RuntimeError):  # no TP group (tests)
                tp_rank = 0
            self._worker = FlexKVWorker(
                cfg,
                namespace=cache_namespace(model, block_size, cfg.namespace),
                num_blocks=int(kv_cache_config.num_blocks) if kv_cache_config else 0,
                block_size=block_size,
                model=model,
                cpu_slots=cfg.cpu_slots(block_bytes),
                tp_rank=tp_rank,
                block_sizes=tuple(g.block_size for g in groups),
                group_of=layer_groups(kv_cache_config),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ---- scheduler side (EngineCore) ----
    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def reset_cache(self) -> bool:
        return self._scheduler.reset_cache() if self._scheduler is not None else True

    # ---- worker side ----
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None and isinstance(kv_connector_metadata, FlexKVMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are handed to the save thread in wait_for_save

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self._worker.take_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> FlexKVStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return side.stats.take() if side is not None else None
