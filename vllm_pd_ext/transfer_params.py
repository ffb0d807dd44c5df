"""The request fields that steer an engine's connectors, and who may set them.

vLLM hands a request's ``kv_transfer_params`` (and ``ec_transfer_params``, the encoder cache's)
to the KV connectors: where to load a prompt's KV from, where to push it, which blocks. The
fields reach the engine at the top level of a request or inside ``vllm_xargs`` (vLLM copies
those into ``sampling_params.extra_args``, where the connectors read them), so a client who can
set either can point an engine at any host. Only the proxy sets them; every part that takes a
client's request removes them (the proxy) or refuses them (the render server, in
``vllm_xargs``).

Imports nothing of ours: every part may use it.
"""

from __future__ import annotations

from typing import Any

#: The fields vLLM's connectors act on, top level or in ``vllm_xargs``/``extra_args``.
STEERING_FIELDS = ("kv_transfer_params", "ec_transfer_params")

#: What a fleet-key signature (:mod:`vllm_pd_ext.fleet_key`) covers in the params a decode
#: engine running our connector acts on: everything it acts on, and not the flags it flips in
#: place. READ: the prefill engine's answer, signed by that engine.
READ_SIGNED_FIELDS = (
    "transfer_mode",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "prompt_hash",
    "tp_size",
    "lease_s",
    "protocol",
)
#: WRITE: the decode leg's params, built and signed by the proxy.
WRITE_SIGNED_FIELDS = (
    "transfer_mode",
    "transfer_id",
    "remote_engine_id",
    "remote_host",
    "remote_port",
)


def without_steering(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (``vllm_xargs``, ``extra_args``) without the ``STEERING_FIELDS``."""
    return {k: v for k, v in fields.items() if k not in STEERING_FIELDS}
