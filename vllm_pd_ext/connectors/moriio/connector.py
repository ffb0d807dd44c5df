"""PdExtMoRIIOConnector: placeholder until the transport/MoRI-IO issue (#5) lands.

The class is importable (vLLM's API server resolves it for metrics and HMA checks) and fails
at construction with a message naming the tracking issue.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from vllm_pd_ext.connectors.common.placeholder import not_implemented


class PdExtMoRIIOConnector(KVConnectorBase_V1):
    """Prefill-to-decode KV transfer connector (not implemented yet)."""

    def __new__(cls, *args, **kwargs):
        raise not_implemented(cls.__name__, issue=5)
