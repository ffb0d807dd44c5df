"""What our P/D connectors' scheduler side tells the worker side each step (plain dataclasses).

Both sides run in different processes; vLLM pickles the metadata object into each worker.
Block ids come per KV cache group (one tuple per group; a single group without vLLM's hybrid
allocator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

# The modes, re-exported for the worker side.
from vllm_pd_ext.transfer_params import READ as READ
from vllm_pd_ext.transfer_params import WRITE as WRITE


@dataclass(frozen=True)
class RemoteRef:
    """Where a prefill worker's side channel is, and the request id it knows."""

    engine_id: str
    host: str
    port: int
    request_id: str | None = None
    #: The prefill engine's tensor parallel size (READ answers say it); None: ours.
    tp_size: int | None = None


@dataclass(frozen=True)
class RecvSpec:
    """Decode side: load ``pairs[g]`` (local block, remote block) of group ``g`` of ``req_id``.

    READ: pull from the remote's blocks, then tell it it may free them. WRITE: offer our
    blocks to the remote under ``transfer_id`` and wait for its "written" notice.
    """

    req_id: str
    mode: str
    remote: RemoteRef
    pairs: tuple[tuple[tuple[int, int], ...], ...]
    local_block_ids: tuple[tuple[int, ...], ...]
    transfer_id: str | None = None
    lease_s: float | None = None  # READ: how long the prefill side holds after a renewal
    #: WRITE: the hash (``scheduler.prompt_hash``) of the prompt tokens this request loads; a
    #: "written" notice that names another prompt's hash is refused.
    prompt_hash: str | None = None
    #: The request's W3C ``traceparent`` (``tracing.py``: the ``kv_load`` span's parent);
    #: None when the engine does not trace.
    traceparent: str | None = None


@dataclass(frozen=True)
class SendSpec:
    """Prefill side: ``req_id`` finished; its ``block_ids`` are held for a decode instance.

    READ: hold them under a lease until the decode side says done. WRITE: they are being
    pushed under ``transfer_id``; free once the push ends.
    """

    req_id: str
    mode: str
    block_ids: tuple[tuple[int, ...], ...]
    transfer_id: str | None = None
    #: The request's ``traceparent`` (READ: the ``kv_hold`` span's parent), or None.
    traceparent: str | None = None


@dataclass(frozen=True)
class PushSpec:
    """Prefill side, WRITE mode: this step computes the last prompt tokens of ``req_id``;
    push each layer of ``block_ids`` as it is saved, then name ``prompt_hash`` (the prompt
    computed) in the "written" notice."""

    req_id: str
    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    prompt_hash: str
    #: The request's ``traceparent`` (the ``kv_push`` span's parent), or None.
    traceparent: str | None = None


@dataclass
class PdTransferMetadata(KVConnectorMetadata):
    """One step's instructions for the worker side."""

    recv: list[RecvSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    push: list[PushSpec] = field(default_factory=list)
    renew: list[RemoteRef] = field(default_factory=list)
    release: list[RemoteRef] = field(default_factory=list)
