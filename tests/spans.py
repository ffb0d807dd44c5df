"""Reading the proxy's traces in tests: the spans an ``InMemorySpanExporter`` holds, by
request."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import pytest


def request_trace(exporter: Any, request_id: str, timeout: float = 30.0) -> dict[str, list]:
    """The finished spans of the trace whose request span is ``request_id``'s, by name
    (``request`` holds that span), once it has ended (every child ends before it). Fails
    unless each other span of the trace is a child of the request span."""
    deadline = time.monotonic() + timeout
    while True:
        spans = exporter.get_finished_spans()
        roots = [
            s
            for s in spans
            if s.name == "request" and s.attributes.get("vllm_pd.request_id") == request_id
        ]
        if roots:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"no request span for {request_id}: {[s.name for s in spans]}")
        time.sleep(0.02)
    (root,) = roots
    trace_id = root.context.trace_id
    out: dict[str, list] = {}
    for span in spans:
        if span.context.trace_id == trace_id:
            out.setdefault(span.name, []).append(span)
            if span is not root:
                assert span.parent is not None and span.parent.span_id == root.context.span_id
    return out


def traceparent_of(span: Any) -> str:
    """The ``traceparent`` header that names ``span`` as the parent."""
    ctx = span.context
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class OtlpCollector:
    """An OTLP/HTTP trace collector on 127.0.0.1 (``url``): keeps the spans of every export
    request (protobuf ``Span`` messages) in ``spans``."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        spans: list = []
        self.spans = spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: The environment of an engine that traces to an ``OtlpCollector`` (vLLM's exporter over
#: OTLP/HTTP, which the collector speaks).
OTLP_HTTP = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


def engine_spans(
    collector: OtlpCollector, parent, timeout: float = 60.0, name: str | None = None
) -> list:
    """The spans (called ``name``, when given) the engines exported under the proxy's span
    ``parent`` (vLLM exports in batches: polled)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s
            for s in list(collector.spans)
            if s.trace_id == parent.context.trace_id.to_bytes(16, "big")
            and s.parent_span_id == parent.context.span_id.to_bytes(8, "big")
            and (name is None or s.name == name)
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
