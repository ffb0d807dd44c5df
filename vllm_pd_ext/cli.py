"""The ``vllm-pd`` command: one subcommand per tool.

Subcommands import their heavy modules lazily so that ``vllm-pd --help`` and
``vllm-pd kv-size`` stay fast and work without vLLM or torch installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _cmd_kv_size(args: argparse.Namespace) -> int:
    from vllm_pd_ext.tools.kv_size import (
        ConfigError,
        compute_kv_size,
        format_report,
        load_config,
    )

    try:
        size = compute_kv_size(load_config(args.config), args.dtype, args.ssm_dtype)
    except ConfigError as exc:
        print(f"vllm-pd kv-size: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(size.to_json(args.tokens, args.link_gbps), indent=2))
    else:
        print(format_report(size, args.tokens, args.link_gbps))
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from vllm_pd_ext.util.tiny_model import ensure_model

    try:
        print(ensure_model(args.name, args.cache_dir))
    except ValueError as exc:  # an unknown name: the message lists the known ones
        print(f"vllm-pd tiny-model: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_pd_ext.tools.pd_demo import run_demo

    return run_demo(
        model=args.model,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        log_dir=args.log_dir,
        as_json=args.json,
    )


def _cmd_up(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from vllm_pd_ext.tools.launcher import UpConfig, run_up
    from vllm_pd_ext.util.config_file import read_mapping

    data = read_mapping(args.config) if args.config else {}
    flags = {
        "model": args.model,
        "prefill": args.prefill,
        "decode": args.decode,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "connector": args.connector,
        "pdext_backend": args.pdext_backend,
        "pdext_mode": args.pdext_mode,
        "mode": args.mode,
        "render": args.render,
        "device": args.device,
        "proxy_port": args.port,
        "max_model_len": args.max_model_len,
        "min_split_prompt_tokens": args.min_split_prompt_tokens,
        "log_dir": args.log_dir,
        "log_format": args.log_format,
        "otlp_traces_endpoint": args.otlp_traces_endpoint,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if args.gpus:
        data["gpus"] = args.gpus.split(";")
    if args.vllm_arg:
        data["vllm_args"] = args.vllm_arg
    if args.no_cost_model:
        data["cost_model"] = False
    if args.no_kv_events:
        data["kv_events"] = False
    try:
        config = UpConfig.model_validate(data)
    except ValidationError as exc:
        print(f"vllm-pd up: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    return run_up(config)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_pd_ext.tools.doctor import doctor_main

    return doctor_main(
        args.prefill,
        args.decode,
        args.prompts,
        args.prompt_tokens,
        args.link_gbps,
        args.json,
        idle_window_s=args.idle_window_s,
        busy_pct=args.busy_poll_pct,
    )


def _parse_slo(text: str) -> tuple[float, float]:
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        slo[key.strip()] = float(value)
    if set(slo) != {"ttft", "itl"}:
        raise ValueError("--slo needs ttft=MS,itl=MS")
    return slo["ttft"], slo["itl"]


def _cmd_bench(args: argparse.Namespace) -> int:
    from vllm_pd_ext.tools.bench import Workload, bench_main, bench_up_main, stack_configs

    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
        slo_ttft, slo_itl = _parse_slo(args.slo)
    except ValueError as exc:
        print(f"vllm-pd bench: {exc}", file=sys.stderr)
        return 2
    if not rates and not args.sequential:
        print("vllm-pd bench: nothing to run: give --rates or --sequential", file=sys.stderr)
        return 2
    workload = Workload(
        rates=rates,
        requests_per_rate=args.requests,
        sequential=args.sequential,
        long_fraction=args.long_fraction,
        long_tokens=args.long_tokens,
        short_tokens=args.short_tokens,
        output_tokens=args.output_tokens,
    )
    if not args.up:
        stack_only = [f for f in ("connector", "pdext_backend", "config") if getattr(args, f)]
        if stack_only:
            flags = ", ".join("--" + f.replace("_", "-") for f in stack_only)
            print(f"vllm-pd bench: {flags} only with --up", file=sys.stderr)
            return 2
        if not (args.colocated and args.pd):
            print("vllm-pd bench: give --colocated and --pd, or --up", file=sys.stderr)
            return 2
        return bench_main(
            args.colocated,
            args.pd,
            args.model,
            workload,
            slo_ttft,
            slo_itl,
            args.json,
            args.png,
        )
    connectors = args.connector.split(",") if args.connector else None
    try:
        configs = stack_configs(args.config, connectors, args.pdext_backend)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"vllm-pd bench: invalid stack configuration:\n{exc}", file=sys.stderr)
        return 2
    return bench_up_main(
        configs, workload, slo_ttft, slo_itl, args.json, args.png, label_rows=bool(args.connector)
    )


def build_parser() -> argparse.ArgumentParser:
    from vllm_pd_ext import __version__
    from vllm_pd_ext.util.logs import LOG_FORMATS

    parser = argparse.ArgumentParser(
        prog="vllm-pd",
        description="Disaggregated prefill/decode serving tools for stock vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-pd-ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    kv = sub.add_parser(
        "kv-size",
        help="KV-cache bytes per token and per prompt for a Hugging Face config.json",
        description="Print KV-cache bytes per token, per prompt and per P/D transfer for the "
        "model a config.json describes (full attention with GQA, MLA, sliding-window and "
        "hybrid attention + SSM models).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    kv.add_argument("config", help="path to config.json or to the model directory holding it")
    kv.add_argument("--tokens", type=_positive_int, default=8192, help="prompt length")
    kv.add_argument(
        "--dtype",
        default="auto",
        help="KV cache dtype: auto (the model's), bfloat16, float16, float32, fp8",
    )
    kv.add_argument(
        "--ssm-dtype",
        default="auto",
        help="SSM (temporal) state dtype for hybrid models; auto = same as --dtype",
    )
    kv.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=None,
        help="also print the ideal transfer time over a link of this many Gb/s",
    )
    kv.add_argument("--json", action="store_true", help="print one JSON object")
    kv.set_defaults(func=_cmd_kv_size)

    tiny = sub.add_parser(
        "tiny-model",
        help="build (or find cached) a tiny random-weight test model and print its path",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tiny.add_argument("name", help="a tiny model's name (an unknown one lists them all)")
    tiny.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder (default: $VLLM_PD_EXT_CACHE or ~/.cache/vllm-pd-ext)",
    )
    tiny.set_defaults(func=_cmd_tiny_model)

    demo = sub.add_parser(
        "demo",
        help="run one real P/D request on a tiny model (two vllm serve, NixlConnector on CPU)",
        description="Start a prefill and a decode `vllm serve` with vLLM's NixlConnector on "
        "CPU, send one greedy request through both legs and compare it with the same "
        "request served colocated. Needs vLLM and nixl installed (scripts/bootstrap.sh).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--model", default="tiny-llama", help="tiny-llama, tiny-qwen, or a local model directory"
    )
    demo.add_argument("--prompt-tokens", type=_positive_int, default=300)
    demo.add_argument("--max-tokens", type=_positive_int, default=32)
    demo.add_argument("--log-dir", type=Path, default=Path("logs/demo"))
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(func=_cmd_demo)

    up = sub.add_parser(
        "up",
        help="start, supervise and stop a local P/D stack (engines + proxy) with one command",
        description="Start N prefill and M decode `vllm serve` instances with the connector's "
        "--kv-transfer-config (in token mode also render servers, engines on "
        "--enable-scale-out) and the proxy in front of them; wait until healthy; print the "
        "endpoint; restart parts that die; Ctrl-C stops everything it started.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    up.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML/JSON file with UpConfig fields (flags override it)",
    )
    up.add_argument(
        "--model",
        default=None,
        help="tiny-llama, tiny-qwen, or a model dir/name (default tiny-llama)",
    )
    up.add_argument("--prefill", type=int, default=None, help="prefill instances (default 1)")
    up.add_argument("--decode", type=int, default=None, help="decode instances (default 1)")
    up.add_argument(
        "--prefill-tp",
        type=int,
        default=None,
        help="tensor-parallel ranks per prefill instance (default 1; cpu: a core per rank)",
    )
    up.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="tensor-parallel ranks per decode instance (default 1; connector pdext: the "
        "same as --prefill-tp)",
    )
    up.add_argument(
        "--connector",
        default=None,
        help="KV connector: pdext (our PdExtMoRIIOConnector, read mode) or nixl (vLLM's "
        "NixlConnector) (default pdext)",
    )
    up.add_argument(
        "--pdext-backend",
        default=None,
        help="transport of --connector pdext: tcp (our own data path) or mooncake (the "
        "Mooncake transfer engine over TCP) (default tcp)",
    )
    up.add_argument(
        "--pdext-mode",
        default=None,
        choices=("read", "write"),
        help="transfer mode of --connector pdext: read (the decode pulls) or write (the "
        "prefill pushes); both between any TP sizes that divide the KV heads (default read)",
    )
    up.add_argument(
        "--mode",
        default=None,
        help="text: the proxy forwards OpenAI requests; token: render servers turn them into "
        "token ids for engines on --enable-scale-out (default text)",
    )
    up.add_argument(
        "--render", type=int, default=None, help="render servers in token mode (default 1)"
    )
    up.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    up.add_argument(
        "--gpus", default=None, help="CUDA_VISIBLE_DEVICES per instance, ';'-separated (e.g. '0;1')"
    )
    up.add_argument("--port", type=int, default=None, help="proxy port (default 8000)")
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--min-split-prompt-tokens", type=int, default=None)
    up.add_argument("--no-cost-model", action="store_true")
    up.add_argument(
        "--no-kv-events",
        action="store_true",
        help="engines publish no KV cache events; the proxy routes on the prefix estimate",
    )
    up.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra argument for every vllm serve (repeatable)",
    )
    up.add_argument("--log-dir", type=Path, default=None)
    up.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="json: up's lines, the proxy's and the render servers' as one JSON object per "
        "line (default text)",
    )
    up.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="OpenTelemetry collector for the proxy's and the engines' traces, one per "
        "request (needs the otel extra; default off)",
    )
    up.set_defaults(func=_cmd_up)

    from vllm_pd_ext.tools.engine_checks import BUSY_POLL_PCT, IDLE_WINDOW_S

    doc = sub.add_parser(
        "doctor",
        help="measure a running P/D pair and say what makes KV transfer slow",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    doc.add_argument("--prefill", required=True, metavar="URL", help="a prefill instance")
    doc.add_argument("--decode", required=True, metavar="URL", help="a decode instance")
    doc.add_argument("--prompts", type=_positive_int, default=3, help="measured prompts")
    doc.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=None,
        help="prompt length (default: the model's context minus 16, at most 4096)",
    )
    doc.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=None,
        help="the link speed the transfer should reach, for comparison",
    )
    doc.add_argument(
        "--idle-window-s",
        type=_non_negative_float,
        default=IDLE_WINDOW_S,
        help="seconds over which each idle engine on this host has its CPU measured (0: not)",
    )
    doc.add_argument(
        "--busy-poll-pct",
        type=_positive_float,
        default=BUSY_POLL_PCT,
        help="an idle engine using this much of one core (%%) or more is warned about",
    )
    doc.add_argument("--json", action="store_true")
    doc.set_defaults(func=_cmd_doctor)

    bench = sub.add_parser(
        "bench",
        help="goodput A/B: the same workload against colocated and P/D serving",
        description="Poisson arrivals at several rates, long and short streaming prompts, "
        "against a colocated endpoint and a P/D endpoint; TTFT/ITL percentiles, goodput "
        "under the SLO, a table, JSON (every request's figures) and a PNG; with --sequential "
        "also N requests one at a time. Every prompt is unique (no prefix-cache help). Give "
        "both endpoints, or --up to bring up a local 1P1D stack (colocated = its decode "
        "instance, P/D = its proxy), one per --connector.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument("--colocated", metavar="URL", help="colocated endpoint")
    bench.add_argument("--pd", metavar="URL", help="P/D endpoint (a vllm-pd proxy)")
    bench.add_argument("--up", action="store_true", help="bring up a local stack to measure")
    bench.add_argument(
        "--connector",
        default=None,
        metavar="NAMES",
        help="with --up: one stack per connector in turn, comma-separated (pdext, nixl), "
        "each measured colocated and P/D, all rows in one table and JSON",
    )
    bench.add_argument(
        "--pdext-backend",
        default=None,
        help="with --up: the transport of connector pdext, as `vllm-pd up` has it (tcp, mooncake)",
    )
    bench.add_argument(
        "--config",
        type=Path,
        default=None,
        help="with --up: a `vllm-pd up` YAML/JSON file for the stacks (default: tiny-llama "
        "1P1D, every prompt split); the proxy's cost model is always off",
    )
    bench.add_argument("--model", default=None, help="served model name (default: ask /v1/models)")
    bench.add_argument(
        "--rates", default="1,2,4", help="request rates, req/s ('' for none: --sequential only)"
    )
    bench.add_argument("--requests", type=_positive_int, default=20, help="requests per rate")
    bench.add_argument(
        "--sequential",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="also N requests of --long-tokens one after another (before the rates), the "
        "two endpoints taking turns",
    )
    bench.add_argument("--long-fraction", type=float, default=0.3)
    bench.add_argument("--long-tokens", type=_positive_int, default=400)
    bench.add_argument("--short-tokens", type=_positive_int, default=32)
    bench.add_argument("--output-tokens", type=_positive_int, default=32)
    bench.add_argument("--slo", default="ttft=1000,itl=100", help="SLOs in ms")
    bench.add_argument("--json", type=Path, default=Path("bench-results/bench.json"))
    bench.add_argument("--png", type=Path, default=Path("bench-results/bench.png"))
    bench.set_defaults(func=_cmd_bench)

    from vllm_pd_ext.proxy.cli import add_parser as add_proxy_parser
    from vllm_pd_ext.render_server.cli import add_parser as add_render_parser

    add_proxy_parser(sub)
    add_render_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `vllm-pd kv-size ... | head`: not an error worth a trace
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
