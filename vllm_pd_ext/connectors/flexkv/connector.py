"""PdExtFlexKVConnector: placeholder until the tiered-cache issue (#6) lands.

The class is importable (vLLM's API server resolves it for metrics and HMA checks) and fails
at construction with a message naming the tracking issue.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from vllm_pd_ext.connectors.common.placeholder import not_implemented


class PdExtFlexKVConnector(KVConnectorBase_V1):
    """Tiered KV cache connector (not implemented yet)."""

    def __new__(cls, *args, **kwargs):
        raise not_implemented(cls.__name__, issue=6)
