"""Streaming derender as token mode does it: this tree's render server vs a baseline.

Per event (vLLM's wire format, and what the baseline always gets), each engine event is one
render-server call carrying the generate chunk, the ``stream_state``, the prompt's token ids
and the client's request. Over our streaming call (``vllm_pd_ext.derender_stream``, what
``ours`` gets unless ``--per-event``), the context goes once and each event is one line of
the call's body. This measures each event from the proxy's side with the proxy's own
:class:`~vllm_pd_ext.proxy.token_mode.DerenderStream` and :class:`RenderTier` (one-token engine
events, as the engine writes them), against two ``vllm-pd render`` servers of tiny-llama:
``ours`` (this tree) and ``baseline`` (``--baseline`` git ref, default ``main``, exported with
``git archive``), alternating server every stream. No engine runs.

Per server and prompt length: the proxy-side latency of each event (``DerenderStream.feed``
of one event: p50/p90/p99; keys say ``call``) and the proxy's CPU for it (``thread_time``:
encoding, the HTTP client, decoding the answer), the server's own time per event (its
``/metrics``), the server process group's CPU per event (user+sys, ``/proc``), the request
bytes of an event. The derendered text of each stream must be equal between the servers, or
the run fails.

    .venv/bin/python benchmarks/derender_calls.py [--baseline REF] [--streams 40] [--per-event]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pd_backends import RunError, git, run_head, run_main
from token_vs_text import chat_prompt

from vllm_pd_ext import derender_stream as wire
from vllm_pd_ext.proxy.token_mode import DerenderStream, RenderTier
from vllm_pd_ext.util.proc_cpu import group_cpu_s
from vllm_pd_ext.util.prom import parse_metrics
from vllm_pd_ext.util.tiny_model import ensure_model
from vllm_pd_ext.util.vllm_process import free_port

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("ours", "baseline")
SECONDS = "vllm_pd_render_request_seconds"
MAX_MODEL_LEN = 4096


def export(ref: str, into: Path) -> Path:
    """``vllm_pd_ext`` of git ``ref`` under ``into``."""
    data = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "vllm_pd_ext"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def start_render(path: Path, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [str(model), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--served-model-name", "tiny-llama", "--max-model-len", str(MAX_MODEL_LEN)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_pd_ext.cli", "render", *args],
            env={**os.environ, "PYTHONPATH": str(path)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunError(f"render server from {path} exited; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.2)
    raise RunError(f"render server from {path} not healthy in 120 s; see {log}")


def server_seconds(url: str) -> tuple[float, float]:
    """Derender calls (or batches of chunks on a streaming call) and their seconds."""
    metrics = parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
    routes = ("chat_derender", "chat_derender_stream")
    return (
        sum(metrics.total(f"{SECONDS}_count", route=r) for r in routes),
        sum(metrics.total(f"{SECONDS}_sum", route=r) for r in routes),
    )


def chat(prompt_words: int, tag: str, tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": chat_prompt(tag, prompt_words)}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }


async def one_stream(
    url: str, body: dict[str, Any], token_ids: list[int], stream_calls: bool
) -> dict[str, Any]:
    """One streamed answer derendered event by event: seconds per event, the proxy's CPU
    seconds per event (this thread), request bytes per event (a per-event call, or the line
    on the streaming call), prompt tokens, the text."""
    tier = RenderTier(
        (url,), timeout_s=30, connect_s=5, max_connections=4, stream_calls=stream_calls
    )
    sizes: list[int] = []
    lines: list[int] = []
    call = tier.call

    async def measured(path: str, req: dict[str, Any], request_id: str) -> Any:
        sizes.append(len(json.dumps(req, separators=(",", ":"))))
        return await call(path, req, request_id)

    tier.call = measured  # type: ignore[method-assign, assignment]
    try:
        tokens = await tier.render("chat", body, "bench", stream=True)
        stream = DerenderStream(tier, "chat", body, tokens, "bench")
        seconds, cpu, text = [], [], []
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            event = {
                "request_id": "bench",
                "choices": [
                    {"index": 0, "token_ids": [token], "finish_reason": "length" if last else None}
                ],
            }
            raw = b"data: " + json.dumps(event).encode() + b"\n\n"
            lines.append(len(wire.line({**event, "request_id": tokens.response_id})))
            started, thread = time.perf_counter(), time.thread_time()
            out = await stream.feed(raw)
            seconds.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - thread)
            chunk = json.loads(out[len(b"data: ") : -2])
            if "error" in chunk:
                raise RunError(f"{url}: derender failed: {chunk['error']}")
            text.append(chunk["choices"][0]["delta"].get("content") or "")
        if stream.streaming != stream_calls:
            raise RunError(f"{url}: streaming call {stream.streaming}, wanted {stream_calls}")
        stream.close()
        return {
            "seconds": seconds,
            "proxy_cpu_s": cpu,
            "sizes": lines if stream_calls else sizes[1:],  # sizes[0]: the render call
            "prompt_tokens": len(tokens.prompt_ids),
            "text": "".join(text),
        }
    finally:
        await tier.close()


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def measure(args: argparse.Namespace, urls: dict[str, str], procs: dict[str, Any]) -> list[dict]:
    rounds = []
    vocab = range(300, 31000)
    for prompt_words in args.prompt_words:
        for s in range(args.streams):
            rng = random.Random(f"answer-{prompt_words}-{s}")
            token_ids = [rng.choice(vocab) for _ in range(args.tokens)]
            body = chat(prompt_words, f"prompt-{prompt_words}-{s}", args.tokens)
            texts = {}
            for server in SERVERS if s % 2 == 0 else SERVERS[::-1]:
                url = urls[server]
                calls0, server_s0 = server_seconds(url)
                cpu0 = group_cpu_s(procs[server].pid)
                streams = server == "ours" and not args.per_event
                got = asyncio.run(one_stream(url, body, token_ids, streams))
                texts[server] = got["text"]
                cpu1 = group_cpu_s(procs[server].pid)
                calls1, server_s1 = server_seconds(url)
                calls = calls1 - calls0
                rounds.append(
                    {
                        "prompt_words": prompt_words,
                        "stream": s,
                        "server": server,
                        "calls": int(calls),
                        "prompt_tokens": got["prompt_tokens"],
                        "call_ms": [round(x * 1e3, 3) for x in got["seconds"]],
                        "proxy_cpu_ms_per_call": round(float(np.mean(got["proxy_cpu_s"])) * 1e3, 3),
                        "request_bytes_median": int(np.median(got["sizes"])),
                        "server_ms_per_call": round((server_s1 - server_s0) / calls * 1e3, 3),
                        # the render call and two /metrics scrapes are in this window too
                        "server_cpu_ms_per_call": round((cpu1 - cpu0) / calls * 1e3, 3),
                    }
                )
            if texts["ours"] != texts["baseline"]:
                raise RunError(f"stream {s} ({prompt_words} words): the servers' texts differ")
    return rounds


def summarize(rounds: list[dict], prompt_words: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for words in prompt_words:
        per: dict[str, Any] = {}
        for server in SERVERS:
            mine = [r for r in rounds if r["server"] == server and r["prompt_words"] == words]
            ms = [x for r in mine for x in r["call_ms"]]
            per[server] = {
                "calls": len(ms),
                "call_ms": {"p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99)},
                "server_ms_per_call_median": pct([r["server_ms_per_call"] for r in mine], 50),
                "server_cpu_ms_per_call_median": pct(
                    [r["server_cpu_ms_per_call"] for r in mine], 50
                ),
                "request_bytes_median": int(np.median([r["request_bytes_median"] for r in mine])),
                "prompt_tokens_median": int(np.median([r["prompt_tokens"] for r in mine])),
                "proxy_cpu_ms_per_call_median": pct([r["proxy_cpu_ms_per_call"] for r in mine], 50),
            }
        per["ours_over_baseline"] = {
            q: round(per["ours"]["call_ms"][q] / per["baseline"]["call_ms"][q], 3)
            for q in ("p50", "p90", "p99")
        }
        out[f"{words}_words"] = per
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref of the baseline render server")
    ap.add_argument(
        "--per-event",
        action="store_true",
        help="ours per event too (default: ours over one streaming call per stream, the "
        "baseline always per event)",
    )
    ap.add_argument("--streams", type=int, default=40, help="streams per server and prompt")
    ap.add_argument("--tokens", type=int, default=64, help="one-token events per stream")
    ap.add_argument("--prompt-words", type=int, nargs="+", default=[120, 1500])
    ap.add_argument("--log-dir", type=Path, default=Path("logs/derender_calls"))
    ap.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "derender_calls.json"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model("tiny-llama")
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="derender-baseline-") as tmp:
        try:
            paths = {"ours": REPO, "baseline": export(args.baseline, Path(tmp))}
            urls = {}
            for server in SERVERS:
                procs[server], urls[server] = start_render(
                    paths[server], model, args.log_dir / f"{server}.log"
                )
            rounds = measure(args, urls, procs)
        finally:
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
    result = {
        **run_head("derender_calls", started, load_start),
        "baseline": {"ref": args.baseline, "commit": git("rev-parse", "--short", args.baseline)},
        "ours_over": "per-event calls" if args.per_event else "one streaming call per stream",
        "streams": args.streams,
        "tokens": args.tokens,
        "prompt_words": args.prompt_words,
        "summary": summarize(rounds, args.prompt_words),
        "every_stream": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    print(f"load {m['loadavg_at_start'][0]:.2f} -> {m['loadavg_at_end'][0]:.2f}")
    for words, per in result["summary"].items():
        for server in SERVERS:
            s = per[server]
            print(
                f"{words:>12} {server:<9} call ms p50 {s['call_ms']['p50']:>7} p90 "
                f"{s['call_ms']['p90']:>7} p99 {s['call_ms']['p99']:>7}; server "
                f"{s['server_ms_per_call_median']} ms, CPU {s['server_cpu_ms_per_call_median']} "
                f"ms per call; proxy CPU {s['proxy_cpu_ms_per_call_median']} ms per call; "
                f"{s['prompt_tokens_median']} prompt tokens, {s['request_bytes_median']} B a call"
            )
        print(f"{words:>12} ours/baseline {per['ours_over_baseline']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main("derender_calls", main)
