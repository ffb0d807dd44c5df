"""Settings of one render server process: a pydantic model built once in ``main()``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from vllm_pd_ext.render_server.parsers import REASONING_PARSERS, TOOL_PARSERS
from vllm_pd_ext.util.logs import LogFormat

#: Keys of ``config.json`` that give a model's context length, in the order vLLM tries them.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)

_VLLM_MISSING = (
    "parser_source 'vllm' resolves parser {name!r} through vLLM's parser registry, but vLLM is "
    "not installed in this environment (pip install 'vllm-pd-ext[vllm]' or '[cpu]'), or use a "
    "built-in parser"
)


def _check_vllm_registered(kind: str, name: str) -> None:
    """Raise ``ValueError`` unless vLLM is importable and registers ``name`` as a ``kind``
    ("reasoning parser" or "tool-call parser"). Runs when the settings are validated."""
    try:
        if kind == "reasoning parser":
            from vllm.reasoning import ReasoningParserManager as manager
        else:
            from vllm.tool_parsers import ToolParserManager as manager
    except ImportError:
        raise ValueError(_VLLM_MISSING.format(name=name)) from None
    registered = manager.list_registered()
    if name not in registered:
        raise ValueError(
            f"unknown {kind} {name!r}: neither built in nor registered in vLLM "
            f"({', '.join(sorted(registered))})"
        )


#: Where ``vllm-pd render`` and its worker processes read the API key (never a flag: it would
#: show in the process list).
API_KEY_ENV = "VLLM_PD_RENDER_API_KEY"


class RenderSettings(BaseModel):
    """Everything a render server needs; validated once, fails fast on a bad value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="model or tokenizer directory (holds tokenizer files)")
    served_model_name: str | None = Field(
        default=None, description="name in /v1/models and responses; default: the path given"
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=0, le=65535)
    workers: int = Field(default=1, ge=1, description="uvicorn worker processes")
    max_model_len: int | None = Field(
        default=None, ge=1, description="context length; default: the model's config.json"
    )
    chat_template: str | None = Field(
        default=None, description="a template file path or the template text itself"
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    parser_source: Literal["builtin", "vllm"] = Field(
        default="builtin",
        description="where parser names resolve: only the built-in parsers, or vLLM's parser "
        "registry for names not built in (needs vLLM installed)",
    )
    enable_auto_tool_choice: bool = False
    fast_bpe: bool = Field(
        default=True,
        description="encode byte-level BPE text with tiktoken when a startup self-check shows "
        "ids identical to the HF tokenizer (else HF is used); False: always HF",
    )
    max_logprobs: int = Field(default=20, ge=-1)
    api_key: SecretStr | None = Field(
        default=None,
        exclude=True,  # never in a dump: workers read it from API_KEY_ENV themselves
        description=f"bearer token every route but /health needs (from ${API_KEY_ENV})",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="client connections at once per worker process; beyond them, requests "
        "get 503 (slow or many clients cannot exhaust the worker)",
    )
    max_n: int = Field(default=16384, ge=1)
    max_derender_streams: int = Field(
        default=1024,
        ge=1,
        description="long-lived streaming derender calls at once per worker process; beyond "
        "them, 503 (the caller derenders per event)",
    )
    derender_stream_idle_s: float = Field(
        default=300.0, gt=0, description="longest wait for the next line of a streaming call"
    )
    derender_stream_max_s: float = Field(
        default=3600.0, gt=0, description="longest life of one streaming derender call"
    )
    log_level: str = "info"
    log_format: LogFormat = Field(
        default="text", description="json: one JSON object per line, with the request id"
    )

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, value: str) -> str:
        if not Path(value).is_dir():
            raise ValueError(f"model directory {value!r} does not exist")
        return value

    @model_validator(mode="after")
    def _known_parsers(self) -> RenderSettings:
        for kind, value, built_in in (
            ("reasoning parser", self.reasoning_parser, REASONING_PARSERS),
            ("tool-call parser", self.tool_call_parser, tuple(TOOL_PARSERS)),
        ):
            if value is None or value in built_in:
                continue
            if self.parser_source == "builtin":
                raise ValueError(
                    f"unknown {kind} {value!r}; built in: {', '.join(built_in)} "
                    "(parser_source 'vllm' takes the names vLLM registers)"
                )
            _check_vllm_registered(kind, value)
        return self

    @property
    def uses_vllm_parsers(self) -> bool:
        """True when a configured parser name resolves through vLLM's registry (then vLLM's
        composed parser does all reasoning and tool parsing, as in ``vllm launch render``)."""
        return self.parser_source == "vllm" and (
            (self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS)
            or (self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS)
        )

    @property
    def model_name(self) -> str:
        """The name clients use for this model (vLLM's default: the path as given)."""
        return self.served_model_name or self.model

    def resolved_max_model_len(self, tokenizer_max_len: int | None = None) -> int:
        """``max_model_len`` if set, else the model's context length from ``config.json``."""
        if self.max_model_len is not None:
            return self.max_model_len
        config_path = Path(self.model) / "config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            text_config = config.get("text_config") or {}
            for source in (config, text_config):
                for key in _CONTEXT_KEYS:
                    value = source.get(key)
                    if isinstance(value, int) and value > 0:
                        return value
        if tokenizer_max_len and tokenizer_max_len < 10**9:
            return tokenizer_max_len
        return 2048

    def resolved_chat_template(self) -> str | None:
        """The ``--chat-template`` text: read from a file when it names one."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        try:
            if path.is_file():
                return path.read_text()
        except OSError:
            pass
        return self.chat_template
