"""P/D protocols: what each leg's ``kv_transfer_params`` carry and whether the legs overlap.

* ``nixl-pull`` / ``nixl-push`` (vLLM's NixlConnector, and connectors speaking its protocol):
  serial. The prefill leg carries the marker below; its answer's ``kv_transfer_params`` (P's
  block ids and side-channel coordinates) go verbatim into the decode leg. In push mode P writes
  into D's blocks once D registers them; the proxy's part is the same.
* ``mooncake`` (vLLM's MooncakeConnector): concurrent. The proxy mints a ``transfer_id``, sends
  P ``{do_remote_decode, transfer_id}`` and, at the same time, D ``{do_remote_prefill,
  transfer_id, remote_engine_id, remote_bootstrap_addr}``; D pulls from P's bootstrap server
  once P has computed the prompt. Prefill instances must be configured with ``engine_id`` and
  ``bootstrap_addr``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_pd_ext.proxy.config import InstanceConfig

#: The prefill leg's marker for NIXL-style serial protocols.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class LegPlan:
    """The ``kv_transfer_params`` of both legs of one split request.

    ``decode_params`` is None for serial protocols: they come from the prefill's answer.
    """

    prefill_params: dict[str, Any]
    decode_params: dict[str, Any] | None


class PDProtocol(Protocol):
    name: str
    #: True when the decode leg is sent while the prefill leg runs.
    concurrent: bool

    def plan(self, request_id: str, prefill: InstanceConfig) -> LegPlan:
        """Both legs' params for a request whose prefill runs on ``prefill``."""
        ...


class NixlSerial:
    concurrent = False

    def __init__(self, name: str):
        self.name = name

    def plan(self, request_id: str, prefill: InstanceConfig) -> LegPlan:
        return LegPlan(prefill_params=dict(NIXL_PREFILL_PARAMS), decode_params=None)


class MooncakeConcurrent:
    name = "mooncake"
    concurrent = True

    def plan(self, request_id: str, prefill: InstanceConfig) -> LegPlan:
        if not prefill.engine_id or not prefill.bootstrap_addr:
            raise ValueError(
                f"prefill instance {prefill.label} needs engine_id and bootstrap_addr "
                "for the mooncake protocol"
            )
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        return LegPlan(
            prefill_params={"do_remote_decode": True, "transfer_id": transfer_id},
            decode_params={
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_engine_id": prefill.engine_id,
                "remote_bootstrap_addr": prefill.bootstrap_addr,
            },
        )


def make_protocol(name: str) -> PDProtocol:
    if name in ("nixl-pull", "nixl-push"):
        return NixlSerial(name)
    if name == "mooncake":
        return MooncakeConcurrent()
    raise ValueError(f"unknown P/D protocol {name!r}")
