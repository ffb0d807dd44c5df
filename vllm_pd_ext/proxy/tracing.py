"""OpenTelemetry traces of the proxy's requests (the ``otel`` extra); off by default.

With ``otlp_traces_endpoint`` set (``--otlp-traces-endpoint``, as vLLM names its own), every
completion request the proxy admits is one trace:

    request         SERVER: arrival to last byte; route, decision (split or colocated) and
                    its reason, outcome, the instances that served it
    ├ render        token mode: the render call
    ├ prefill       CLIENT, one per prefill attempt: instance, HTTP status or error
    ├ decode        CLIENT, one per decode attempt: instance, attempt; a retried one ends
                    in error; the event ``first_token``
    ├ transfer_wait a split stream: the prefill leg's end to the first token (the KV
                    transfer and the decode side's admission)
    ├ decode_stream a stream: the first token to the end
    └ derender      token mode: the answer's derender call(s)

A decision changed after it was made (prefill failed, a stall) is a ``fallback`` event on the
request span, with its reason; an answer whose engine broke part-way is a ``migration`` event
there (where it went, after how many tokens, or why it did not). Each engine request carries
the W3C ``traceparent`` of its leg's span, so an engine run with vLLM's
``--otlp-traces-endpoint`` puts its own spans under that leg; render calls carry the request
span's. A client's ``traceparent`` makes the request span its child.

Off, nothing here runs: ``Call.trace`` stays None, each hook in the request path is one
``is None`` test, no span object is made and the SDK is never imported.

The hooks: ``service.py`` (the trace's start, render), ``call.py`` (decisions, outcome,
end), ``prefill.py`` and ``decode.py`` (each leg's span and header), ``relay.py`` (first
token), ``token_mode.py`` (derender, render's header). All of it runs on the proxy's event
loop (``first_token`` may run in an engine connection's callback).
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from vllm_pd_ext.util.logs import bind_request

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from vllm_pd_ext.proxy.decision import Decision
    from vllm_pd_ext.proxy.fleet import Instance
    from vllm_pd_ext.proxy.request import RequestContext

#: The ``service.name`` of the proxy's spans.
SERVICE_NAME = "vllm-pd-proxy"
#: The tracer's instrumentation scope.
SCOPE = "vllm_pd_ext.proxy"
#: The child spans of a request span (see the module docstring).
SPANS = ("render", "prefill", "decode", "transfer_wait", "decode_stream", "derender")
#: What to install when the SDK is missing.
MISSING = "tracing needs the OpenTelemetry SDK and OTLP exporter: pip install 'vllm-pd-ext[otel]'"
#: vLLM's choice of OTLP transport for the same endpoint flag (grpc, or http/protobuf).
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

#: The trace of the request the current task serves (set only when tracing is on).
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("vllm_pd_trace", default=None)


def current() -> RequestTrace | None:
    """The trace of the request this task serves; None when tracing is off."""
    return _CURRENT.get()


class Tracing:
    """The proxy's tracer, one per ``ProxyService`` when tracing is on."""

    def __init__(self, provider: TracerProvider):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)
        self.api = trace
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_exporter(cls, exporter: SpanExporter, *, batch: bool = True) -> Tracing:
        """Spans go to ``exporter``: in batches from a background thread, or (``batch``
        False: tests) each as it ends."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as exc:
            raise RuntimeError(MISSING) from exc
        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider)

    @classmethod
    def to_endpoint(cls, endpoint: str) -> Tracing:
        """Spans go to the OTLP collector at ``endpoint``, over gRPC unless
        ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says ``http/protobuf`` (as vLLM does)."""
        protocol = os.environ.get(PROTOCOL_ENV, "grpc")
        exporter: SpanExporter
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as Grpc,
                )

                exporter = Grpc(endpoint=endpoint, insecure=True)
            elif protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as Http,
                )

                exporter = Http(endpoint=endpoint)
            else:
                raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: grpc or http/protobuf")
        except ImportError as exc:
            raise RuntimeError(MISSING) from exc
        return cls.to_exporter(exporter)

    def start(self, ctx: RequestContext, traceparent: bytes | None) -> RequestTrace:
        """The trace of the request ``ctx``, begun when it arrived; ``traceparent``: the
        client's header, if it sent one. Binds the trace to this task (derender, logs)."""
        parent = None
        if traceparent is not None:
            parent = self.propagator.extract({"traceparent": traceparent.decode("latin-1")})
        trace = RequestTrace(self, ctx, parent)
        _CURRENT.set(trace)
        bind_request(ctx.request_id, trace.trace_id)
        return trace

    def shutdown(self) -> None:
        """Export what is pending and stop (the proxy's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans: the request span, and its children while they are open."""

    __slots__ = (
        "_clock",
        "_decode",
        "_decoded",
        "_open",
        "_parent",
        "_stream",
        "root",
        "trace_id",
        "tracing",
    )

    def __init__(self, tracing: Tracing, ctx: RequestContext, parent: Any):
        self.tracing = tracing
        #: the wall clock (ns) less perf_counter's: every time here is a perf_counter
        #: reading on the wall clock, so the spans' order is the monotonic clock's
        self._clock = time.time_ns() - int(time.perf_counter() * 1e9)
        api = tracing.api
        attributes: dict[str, Any] = {
            "vllm_pd.request_id": ctx.request_id,
            "vllm_pd.route": ctx.route,
            "vllm_pd.stream": ctx.stream,
            "vllm_pd.est_prompt_tokens": ctx.est_prompt_tokens,
        }
        if ctx.client_request_id:
            attributes["vllm_pd.client_request_id"] = ctx.client_request_id
        self.root: Span = tracing.tracer.start_span(
            "request",
            context=parent,
            kind=api.SpanKind.SERVER,
            start_time=self._ns(ctx.received),
            attributes=attributes,
        )
        self._parent = api.set_span_in_context(self.root)
        self.trace_id = format(self.root.get_span_context().trace_id, "032x")
        self._open: list[Span] = []
        self._decode: Span | None = None
        self._decoded = 0  # decode attempts so far
        self._stream: Span | None = None

    # -- spans -------------------------------------------------------------------------

    def _ns(self, perf: float | None = None) -> int:
        """``perf`` (a perf_counter reading; default now) on the wall clock, in ns."""
        return int((time.perf_counter() if perf is None else perf) * 1e9) + self._clock

    def child(self, name: str, start: float | None = None, **attributes: Any) -> Span:
        """A span under the request's, begun now (or at ``start``, a perf_counter reading);
        ended by ``done``, or when the request ends."""
        span = self.tracing.tracer.start_span(
            name,
            context=self._parent,
            start_time=self._ns(start),
            attributes={f"vllm_pd.{k}": v for k, v in attributes.items()},
        )
        self._open.append(span)
        return span

    def done(
        self,
        span: Span | None,
        error: str | None = None,
        end: float | None = None,
        **attributes: Any,
    ) -> None:
        """End ``span`` (at ``end``, a perf_counter reading, else now), failed with
        ``error`` when given; once (later calls, and None, do nothing)."""
        if span is None or span not in self._open:
            return
        self._open.remove(span)
        for key, value in attributes.items():
            span.set_attribute(f"vllm_pd.{key}", value)
        if error is not None:
            api = self.tracing.api
            span.set_attribute("error.type", error)
            span.set_status(api.Status(api.StatusCode.ERROR, error))
        span.end(self._ns(end))

    def traceparent(self, span: Span | None = None) -> str:
        """The W3C ``traceparent`` of ``span`` (default: the request span)."""
        carrier: dict[str, str] = {}
        context = self._parent if span is None else self.tracing.api.set_span_in_context(span)
        self.tracing.propagator.inject(carrier, context=context)
        return carrier["traceparent"]

    # -- the request path's hooks ------------------------------------------------------

    def leg(self, role: str, inst: Instance, headers: dict[str, str]) -> Span:
        """A leg's attempt on ``inst`` begins: its span, whose ``traceparent`` is added to
        ``headers`` (the engine request's). A decode attempt ends the one before it: failed
        (a retry elsewhere), or done (on the same instance: a guarded leg's second step)."""
        api = self.tracing.api
        span = self.tracing.tracer.start_span(
            role,
            context=self._parent,
            kind=api.SpanKind.CLIENT,
            start_time=self._ns(),
            attributes={"vllm_pd.instance": inst.label, "server.address": inst.url},
        )
        self._open.append(span)
        self.root.set_attribute(f"vllm_pd.{role}.instance", inst.label)
        if role == "decode":
            self._decoded += 1
            span.set_attribute("vllm_pd.attempt", self._decoded)
            last = self._decode
            if last is not None:
                same = getattr(last, "attributes", {}).get("server.address") == inst.url
                self.done(last, None if same else "retried")
            self._decode = span
        headers["traceparent"] = self.traceparent(span)
        return span

    def leg_done(
        self, span: Span | None, status: int | None = None, error: str | None = None
    ) -> None:
        """A prefill attempt answered (HTTP ``status``) or failed (``error``)."""
        if span is not None and status is not None:
            span.set_attribute("http.response.status_code", status)
            if status != 200 and error is None:
                error = f"HTTP {status}"
        self.done(span, error)

    def decided(self, decision: Decision) -> None:
        """The request is served as ``decision`` says: the first decision, or a fallback."""
        root = self.root
        attributes = getattr(root, "attributes", None) or {}
        if "vllm_pd.decision" in attributes:
            root.add_event(
                "fallback", {"vllm_pd.reason": decision.reason, "vllm_pd.to": decision.label}
            )
        root.set_attribute("vllm_pd.decision", decision.label)
        root.set_attribute("vllm_pd.reason", decision.reason)

    def migrated(
        self, outcome: str, failed: str, reason: str, to: str | None, after: int | None
    ) -> None:
        """An answer that broke on ``failed`` (``reason``) moved on to ``to`` after ``after``
        tokens, or not (``outcome``, migration.py's): a ``migration`` event."""
        attributes: dict[str, Any] = {
            "vllm_pd.outcome": outcome,
            "vllm_pd.from": failed,
            "vllm_pd.reason": reason,
        }
        if to is not None:
            attributes["vllm_pd.to"] = to
        if after is not None:
            attributes["vllm_pd.after_tokens"] = after
        self.root.add_event("migration", attributes)

    def first_token(self, now: float, prefill_done: float | None) -> None:
        """A stream's first token went to the client at ``now`` (perf_counter);
        ``prefill_done``: when a split's prefill leg ended."""
        if self._decode is not None:
            self._decode.add_event("first_token", timestamp=self._ns(now))
        if prefill_done is not None:
            self.done(self.child("transfer_wait", start=prefill_done), end=now)
        self._stream = self.child("decode_stream", start=now)

    def finished(self, outcome: str, detail: str | None) -> None:
        """The request's outcome (``Call.finish``)."""
        root = self.root
        root.set_attribute("vllm_pd.outcome", outcome)
        if outcome not in ("ok", "client_gone"):
            api = self.tracing.api
            root.set_status(api.Status(api.StatusCode.ERROR, detail or outcome))

    def end(self) -> None:
        """The request's last byte is out (``Call.close``): every span still open ends."""
        for span in list(self._open):
            self.done(span)
        self.root.end(self._ns())
