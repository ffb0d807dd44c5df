"""The relay's whole answer: what starlette's JSONResponse would have sent, byte for byte."""

from __future__ import annotations

import pytest
from fastapi.responses import JSONResponse

from vllm_pd_ext.proxy.relay import JSONAnswer

ANSWERS = [
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo ✓", "logprobs": None}]},
    {"usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}, "x": [1.5, True]},
    {},
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_json_answer_has_the_body_and_head_of_starlettes_json_response(answer):
    ours = JSONAnswer(answer, "req-7")
    theirs = JSONResponse(answer, headers={"X-Request-Id": "req-7"})
    assert (ours.status_code, ours.body, ours.raw_headers) == (
        theirs.status_code,
        theirs.body,
        theirs.raw_headers,
    )
    assert ours.background is None


def test_a_json_answer_refuses_what_json_response_refuses():
    with pytest.raises(ValueError):
        JSONResponse({"x": float("nan")})
    with pytest.raises(ValueError):
        JSONAnswer({"x": float("nan")}, "req-7")
