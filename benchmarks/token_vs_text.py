"""Token mode vs text mode on one P/D stack: what render/derender in the stream path costs.

One ``vllm-pd up --mode token`` stack (``--config``, default ``examples/up-token.yaml``:
tiny-llama, one prefill and one decode ``vllm serve --enable-scale-out`` on CPU, our connector
over tcp, one render server, the token-mode proxy) through the launcher's own
:class:`~vllm_pd_ext.tools.launcher.Stack`, and beside its proxy a second proxy in text mode
on the same engines (the same ProxyConfig without render servers: same instances, protocol,
fleet key, ``min_split_prompt_tokens``, cost model off so every long prompt is split).
Engines on ``--enable-scale-out`` still serve the OpenAI routes the text proxy uses.

After both proxies' warm-up, ``--rounds`` rounds of ``--requests`` sequential streamed chat
requests per mode, alternating mode request by request (the first mode swapped every
round), each with its own prompt (a few hundred tokens of words, long enough to split; no
prompt is sent twice, so no request finds another's prompt in a prefix cache),
``max_tokens`` 64, temperature 0, ``ignore_eos``. Per request: client TTFT (request sent to
the first event with content) and every gap between content events (ITL), the events and
tokens of the answer, and how the proxy served it (its ``/metrics`` decisions).

Then ``--checks`` prompts are sent to both modes, one after the other: the greedy answers
must be equal, or the run fails.

The render server's own timings (its ``/metrics``, ``vllm_pd_render_request_seconds``) over
the measured requests, per route (``chat_render``: one call per token-mode request;
``chat_derender``: per-event streaming calls, made where the render server lacks the
long-lived streaming call; ``chat_derender_stream``: the chunks handled on that one call per
request, counted per batch of chunks that arrived together): calls per token-mode request,
server-side ms per call, the share of calls slower than 10 and 25 ms; the proxy's streamed
answers derendered per event, by reason; and each part's CPU over the measured requests.

Summary per mode: TTFT p50/p90/p99, ITL p50/p99 over every gap between content events,
TPOT p50/p90/p99 (first to last content event over the tokens after the first: the pace per
token, which the two modes' different event counts do not bend), and token/text ratios (the
target: p90 TTFT and p99 ITL within 1.2x). ``--resummarize`` recomputes the summary of a
written result from its recorded requests. Writes ``benchmarks/results/token_vs_text.json``.

Another job's engines on the same cores would skew the figures, so the run refuses to start
while any ``vllm serve`` is running; run it under the lock the integration tests take:

    flock /tmp/vllm-serve.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/token_vs_text.py
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pd_backends import (
    DECISIONS,
    FALLBACKS,
    RunError,
    config_name,
    delta,
    git,
    run_head,
    run_main,
    scrape,
    stopped_cleanly,
    vllm_serve_processes,
)

from vllm_pd_ext.tools.launcher import Part, Stack, ToolProcess, UpConfig
from vllm_pd_ext.util.config_file import read_mapping
from vllm_pd_ext.util.proc_cpu import group_cpu_s
from vllm_pd_ext.util.vllm_process import free_port

REPO = Path(__file__).resolve().parent.parent
MODES = ("token", "text")
RENDER_SECONDS = "vllm_pd_render_request_seconds"
#: The token-mode proxy's streamed answers derendered per event, by reason.
PER_EVENT = "vllm_pd_derender_per_event_total"
#: Words the prompts are drawn from (a prompt's tokens then vary with its words).
WORDS = (
    "cache",
    "prefill",
    "decode",
    "token",
    "stream",
    "engine",
    "proxy",
    "render",
    "block",
    "layer",
    "tensor",
    "request",
    "answer",
    "latency",
    "budget",
    "river",
    "mountain",
    "garden",
    "yellow",
    "quiet",
    "seven",
    "number",
    "paper",
    "signal",
    "kernel",
    "memory",
    "socket",
    "thread",
    "window",
    "orange",
    "planet",
    "market",
)


def chat_prompt(tag: str, words: int) -> str:
    rng = random.Random(tag)
    return f"[{tag}] " + " ".join(rng.choice(WORDS) for _ in range(words))


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: its text, TTFT, ITL gaps (ms), events and tokens."""
    start = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] | None = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RunError(f"{url} answered {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RunError(f"{url} stream failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            content = "".join(
                (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []
            )
            if content:
                arrivals.append(time.perf_counter())
                text.append(content)
    if not arrivals:
        raise RunError(f"{url} streamed no content")
    return {
        "ttft_ms": round((arrivals[0] - start) * 1e3, 2),
        "itl_ms": [round((b - a) * 1e3, 2) for a, b in itertools.pairwise(arrivals)],
        "events": len(arrivals),
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "text": "".join(text),
    }


def wait_healthy(part: Part, timeout: float = 60.0) -> None:
    """Until the proxy ``part`` sees every engine healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if part.proc.poll() is not None:
            raise RunError(f"{part.name} exited with {part.proc.returncode}")
        try:
            body = httpx.get(f"{part.url}/health", timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            body = {}
        if body.get("healthy_prefill") and body.get("healthy_decode"):
            return
        time.sleep(0.2)
    raise RunError(f"{part.name} did not see the engines healthy in {timeout:.0f}s")


def text_proxy(stack: Stack, log_dir: Path) -> Part:
    """A text-mode proxy on ``stack``'s engines: its token proxy's config, no render."""
    config = {**stack.proxy_config(), "port": free_port(), "render": []}
    path = log_dir / "proxy-text.json"
    path.write_text(json.dumps(config, indent=2))
    part = Part(
        name="proxy-text",
        url=f"http://127.0.0.1:{config['port']}",
        start=lambda: ToolProcess(
            "proxy", ["--config", str(path)], log_dir / "proxy-text.log", stack.key_env
        ),
    )
    part.handle = part.start()
    return part


def render_route(before: Any, after: Any, route: str, per: int) -> dict[str, Any]:
    """The render server's ``route`` between two scrapes: calls (per token-mode request),
    server-side ms per call, and the share of calls slower than 10 and 25 ms."""

    def count(m: Any, suffix: str, **labels: str) -> float:
        return m.total(f"{RENDER_SECONDS}_{suffix}", route=route, **labels)

    calls = count(after, "count") - count(before, "count")
    if not calls:
        return {"calls": 0}
    seconds = count(after, "sum") - count(before, "sum")
    out: dict[str, Any] = {
        "calls": int(calls),
        "calls_per_request": round(calls / per, 2),
        "server_ms_per_call": round(seconds / calls * 1e3, 3),
    }
    for le in ("0.01", "0.025"):
        fast = count(after, "bucket", le=le) - count(before, "bucket", le=le)
        out[f"share_over_{float(le) * 1e3:g}ms"] = round(1 - fast / calls, 4)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    data = read_mapping(args.config)
    data.update(mode="token", proxy_port=free_port(), cost_model=False, log_dir=str(args.log_dir))
    config = UpConfig.model_validate(data)
    stack = Stack(config)
    stack.build()
    text_part: Part | None = None
    record: dict[str, Any] = {}
    try:
        if not stack.start():
            raise RunError(f"the stack did not come up; logs in {config.log_dir}")
        stack.warm_up()
        text_part = text_proxy(stack, config.log_dir)
        wait_healthy(text_part)
        proxies = {"token": stack.parts[-1], "text": text_part}
        render = next(p for p in stack.parts if p.name.startswith("render"))
        model = stack.served_name
        parts = [p for p in stack.parts if p.handle is not None] + [text_part]

        def body(prompt: str) -> dict[str, Any]:
            return {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        requests: list[dict[str, Any]] = []
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            for mode in MODES:  # the text proxy's first split; the token one's was warm_up
                stream_chat(client, proxies[mode].url, body(chat_prompt(f"warm-{mode}", 120)))
            before = {m: scrape(client, p.url) for m, p in proxies.items()}
            render_before = scrape(client, render.url)
            cpu_before = {p.name: group_cpu_s(p.proc.pid) for p in parts}
            started = time.monotonic()
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for i in range(args.requests):
                    for mode in order:
                        tag = f"r{r}-{i}-{mode}"
                        last = scrape(client, proxies[mode].url)
                        got = stream_chat(client, proxies[mode].url, body(chat_prompt(tag, 120)))
                        now = scrape(client, proxies[mode].url)
                        how = delta(
                            now.by_label(DECISIONS, "decision", "reason"),
                            last.by_label(DECISIONS, "decision", "reason"),
                        )
                        fell = delta(
                            now.by_label(FALLBACKS, "reason"), last.by_label(FALLBACKS, "reason")
                        )
                        got.pop("text")
                        requests.append(
                            {
                                "round": r,
                                "mode": mode,
                                "prompt": tag,
                                **got,
                                "served": "+".join(sorted(how)),
                                "fallbacks": "+".join(sorted(fell)),
                            }
                        )
            took = time.monotonic() - started
            cpu = {
                p.name: round(100 * (group_cpu_s(p.proc.pid) - cpu_before[p.name]) / took, 1)
                for p in parts
            }
            render_after = scrape(client, render.url)
            after = {m: scrape(client, p.url) for m, p in proxies.items()}
            checks = []
            for i in range(args.checks):
                answers = {}
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    prompt = body(chat_prompt(f"check-{i}", 120))
                    answers[mode] = stream_chat(client, proxies[mode].url, prompt)["text"]
                checks.append(
                    {
                        "prompt": f"check-{i}",
                        "equal": answers["token"] == answers["text"],
                        "answers": answers,
                    }
                )
        measured_token = sum(r["mode"] == "token" for r in requests)
        record = {
            "requests": requests,
            "measured_s": round(took, 1),
            "cpu_pct_of_a_core_while_measuring": cpu,
            "decisions": {
                m: delta(
                    after[m].by_label(DECISIONS, "decision", "reason"),
                    before[m].by_label(DECISIONS, "decision", "reason"),
                )
                for m in MODES
            },
            "fallbacks": {
                m: delta(
                    after[m].by_label(FALLBACKS, "reason"), before[m].by_label(FALLBACKS, "reason")
                )
                for m in MODES
            },
            "derendered_per_event": delta(
                after["token"].by_label(PER_EVENT, "reason"),
                before["token"].by_label(PER_EVENT, "reason"),
            ),
            "render_server": {
                route: render_route(render_before, render_after, route, measured_token)
                for route in ("chat_render", "chat_derender", "chat_derender_stream")
            },
            "greedy_checks": checks,
        }
    finally:
        groups = [p.proc.pid for p in stack.parts if p.handle is not None]
        if text_part is not None:
            groups.append(text_part.proc.pid)
            text_part.handle.stop()
        stack.stop_all()
        left = stopped_cleanly(groups)
    record["left_after_stop"] = left
    if left:
        raise RunError(f"processes left after the stack stopped: {left}")
    return record


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2)


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in record["requests"] if r["mode"] == mode]
        ttft = [r["ttft_ms"] for r in mine]
        itl = [g for r in mine for g in r["itl_ms"]]
        # the pace per token: first to last content event over the tokens after the first
        # (events coalesce tokens in token mode, and near-simultaneous tokens leave as
        # separate events in text mode, so per-event gaps differ by construction)
        tpot = [sum(r["itl_ms"]) / (r["completion_tokens"] - 1) for r in mine]
        out[mode] = {
            "requests": len(mine),
            "split": sum(r["served"] == "split/split" for r in mine),
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
            "itl_gaps": len(itl),
            "itl_gaps_under_half_a_ms": sum(g < 0.5 for g in itl),
            "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
            "events_per_request_mean": round(float(np.mean([r["events"] for r in mine])), 2),
            "ttft_ms_p90_per_round": [
                pct([r["ttft_ms"] for r in mine if r["round"] == k], 90)
                for k in sorted({r["round"] for r in mine})
            ],
            "itl_ms_p99_per_round": [
                pct([g for r in mine if r["round"] == k for g in r["itl_ms"]], 99)
                for k in sorted({r["round"] for r in mine})
            ],
        }
    token, text = out["token"], out["text"]
    out["token_over_text"] = {
        "ttft_p50": round(token["ttft_ms"]["p50"] / text["ttft_ms"]["p50"], 3),
        "ttft_p90": round(token["ttft_ms"]["p90"] / text["ttft_ms"]["p90"], 3),
        "ttft_p99": round(token["ttft_ms"]["p99"] / text["ttft_ms"]["p99"], 3),
        "itl_p50": round(token["itl_ms"]["p50"] / text["itl_ms"]["p50"], 3),
        "itl_p99": round(token["itl_ms"]["p99"] / text["itl_ms"]["p99"], 3),
        "tpot_p50": round(token["tpot_ms"]["p50"] / text["tpot_ms"]["p50"], 3),
        "tpot_p99": round(token["tpot_ms"]["p99"] / text["tpot_ms"]["p99"], 3),
    }
    ratio = out["token_over_text"]
    out["target_met"] = ratio["ttft_p90"] <= 1.2 and ratio["itl_p99"] <= 1.2
    return out


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"\n{result['rounds']} rounds x {result['requests_per_round']} streamed chats per mode, "
        f"{result['max_tokens']} tokens, alternating; {m['cpus']} CPUs, load "
        f"{m['loadavg_at_start'][0]:.2f} -> {m['loadavg_at_end'][0]:.2f}"
    )
    print(
        f"{'mode':<7}{'split':>7}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
        f"{'TPOT p50':>10}{'p99':>8}{'events':>8}"
    )
    for mode in MODES:
        s = result["summary"][mode]
        t, i, p = s["ttft_ms"], s["itl_ms"], s["tpot_ms"]
        print(
            f"{mode:<7}{s['split']:>4}/{s['requests']:<2}{t['p50']:>10}{t['p90']:>8}"
            f"{t['p99']:>8}{i['p50']:>9}{i['p99']:>8}{p['p50']:>10}{p['p99']:>8}"
            f"{s['events_per_request_mean']:>8}"
        )
    print(f"token/text: {result['summary']['token_over_text']}")
    for route, figures in result["run"]["render_server"].items():
        print(f"render server {route}: {figures}")
    print(f"CPU while measuring, % of a core: {result['run']['cpu_pct_of_a_core_while_measuring']}")
    print(f"greedy checks equal: {[c['equal'] for c in result['run']['greedy_checks']]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "up-token.yaml")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the first mode alternates")
    ap.add_argument("--requests", type=int, default=12, help="requests per mode per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--checks", type=int, default=3, help="prompts sent to both modes")
    ap.add_argument("--log-dir", type=Path, default=Path("logs/token_vs_text"))
    ap.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "token_vs_text.json"
    )
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="run nothing: recompute the summary of --out from its recorded requests (the "
        "commit that did it is recorded as summarized_by)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the order is swapped every round)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resummarize:
        result = json.loads(args.out.read_text())
        result["summary"] = summarize(result["run"])
        result["summarized_by"] = git("rev-parse", "--short", "HEAD")
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print_table(result)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the stack stops in its finally
    strays = vllm_serve_processes()
    if strays:
        print("vllm serve is already running; measure on a quiet host:", *strays, sep="\n  ")
        return 1
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = measure(args)
    result = {
        **run_head("token_vs_text", started, load_start),
        "config": config_name(args.config),
        "overrides": {"mode": "token", "cost_model": False},
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "max_tokens": args.max_tokens,
        "summary": summarize(record),
        "run": record,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    if not all(c["equal"] for c in record["greedy_checks"]):
        print("token_vs_text: greedy answers differ between the modes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main("token_vs_text", main)
