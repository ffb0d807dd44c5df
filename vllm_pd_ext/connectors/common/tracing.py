"""Spans of our P/D connectors' KV transfers, under the trace of the engine request each serves.

vLLM hands a request's W3C trace headers to EngineCore only when the engine runs with
``--otlp-traces-endpoint`` (``AsyncLLM.add_request`` drops them otherwise), as
``Request.trace_headers``, which the scheduler-side connector sees in every hook. The
scheduler side copies the ``traceparent`` (:func:`traceparent_of`) into the worker side's
spec of each transfer (``RecvSpec``, ``PushSpec``, ``SendSpec``), and the worker side ends one
span per transfer, a child of that context (the proxy's ``decode`` or ``prefill`` leg span,
when the request came through a tracing proxy):

    kv_load   decode side, READ or WRITE: from the load's start to the blocks loaded, or
              its failure (the request is then recomputed or failed)
    kv_push   prefill side, WRITE: from the push's start (after the prefill step) to the
              "written" notice, or its failure (no decode offer within the lease, ...)
    kv_hold   prefill side, READ: the request's blocks held for a decode instance, from the
              request's end to their release, or to their lease's expiry

Attributes (``vllm_pd.kv.`` prefix): ``mode``, ``bytes`` (moved by this side; a WRITE's
decode side moves none itself), ``peer`` (the other engine's id, when known), ``outcome``
(ok, failed, released, expired, refused); ``server.address``/``server.port`` name the prefill
side channel a load went to. A failure also sets ``error.type`` (the exception's class) and
the span's error status.

The spans go to the process's global tracer provider, which vLLM sets in EngineCore and in
each worker process when tracing is on (``vllm.tracing.maybe_init_worker_tracer``). Without
a ``traceparent`` (tracing off, or a request that came without one) nothing here runs beyond
one ``is None`` test per transfer, and OpenTelemetry is never imported.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

logger = logging.getLogger(__name__)

#: The tracer's instrumentation scope.
SCOPE = "vllm_pd_ext.connectors"
#: The spans this module makes (see the module docstring).
SPANS = ("kv_load", "kv_push", "kv_hold")
#: A failure's message is cut to this many characters in the span's status.
MAX_MESSAGE = 300


def traceparent_of(request: Any) -> str | None:
    """The W3C ``traceparent`` vLLM kept for ``request`` (a ``vllm.v1.request.Request``);
    None when the engine does not trace or the request came without one."""
    headers = getattr(request, "trace_headers", None)  # vLLM releases without it: None
    return headers.get("traceparent") if headers else None


class TransferSpans:
    """Ends the connector's spans; one per worker. Thread-safe (transfer threads call it).

    ``provider``: the tracer provider to use (tests); default, the process's global one,
    looked up at the first span.
    """

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer: Tracer | None = None
        self._api: Any = None
        self._propagator: Any = None
        self._missing = False

    def _start(self) -> Tracer | None:
        if self._tracer is None and not self._missing:
            try:
                from opentelemetry import trace
                from opentelemetry.trace.propagation.tracecontext import (
                    TraceContextTextMapPropagator,
                )
            except ImportError:
                self._missing = True
                logger.warning("KV transfer spans need opentelemetry-api; none are made")
                return None
            self._api = trace
            self._propagator = TraceContextTextMapPropagator()
            provider = self._provider or trace.get_tracer_provider()
            self._tracer = provider.get_tracer(SCOPE)
        return self._tracer

    def record(
        self,
        name: str,
        traceparent: str,
        start_ns: int,
        *,
        outcome: str,
        error: BaseException | None = None,
        end_ns: int | None = None,
        address: tuple[str, int] | None = None,
        **attributes: Any,
    ) -> None:
        """End span ``name``, begun at ``start_ns`` (``time.time_ns()``), as a child of
        ``traceparent``; ``attributes`` go under ``vllm_pd.kv.`` (None values are left
        out); ``error``, the exception that failed it, sets ``error.type`` (its class) and the
        error status (its message). Never raises for a bad ``traceparent`` (the span
        is then a root of its own)."""
        tracer = self._start()
        if tracer is None:
            return
        api = self._api
        attrs = {f"vllm_pd.kv.{k}": v for k, v in attributes.items() if v is not None}
        attrs["vllm_pd.kv.outcome"] = outcome
        if address is not None:
            attrs["server.address"], attrs["server.port"] = address
        span = tracer.start_span(
            name,
            context=self._propagator.extract({"traceparent": traceparent}),
            kind=api.SpanKind.INTERNAL if name == "kv_hold" else api.SpanKind.CLIENT,
            start_time=start_ns,
            attributes=attrs,
        )
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(api.Status(api.StatusCode.ERROR, str(error)[:MAX_MESSAGE]))
        span.end(time.time_ns() if end_ns is None else end_ns)
