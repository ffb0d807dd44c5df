"""Reading the proxy's traces in tests: the spans an ``InMemorySpanExporter`` holds, by
request."""

from __future__ import annotations

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
