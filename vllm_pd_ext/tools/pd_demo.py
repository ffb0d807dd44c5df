"""One real prefill/decode round trip on a tiny model: the README's main job.

Starts a prefill and a decode ``vllm serve`` with vLLM's NixlConnector on CPU (one core
each), sends one greedy request colocated (prefill instance alone) and then split (prefill
leg with ``max_tokens=1``, decode leg with the prefill's ``kv_transfer_params``), and prints
TTFT for both, how many prompt tokens the decode side received over KV transfer, and whether
the two outputs are token-for-token equal. Exit status 0 only when both hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from vllm_pd_ext.transfer_params import NixlPrefill
from vllm_pd_ext.util.busy_threads import summary
from vllm_pd_ext.util.prom import EXTERNAL_KV, PROMPT_TOKENS_BY_SOURCE
from vllm_pd_ext.util.tiny_model import MODELS, ensure_model
from vllm_pd_ext.util.vllm_process import VllmServer, free_port, start_vllm_serve

#: The prefill leg's params: NIXL's marker (our connector reads it as a READ).
PREFILL_PARAMS = NixlPrefill().params()
NIXL_CPU = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


WARMUP_ROUNDS = 3
MEASURED_ROUNDS = 5


SEED_TEXT = (
    "Disaggregated serving runs the prompt on one instance and the generation on another. "
    "The prefill instance computes the key and value cache for every prompt token, then the "
    "decode instance pulls those blocks and continues from the first generated token. "
)


@dataclass
class DemoResult:
    model: str
    prompt_tokens: int
    max_tokens: int
    colocated_ttft_ms: float
    pd_ttft_ms: float
    prefill_leg_ms: float
    decode_first_token_ms: float
    decode_external_kv_tokens: int
    decode_local_compute_tokens: int
    colocated_token_ids: list[int]
    pd_token_ids: list[int]

    @property
    def outputs_equal(self) -> bool:
        return self.colocated_token_ids == self.pd_token_ids

    @property
    def kv_received(self) -> bool:
        return self.decode_external_kv_tokens >= self.prompt_tokens - 1

    @property
    def ok(self) -> bool:
        return self.outputs_equal and self.kv_received


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: Path):
    """``model_dir``'s tokenizer, loaded once per process (a load costs seconds on a busy host)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_prompt_ids(model_dir: Path, num_tokens: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of plain English text for ``model_dir``'s tokenizer."""
    tokenizer = _tokenizer(Path(model_dir))
    ids: list[int] = []
    text = SEED_TEXT
    while len(ids) < num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
        text += SEED_TEXT
    return ids[:num_tokens]


def completion_body(server: VllmServer, prompt_ids: list[int], max_tokens: int) -> dict:
    return {
        "model": server.served_name,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def stream_completion(
    client: httpx.Client, server: VllmServer, body: dict
) -> tuple[list[int], float]:
    """Stream a completion; return (generated token ids, seconds to the first token)."""
    start = time.perf_counter()
    first: float | None = None
    token_ids: list[int] = []
    payload = {**body, "stream": True}
    with client.stream("POST", f"{server.base_url}/v1/completions", json=payload) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{server.base_url} answered {resp.status_code}: {resp.text}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"{server.base_url} stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                if new and first is None:
                    first = time.perf_counter() - start
                token_ids.extend(new)
    if first is None:
        raise RuntimeError(f"{server.base_url} streamed no tokens")
    return token_ids, first


def prefill_leg(client: httpx.Client, server: VllmServer, body: dict) -> tuple[dict, float]:
    """The prefill leg: one token, KV kept for a remote decode; return its params and time."""
    payload = {**body, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
    start = time.perf_counter()
    resp = client.post(f"{server.base_url}/v1/completions", json=payload)
    elapsed = time.perf_counter() - start
    resp.raise_for_status()
    params = resp.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError("prefill instance returned no kv_transfer_params")
    return params, elapsed


def _progress(message: str) -> None:
    print(f"[vllm-pd demo] {message}", file=sys.stderr, flush=True)


def run_pd_round_trip(
    prefill: VllmServer, decode: VllmServer, model_dir: Path, prompt_tokens: int, max_tokens: int
) -> DemoResult:
    """Colocated request on ``prefill``, then the same request split across both."""
    prompt_ids = make_prompt_ids(model_dir, prompt_tokens)
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        body = completion_body(prefill, prompt_ids, max_tokens)
        colocated_ids, colocated_ttft = stream_completion(client, prefill, body)

        external_before = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV)
        local_before = decode.metric(PROMPT_TOKENS_BY_SOURCE, source="local_compute")
        params, prefill_s = prefill_leg(client, prefill, body)
        decode_body = {
            **completion_body(decode, prompt_ids, max_tokens),
            "kv_transfer_params": params,
        }
        pd_ids, decode_first = stream_completion(client, decode, decode_body)
        external = decode.metric(PROMPT_TOKENS_BY_SOURCE, **EXTERNAL_KV) - external_before
        local = decode.metric(PROMPT_TOKENS_BY_SOURCE, source="local_compute") - local_before
    return DemoResult(
        model=prefill.served_name,
        prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        colocated_ttft_ms=colocated_ttft * 1e3,
        pd_ttft_ms=(prefill_s + decode_first) * 1e3,
        prefill_leg_ms=prefill_s * 1e3,
        decode_first_token_ms=decode_first * 1e3,
        decode_external_kv_tokens=int(external),
        decode_local_compute_tokens=int(local),
        colocated_token_ids=colocated_ids,
        pd_token_ids=pd_ids,
    )


def start_nixl_pair(model_dir: Path, log_dir: Path) -> tuple[VllmServer, VllmServer]:
    """A prefill (core 0) and a decode (core 1) instance with NixlConnector on CPU."""
    servers = []
    for role, core in (("prefill", 0), ("decode", 1)):
        servers.append(
            start_vllm_serve(
                model_dir,
                log_path=log_dir / f"{role}.log",
                cpu_core=core,
                kv_transfer_config=NIXL_CPU,
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                extra_args=["--no-enable-prefix-caching"],
            )
        )
    return servers[0], servers[1]


def format_result(result: DemoResult, rounds: list[DemoResult]) -> str:
    """The report: median round's timings, correctness over every round."""
    equal = sum(r.outputs_equal for r in rounds)
    received = sum(r.kv_received for r in rounds)
    verdict = "yes" if equal == len(rounds) else "NO"
    return "\n".join(
        [
            f"model: {result.model}, prompt {result.prompt_tokens} tokens, "
            f"{result.max_tokens} output tokens, greedy; median of {len(rounds)} rounds",
            f"TTFT colocated:       {result.colocated_ttft_ms:8.1f} ms",
            f"TTFT P/D:             {result.pd_ttft_ms:8.1f} ms "
            f"(prefill leg {result.prefill_leg_ms:.1f} ms + decode first token "
            f"{result.decode_first_token_ms:.1f} ms)",
            f"KV tokens received by decode: {result.decode_external_kv_tokens} of "
            f"{result.prompt_tokens} prompt tokens "
            f"(recomputed locally: {result.decode_local_compute_tokens})",
            f"prompt KV received over the wire in {received} of {len(rounds)} rounds",
            f"P/D output equals colocated: {verdict} ({equal} of {len(rounds)} rounds)",
            "note: both instances share this machine's CPU cores; the timings show the "
            "mechanism, not the GPU effect of splitting.",
        ]
    )


