"""Proxy overhead: our proxy in pass-through next to direct engine access and vllm-router.

Three targets front the same upstream in one run:

* ``direct``: the engine itself (the floor);
* ``ours``: ``vllm-pd proxy --both URL`` (run as ``python -m vllm_pd_ext.cli proxy``):
  pass-through, one instance serving both roles so no request is split, defaults otherwise;
* ``vllm-router``: the Rust router from PyPI, ``--policy round_robin`` over the same URL;
* ``ours-before`` (with ``--baseline PATH``): our proxy from another checkout of this
  repository (an earlier commit), same flags: a change's effect measured in one run;
* ``ours-traced`` (with ``--traced``): our proxy with tracing on (``--otlp-traces-endpoint``,
  spans exported over OTLP/HTTP to a collector process beside the upstream that takes them).

The upstream is one real ``vllm serve`` of the tiny test model (``--upstream vllm``, default)
or a no-compute fake engine in its own process (``--upstream fake``,
``vllm_pd_ext.testing.fake_engine.BareEngine``) that isolates the proxies' cost from engine noise.

Workload: many short streaming ``/v1/completions`` requests (a short prompt, ``--max-tokens``
tokens, ``ignore_eos``). Each round has two phases, and rounds are repeated ``--rounds`` times:

1. latency: ``--latency-requests`` requests per target, one at a time, interleaved request by
   request in an order drawn afresh for each request (seeded, ``--seed``), so drift in the
   host's load hits all targets alike and none always follows the same neighbour.
   Measured per request: TTFT (send to first SSE token event) and ITL (mean gap between its
   token events).
2. saturation: ``--sat-requests`` requests per target at ``--sat-concurrency`` in flight;
   requests/s. Targets run one after another, in an order drawn for each round.

Reported per target: p50/p99 TTFT and p50 ITL, and their excess over direct in the same round
(median over rounds); TTFT p99 pooled over all rounds (more samples in the tail); requests/s
at saturation and its ratio to direct; the CPU time each proxy process spent per request it
served, at low load and at saturation, also net of its idle background rate (health checks).
CPU time is read to the nanosecond (each process's CPU clock, every thread, ended ones
included; ``vllm_pd_ext.util.proc_cpu.group_cpu``), in 10 ms ticks only where Linux refuses
that; ``cpu_read_with`` in the JSON says which, per target.
CPU per request is the figure least disturbed by other work on a shared machine. Also
recorded: what our proxy's health loop parses every 2 s (the engine's ``/metrics``), timed.

Processes: the upstream is pinned to ``--upstream-core`` (vLLM's OpenMP threads bound there),
the load generator and both proxies to ``--front-core``. Every process started here runs in
its own process group and is stopped on exit, Ctrl-C or SIGTERM. Both proxies are started
afresh (and warmed up) before every round: a tail percentile of one process also reflects the
luck of its launch (two launches of the same proxy once differed by ~0.15 ms at p99), and new
processes every round spread that luck over the rounds for both alike (``--same-proxies``: one
launch for all rounds). Requests are bounded in number, each phase in time, and no round
starts after ``--max-minutes``.

Writes ``benchmarks/results/proxy_overhead.json`` (``proxy_overhead_fake.json`` with
``--upstream fake``). Run: ``.venv/bin/python benchmarks/proxy_overhead.py``: about 2 min on
a quiet host (~30 s of it vLLM starting), longer when it is loaded (the JSON records the host);
``--upstream fake`` takes 1-3 min. Needs ``vllm-router`` installed (or ``--skip-router``).
``--py-spy`` then samples our proxy with py-spy (native stacks, idle samples dropped) during
one extra low-load and one extra saturation phase, and adds its busiest functions to the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from vllm_pd_ext.util.proc_cpu import group_cpu, group_cpu_s
from vllm_pd_ext.util.vllm_process import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
TARGETS = ("direct", "ours", "ours-traced", "ours-before", "vllm-router")
#: The targets that are proxies (restarted every round).
PROXIES = ("ours", "ours-traced", "ours-before", "vllm-router")

#: ``--traced``'s OTLP/HTTP collector: takes every export and answers 200 (what a collector
#: elsewhere costs the proxy is its export, not the collector's work).
OTLP_SINK = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
PROMPT = "the quick brown fox jumps over the lazy dog while a proxy forwards every token it sees"
PROMPT_WORDS = PROMPT.split(" ")


# -- processes ------------------------------------------------------------------------------


def _affinity(cpus: set[int] | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


@dataclass
class Child:
    """A process this script started, in its own process group."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
                if sig == signal.SIGTERM:
                    # the leader is gone; reap anything left in its group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    return


