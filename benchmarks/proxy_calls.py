"""Python calls per proxied request: a deterministic stand-in for the proxy's CPU per request.

Timing on a shared host is noisy; the number of function calls a request costs is not. This
runs our proxy (``vllm-pd proxy --both URL``, built as the CLI builds it, fast path, uvloop
and all) in this process, in front of the fake upstream ``proxy_overhead.py --upstream fake``
uses (``vllm_pd_ext.testing.fake_engine``, in its own process), and counts with
``sys.setprofile`` every Python function call (a coroutine's or generator's resumption counts
as one, as in cProfile) and every C call the proxy's thread makes for one request, from the
client's first byte to a short settle after its last; then, in a second pass of the same
requests, with ``sys.settrace``, the bytecode instructions each Python function executes
(``--no-opcodes``: not). Requests: one streamed ``/v1/completions`` of ``--max-tokens``
tokens and one non-streamed, each ``--repeat`` times after a warm-up; the client is a thread
of this process (not counted). Tasks that were already running when counting began (uvicorn's
tick, the health loops) are left out; what the loop does for them outside a task (a health
check's connection, a tick's timer) is not, so some runs count more: the run with the fewest
is the one reported.

The fake upstream pauses ``--token-interval-ms`` between tokens (5 ms by default, long enough
under the profiler that every token reaches the proxy as its own read, as at 1 ms without it).

Prints, per request kind, the totals of every run and the top functions of the reported one;
writes ``benchmarks/results/proxy_calls_<label>.json`` (date, commit, every count of it).

    .venv/bin/python benchmarks/proxy_calls.py [--label before|after] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from proxy_overhead import request_body, spawn_fake_upstream, wait_ready

from vllm_pd_ext.proxy import cli
from vllm_pd_ext.util.logs import setup_logging, uvicorn_log_config
from vllm_pd_ext.util.vllm_process import free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
KINDS = ("stream", "whole")


def _where(filename: str) -> str:
    """A source path, short: from the package or ``site-packages`` on."""
    for mark in ("site-packages/", str(REPO) + "/", "/lib/python"):
        if mark in filename:
            return filename.rpartition(mark)[2]
    return filename


class Counting:
    """On the proxy's thread, the background tasks that were running when it started left
    out: ``sys.setprofile``'s calls by function (``opcodes=False``), or ``sys.settrace``'s
    bytecode instructions executed by function (``opcodes=True``; C code runs none)."""

    def __init__(self, opcodes: bool = False) -> None:
        self.opcodes = opcodes
        self.calls: Counter[tuple[str, str]] = Counter()  # (kind, function) -> count
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.calls.clear()
        self._loop = asyncio.get_running_loop()
        self._background = set(asyncio.all_tasks())
        if self.opcodes:
            sys.settrace(self._trace)
        else:
            sys.setprofile(self._event)

    def stop(self) -> None:
        if self.opcodes:
            sys.settrace(None)
        else:
            sys.setprofile(None)

    def _ours(self, code: Any) -> bool:
        """Is this frame's work outside the count?"""
        return asyncio.current_task(self._loop) in self._background or code.co_filename == __file__

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if self._ours(code):
                return
            self.calls["py", _name(code)] += 1
        elif event == "c_call":
            if asyncio.current_task(self._loop) in self._background:
                return
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None)
            if module is None and owner is not None and not isinstance(owner, type(sys)):
                module = type(owner).__module__
            self.calls["c", f"{module}.{arg.__qualname__}"] += 1

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event != "call" or self._ours(code):
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        calls, key = self.calls, ("op", _name(code))

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                calls[key] += 1
            return local

        return local


def _name(code: Any) -> str:
    return f"{code.co_qualname} ({_where(code.co_filename)}:{code.co_firstlineno})"


def _proxy_server(upstream: str, port: int) -> tuple[Any, Any]:
    """The proxy as ``vllm-pd proxy --both UPSTREAM`` builds it (``cli.main``), unstarted."""
    import uvicorn

    from vllm_pd_ext.proxy.app import create_app

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    argv = ["proxy", "--both", upstream, "--port", str(port), "--log-level", "warning"]
    args = parser.parse_args(argv)
    config = cli.build_config(args)
    setup_logging(args.log_level, args.log_format, cli.TEXT_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(config, freeze_gc=True)
    gc.set_threshold(10_000, 10, 10)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            log_config=uvicorn_log_config(args.log_level, args.log_format, cli.TEXT_FORMAT),
            access_log=False,
            proxy_headers=False,
            **app.server_settings(),
        )
    )
    return server, app


