"""``kv_connector_extra_config`` of our P/D connectors, validated once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_pd_ext.connectors.common.side_channel import SideChannelLimits
from vllm_pd_ext.transport.registry import backend_names

M = TypeVar("M", bound=BaseModel)


class TransferConfig(BaseModel):
    """Settings shared by our P/D connectors (``PdExtMoRIIOConnector``, the Mamba connector).

    Every key is optional; an unknown key or a bad value fails the engine's start with a
    message naming it.
    """

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        "mooncake",
        description="Transport backend by name: one of vllm_pd_ext.transport.backend_names() "
        "(the package's docstring says what each moves bytes over).",
    )
    backend_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Backend settings, e.g. {'protocol': 'rdma'}; 'host' defaults as "
        "side_channel_host does.",
    )
    transfer_mode: Literal["read", "write"] = Field(
        "read",
        description="Default mode when kv_transfer_params name none: read (D pulls after P "
        "finishes) or write (P pushes each layer into D's blocks).",
    )
    side_channel_host: str | None = Field(
        None,
        description="Host the prefill side's handshake server binds and advertises; default: "
        "VLLM_HOST_IP when set, else 127.0.0.1 (without a fleet key it authenticates nobody: "
        "then name an address only on a private network).",
    )
    side_channel_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Handshake server port (plus the worker's TP rank); default kv_port.",
    )
    side_channel_limits: SideChannelLimits = Field(
        default_factory=SideChannelLimits,
        description="What the handshake server serves at most: connections (in all and per "
        "address), deadlines for a request's head and for an idle connection, head and body "
        "sizes; e.g. {'max_per_source': 8}.",
    )
    lease_s: float = Field(
        30.0, gt=0, description="P frees a request's blocks this long after D last renewed."
    )
    transfer_timeout_s: float = Field(
        60.0, gt=0, description="D gives up on one transfer (then kv_load_failure_policy applies)."
    )
    handshake_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Timeout of one handshake call; also how long a WRITE's decode that gave "
        "up keeps its blocks while the prefill says its writes into them are in flight.",
    )
    max_concurrent_transfers: int = Field(
        4, ge=1, le=64, description="Transfers a decode worker runs at once."
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in backend_names():
            known = ", ".join(backend_names())
            raise ValueError(f"unknown transport backend {value!r}; known: {known}")
        return value


def parse_extra_config(model: type[M], connector: str, extra: Mapping[str, Any] | None) -> M:
    """Validate ``extra`` into ``model``; ``ValueError`` naming the connector and the bad key."""
    try:
        return model.model_validate(dict(extra or {}))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
            for err in e.errors()
        )
        raise ValueError(f"invalid kv_connector_extra_config for {connector}: {problems}") from None


def parse_transfer_config(connector: str, extra: Mapping[str, Any] | None) -> TransferConfig:
    """Validate ``extra``; ``ValueError`` naming the connector and the bad key otherwise."""
    return parse_extra_config(TransferConfig, connector, extra)
