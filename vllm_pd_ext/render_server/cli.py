"""``vllm-pd render``: argument parsing and the uvicorn launch of the render server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from pydantic import ValidationError

from vllm_pd_ext.render_server.settings import API_KEY_ENV, RenderSettings
from vllm_pd_ext.util.logs import LOG_FORMATS, setup_logging, uvicorn_log_config

logger = logging.getLogger(__name__)

_DEFAULTS = RenderSettings.model_fields
#: The render server's log lines in text.
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``render`` subcommand to ``subparsers``; its handler is :func:`main`."""
    p = subparsers.add_parser(
        "render",
        help="run the standalone render / derender server (CPU only, no vLLM needed)",
        description="Serve vLLM-compatible /v1/chat/completions/render, /v1/completions/render "
        "and the matching derender routes for the tokenizer in MODEL_OR_TOKENIZER_DIR.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_OR_TOKENIZER_DIR")
    p.add_argument("--host", default=_DEFAULTS["host"].default)
    p.add_argument("--port", type=int, default=_DEFAULTS["port"].default)
    p.add_argument("--workers", type=int, default=_DEFAULTS["workers"].default)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--chat-template", default=None, help="file path or template text")
    p.add_argument(
        "--chat-template-content-format", default="auto", choices=["auto", "string", "openai"]
    )
    p.add_argument("--default-chat-template-kwargs", type=_json_dict, default=None)
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="built in: deepseek_r1, qwen3, deepseek_v3 (others with --parser-source vllm)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="built in: hermes, llama3_json, deepseek_v3, mistral "
        "(others with --parser-source vllm)",
    )
    p.add_argument(
        "--parser-source",
        default=_DEFAULTS["parser_source"].default,
        choices=["builtin", "vllm"],
        help="builtin: only the built-in parsers (no vLLM needed); vllm: a parser name not "
        "built in is taken from vLLM's parser registry (needs vLLM installed; its parsers "
        "then parse everything, and streaming replays the output per chunk as vLLM does)",
    )
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument(
        "--no-fast-bpe",
        dest="fast_bpe",
        action="store_false",
        help="always encode with the HF tokenizer (by default a tiktoken encoder does the BPE "
        "of byte-level BPE tokenizers once a startup self-check shows identical ids)",
    )
    p.add_argument("--max-logprobs", type=int, default=_DEFAULTS["max_logprobs"].default)
    p.add_argument("--max-body-bytes", type=int, default=_DEFAULTS["max_body_bytes"].default)
    p.add_argument(
        "--max-connections",
        type=int,
        default=_DEFAULTS["max_connections"].default,
        help=_DEFAULTS["max_connections"].description,
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_DEFAULTS["log_format"].default,
        help="json: one JSON object per line, with the request id (and the trace id the "
        "proxy sent) on a request's lines",
    )
    p.set_defaults(func=main)
    return p


def settings_from_args(args: argparse.Namespace) -> RenderSettings:
    """The validated settings for parsed ``args`` (raises ``ValidationError``)."""
    return RenderSettings(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        workers=args.workers,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        parser_source=args.parser_source,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        fast_bpe=args.fast_bpe,
        max_logprobs=args.max_logprobs,
        api_key=os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def server_limits(settings: RenderSettings) -> dict[str, Any]:
    """The uvicorn settings that bound what clients can make a worker hold."""
    return {"limit_concurrency": settings.max_connections}


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted; returns the process exit code."""
    import uvicorn

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"vllm-pd render: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format, TEXT_FORMAT)
    os.environ["VLLM_PD_RENDER_SETTINGS"] = settings.model_dump_json()
    uvicorn.run(
        "vllm_pd_ext.render_server.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(settings.log_level, settings.log_format, TEXT_FORMAT),
        access_log=False,
        **server_limits(settings),
        # a busy shared host can delay a worker's health answer past uvicorn's 5 s default
        timeout_worker_healthcheck=60,
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="vllm-pd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
