"""``vllm-pd proxy``: flags and config file to a running proxy."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.util.config_file import read_mapping
from vllm_pd_ext.util.logs import LOG_FORMATS, setup_logging, uvicorn_log_config

ENV_PREFIX = "VLLM_PD_PROXY_"
#: The exit status when the server could not start (``uvicorn.run``'s).
STARTUP_FAILURE = 3
#: The proxy's log lines in text.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_parser(subparsers: Any) -> None:
    """Add the ``proxy`` subcommand to the ``vllm-pd`` parser."""
    defaults = ProxyConfig.model_fields
    p = subparsers.add_parser(
        "proxy",
        help="run the P/D-aware OpenAI-compatible proxy",
        description="OpenAI-compatible front door for prefill and decode `vllm serve` "
        "instances. Settings come from --config (YAML/JSON), then VLLM_PD_PROXY_* "
        "environment variables (e.g. VLLM_PD_PROXY_API_KEY), then flags.",
    )
    p.add_argument("--config", type=Path, help="YAML or JSON file with ProxyConfig fields")
    p.add_argument("--host", default=None, help=f"(default {defaults['host'].default})")
    p.add_argument("--port", type=int, default=None, help=f"(default {defaults['port'].default})")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill instance (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode instance (repeatable)",
    )
    p.add_argument(
        "--both",
        action="append",
        default=[],
        metavar="URL",
        help="an instance serving both roles (repeatable)",
    )
    p.add_argument(
        "--render",
        action="append",
        default=[],
        metavar="URL",
        help="a render server (repeatable); any given turns on token mode: engines get token "
        "ids on /inference/v1/generate (vllm serve --enable-scale-out or --tokens-only)",
    )
    p.add_argument(
        "--instances-file",
        type=Path,
        default=None,
        help="watched JSON/YAML file with an `instances` list",
    )
    p.add_argument(
        "--prefill-policy", default=None, help=f"(default {defaults['prefill_policy'].default})"
    )
    p.add_argument(
        "--decode-policy", default=None, help=f"(default {defaults['decode_policy'].default})"
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="text mode: the served model's directory (its tokenizer.json): text completion "
        "prompts are tokenized to look them up in the engines' prefix indexes",
    )
    p.add_argument(
        "--min-split-prompt-tokens",
        type=int,
        default=None,
        help="prompts shorter than this run colocated (default 256)",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=None,
        help="times an answer whose engine fails part-way moves to another instance "
        f"(default {defaults['max_migrations'].default}; 0: an SSE error event instead)",
    )
    p.add_argument(
        "--no-cost-model", action="store_true", help="never colocate on measured transfer cost"
    )
    p.add_argument(
        "--no-hedge",
        action="store_true",
        help="never start a late split stream colocated beside it (the stall guard's "
        "deadlines alone)",
    )
    p.add_argument(
        "--no-fast-path",
        action="store_true",
        help="serve through uvicorn's own request cycle only (the fast path reads uvicorn "
        "internals, checked at start-up)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces (one per request, a span per stage and leg) to this "
        "OTLP collector, as vLLM's flag of the same name; needs the otel extra (default: off)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: one JSON object per line, with the request id (and trace id) on a "
        "request's lines",
    )
    p.set_defaults(func=main)


def build_config(args: argparse.Namespace) -> ProxyConfig:
    """Merge file, environment and flags (later wins) into one validated config."""
    data: dict[str, Any] = read_mapping(args.config) if args.config else {}
    for key in ("api_key", "admin_token", "metrics_token", "render_api_key", "host", "port"):
        value = os.environ.get(ENV_PREFIX + key.upper())
        if value:
            data[key] = value
    keys = ("host", "port", "instances_file", "prefill_policy", "decode_policy", "tokenizer")
    for key in (*keys, "otlp_traces_endpoint"):
        value = getattr(args, key)
        if value is not None:
            data[key] = str(value) if isinstance(value, Path) else value
    flags = [
        {"url": u, "role": role}
        for role, urls in (("prefill", args.prefill), ("decode", args.decode), ("both", args.both))
        for u in urls
    ]
    if flags:
        data["instances"] = [*data.get("instances", []), *flags]
    if args.render:
        data["render"] = [*data.get("render", []), *args.render]
    decision = dict(data.get("decision", {}))
    if args.min_split_prompt_tokens is not None:
        decision["min_split_prompt_tokens"] = args.min_split_prompt_tokens
    if args.no_cost_model:
        decision["cost_model"] = False
    if decision:
        data["decision"] = decision
    if args.no_hedge:
        data["stall_guard"] = {**data.get("stall_guard", {}), "hedge": False}
    if args.no_fast_path:
        data["fast_path"] = False
    if args.max_migrations is not None:
        data["max_migrations"] = args.max_migrations
    return ProxyConfig.model_validate(data)


def main(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from vllm_pd_ext.proxy.app import create_app
    from vllm_pd_ext.proxy.front_protocol import quiet_server

    try:
        config = build_config(args)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"vllm-pd proxy: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format, TEXT_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        app = create_app(config, freeze_gc=True)
    except RuntimeError as exc:  # tracing asked for without the otel extra
        print(f"vllm-pd proxy: {exc}", file=sys.stderr)
        return 2
    # The request path leaves no reference cycles behind, so collections only walk the young
    # objects of requests in flight: collect every 10,000 net allocations, not every 700
    # (a pass costs ~0.1-0.3 ms, paid by whichever request is running).
    gc.set_threshold(10_000, 10, 10)
    # ``uvicorn.run`` with one process, its server ticking once a second (``quiet_server``)
    server = quiet_server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=args.log_level.lower(),
            log_config=uvicorn_log_config(args.log_level, args.log_format, TEXT_FORMAT),
            access_log=False,
            proxy_headers=False,  # the proxy never reads the client's address
            **app.server_settings(),
        )
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else STARTUP_FAILURE
