"""What each leg sends the engines, in text mode (OpenAI bodies) and token mode (generate).

* the one-token leg: the prefill leg, and a drain (a decode instance pulling an abandoned
  prefill's KV so the prefill side frees it): one token, not streamed, no ``min_tokens`` or
  ``stream_options``, carrying the leg's ``kv_transfer_params``;
* the decode leg: the client's request as it came (its own bytes when nothing was changed),
  plus the decode side's ``kv_transfer_params`` when the request was split.
"""

from __future__ import annotations

from typing import Any

from vllm_pd_ext.proxy.request import RequestContext
from vllm_pd_ext.proxy.token_mode import generate_leg

#: Fields the one-token leg drops; the decode leg sends the client's originals.
ONE_TOKEN_DROPPED = ("stream_options", "min_tokens")


def one_token_body(ctx: RequestContext, params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's (or a drain's) body: one token, not streamed, carrying ``params``."""
    if ctx.tokens is not None:
        return generate_leg(ctx.tokens.generate, params, max_tokens=1)
    out = {k: v for k, v in ctx.body.items() if k not in ONE_TOKEN_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(params)
    return out


def decode_body(ctx: RequestContext, params: dict[str, Any] | None) -> dict[str, Any] | bytes:
    """The decode leg's body: the engine body with ``params``, or, colocated in text mode,
    the client's bytes as they came (not encoded again)."""
    if params is not None:
        return {**ctx.engine_body, "kv_transfer_params": params}
    if ctx.tokens is None and ctx.raw is not None:
        return ctx.raw
    return ctx.engine_body
