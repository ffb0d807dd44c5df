"""PdExtMambaStateConnector: prefill/decode disaggregation for hybrid attention + SSM models.

The same transfer machinery as ``PdExtMoRIIOConnector`` (shared shell, scheduler and worker in
:mod:`vllm_pd_ext.connectors.common`), with vLLM's hybrid KV cache manager on (``SupportsHMA``):
every KV cache group moves, attention blocks per token and Mamba / linear-attention state pages
whole. The prefill side stops one prompt token short so its state pages hold the state after
N-1 tokens; the decode side loads exactly those and computes token N itself (see
:mod:`vllm_pd_ext.connectors.common.scheduler`). Pure SSM models (no attention group) work too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

from vllm_pd_ext.connectors.common.connector import PdTransferConnector

if TYPE_CHECKING:
    from vllm.v1.request import Request


class PdExtMambaStateConnector(PdTransferConnector, SupportsHMA):
    """P/D KV and SSM-state transfer for hybrid models (READ and WRITE modes)."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, [list(g) for g in block_ids])
