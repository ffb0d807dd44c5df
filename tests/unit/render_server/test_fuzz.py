"""Seeded, bounded fuzzing of every route: no body a client can send gives a 5xx."""

from __future__ import annotations

import copy
import random

import pytest
from fastapi.testclient import TestClient

from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.settings import RenderSettings

SEEDS = {
    "/v1/chat/completions/render": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "none",
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["x"],
    },
    "/v1/completions/render": {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1},
    "/v1/chat/completions/derender": {
        "generate_response": {"choices": [{"token_ids": [13048, 1052], "finish_reason": "stop"}]},
        "prompt_token_ids": [1, 2],
    },
    "/v1/completions/derender": {
        "stream": True,
        "generate_chunk": {"choices": [{"token_ids": [13048]}]},
        "stream_state": {"prev_tokens": ["a", "b"], "prefix_offset": 0, "read_offset": 2},
    },
}
ODD_VALUES = [
    None,
    -1,
    0,
    2**70,
    -(2**70),
    1.5,
    float("1e308"),
    "",
    "x" * 300,
    "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
    [],
    [None],
    [-5, 10**9],
    {},
    {"a": [1, {"b": None}]},
    True,
]


def _mutate(rng: random.Random, value):
    if isinstance(value, dict) and value and rng.random() < 0.7:
        out = dict(value)
        key = rng.choice([*out, "unknown_field", "stream"])
        out[key] = _mutate(rng, out.get(key))
        if rng.random() < 0.2:
            out.pop(rng.choice(list(out)), None)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        items = list(value)
        i = rng.randrange(len(items))
        items[i] = _mutate(rng, items[i])
        return items
    return copy.deepcopy(rng.choice(ODD_VALUES))


@pytest.fixture(scope="module")
def client(tiny_qwen):
    with TestClient(create_app(RenderSettings(model=str(tiny_qwen), max_model_len=256))) as c:
        yield c


@pytest.mark.parametrize("route", list(SEEDS))
def test_fuzzed_bodies_never_5xx(client, route):
    rng = random.Random(route)
    for _ in range(150):
        body = SEEDS[route]
        for _ in range(rng.randint(1, 3)):
            body = _mutate(rng, body)
        resp = client.post(route, json=body)
        assert resp.status_code < 500, (body, resp.text)
        if resp.status_code != 200:
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == resp.status_code and len(err["message"]) <= 2000
