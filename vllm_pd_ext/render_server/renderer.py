"""Render: an OpenAI chat or completion request -> vLLM ``GenerateRequest`` bodies.

Applies the chat template exactly as vLLM 0.32 does (message normalisation, tool dicts,
template kwargs filtered to what the template reads), tokenizes with the Rust backend, checks
the prompt against ``max_model_len`` with vLLM's wording and maps sampling parameters with
:mod:`.sampling`. Runs in the server's worker process; pure CPU, no I/O.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from typing import Any

from vllm_pd_ext.render_server.errors import RenderError
from vllm_pd_ext.render_server.parsers import (
    reasoning_active,
    reasoning_keeps_special_tokens,
    reasoning_parser,
)
from vllm_pd_ext.render_server.protocol import ChatCompletionRequest, CompletionRequest
from vllm_pd_ext.render_server.sampling import (
    check_response_format,
    get_max_tokens,
    request_structured_outputs,
    to_sampling_params,
    validation_error,
)
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import TokenizerInfo
from vllm_pd_ext.render_server.tool_choice import (
    check_tool_usage,
    forced_name,
    is_forced,
    tool_structured_outputs,
)

logger = logging.getLogger(__name__)

#: ``apply_chat_template`` parameters always accepted (transformers' own signature).
_HF_BASE_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_OPENAI_CONTENT_LOOP = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+(?:\w+\.content|\w+\[['\"]content['\"]\])(?:\s*\|[^%]*)?\s*-?%\}"
)


def _random_id() -> str:
    return uuid.uuid4().hex[:16]


def detect_content_format(template: str | None) -> str:
    """'openai' when the template iterates over message content parts, else 'string'."""
    if template and _OPENAI_CONTENT_LOOP.search(template):
        return "openai"
    return "string"


def _template_variables(template: str) -> frozenset[str]:
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except Exception:  # an unparsable template fails later with a clear error
        return frozenset()


class Renderer:
    """Turns requests into GenerateRequest dicts for one tokenizer and one settings object."""

    def __init__(self, settings: RenderSettings, tok: TokenizerInfo) -> None:
        self.settings = settings
        self.tok = tok
        self.max_model_len = settings.resolved_max_model_len(tok.hf.model_max_length)
        self.template = tok.chat_template
        fmt = settings.chat_template_content_format
        self.content_format = detect_content_format(self.template) if fmt == "auto" else fmt
        self.template_vars = _template_variables(self.template) if self.template else frozenset()
        self.default_sampling_params = _generation_defaults(settings.model)
        self.tools_enabled = settings.enable_auto_tool_choice and settings.tool_call_parser

    # ---- shared ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 (vLLM's wording) when ``model`` names another model."""
        if model is not None and model != self.settings.model_name:
            from vllm_pd_ext.render_server.errors import ModelNotFoundError

            raise ModelNotFoundError(model)

    def _check_prompt_len(self, ids: list[int]) -> None:
        limit = self.max_model_len
        if len(ids) > limit:
            count = min(len(ids), limit + 1)  # vLLM encodes with max_length = limit + 1
            qualifier = "at least " if count == limit + 1 else ""
            raise validation_error(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains {qualifier}{count} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                count,
            )

    def _check_text_len(self, text: str) -> None:
        max_chars = self.max_model_len * self.tok.max_chars_per_token
        if len(text) > max_chars:
            raise validation_error(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {len(text)} characters (more than "
                f"{max_chars} characters, which is the upper bound for "
                f"{self.max_model_len} input tokens). Please reduce the length of the "
                "input prompt.",
                "input_text",
                len(text),
            )

    def _check_output_budget(self, requested: int | None, param: str) -> None:
        if requested is not None and requested > self.max_model_len:
            raise validation_error(
                f"{param}={requested} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens.",
                param,
                requested,
            )

    def _truncate(self, ids: list[int], truncate: int | None, side: str | None) -> list[int]:
        if truncate is None:
            return ids
        if truncate < 0:
            truncate = max(0, self.max_model_len - 1)
        if truncate > self.max_model_len:
            raise validation_error(
                f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len "
                f"= {self.max_model_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
                truncate,
            )
        if truncate >= len(ids):
            return ids
        if truncate == 0:
            return []
        return ids[-truncate:] if side == "left" else ids[:truncate]

    # ---- chat ------------------------------------------------------------------------------

    def conversation(self, request: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as vLLM hands them to the template (content joined or wrapped)."""
        conv: list[dict[str, Any]] = []
        wrap = self.content_format == "openai"
        for i, msg in enumerate(request.messages):
            role = msg.get("role")
            if not isinstance(role, str):
                raise RenderError(f"messages[{i}].role must be a string", param="messages")
            content = msg.get("content")
            if content is None:
                parts: list[Any] = []
            elif isinstance(content, str):
                parts = [{"type": "text", "text": content}]
            elif isinstance(content, list):
                parts = content
            else:
                raise RenderError(
                    f"messages[{i}].content must be a string or a list", param="messages"
                )
            texts = []
            for part in parts:
                if isinstance(part, str):
                    texts.append(part)
                    continue
                if not isinstance(part, dict) or part.get("type") not in ("text", None):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RenderError(
                        f"content part type {kind!r} is not supported by this render server "
                        "(text only)",
                        param="messages",
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise RenderError("text content parts need a string 'text'", param="messages")
                texts.append(text)
            if wrap:
                out: dict[str, Any] = {
                    "role": role,
                    "content": [{"type": "text", "text": t} for t in texts],
                }
            else:
                out = {"role": role, "content": "\n".join(texts)}
            if role == "assistant":
                if msg.get("tool_calls") is not None:
                    out["tool_calls"] = _tool_calls_for_template(msg["tool_calls"])
                    if not out["tool_calls"]:
                        out.pop("tool_calls")
                if msg.get("reasoning") is not None:
                    out["reasoning"] = msg["reasoning"]
                    out["reasoning_content"] = msg["reasoning"]
            elif role == "tool":
                if "tool_call_id" in msg:
                    out["tool_call_id"] = msg["tool_call_id"]
                if isinstance(out["content"], list):
                    out["content"] = "\n".join(t["text"] for t in out["content"])
            if isinstance(msg.get("name"), str):
                out["name"] = msg["name"]
            conv.append(out)
        return conv

    def chat_template_kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Template kwargs vLLM passes: server defaults < request kwargs < request flags."""
        user = request.chat_template_kwargs or {}
        bad = {"chat_template", "tokenize"} & user.keys()
        if bad:
            raise RenderError(f"Found unexpected chat template kwargs from request: {bad}")
        extra: dict[str, Any] = {
            "add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
            "documents": request.documents,
            "reasoning_effort": request.reasoning_effort,
        }
        if request.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = request.reasoning_effort != "none"
        unset = (None, "auto")
        merged = {**user, **{k: v for k, v in extra.items() if v not in unset}}
        # vLLM folds its --cohere-format default (cmd4) into the default kwargs
        defaults = {"cohere_format": "cmd4", **self.settings.default_chat_template_kwargs}
        if defaults:
            merged = {**defaults, **{k: v for k, v in merged.items() if v not in unset}}
        return merged

    def render_chat_text(self, request: ChatCompletionRequest) -> str:
        """The prompt text the chat template produces for ``request``."""
        if request.chat_template is not None:
            raise RenderError(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template."
            )
        if self.template is None:
            raise RenderError(
                "As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one."
            )
        tool_choice = request.tool_choice
        if request.tools and tool_choice == "auto" and not self.tools_enabled:
            raise RenderError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        if request.tools and is_forced(tool_choice) and not self.settings.tool_call_parser:
            desc = (
                f'function "{forced_name(tool_choice)}"'
                if isinstance(tool_choice, dict)
                else f'"{tool_choice}"'
            )
            raise RenderError(f"tool_choice={desc} requires --tool-call-parser to be set")
        tools = None if request.tools is None else [_tool_dict(t) for t in request.tools]
        kwargs = self.chat_template_kwargs(request)
        accept = self.template_vars | _HF_BASE_PARAMS
        kwargs = {k: v for k, v in kwargs.items() if k in accept}
        conversation = self.conversation(request)
        try:
            return self.tok.hf.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                **kwargs,
            )
        except RenderError:
            raise
        except Exception as exc:
            raise RenderError(f"chat template error: {exc}") from exc

    def render_chat(
        self, request: ChatCompletionRequest, request_id: str | None = None
    ) -> dict[str, Any]:
        """The GenerateRequest (as a JSON-ready dict) vLLM's render server returns."""
        # request-level checks vLLM's pydantic models run before anything else
        check_tool_usage({"tools": request.tools, "tool_choice": request.tool_choice})
        check_response_format(request)
        self.check_model(request.model)
        if request.use_beam_search:
            raise RenderError("Beam search is not supported by the render endpoint")
        requested = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        self._check_output_budget(
            requested,
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        )
        forced = is_forced(request.tool_choice) and bool(self.settings.tool_call_parser)
        if forced and request.tools and self.settings.uses_vllm_parsers:
            # vLLM's own parser's adjust_request decides skip_special_tokens too
            from vllm_pd_ext.render_server.parsers.vllm_registry import adjusted_constraint

            kwargs = self.chat_template_kwargs(request)
            _, skip = adjusted_constraint(self.settings, self.tok, request, kwargs)
            request = request.model_copy(update={"skip_special_tokens": skip})
        elif (self.tools_enabled or forced) and request.tools and request.tool_choice != "none":
            # hermes' adjust_request: keep <tool_call> markers in the detokenized text
            request = request.model_copy(update={"skip_special_tokens": False})
        elif reasoning_keeps_special_tokens(self.settings.reasoning_parser):
            request = request.model_copy(update={"skip_special_tokens": False})
        text = self.render_chat_text(request)
        if request.truncate_prompt_tokens is None:
            self._check_text_len(text)
        ids = self.tok.encode(text, add_special_tokens=request.add_special_tokens)
        ids = self._truncate(ids, request.truncate_prompt_tokens, _side(request))
        self._check_prompt_len(ids)
        if not ids:
            raise RenderError("No token_ids rendered")
        max_tokens = get_max_tokens(
            self.max_model_len,
            requested,
            len(ids),
            self.default_sampling_params,
            request.truncate_prompt_tokens,
        )
        params = to_sampling_params(
            request,
            max_tokens,
            self.default_sampling_params,
            max_logprobs=self.settings.max_logprobs,
            **self._tool_constraint(request),
        )
        rid = request_id or request.request_id or _random_id()
        return _generate_request(
            f"chatcmpl-{rid}",
            ids,
            params,
            request,
            reasoning_parser_kwargs=self._reasoning_parser_kwargs(request),
            reasoning_ended=self._reasoning_ended(request, ids),
        )

    def _tool_constraint(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """``structured_outputs`` for :func:`to_sampling_params` when the tool parser's
        ``adjust_request`` replaces the request's own (see :mod:`.tool_choice`)."""
        parser = self.settings.tool_call_parser
        if not parser or not request.tools or request.tool_choice == "none":
            return {}
        if self.settings.uses_vllm_parsers:
            if not is_forced(request.tool_choice):
                return {}
            # vLLM's own parser decides the constraint (JSON schema or structural tag)
            from vllm_pd_ext.render_server.parsers.vllm_registry import adjusted_constraint

            kwargs = self.chat_template_kwargs(request)
            so, _ = adjusted_constraint(self.settings, self.tok, request, kwargs)
            return {"structured_outputs": so}
        replaced, so = tool_structured_outputs(
            [_tool_dict(t) for t in request.tools],
            request.tool_choice,
            request.parallel_tool_calls,
            parser,
            lambda: request_structured_outputs(request),
            (request.structured_outputs, request.response_format),
        )
        return {"structured_outputs": so} if replaced else {}

    def _reasoning_ended(self, request: ChatCompletionRequest, ids: list[int]) -> bool | None:
        """vLLM's ``resolve_reasoning_ended``: None without a reasoning parser."""
        if not request.include_reasoning:
            return True
        if self.settings.reasoning_parser is None:
            return None
        if self.settings.uses_vllm_parsers:
            from vllm_pd_ext.render_server.parsers.vllm_registry import reasoning_ended

            kwargs = self.chat_template_kwargs(request)
            return reasoning_ended(self.settings, self.tok, request, ids, kwargs)
        name = self.settings.reasoning_parser
        if not reasoning_active(name, self.chat_template_kwargs(request)):
            return True  # vLLM's identity parser: reasoning never open
        return reasoning_parser(self.tok, name).prompt_ended_reasoning(ids)

    def _reasoning_parser_kwargs(self, request: ChatCompletionRequest) -> dict[str, Any] | None:
        if self.settings.reasoning_parser is None:
            return None
        return {"chat_template_kwargs": self.chat_template_kwargs(request)}

    # ---- completions -----------------------------------------------------------------------

    def render_completion(
        self, request: CompletionRequest, request_id: str | None = None
    ) -> list[dict[str, Any]]:
        """One GenerateRequest dict per prompt, as vLLM's ``/v1/completions/render``."""
        check_response_format(request)
        self.check_model(request.model)
        if request.use_beam_search:
            raise RenderError("Beam search is not supported by the render endpoint")
        self._check_output_budget(request.max_tokens, "max_tokens")
        prompt = request.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise RenderError("Prompt cannot be empty", param="prompt")
        if request.suffix is not None:
            raise RenderError("suffix is not currently supported", param="suffix")
        prompts: list[str | list[int]]
        if isinstance(prompt, str):
            prompts = [prompt]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            if request.truncate_prompt_tokens is None:
                self._check_text_len(text)
        encoded = iter(self.tok.encode_batch(texts, add_special_tokens=request.add_special_tokens))
        all_ids: list[list[int]] = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else list(p)
            if not isinstance(p, str) and any(t < 0 or t >= self.tok.vocab_size for t in ids):
                bad = next(t for t in ids if t < 0 or t >= self.tok.vocab_size)
                raise RenderError(f"Token id {bad} is out of vocabulary", param="prompt")
            ids = self._truncate(ids, request.truncate_prompt_tokens, _side(request))
            self._check_prompt_len(ids)
            if not ids:
                raise RenderError("No token_ids rendered")
            all_ids.append(ids)
        base = f"cmpl-{request_id or request.request_id or _random_id()}"
        out = []
        for i, ids in enumerate(all_ids):
            max_tokens = get_max_tokens(
                self.max_model_len,
                request.max_tokens,
                len(ids),
                self.default_sampling_params,
                request.truncate_prompt_tokens,
            )
            params = to_sampling_params(
                request,
                max_tokens,
                self.default_sampling_params,
                max_logprobs=self.settings.max_logprobs,
            )
            rid = base if len(all_ids) == 1 else f"{base}-{i}"
            out.append(_generate_request(rid, ids, params, request))
        return out


def _side(request: ChatCompletionRequest | CompletionRequest) -> str | None:
    side = getattr(request, "truncation_side", None)
    return side if side in ("left", "right") else None


def _tool_dict(tool: dict[str, Any]) -> dict[str, Any]:
    """A request tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RenderError("tools entries must be objects of type 'function'", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RenderError("each tool needs a function object with a string name", param="tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RenderError("tool function parameters must be a JSON object", param="tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise RenderError("tool function description must be a string", param="tools")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": desc, "parameters": params}
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    defer = fn.get("defer_loading", tool.get("defer_loading"))
    if defer is not None:
        out_fn["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _tool_calls_for_template(tool_calls: Any) -> list[dict[str, Any]]:
    """Assistant tool calls with ``arguments`` parsed to a dict, as vLLM does."""
    if not isinstance(tool_calls, list):
        raise RenderError("assistant tool_calls must be a list", param="tool_calls")
    out = []
    for item in tool_calls:
        if not isinstance(item, dict):
            raise RenderError("assistant tool_calls entries must be objects.", param="tool_calls")
        item = copy.deepcopy(item)
        fn = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RenderError(
                "chat completions only support assistant tool_calls of type 'function'.",
                param="tool_calls",
            )
        args = fn.get("arguments")
        if args:
            parsed: Any = args
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        else:
            fn["arguments"] = {}
        out.append(item)
    return out


def _generation_defaults(model_dir: str) -> dict[str, Any]:
    """vLLM's ``get_diff_sampling_param`` for ``generation_config="auto"``."""
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    keys = (
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "max_new_tokens",
    )
    diff = {k: config[k] for k in keys if config.get(k) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff


def _generate_request(
    request_id: str,
    token_ids: list[int],
    sampling_params: dict[str, Any],
    request: ChatCompletionRequest | CompletionRequest,
    *,
    reasoning_parser_kwargs: dict[str, Any] | None = None,
    reasoning_ended: bool | None = None,
) -> dict[str, Any]:
    stream_options = None
    if request.stream and request.stream_options is not None:
        stream_options = {
            "include_usage": request.stream_options.include_usage,
            "continuous_usage_stats": request.stream_options.continuous_usage_stats,
        }
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params,
        "model": request.model,
        "reasoning_ended": reasoning_ended,
        "reasoning_parser_kwargs": reasoning_parser_kwargs,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(request.stream),
        "stream_options": stream_options,
        "cache_salt": request.cache_salt,
        "priority": request.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
