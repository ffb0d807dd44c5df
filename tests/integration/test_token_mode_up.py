"""Token mode end to end: `vllm-pd up --mode token` brings up render + 1P + 1D + proxy; greedy
output through it (split and colocated, completions and chat, streaming and not) equals text
mode's (the engine's own OpenAI routes); SIGINT leaves no process behind."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import requires_vllm
from tests.integration.fleet_helpers import Trap, running_up
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE, parse_metrics

pytestmark = [pytest.mark.integration, requires_vllm]


def _stream_text(url: str, body: dict) -> tuple[str, dict | None]:
    text, usage = "", None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    for event in raw.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        data = json.loads(event[6:])
        assert "error" not in data, data
        usage = data.get("usage") or usage
        for choice in data["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, usage


def _client_cannot_steer_the_decode_connector(proxy: str, decode_url: str, body: dict) -> None:
    """A client's kv_transfer_params in vllm_xargs (vLLM copies them into extra_args, where
    the connectors read them), pointing the decode engine at a trap: the trap is never
    contacted, the decode side loads nothing external, and the answer is the colocated one."""
    trap = Trap()
    try:
        steer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "trap",
            "remote_request_id": "someone-elses-request",
            "remote_block_ids": [0, 1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": trap.port,
            "transfer_mode": "read",
            "tp_size": 1,
        }
        short = {**body, "prompt": body["prompt"][:3]}
        want = httpx.post(f"{decode_url}/v1/completions", json=short, timeout=120).json()
        external = _external_tokens(decode_url)
        attack = {**short, "vllm_xargs": {"kv_transfer_params": steer}}
        resp = httpx.post(f"{proxy}/completions", json=attack, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert _external_tokens(decode_url) == external
        assert trap.accepted == 0
    finally:
        trap.close()


def _external_tokens(url: str) -> float:
    metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    return metrics.total(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)


@pytest.mark.parametrize("connector", ["nixl", "pdext"])
def test_up_token_mode_equals_text_mode(model_cache, tiny_llama, tmp_path, connector):
    args = ["--mode", "token", "--connector", connector]
    args += ["--min-split-prompt-tokens", "32", "--no-cost-model"]
    with running_up(args, tmp_path, model_cache) as up:
        banner = up.banner
        assert "token mode" in banner and f"connector {connector}" in banner
        decode_url, render_url = up.parts["decode-0"], up.parts["render-0"]
        assert len(up.children) >= 4  # render server, two engines (and their workers), proxy
        model = up.model
        proxy = f"{up.proxy}/v1"

        long_prompt = make_prompt_ids(tiny_llama, 120)
        greedy = {"model": model, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        # each path its own cache_salt: a prompt the decode engine already holds would be
        # served colocated there (cached_on_decode: up routes on the engines' KV events)
        salted = {"direct": {"cache_salt": "direct"}, "whole": {"cache_salt": "whole"}}
        salted["stream"] = {"cache_salt": "stream"}
        for prompt in (long_prompt, [long_prompt[0], long_prompt[1], long_prompt[2]]):
            body = {**greedy, "prompt": prompt, "return_token_ids": True}
            text_mode = httpx.post(
                f"{decode_url}/v1/completions", json={**body, **salted["direct"]}, timeout=120
            )
            resp = httpx.post(f"{proxy}/completions", json={**body, **salted["whole"]}, timeout=120)
            assert resp.status_code == 200, resp.text
            got, want = resp.json()["choices"][0], text_mode.json()["choices"][0]
            assert got["token_ids"] == want["token_ids"]
            assert got["text"] == want["text"]
            assert resp.json()["usage"]["prompt_tokens"] == len(prompt)
            streamed, usage = _stream_text(
                f"{proxy}/completions",
                {**body, **salted["stream"], "stream_options": {"include_usage": True}},
            )
            assert streamed == want["text"]
            assert usage is not None and usage["completion_tokens"] == 12

        words = " ".join(f"item{i}" for i in range(80))
        chat = {**greedy, "messages": [{"role": "user", "content": f"List these: {words}"}]}
        want = httpx.post(
            f"{decode_url}/v1/chat/completions", json={**chat, **salted["direct"]}, timeout=120
        ).json()
        got = httpx.post(
            f"{proxy}/chat/completions", json={**chat, **salted["whole"]}, timeout=120
        ).json()
        content = want["choices"][0]["message"]["content"]
        assert got["choices"][0]["message"]["content"] == content
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        stream = {**chat, **salted["stream"]}
        assert _stream_text(f"{proxy}/chat/completions", stream)[0] == content

        bad = httpx.post(f"{proxy}/completions", json={**body, "suffix": "x"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"

        metrics = httpx.get(f"{up.proxy}/metrics").text
        # the launcher's warm-up, long completion x2, chat x2 split; the 3-token prompt x2
        # colocated
        assert 'vllm_pd_decisions_total{decision="split",reason="split"} 5.0' in metrics
        assert 'vllm_pd_decisions_total{decision="colocated"' in metrics
        # every streamed answer went over one streaming derender call, none per event
        assert "vllm_pd_derender_per_event_total{" not in metrics
        served = parse_metrics(httpx.get(f"{render_url}/metrics", timeout=30).text)
        for route, n in (
            ("completion_derender_stream", 2),
            ("chat_derender_stream", 1),
            ("completion_derender", 3),  # the warm-up and two whole answers: none per event
            ("chat_derender", 1),
        ):
            assert served.total("vllm_pd_render_requests_total", route=route) == n, route

        _client_cannot_steer_the_decode_connector(proxy, decode_url, body)