def spawn(
    name: str,
    argv: list[str],
    log_dir: Path,
    cpus: set[int] | None,
    tree: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> Child:
    """Start ``argv`` in a new session with its output in ``log_dir/name.log``; ``tree``: a
    checkout whose ``vllm_pd_ext`` the process imports (its working directory and
    ``PYTHONPATH``); ``env_extra``: added to its environment."""
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tree,
            start_new_session=True,
            preexec_fn=(lambda: _affinity(cpus)) if cpus else None,
        )
    return Child(name, proc, log_path)


def spawn_fake_upstream(
    log_dir: Path, token_interval_ms: float, cpus: set[int] | None
) -> tuple[Child, str]:
    """Start the fake engine (``vllm_pd_ext.testing.fake_engine``) on a free port; it and
    its URL (not yet waited for: :func:`wait_ready`)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_pd_ext.testing.fake_engine", "--port", str(port)]
    argv += ["--token-interval-ms", str(token_interval_ms)]
    return spawn("fake-upstream", argv, log_dir, cpus), f"http://127.0.0.1:{port}"


def wait_ready(child: Child, url: str, timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail fast if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited early:\n{child.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{child.name} not ready at {url} after {timeout:.0f}s:\n{child.log_tail()}")


class Fleet:
    """The upstream and the two proxies; ``close()`` stops everything that was started."""

    def __init__(self, args: argparse.Namespace, log_dir: Path):
        self.args = args
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.vllm: Any = None
        self.urls: dict[str, str] = {}
        self.model = "fake"
        self.pids: dict[str, int] = {}
        self.sink_url = ""  # --traced: the OTLP collector's

    def start(self) -> None:
        args = self.args
        up_cpus = {args.upstream_core} if args.pin else None
        if args.upstream == "vllm":
            upstream_url = self._start_vllm(up_cpus)
        else:
            fake, upstream_url = spawn_fake_upstream(self.log_dir, args.token_interval_ms, up_cpus)
            self.children.append(fake)
            wait_ready(fake, upstream_url + "/health", 30)
            self.pids["upstream"] = fake.proc.pid
        self.urls["direct"] = upstream_url
        if args.traced:  # the collector, beside the upstream
            port = free_port()
            sink = spawn(
                "otlp-sink", [sys.executable, "-c", OTLP_SINK, str(port)], self.log_dir, up_cpus
            )
            self.children.append(sink)
            self.sink_url = f"http://127.0.0.1:{port}/v1/traces"
        self.start_proxies()

    def start_proxies(self) -> None:
        """Start our proxy and vllm-router in front of the upstream (fresh processes)."""
        args = self.args
        front_cpus = {args.front_core} if args.pin else None
        upstream_url = self.urls["direct"]
        ours = [self._start_ours("ours", REPO, front_cpus)]
        if args.traced:
            traced = ["--otlp-traces-endpoint", self.sink_url]
            ours.append(self._start_ours("ours-traced", REPO, front_cpus, traced))
        if args.baseline is not None:
            ours.append(self._start_ours("ours-before", args.baseline, front_cpus))

        if not args.skip_router:
            router_port = free_port()
            router = spawn(
                "vllm-router",
                [
                    router_executable(),
                    "--worker-urls",
                    upstream_url,
                    "--policy",
                    "round_robin",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(router_port),
                    "--prometheus-port",
                    str(free_port()),
                    "--log-level",
                    "warning",
                ],
                self.log_dir,
                front_cpus,
            )
            self.children.append(router)
            self.urls["vllm-router"] = f"http://127.0.0.1:{router_port}"
            self.pids["vllm-router"] = router.proc.pid
            wait_ready(router, self.urls["vllm-router"] + "/v1/models", 60)
        for child in ours:
            wait_ready(child, self.urls[child.name] + "/health", 60)

    def _start_ours(
        self, name: str, tree: Path, cpus: set[int] | None, extra: list[str] | None = None
    ) -> Child:
        """``vllm-pd proxy`` from the checkout ``tree`` in front of the upstream, with the
        flags ``extra`` (tracing: to the OTLP/HTTP collector)."""
        port = free_port()
        child = spawn(
            name,
            [
                sys.executable,
                "-m",
                "vllm_pd_ext.cli",  # `vllm-pd`, without relying on the console script
                "proxy",
                "--both",
                self.urls["direct"],
                "--port",
                str(port),
                "--log-level",
                "warning",
                *(extra or []),
            ],
            self.log_dir,
            cpus,
            tree,
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"} if extra else None,
        )
        self.children.append(child)
        self.urls[name] = f"http://127.0.0.1:{port}"
        self.pids[name] = child.proc.pid
        return child

    def restart_proxies(self) -> None:
        """Stop both proxies and start new processes: each launch has its own luck (memory
        layout, cache placement), which a tail percentile sees; fresh ones every round
        spread it over the rounds for both proxies alike."""
        for child in [c for c in self.children if c.name in PROXIES]:
            child.stop()
            self.children.remove(child)
        self.start_proxies()

    def _start_vllm(self, cpus: set[int] | None) -> str:
        from vllm_pd_ext.util.tiny_model import ensure_model
        from vllm_pd_ext.util.vllm_process import start_vllm_serve

        model_dir = ensure_model(self.args.model)
        # Popen inherits our affinity: switch to the upstream core while it forks, then back.
        before = os.sched_getaffinity(0) if cpus else None
        _affinity(cpus)
        try:
            self.vllm = start_vllm_serve(
                model_dir,
                log_path=self.log_dir / "vllm.log",
                cpu_core=self.args.upstream_core if cpus else None,
                served_name=self.args.model,
            )
        finally:
            _affinity(before)
        self.model = self.args.model
        self.pids["upstream"] = self.vllm.proc.pid
        self.vllm.wait_healthy(timeout=300)
        return self.vllm.base_url

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self.vllm is not None:
            self.vllm.stop()


def router_executable() -> str:
    exe = Path(sys.executable).with_name("vllm-router")
    found = str(exe) if exe.is_file() else shutil.which("vllm-router")
    if not found:
        raise SystemExit(
            "vllm-router is not installed: `uv pip install vllm-router` (or pass --skip-router)"
        )
    return found


# -- load generator -------------------------------------------------------------------------


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    itl: float = 0.0  # mean gap between token events of this request
    events: int = 0
    e2e: float = 0.0
    error: str = ""


@dataclass
class Client:
    name: str
    url: str
    session: aiohttp.ClientSession


def request_body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    words = PROMPT_WORDS[i % len(PROMPT_WORDS) :] + PROMPT_WORDS[: i % len(PROMPT_WORDS)]
    return {
        "model": model,
        "prompt": " ".join(words),
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def one_request(client: Client, body: dict[str, Any]) -> Sample:
    """Send one streaming completion; time its token events as the client sees them."""
    t0 = time.perf_counter()
    first = last = 0.0
    events = 0
    try:
        async with client.session.post(client.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Sample(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    if not events:
                        first = now
                    last = now
                    events += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if not events:
        return Sample(False, error="no token events")
    itl = (last - first) / (events - 1) if events > 1 else 0.0
    return Sample(True, ttft=first - t0, itl=itl, events=events, e2e=end - t0)


async def latency_phase(
    clients: list[Client],
    model: str,
    n: int,
    max_tokens: int,
    offset: int,
    rng: random.Random | None = None,
) -> dict[str, list[Sample]]:
    """``n`` requests per client, one at a time, interleaved request by request; with
    ``rng``, the clients' order is drawn afresh for every request (a fixed or rotated order
    keeps each target next to the same neighbours, whose cache footprint it then inherits)."""
    out: dict[str, list[Sample]] = {c.name: [] for c in clients}
    for i in range(n):
        body = request_body(model, offset + i, max_tokens)
        for c in rng.sample(clients, len(clients)) if rng is not None else clients:
            out[c.name].append(await one_request(c, body))
    return out


async def saturation_phase(
    client: Client, model: str, n: int, concurrency: int, max_tokens: int, budget_s: float
) -> tuple[float, list[Sample]]:
    """``n`` requests at ``concurrency`` in flight; returns (requests/s, samples)."""
    samples: list[Sample] = []
    next_i = 0
    deadline = time.perf_counter() + budget_s

    async def worker() -> None:
        nonlocal next_i
        while next_i < n and time.perf_counter() < deadline:
            i = next_i
            next_i += 1
            samples.append(await one_request(client, request_body(model, i, max_tokens)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    done = sum(s.ok for s in samples)
    return done / wall, samples


async def py_spy_phase(
    client: Client, pid: int, args: argparse.Namespace, model: str, out_dir: Path
) -> dict[str, Any]:
    """Sample our proxy with py-spy: once at low load (sequential), once at saturation."""
    exe = Path(sys.executable).with_name("py-spy")
    spy = str(exe) if exe.is_file() else shutil.which("py-spy")
    if not spy:
        return {"error": "py-spy not installed"}
    out: dict[str, Any] = {}
    for phase in ("low_load", "saturation"):
        raw = out_dir / f"ours.{phase}.pyspy.txt"
        proc = await asyncio.create_subprocess_exec(
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--native",  # C frames, so idle (epoll) samples can be told from busy ones
            "--format",
            "raw",
            "--output",
            str(raw),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        await asyncio.sleep(1.0)
        cpu0 = group_cpu_s(pid)
        try:
            if phase == "low_load":
                n = max(300, args.latency_requests * 2)
                samples = (await latency_phase([client], model, n, args.max_tokens, 0))["ours"]
                rps = float("nan")
            else:
                rps, samples = await saturation_phase(
                    client, model, args.sat_requests * 2, args.sat_concurrency, args.max_tokens, 60
                )
        finally:
            cpu = group_cpu_s(pid) - cpu0
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                _, err = await asyncio.wait_for(proc.communicate(), 30)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                err = b"py-spy did not stop"
        if not raw.is_file():
            out[phase] = {"error": err.decode(errors="replace")[-500:]}
            continue
        done = max(1, sum(x.ok for x in samples))
        out[phase] = {
            "requests": done,
            "req_per_s": None if rps != rps else round(rps, 1),
            "cpu_ms_per_req_while_sampled": ms(cpu / done),
            **summarize_collapsed(raw),
        }
        if args.keep_logs:
            print(f"py-spy collapsed stacks: {raw}", file=sys.stderr)
    return out


def summarize_collapsed(path: Path, top: int = 25) -> dict[str, Any]:
    """Busy-time shares per Python function from py-spy's collapsed ``--native`` stacks.

    Samples whose innermost frame is the event loop waiting (``epoll_wait``) are idle and
    left out. py-spy samples wall-clock time, so a process preempted inside a syscall (a
    loopback ``write`` that wakes the reader on the same core) still shows as busy there:
    samples whose native leaf is in libc are counted apart (``in_libc_pct``, by function),
    and the rest, Python and C-extension time, is charged to the nearest Python frame.
    """
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    package_counts: Counter[str] = Counter()
    libc_counts: Counter[str] = Counter()
    total = idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        raw = [f for f in stack.split(";") if f]
        if not raw or raw[-1].startswith(IDLE_FRAMES):
            idle += n
            continue
        total += n
        py = [f for f in raw if ".py" in f]
        frames = [_short_frame(f) for f in py]
        if "(libc" in raw[-1]:
            where = frames[-1] if frames else "?"
            libc_counts[f"{raw[-1].partition(' (')[0]} in {where}"] += n
        elif frames:
            self_counts[frames[-1]] += n
            package_counts[_package(py[-1])] += n
        for f in set(frames):
            incl_counts[f] += n

    def share(c: Counter[str], k: int = top) -> list[list[Any]]:
        return [[f, round(100.0 * n / total, 1)] for f, n in c.most_common(k)] if total else []

    return {
        "samples": total,
        "idle_samples": idle,
        "in_libc_pct": share(libc_counts, 10),
        "self_pct_by_package": share(package_counts, 15),
        "self_pct": share(self_counts),
        "inclusive_pct": share(incl_counts, 60),
    }


IDLE_FRAMES = ("epoll_wait", "epoll_pwait", "poll ", "select ")


def _frame_file(frame: str) -> str:
    # py-spy frames read "func (path/to/module.py:123)"
    return frame.partition(" (")[2].rstrip(")").rsplit(":", 1)[0]


def _short_frame(frame: str) -> str:
    name, file = frame.partition(" (")[0], _frame_file(frame)
    return f"{name} ({file.rpartition('site-packages/')[2]})"


def _package(frame: str) -> str:
    """Top-level package of a frame (py-spy prints paths relative to ``sys.path``)."""
    parts = Path(_frame_file(frame)).parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1 :]
    return parts[0] if parts else "?"


# -- statistics -----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(x: float) -> float | None:
    return None if x != x else round(x * 1000.0, 3)  # NaN (nothing measured) -> null


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return round(statistics.median(xs), 3) if xs else None


def round_stats(
    lat: dict[str, list[Sample]], sat: dict[str, float], cpu: dict[str, dict[str, float]]
) -> dict[str, dict]:
    stats: dict[str, dict] = {}
    for name, samples in lat.items():
        good = [s for s in samples if s.ok]
        ttft = [s.ttft for s in good]
        itl = [s.itl for s in good if s.events > 1]
        stats[name] = {
            "n": len(samples),
            "errors": len(samples) - len(good),
            "ttft_p50_ms": ms(pct(ttft, 50)),
            "ttft_p99_ms": ms(pct(ttft, 99)),
            "itl_p50_ms": ms(pct(itl, 50)),
            "e2e_p50_ms": ms(pct([s.e2e for s in good], 50)),
            "sat_req_per_s": round(sat.get(name, float("nan")), 2),
            # CPU of the proxy process per request it served (low load / saturation), all
            # of it and net of its idle background rate (health checks), and of the
            # upstream per request during this target's saturation phase
            "cpu_ms_per_req_low_load": ms(cpu[name].get("lat", float("nan"))),
            "cpu_ms_per_req_sat": ms(cpu[name].get("sat", float("nan"))),
            "net_cpu_ms_per_req_low_load": ms(cpu[name].get("lat_net", float("nan"))),
            "net_cpu_ms_per_req_sat": ms(cpu[name].get("sat_net", float("nan"))),
            "upstream_cpu_ms_per_req_sat": ms(cpu[name].get("sat_upstream", float("nan"))),
        }
    direct = stats["direct"]
    for st in stats.values():
        st["added_ttft_p50_ms"] = round(st["ttft_p50_ms"] - direct["ttft_p50_ms"], 3)
        st["added_ttft_p99_ms"] = round(st["ttft_p99_ms"] - direct["ttft_p99_ms"], 3)
        st["added_itl_p50_ms"] = round(st["itl_p50_ms"] - direct["itl_p50_ms"], 3)
        st["sat_vs_direct"] = round(st["sat_req_per_s"] / direct["sat_req_per_s"], 3)
    return stats


def summarize(rounds: list[dict[str, dict]], pooled: dict[str, list[Sample]]) -> dict[str, dict]:
    keys = [k for k in rounds[0]["direct"] if k not in ("n", "errors")]
    summary: dict[str, dict] = {}
    for name in rounds[0]:
        row: dict[str, Any] = {k: _median([r[name][k] for r in rounds]) for k in keys}
        good = [s.ttft for s in pooled[name] if s.ok]
        row["pooled_ttft_p99_ms"] = ms(pct(good, 99))
        # The tail's shape: a few far outliers and a fat shoulder call for different fixes.
        row["pooled_ttft_quantiles_ms"] = {
            f"p{q:g}": ms(pct(good, q)) for q in (50, 90, 95, 98, 99, 99.5, 99.9, 100)
        }
        row["pooled_n"] = len(good)
        row["errors"] = sum(r[name]["errors"] for r in rounds)
        summary[name] = row
    for row in summary.values():
        row["pooled_added_ttft_p99_ms"] = round(
            row["pooled_ttft_p99_ms"] - summary["direct"]["pooled_ttft_p99_ms"], 3
        )
    return summary


# -- the run --------------------------------------------------------------------------------


async def run_rounds(fleet: Fleet, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    names = [n for n in TARGETS if n in fleet.urls]
    conn_limit = max(args.sat_concurrency * 2, 8)
    clients: dict[str, Client] = {}

    def connect(targets: list[str]) -> None:
        for n in targets:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=conn_limit, ttl_dns_cache=None),
                timeout=aiohttp.ClientTimeout(total=args.request_timeout_s),
            )
            clients[n] = Client(n, fleet.urls[n], session)

    async def warm_up(targets: list[str]) -> None:
        """Every path used once (connections, engine caches, first-call imports)."""
        warm = await latency_phase(
            [clients[n] for n in targets], fleet.model, 5, args.max_tokens, 0
        )
        await asyncio.gather(
            *(
                saturation_phase(
                    clients[n],
                    fleet.model,
                    args.sat_concurrency,
                    args.sat_concurrency,
                    args.max_tokens,
                    30,
                )
                for n in targets
            )
        )
        failures = {n: [s.error for s in ss if not s.ok] for n, ss in warm.items()}
        if any(failures.values()):
            raise RuntimeError(f"warm-up requests failed: {failures}")

    proxies = [n for n in names if n != "direct"]
    connect(names)
    try:
        await warm_up(names)

        # How each target's CPU time is read: "cpu-clock" (ns) unless Linux refuses.
        cpu_methods = {n: group_cpu(pid).method for n, pid in fleet.pids.items()}
        # Background CPU of each proxy with no requests (health checks): subtracted below.
        idle0 = {n: group_cpu_s(pid) for n, pid in fleet.pids.items() if n in clients}
        t_idle = time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_rate = {
            n: (group_cpu_s(fleet.pids[n]) - c) / (time.perf_counter() - t_idle)
            for n, c in idle0.items()
        }
        deadline = time.monotonic() + args.max_minutes * 60
        rounds: list[dict[str, dict]] = []
        pooled: dict[str, list[Sample]] = {n: [] for n in names}
        errors: dict[str, Counter[str]] = {n: Counter() for n in names}
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                print(f"--max-minutes reached: stopping after {r} rounds", flush=True)
                break
            t_round = time.perf_counter()
            if r and args.fresh_proxies and proxies:
                for n in proxies:
                    await clients.pop(n).session.close()
                await asyncio.to_thread(fleet.restart_proxies)
                connect(proxies)
                await warm_up(proxies)
            rng = random.Random(args.seed * 1_000_003 + r)
            order = rng.sample(names, len(names))
            cpu0 = {n: group_cpu_s(pid) for n, pid in fleet.pids.items()}
            t_lat = time.perf_counter()
            lat = await latency_phase(
                [clients[n] for n in order],
                fleet.model,
                args.latency_requests,
                args.max_tokens,
                offset=r * args.latency_requests,
                rng=rng,
            )
            lat_wall = time.perf_counter() - t_lat
            cpu: dict[str, dict[str, float]] = {n: {} for n in names}
            for n, pid in fleet.pids.items():
                if n in cpu:  # a proxy serves only its own requests: its CPU is theirs
                    used = group_cpu_s(pid) - cpu0[n]
                    cpu[n]["lat"] = used / args.latency_requests
                    cpu[n]["lat_net"] = (used - idle_rate[n] * lat_wall) / args.latency_requests
            sat: dict[str, float] = {}
            for n in order:
                before = {k: group_cpu_s(pid) for k, pid in fleet.pids.items()}
                t_sat = time.perf_counter()
                sat[n], samples = await saturation_phase(
                    clients[n],
                    fleet.model,
                    args.sat_requests,
                    args.sat_concurrency,
                    args.max_tokens,
                    args.phase_budget_s,
                )
                done = max(1, sum(s.ok for s in samples))
                for k in (n, "upstream"):
                    if k in fleet.pids:
                        delta = group_cpu_s(fleet.pids[k]) - before[k]
                        cpu[n]["sat" if k == n else "sat_upstream"] = delta / done
                        if k == n:
                            idle = idle_rate[n] * (time.perf_counter() - t_sat)
                            cpu[n]["sat_net"] = (delta - idle) / done
                errors[n].update(s.error for s in samples if not s.ok)
            for n, ss in lat.items():
                pooled[n].extend(ss)
                errors[n].update(s.error for s in ss if not s.ok)
            stats = round_stats(lat, sat, cpu)
            rounds.append(stats)
            print(
                f"round {r + 1}/{args.rounds} ({time.perf_counter() - t_round:.0f}s): "
                + "  ".join(
                    f"{n} ttft p50 {stats[n]['ttft_p50_ms']:.2f} p99 {stats[n]['ttft_p99_ms']:.2f}"
                    f" ms, {stats[n]['sat_req_per_s']:.0f} req/s"
                    for n in names
                ),
                flush=True,
            )
        scrape = await health_scrape_cost(fleet.urls["direct"])
        profile = None
        if args.py_spy:
            profile = await py_spy_phase(
                clients["ours"], fleet.pids["ours"], args, fleet.model, log_dir
            )
        return {
            "cpu_read_with": cpu_methods,
            "idle_cpu_ms_per_s": {n: ms(v) for n, v in idle_rate.items()},
            "rounds": rounds,
            "summary": summarize(rounds, pooled),
            "health_scrape_parse": scrape,
            "error_kinds": {n: dict(c.most_common(5)) for n, c in errors.items() if c},
            "profile_ours": profile,
        }
    finally:
        for c in clients.values():
            await c.session.close()


async def health_scrape_cost(upstream: str) -> dict[str, Any]:
    """What our proxy's health loop parses every ``health_interval_s`` (2 s by default).

    ``Fleet._check`` fetches the engine's ``/metrics``, picks the lines of the three load
    gauges (``fleet._load_lines``) and parses those with
    ``vllm_pd_ext.util.prom.parse_metrics``, on the event loop: the time it takes is a stall
    for every request in flight at that moment. Parsing the whole scrape is timed beside it.
    """
    from vllm_pd_ext.proxy.config import InstanceConfig
    from vllm_pd_ext.proxy.fleet import Fleet, Instance
    from vllm_pd_ext.util.prom import parse_metrics

    async with httpx.AsyncClient(trust_env=False) as client:
        raw = (await client.get(upstream + "/metrics", timeout=10)).content
    text = raw.decode()
    inst = Instance(InstanceConfig(url=upstream), client=None)  # type: ignore[arg-type]

    def timed(fn: Any) -> float | None:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return ms(statistics.median(times))

    return {
        "bytes": len(raw),
        "lines": text.count("\n"),
        "parse_ms": timed(lambda: parse_metrics(text)),
        "parse_needed_lines_only_ms": timed(lambda: Fleet._read_load(inst, raw)),
    }


def _commit(tree: Path) -> str:
    """The short commit ``tree`` is checked out at ("" when git cannot tell)."""
    with contextlib.suppress(Exception):
        return subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    return ""


def machine() -> dict[str, Any]:
    """nproc, CPU model, versions of everything measured, and the repo commit."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = _commit(REPO)
    dirty = ""
    with contextlib.suppress(Exception):
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "vllm_pd_ext"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_commit": commit,
        "uncommitted_in_vllm_pd_ext": dirty.splitlines(),
        "versions": {
            d: version(d)
            for d in (
                "vllm",
                "vllm-router",
                "vllm-pd-ext",
                "httpx",
                "uvicorn",
                "fastapi",
                "starlette",
                "uvloop",
                "aiohttp",
            )
        },
    }