def run_demo(
    model: str, prompt_tokens: int, max_tokens: int, log_dir: Path, as_json: bool = False
) -> int:
    """The ``vllm-pd demo`` command. Returns the process exit status."""
    model_dir = ensure_model(model) if model in MODELS else Path(model)
    _progress(f"model: {model_dir}")
    _progress("starting prefill (core 0) and decode (core 1) vllm serve with NixlConnector...")
    start = time.monotonic()
    prefill, decode = start_nixl_pair(model_dir, log_dir)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        _progress(f"both healthy after {time.monotonic() - start:.0f}s; warming up")
        for name, server in (("prefill", prefill), ("decode", decode)):
            if calmed := server.calm_idle_pollers():
                _progress(f"{name}: {summary(calmed)}")
        # The first requests pay one-off costs (NIXL handshake, memory registration, kernel
        # warm-up; 0.3-1.5 s on CPU): warm up at the same length so the figures shown are
        # the steady state.
        for _ in range(WARMUP_ROUNDS):
            run_pd_round_trip(prefill, decode, model_dir, prompt_tokens, 2)
        _progress(f"measuring {MEASURED_ROUNDS} rounds")
        rounds = [
            run_pd_round_trip(prefill, decode, model_dir, prompt_tokens, max_tokens)
            for _ in range(MEASURED_ROUNDS)
        ]
    finally:
        _progress(f"stopping servers (logs in {log_dir})")
        prefill.stop()
        decode.stop()
    result = median_round(rounds)
    ok = all(r.ok for r in rounds)
    if as_json:
        print(
            json.dumps(
                {
                    **asdict(result),
                    "rounds": len(rounds),
                    "outputs_equal": all(r.outputs_equal for r in rounds),
                    "kv_received": all(r.kv_received for r in rounds),
                    "ok": ok,
                }
            )
        )
    else:
        print(format_result(result, rounds))
    return 0 if ok else 1


def median_round(rounds: list[DemoResult]) -> DemoResult:
    """The round with the median P/D TTFT, carrying the median colocated TTFT."""
    middle = sorted(rounds, key=lambda r: r.pd_ttft_ms)[len(rounds) // 2]
    colocated = statistics.median(r.colocated_ttft_ms for r in rounds)
    return dataclasses.replace(middle, colocated_ttft_ms=colocated)
