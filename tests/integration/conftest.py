"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.skips import need
from tests.spans import OtlpCollector


@pytest.fixture(scope="module")
def client():
    """One pooled HTTP client per module, with a timeout long enough for CPU engines."""
    with httpx.Client(timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    """An OTLP/HTTP trace collector on loopback per module, for engines run with vLLM's
    ``--otlp-traces-endpoint`` (environment ``tests.spans.OTLP_HTTP``)."""
    need("opentelemetry.sdk", why="the otel extra: spans to an in-memory exporter")
    collector = OtlpCollector()
    yield collector
    collector.close()