def print_table(result: dict[str, Any]) -> None:
    s = result["summary"]
    cfg = result["config"]
    m = result["machine"]
    print()
    print(
        f"upstream={cfg['upstream']}  rounds={len(result['rounds'])}  max_tokens="
        f"{cfg['max_tokens']}  latency: {cfg['latency_requests']} sequential req/target/round, "
        f"interleaved  saturation: {cfg['sat_requests']} req at concurrency "
        f"{cfg['sat_concurrency']}  machine: {m['nproc']} x {m['cpu_model']}, load "
        f"{m['loadavg_at_start'][0]:.1f} -> {m['loadavg_at_end'][0]:.1f}"
    )

    def num(x: float | None, width: int, digits: int) -> str:
        return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"

    print("\nlatency, ms (median over rounds; + = excess over direct in the same round)")
    head = (
        f"{'target':<12} {'TTFT p50':>9} {'+p50':>7} {'TTFT p99':>9} {'+p99':>8} "
        f"{'pooled p99':>11} {'+pooled':>8} {'ITL p50':>8} {'+ITL':>7} {'errors':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, row in s.items():
        print(
            f"{name:<12} {num(row['ttft_p50_ms'], 9, 2)} {num(row['added_ttft_p50_ms'], 7, 2)} "
            f"{num(row['ttft_p99_ms'], 9, 2)} {num(row['added_ttft_p99_ms'], 8, 2)} "
            f"{num(row['pooled_ttft_p99_ms'], 11, 2)} "
            f"{num(row['pooled_added_ttft_p99_ms'], 8, 2)} "
            f"{num(row['itl_p50_ms'], 8, 3)} {num(row['added_itl_p50_ms'], 7, 3)} "
            f"{row['errors']:>6}"
        )
    print(
        f"\nsaturation ({cfg['sat_concurrency']} in flight) and proxy CPU per request, ms "
        "(net = minus the proxy's idle background rate)"
    )
    head = (
        f"{'target':<12} {'req/s':>7} {'x direct':>9} {'CPU low load':>13} {'net':>6} "
        f"{'CPU @satur.':>12} {'net':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, row in s.items():
        print(
            f"{name:<12} {num(row['sat_req_per_s'], 7, 1)} {num(row['sat_vs_direct'], 9, 2)} "
            f"{num(row['cpu_ms_per_req_low_load'], 13, 2)} "
            f"{num(row['net_cpu_ms_per_req_low_load'], 6, 2)} "
            f"{num(row['cpu_ms_per_req_sat'], 12, 2)} {num(row['net_cpu_ms_per_req_sat'], 6, 2)}"
        )
    idle = result.get("idle_cpu_ms_per_s") or {}
    scrape = result.get("health_scrape_parse") or {}
    print(
        "idle CPU, ms/s: "
        + ", ".join(f"{n} {v:.1f}" for n, v in idle.items() if v is not None)
        + f"; upstream /metrics: {scrape.get('bytes')} B, parse_metrics "
        f"{scrape.get('parse_ms')} ms (what the proxy does, the load gauges' lines only: "
        f"{scrape.get('parse_needed_lines_only_ms')} ms)"
    )
    ours = s.get("ours")
    if ours:
        goal = ours["added_ttft_p50_ms"] <= 1.0 and ours["added_ttft_p99_ms"] <= 3.0
        vs = s.get("vllm-router")
        line = (
            f"goal (ours: +p50 <= 1 ms, +p99 <= 3 ms): {'met' if goal else 'MISSED'}"
            f" (+p50 {ours['added_ttft_p50_ms']:.2f}, +p99 {ours['added_ttft_p99_ms']:.2f} ms)"
        )
        if vs:
            line += (
                f"; p99 vs vllm-router: {ours['ttft_p99_ms']:.2f} vs {vs['ttft_p99_ms']:.2f} ms "
                f"({'no worse' if ours['ttft_p99_ms'] <= vs['ttft_p99_ms'] else 'WORSE'})"
            )
        print(line)
    for phase, prof in (result.get("profile_ours") or {}).items():
        if not prof.get("self_pct"):
            continue
        print(
            f"\npy-spy, ours, {phase} ({prof['samples']} busy samples, "
            f"{prof['cpu_ms_per_req_while_sampled']} CPU ms/req), self time by package:"
        )
        print(
            "  in libc (syscalls, incl. preempted in them): "
            + ", ".join(f"{f} {p:.1f}%" for f, p in prof["in_libc_pct"][:4])
        )
        print("  " + ", ".join(f"{f} {p:.1f}%" for f, p in prof["self_pct_by_package"][:10]))
        print("  top functions by self time (share of busy samples):")
        for f, p in prof["self_pct"][:10]:
            print(f"  {p:5.1f}%  {f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", choices=("vllm", "fake"), default="vllm")
    p.add_argument("--model", default="tiny-llama", help="tiny model for --upstream vllm")
    p.add_argument("--token-interval-ms", type=float, default=1.0, help="fake upstream only")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-requests", type=int, default=None, help="per target per round")
    p.add_argument("--sat-requests", type=int, default=None, help="per target per round")
    p.add_argument("--sat-concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--idle-s", type=float, default=6.0, help="idle CPU baseline window")
    p.add_argument(
        "--max-minutes", type=float, default=8.0, help="start no new round after this long"
    )
    p.add_argument("--phase-budget-s", type=float, default=30.0, help="cap per saturation phase")
    p.add_argument("--upstream-core", type=int, default=1)
    p.add_argument("--front-core", type=int, default=0, help="load generator and proxies")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="no CPU pinning")
    p.add_argument("--skip-router", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="the targets' order in each round")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout of an earlier commit: its proxy runs beside ours as ours-before",
    )
    p.add_argument(
        "--same-proxies",
        dest="fresh_proxies",
        action="store_false",
        help="keep both proxies' processes for all rounds (default: new ones every round)",
    )
    p.add_argument(
        "--traced",
        action="store_true",
        help="also ours-traced: our proxy with tracing on (--otlp-traces-endpoint, spans "
        "exported over OTLP/HTTP to a collector that takes them, beside the upstream)",
    )
    p.add_argument("--py-spy", action="store_true", help="profile ours in one extra phase")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep-logs", action="store_true", help="keep the process logs directory")
    args = p.parse_args(argv)
    fake = args.upstream == "fake"
    if args.latency_requests is None:
        args.latency_requests = 200 if fake else 40
    if args.sat_requests is None:
        args.sat_requests = 400 if fake else 64
    if args.out is None:
        args.out = RESULTS / ("proxy_overhead_fake.json" if fake else "proxy_overhead.json")
    if args.pin and (os.cpu_count() or 1) < 2:
        args.pin = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    if args.pin:
        _affinity({args.front_core})

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C must stop the run even when a launcher started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.time()
    load_start = os.getloadavg()
    fleet = Fleet(args, log_dir)
    try:
        fleet.start()
        print(f"ready after {time.time() - started:.0f}s: {fleet.urls}", flush=True)
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        measured = asyncio.run(run_rounds(fleet, args, log_dir))
    except KeyboardInterrupt:
        print("interrupted; stopping processes", file=sys.stderr)
        return 130
    finally:
        fleet.close()
        if args.keep_logs:
            print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    result = {
        "benchmark": "proxy_overhead",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "machine": {**machine(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {
            "direct": "the engine itself",
            "ours": "vllm-pd proxy --both URL --log-level warning (pass-through, defaults)",
            "vllm-router": "vllm-router --worker-urls URL --policy round_robin --log-level warning",
            **(
                {"ours-traced": "the same, --otlp-traces-endpoint (OTLP/HTTP, to a sink)"}
                if args.traced
                else {}
            ),
            **(
                {"ours-before": f"the same, from commit {_commit(args.baseline)}"}
                if args.baseline is not None
                else {}
            ),
        },
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