def _drive(
    server: Any,
    loop_box: list[asyncio.AbstractEventLoop],
    url: str,
    args: argparse.Namespace,
    out: dict[str, list[Counter]],
    errors: list[str],
) -> None:
    """The client thread: warm up, then count each request; stops the server at the end."""
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.05)
        loop = loop_box[0]
        wait_ready_url(url + "/health")
        counting = Counting()
        tracing = Counting(opcodes=True)

        def on_loop(fn: Any) -> None:
            done = threading.Event()

            def run() -> None:  # the Event's calls outside the count
                if fn in (counting.start, tracing.start):
                    done.set()
                fn()
                if fn in (counting.stop, tracing.stop):
                    done.set()

            loop.call_soon_threadsafe(run)
            if not done.wait(30):
                raise RuntimeError("the proxy's loop did not answer")

        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:

            def one(kind: str, i: int) -> None:
                body = request_body("fake", i, args.max_tokens)
                body["stream"] = kind == "stream"
                with client.stream("POST", "/v1/completions", json=body) as resp:
                    data = resp.read()
                if resp.status_code != 200:
                    raise RuntimeError(f"{kind}: HTTP {resp.status_code}: {data[:300]!r}")
                tokens = data.count(b'"text"') if kind == "stream" else 1
                if kind == "stream" and tokens != args.max_tokens:
                    raise RuntimeError(f"stream: {tokens} token events, not {args.max_tokens}")

            for i in range(args.warmup):
                for kind in KINDS:
                    one(kind, i)
            for i in range(args.repeat):
                for kind in KINDS:
                    for counter, runs in ((counting, out[kind]), (tracing, out[kind + "_op"])):
                        if counter is tracing and not args.opcodes:
                            continue
                        on_loop(counter.start)
                        one(kind, i)
                        time.sleep(args.settle_s)  # the proxy's work after the last byte
                        on_loop(counter.stop)
                        runs.append(Counter(counter.calls))
    except Exception as exc:  # reported by the main thread
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        server.should_exit = True


def wait_ready_url(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def commit() -> str:
    """The commit of the checkout whose ``vllm_pd_ext`` was measured (``PYTHONPATH``)."""
    import vllm_pd_ext

    tree = Path(vllm_pd_ext.__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *a], capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--", "vllm_pd_ext")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def summarize(runs: list[Counter], top: int) -> dict[str, Any]:
    totals = [sum(r.values()) for r in runs]
    # the run with the least else in it: the loop also serves the health checks' connections
    # (outside any task) and uvicorn's tick timers, which some runs catch
    least_run = runs[min(range(len(runs)), key=lambda k: totals[k])]
    py = sum(n for (kind, _), n in least_run.items() if kind in ("py", "op"))
    c = sum(n for (kind, _), n in least_run.items() if kind == "c")
    by_function = {f"{kind} {name}": n for (kind, name), n in least_run.most_common()}
    return {
        "total": py + c,
        "python_calls": py,
        "c_calls": c,
        "totals_per_run": totals,
        "python_calls_per_run": [sum(n for (k, _), n in r.items() if k == "py") for r in runs],
        "spread": max(totals) - min(totals),
        "top": list(by_function.items())[:top],
        "by_function": by_function,
        "median_of_totals": statistics.median(totals),
        "min_of_totals": min(totals),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="before", help="results file: proxy_calls_<label>.json")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--token-interval-ms", type=float, default=5.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--settle-s", type=float, default=0.05)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--no-opcodes",
        dest="opcodes",
        action="store_false",
        help="skip the second pass that counts bytecode instructions (sys.settrace)",
    )
    args = p.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="proxy_calls."))
    fake, upstream = spawn_fake_upstream(log_dir, args.token_interval_ms, None)
    try:
        wait_ready(fake, upstream + "/health", 30)
        port = free_port()
        server, _ = _proxy_server(upstream, port)
        out: dict[str, list[Counter]] = {k: [] for k in KINDS}
        out.update({k + "_op": [] for k in KINDS})
        errors: list[str] = []
        loop_box: list[asyncio.AbstractEventLoop] = []

        async def serve() -> None:
            loop_box.append(asyncio.get_running_loop())
            await server.serve()

        client = threading.Thread(
            target=_drive,
            args=(server, loop_box, f"http://127.0.0.1:{port}", args, out, errors),
            daemon=True,
        )
        client.start()
        # the loop uvicorn.run would run (uvloop when installed), as ``cli.main``'s
        from uvicorn._compat import asyncio_run

        asyncio_run(serve(), loop_factory=server.config.get_loop_factory())
        client.join(10)
    finally:
        fake.stop()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1

    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "python": sys.version.split()[0],
        "loop": type(loop_box[0]).__module__,
        "config": {k: v for k, v in vars(args).items() if k not in ("label", "no_write")},
        "method": "sys.setprofile on the proxy's thread: 'call' (Python frames entered, "
        "resumptions included) and 'c_call' events from the client's request to settle_s "
        "after its response; tasks running before the request left out; the run with the fewest",
    }
    for kind in KINDS:
        s = summarize(out[kind], args.top)
        result[kind] = s
        print(
            f"\n== {kind} /v1/completions ({args.max_tokens} tokens): total {s['total']} "
            f"(python {s['python_calls']}, C {s['c_calls']}); runs {s['totals_per_run']}"
        )
        for name, n in s["top"]:
            print(f"{n:7d}  {name}")
        if out[kind + "_op"]:
            ops = summarize(out[kind + "_op"], args.top)
            result[kind]["opcodes"] = {
                "total": ops["total"],
                "totals_per_run": ops["totals_per_run"],
                "by_function": ops["by_function"],
            }
            print(
                f"\n-- {kind}: bytecode instructions {ops['total']}; runs {ops['totals_per_run']}"
            )
            for name, n in ops["top"][: args.top // 2]:
                print(f"{n:7d}  {name}")
    if not args.no_write:
        path = RESULTS / f"proxy_calls_{args.label}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
