"""Schema fuzzing with schemathesis: bodies generated from the server's OpenAPI document never
give a 5xx, and every refusal is an OpenAI error body. Bounded: MAX_EXAMPLES per operation."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.skips import need

need("schemathesis", why="the fuzzer", allow_module_level=True)
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from vllm_pd_ext.render_server.app import create_app  # noqa: E402
from vllm_pd_ext.render_server.openapi import BODIES  # noqa: E402
from vllm_pd_ext.render_server.settings import RenderSettings  # noqa: E402

MAX_EXAMPLES = 40
OPERATIONS = [
    *((path, mode) for path in BODIES for mode in ("positive", "negative")),
    ("/health", "positive"),
    ("/v1/models", "positive"),
    ("/metrics", "positive"),
]


@pytest.fixture(scope="module")
def api_schema(tiny_qwen):
    app = create_app(RenderSettings(model=str(tiny_qwen), max_model_len=256, max_body_bytes=65536))
    with TestClient(app):  # run the lifespan once: the tokenizer loads here
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize(("path", "mode"), OPERATIONS)
def test_no_server_errors(api_schema, path, mode):
    """``positive``: bodies that follow the schema; ``negative``: bodies that break it."""
    post = path in BODIES
    operation = api_schema[path]["POST" if post else "GET"]
    if post:
        assert operation.body, "the document declares the route's request body"
    seen: list[int] = []

    @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call()
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text[:2000])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == response.status_code

    run()
    if post:  # the fuzzer ran, and (negative) its bodies were refused
        assert len(seen) >= MAX_EXAMPLES // 2
        if mode == "negative":
            assert 400 in seen
