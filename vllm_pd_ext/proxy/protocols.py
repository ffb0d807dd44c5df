"""P/D protocols: what each leg's ``kv_transfer_params`` carry and whether the legs overlap.

Serial protocols send the prefill leg first and copy its answer's ``kv_transfer_params`` into
the decode leg; concurrent ones send both legs at once with params the proxy builds.

* ``nixl-pull`` / ``nixl-push`` (vLLM's NixlConnector, and connectors speaking its protocol):
  serial. The prefill leg carries the marker below; its answer (P's block ids and side-channel
  coordinates) goes verbatim into the decode leg. In push mode P writes into D's blocks once D
  registers them; the proxy's part is the same.
* ``mooncake`` (vLLM's MooncakeConnector): concurrent. The proxy mints a ``transfer_id``, sends
  P ``{do_remote_decode, transfer_id}`` and, at the same time, D ``{do_remote_prefill,
  transfer_id, remote_engine_id, remote_bootstrap_addr}``; D pulls from P's bootstrap server
  once P has computed the prompt. Prefill instances need ``engine_id`` and ``bootstrap_addr``
  (``host:port``); D gets it as a URL (``http://host:port``): the connector queries
  ``remote_bootstrap_addr + "/query"``.
* ``moriio-read`` / ``moriio-write`` (vLLM's MoRIIOConnector, ``read_mode`` true / false).
  vLLM's own proxy learns each instance's MoRI-IO address over ZMQ registration and embeds both
  peers' addresses in the request id (``___prefill_addr_..___decode_addr_..``). We instead pass
  the peer's coordinates explicitly in ``kv_transfer_params`` (``remote_host``,
  ``remote_handshake_port``, ``remote_notify_port``: the fallback the connector documents for
  routers that do not rewrite request ids, as llm-d's sidecar does) and take them from the
  fleet config: ``bootstrap_addr`` is the instance's ``host:handshake_port`` and
  ``notify_port`` its notify port (``kv_connector_extra_config`` ``handshake_port`` /
  ``notify_port``, vLLM defaults 6301 / 61005; host = its ``host_ip``). Request ids stay ours.

  - read: serial, like NIXL pull. P gets ``{do_remote_decode, transfer_id}``; its answer
    carries its own coordinates, block ids and the ``transfer_id``, copied into D's request. D
    reads the blocks, then tells P to free them. No coordinates in the config.
  - write: concurrent. Both legs share a ``transfer_id``; P gets D's coordinates (P writes
    into D's blocks once D tells P's notify port they are allocated), D gets P's. Every
    instance needs ``bootstrap_addr`` and ``notify_port``. Because P pushes to the D it was
    told, a decode retry on another instance runs colocated (``binds_decode``).
* ``pdext-read`` / ``pdext-write`` (our PdExtMoRIIOConnector).

  - read: exactly the NIXL-pull serial flow; P's marker carries ``transfer_mode: "read"``.
  - write: concurrent. The proxy mints ``transfer_id`` (uuid4 hex); P gets ``{do_remote_decode,
    transfer_mode: "write", transfer_id}``, D gets ``{do_remote_prefill, transfer_mode,
    transfer_id, remote_engine_id, remote_host, remote_port}`` with P's side channel
    (``bootstrap_addr``) and ``engine_id`` (or null). Prefill instances need
    ``bootstrap_addr``. A decode retry on another instance runs colocated (``binds_decode``).
    With a fleet key the proxy signs D's params, valid for ``WRITE_TTL_S``; a decode engine
    with the key refuses unsigned or expired ones.

Every shape is built with :mod:`vllm_pd_ext.transfer_params`, the one place their keys are
written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm_pd_ext.transfer_params import (
    READ,
    WRITE,
    MooncakeDecode,
    MooncakePrefill,
    MoRIIOWriteDecode,
    MoRIIOWritePrefill,
    NixlPrefill,
    PdExtWriteDecode,
    PrefillLeg,
)

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.config import InstanceConfig


def split_host_port(addr: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``; ValueError if not."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def http_base(addr: str) -> str:
    """``host:port`` as the base URL of an HTTP server there (IPv6 hosts in brackets)."""
    host, port = split_host_port(addr)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class MissingCoordinates(ValueError):
    """An instance lacks the fleet-config fields its protocol needs."""


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
    #: True when the prefill leg is told which decode instance receives the KV: a decode leg
    #: retried on another instance gets no KV and must run colocated.
    binds_decode: bool

    def missing(self, inst: InstanceConfig) -> list[str]:
        """The InstanceConfig fields this protocol needs on ``inst`` that are unset."""
        ...

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        """Both legs' params for a request split across ``prefill`` and ``decode``.

        Runs on the proxy's event loop; mints fresh ids each call. Raises
        ``MissingCoordinates`` when an instance lacks what the protocol needs.
        """
        ...


def _require(protocol: PDProtocol, *instances: InstanceConfig) -> None:
    for inst in instances:
        if missing := protocol.missing(inst):
            raise MissingCoordinates(
                f"instance {inst.label} needs {' and '.join(missing)} for protocol {protocol.name}"
            )


def _unset(inst: InstanceConfig, fields: tuple[str, ...]) -> list[str]:
    return [f for f in fields if getattr(inst, f) in (None, "")]


class NixlSerial:
    concurrent = False
    binds_decode = False

    def __init__(self, name: str):
        self.name = name

    def missing(self, inst: InstanceConfig) -> list[str]:
        return []

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        return LegPlan(prefill_params=NixlPrefill().params(), decode_params=None)


class MooncakeConcurrent:
    name = "mooncake"
    concurrent = True
    binds_decode = False

    def missing(self, inst: InstanceConfig) -> list[str]:
        return _unset(inst, ("engine_id", "bootstrap_addr")) if inst.role != "decode" else []

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        _require(self, prefill)
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        return LegPlan(
            prefill_params=MooncakePrefill(transfer_id).params(),
            decode_params=MooncakeDecode(
                transfer_id=transfer_id,
                remote_engine_id=prefill.engine_id,
                remote_bootstrap_addr=http_base(prefill.bootstrap_addr or ""),
            ).params(),
        )


class MoRIIORead:
    name = "moriio-read"
    concurrent = False
    binds_decode = False

    def missing(self, inst: InstanceConfig) -> list[str]:
        return []

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        return LegPlan(
            prefill_params=PrefillLeg(transfer_id=uuid.uuid4().hex).params(), decode_params=None
        )


def _moriio_leg(leg: type[MoRIIOWritePrefill], transfer_id: str, peer: InstanceConfig):
    """One MoRI-IO WRITE leg's params, naming ``peer``'s MoRI-IO coordinates (the decode side
    allocates its own blocks: none named)."""
    host, handshake_port = split_host_port(peer.bootstrap_addr or "")
    return leg(
        transfer_id=transfer_id,
        remote_engine_id=peer.engine_id,
        remote_host=host,
        remote_handshake_port=handshake_port,
        remote_notify_port=int(peer.notify_port or 0),
    ).params()


class MoRIIOWrite:
    name = "moriio-write"
    concurrent = True
    binds_decode = True

    def missing(self, inst: InstanceConfig) -> list[str]:
        return _unset(inst, ("bootstrap_addr", "notify_port"))

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        _require(self, prefill, decode)
        transfer_id = uuid.uuid4().hex
        return LegPlan(
            prefill_params=_moriio_leg(MoRIIOWritePrefill, transfer_id, decode),
            decode_params=_moriio_leg(MoRIIOWriteDecode, transfer_id, prefill),
        )


class PdExtRead:
    name = "pdext-read"
    concurrent = False
    binds_decode = False

    def missing(self, inst: InstanceConfig) -> list[str]:
        return []

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        return LegPlan(prefill_params=PrefillLeg(transfer_mode=READ).params(), decode_params=None)


class PdExtWrite:
    """With the fleet ``key``, the decode leg's params are signed."""

    name = "pdext-write"
    concurrent = True
    binds_decode = True

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key

    def missing(self, inst: InstanceConfig) -> list[str]:
        return _unset(inst, ("bootstrap_addr",)) if inst.role != "decode" else []

    def plan(self, request_id: str, prefill: InstanceConfig, decode: InstanceConfig) -> LegPlan:
        _require(self, prefill)
        host, port = split_host_port(prefill.bootstrap_addr or "")
        transfer_id = uuid.uuid4().hex
        return LegPlan(
            prefill_params=PrefillLeg(transfer_mode=WRITE, transfer_id=transfer_id).params(),
            decode_params=PdExtWriteDecode.build(transfer_id, prefill.engine_id, host, port).signed(
                self.key
            ),
        )


#: Every protocol by its name in ``ProxyConfig.protocol``, made with the fleet key (or None).
PROTOCOLS: dict[str, Callable[[bytes | None], PDProtocol]] = {
    "nixl-pull": lambda key: NixlSerial("nixl-pull"),
    "nixl-push": lambda key: NixlSerial("nixl-push"),
    "mooncake": lambda key: MooncakeConcurrent(),
    "moriio-read": lambda key: MoRIIORead(),
    "moriio-write": lambda key: MoRIIOWrite(),
    "pdext-read": lambda key: PdExtRead(),
    "pdext-write": PdExtWrite,
}

#: The protocols whose decode-leg params, built by the proxy, our connector checks against a
#: fleet-key signature.
SIGNED_DECODE_PARAMS = frozenset({"pdext-write"})


def make_protocol(name: str, key: bytes | None = None) -> PDProtocol:
    """The protocol named ``name`` (one of ``PROTOCOLS``); with the fleet ``key``, those in
    ``SIGNED_DECODE_PARAMS`` sign their decode params."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown P/D protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name](key)
