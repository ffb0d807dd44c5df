"""Derender: engine token ids -> OpenAI chat / completion responses, batch and streaming.

Mirrors vLLM 0.32's ``OnlineDerenderer`` on the wire. The streaming forms are stateless on the
server: each call takes the client-carried ``stream_state`` and returns the next one. Unlike
vLLM, the parser path does not replay the output on every chunk: the parsers keep their own
small state in ``stream_state.parser_state``, so each call costs O(new tokens).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from vllm_pd_ext.render_server.detokenizer import (
    DetokState,
    detokenize,
    seed_state,
    token_strings,
)
from vllm_pd_ext.render_server.errors import RenderError, SchemaError, validation_message
from vllm_pd_ext.render_server.parsers import ChatParser, make_parser
from vllm_pd_ext.render_server.parsers.state import StateLimits
from vllm_pd_ext.render_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderCompletionRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    GenerateLogProbs,
    GenerateResponse,
    GenerateStreamResponse,
    UsageInfo,
)
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import TokenizerInfo
from vllm_pd_ext.render_server.tool_choice import check_tool_usage

logger = logging.getLogger(__name__)

_LOGPROB_CONTEXT_WINDOW = 4


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _decode_params(
    request: ChatCompletionRequest | CompletionRequest | None, preserve_special: bool = False
) -> bool:
    """``skip_special_tokens`` as the engine derives it (fast tokenizers only)."""
    if preserve_special:
        return False
    return request.skip_special_tokens if request is not None else True


class Derenderer:
    """Derender logic for one tokenizer and one settings object (pure CPU, no I/O)."""

    def __init__(
        self,
        settings: RenderSettings,
        tok: TokenizerInfo,
        max_model_len: int,
        template_kwargs: Callable[[ChatCompletionRequest], dict[str, Any]] | None = None,
    ) -> None:
        self.template_kwargs = template_kwargs
        self.settings = settings
        self.tok = tok
        self.max_model_len = max_model_len
        #: what a carried stream state may hold: one output of max_model_len tokens
        self.limits = StateLimits.for_model(max_model_len, tok.max_chars_per_token)
        self.has_parser = bool(settings.reasoning_parser or settings.tool_call_parser)
        if settings.uses_vllm_parsers:  # fail at startup if vLLM's parser cannot serve tok
            from vllm_pd_ext.render_server.parsers.vllm_registry import parser_class

            parser_class(settings, tok)

    # ---- helpers ---------------------------------------------------------------------------

    def _model(self, model: str | None) -> str:
        if model is not None and model != self.settings.model_name:
            from vllm_pd_ext.render_server.errors import ModelNotFoundError

            raise ModelNotFoundError(model)
        return model or self.settings.model_name

    def _check_bounds(self, responses: list[GenerateResponse]) -> None:
        if len(responses) > self.settings.max_n:
            raise RenderError(
                f"generate_responses count ({len(responses)}) exceeds server maximum "
                f"({self.settings.max_n})."
            )
        for gen in responses:
            for choice in gen.choices:
                if choice.token_ids and len(choice.token_ids) > self.max_model_len:
                    raise RenderError(
                        f"token_ids length ({len(choice.token_ids)}) in choice {choice.index} "
                        f"exceeds max_model_len ({self.max_model_len})."
                    )
                content = choice.logprobs.content if choice.logprobs else None
                if content and len(content) > self.max_model_len:
                    raise RenderError(
                        f"logprobs.content length ({len(content)}) in choice {choice.index} "
                        f"exceeds max_model_len ({self.max_model_len})."
                    )

    def _check_prompt_ids(self, ids: list[int] | None) -> None:
        if ids is not None and len(ids) > self.max_model_len:
            raise RenderError(
                f"prompt_token_ids length ({len(ids)}) exceeds max_model_len "
                f"({self.max_model_len})."
            )

    def _parser(self, chat_request: ChatCompletionRequest) -> ChatParser:
        if self.settings.uses_vllm_parsers:
            from vllm_pd_ext.render_server.parsers.vllm_registry import VllmChatParser

            kwargs = self.template_kwargs(chat_request) if self.template_kwargs else {}
            return VllmChatParser(self.settings, self.tok, chat_request, kwargs)  # type: ignore[return-value]
        return make_parser(
            self.tok,
            reasoning=self.settings.reasoning_parser,
            tools=self.settings.tool_call_parser,
            request=chat_request,
            enable_auto_tools=self.settings.enable_auto_tool_choice,
            template_kwargs=self.template_kwargs(chat_request) if self.template_kwargs else None,
        )

    def _logprobs(
        self, logprobs: GenerateLogProbs, context: list[int] | None = None
    ) -> dict[str, Any]:
        """Integer-id logprobs -> OpenAI chat shape, fixing U+FFFD with the preceding ids."""
        if logprobs.content is None:
            return {"content": None}
        ctx = list(context or [])
        out = []
        for entry in logprobs.content:
            ids = [entry.token_id, *(t.token_id for t in entry.top_logprobs)]
            (text, raw), *tops = token_strings(self.tok, ids)
            if text.endswith("\ufffd"):
                text = self._correct(entry.token_id, ctx)
                raw = list(text.encode("utf-8"))
            top_out = []
            for top, (ttext, traw) in zip(entry.top_logprobs, tops, strict=True):
                if ttext.endswith("\ufffd"):
                    ttext = self._correct(top.token_id, ctx)
                    traw = list(ttext.encode("utf-8"))
                top_out.append({"token": ttext, "logprob": top.logprob, "bytes": traw})
            out.append(
                {"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top_out}
            )
            ctx.append(entry.token_id)
        return {"content": out}

    def _correct(self, token_id: int, context: list[int]) -> str:
        """vLLM's ``_correct_decoded_token``: resolve byte-fallback pieces with context."""
        decode = self.tok.decode
        for n in range(1, min(len(context), 4) + 1):
            ctx = context[-n:]
            full = decode([*ctx, token_id])
            if full.endswith("\ufffd"):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if decode([ctx[j]]).endswith("\ufffd"):
                    clean_end = j
                else:
                    break
            prefix = decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    @staticmethod
    def _completion_logprobs(chat_lp: dict[str, Any], offset: int = 0) -> dict[str, Any]:
        content = chat_lp.get("content")
        if content is None:
            return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        text_offset, token_logprobs, tokens, tops = [], [], [], []
        for entry in content:
            text_offset.append(offset)
            tokens.append(entry["token"])
            token_logprobs.append(entry["logprob"])
            tops.append(
                {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
                if entry["top_logprobs"]
                else None
            )
            offset += len(entry["token"])
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    # ---- chat, batch -----------------------------------------------------------------------

    def chat(self, req: DerenderChatRequest) -> dict[str, Any]:
        """A ``chat.completion`` response for a complete generate response."""
        model = self._model(req.model)
        gen = req.generate_response
        self._check_bounds([gen])
        self._check_prompt_ids(req.prompt_token_ids)
        chat_request = req.chat_request
        _check_chat_request(chat_request)
        if self.has_parser and chat_request is None:
            raise RenderError(
                "chat_request is required when a tool or reasoning parser is configured "
                "because plain detokenization would leak raw parser markup into content."
            )
        use_parser = self.has_parser and chat_request is not None
        skip = _decode_params(chat_request, preserve_special=use_parser)
        seed_ids = (
            req.prompt_token_ids if req.prompt_token_ids is not None else gen.prompt_token_ids
        )
        seed = seed_state(self.tok, seed_ids, skip_special_tokens=skip)
        return_ids = bool(
            chat_request is not None
            and chat_request.return_token_ids
            and (not use_parser or chat_request.include_reasoning)
        )
        choices = []
        for choice in gen.choices:
            if not choice.token_ids:
                raise RenderError(f"choice {choice.index} has empty or null token_ids")
            text, _ = detokenize(self.tok, choice.token_ids, seed, skip_special_tokens=skip)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            finish_reason = choice.finish_reason
            if use_parser:
                assert chat_request is not None
                parser = self._parser(chat_request)
                reasoning, content, calls = parser.parse(
                    text, choice.token_ids, req.prompt_token_ids or gen.prompt_token_ids
                )
                if not chat_request.include_reasoning:
                    reasoning = None
                if isinstance(chat_request.tool_choice, dict) or chat_request.tool_choice == (
                    "required"
                ):
                    content = content or ""
                message["content"] = content
                message["reasoning"] = reasoning
                if calls:  # vLLM's ChatMessage drops an empty tool_calls list
                    message["tool_calls"] = [
                        {
                            "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls
                    ]
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": self._logprobs(choice.logprobs) if choice.logprobs else None,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason,
                    "token_ids": choice.token_ids if return_ids else None,
                    "routed_experts": None,
                }
            )
        prompt_tokens = req.prompt_tokens or 0
        completion_tokens = sum(len(c.token_ids or []) for c in gen.choices)
        return {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": _usage(prompt_tokens, completion_tokens),
            "prompt_logprobs": gen.prompt_logprobs,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": gen.kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": gen.metrics,
        }

    # ---- chat, streaming -------------------------------------------------------------------

    def _stream_start(
        self, req: Any, chunk: Any, skip: bool
    ) -> tuple[DerenderStreamState, DetokState]:
        """The incoming stream state (seeded from the prompt on the first chunk) and the
        detokenizer state built from it; shared by chat and completion streaming."""
        state = req.stream_state
        if state is None:
            seed_ids = (
                req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
            )
            seed = seed_state(self.tok, seed_ids, skip_special_tokens=skip)
            state = DerenderStreamState(
                prev_tokens=seed.prev_tokens,
                prefix_offset=seed.prefix_offset,
                read_offset=seed.read_offset,
            )
        _check_window(state)
        _check_state_bounds(state, self.limits)
        return state, DetokState(list(state.prev_tokens), state.prefix_offset, state.read_offset)

    def chat_stream(self, req: DerenderChatStreamRequest) -> dict[str, Any]:
        """One ``chat.completion.chunk`` plus the next ``stream_state``."""
        model = self._model(req.model)
        chunk = req.generate_chunk
        chat_request = req.chat_request
        _check_chat_request(chat_request)
        if self.has_parser and chat_request is None:
            raise RenderError(
                "chat_request is required when a tool or reasoning parser is configured "
                "because plain detokenization would leak raw parser markup into content."
            )
        if self.has_parser and req.prompt_token_ids is None:
            raise RenderError(
                "prompt_token_ids is required when a tool or reasoning parser is configured. "
                "Without it the parser cannot tell whether the prompt left reasoning open."
            )
        if len(chunk.choices) > 1:
            raise RenderError(
                "derender_chat_stream expects at most one choice per chunk "
                f"(got {len(chunk.choices)})."
            )
        self._check_prompt_ids(req.prompt_token_ids)
        delta_len = sum(len(c.token_ids or []) for c in chunk.choices)
        if delta_len > self.max_model_len:
            raise RenderError(f"delta ({delta_len}) exceeds max_model_len ({self.max_model_len}).")
        use_parser = self.has_parser
        skip = _decode_params(chat_request, preserve_special=use_parser)
        state, detok = self._stream_start(req, chunk, skip)
        update: dict[str, Any] = {}
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text, detok = detokenize(self.tok, delta_ids, detok, skip_special_tokens=skip)
            finish_reason = choice.finish_reason
            if use_parser:
                assert chat_request is not None
                parser = self._parser(chat_request)
                parser.set_prompt_token_ids(req.prompt_token_ids)
                pstate = state.parser_state
                if pstate is None:
                    pstate = parser.initial_state(req.prompt_token_ids or [])
                    delta, pstate = parser.parse_delta(
                        pstate, text, delta_ids, finished=finish_reason is not None
                    )
                else:
                    _check_parser_state(parser, pstate, self.limits)
                    delta, pstate = _parse_carried(parser, pstate, text, delta_ids, finish_reason)
                update["parser_state"] = pstate
                tools_streamed = state.tools_streamed
                ids = list(state.last_tool_call_ids)
                for tc in delta.get("tool_calls") or []:
                    tools_streamed = True
                    if tc["index"] > len(ids):  # calls are numbered from 0 without gaps
                        raise RenderError(
                            f"invalid stream_state.parser_state: tool call {tc['index']} "
                            f"follows only {len(ids)} calls in stream_state.last_tool_call_ids",
                            param="stream_state.parser_state",
                        )
                    if tc["index"] == len(ids):
                        ids.append(tc.get("id") or parser.new_tool_call_id())
                        tc["id"] = ids[tc["index"]]
                        tc["type"] = "function"
                update["tools_streamed"] = tools_streamed
                update["last_tool_call_ids"] = ids
                if not chat_request.include_reasoning:
                    delta.pop("reasoning", None)
                if (
                    finish_reason is not None
                    and tools_streamed
                    and not isinstance(chat_request.tool_choice, dict)
                ):
                    finish_reason = "tool_calls"
                logprobs = None
            else:
                delta = {"content": text if text else None}
                logprobs = (
                    self._logprobs(choice.logprobs, state.logprob_context_token_ids)
                    if choice.logprobs is not None
                    else None
                )
            out_delta: dict[str, Any] = {
                "role": None if state.role_sent else "assistant",
                "content": delta.get("content"),
                "reasoning": delta.get("reasoning"),
            }
            if (
                delta.get("tool_calls")
                and chat_request is not None
                and chat_request.parallel_tool_calls is False
            ):  # vLLM's maybe_filter_parallel_tool_calls
                delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
            if delta.get("tool_calls"):
                out_delta["tool_calls"] = delta["tool_calls"]
            update["role_sent"] = True
            update["logprob_context_token_ids"] = (
                list(state.logprob_context_token_ids) + list(delta_ids)
            )[-_LOGPROB_CONTEXT_WINDOW:]
            return_ids = bool(
                chat_request is not None
                and chat_request.return_token_ids
                and (not use_parser or chat_request.include_reasoning)
            )
            choices.append(
                {
                    "index": choice.index,
                    "delta": out_delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": choice.stop_reason,
                    "token_ids": choice.token_ids if return_ids else None,
                }
            )
        update.update(
            prev_tokens=detok.prev_tokens,
            prefix_offset=detok.prefix_offset,
            read_offset=detok.read_offset,
        )
        new_state = state.model_copy(update=update)
        return {
            "chunk": {
                "id": chunk.request_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": self._stream_usage(chunk.usage, req.prompt_tokens),
                "system_fingerprint": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "metrics": chunk.metrics,
            },
            "stream_state": new_state.model_dump(exclude_none=False),
        }

    @staticmethod
    def _stream_usage(usage: UsageInfo | None, prompt_tokens: int | None) -> dict | None:
        if usage is None:
            return None
        pt = prompt_tokens if prompt_tokens is not None else (usage.prompt_tokens or 0)
        return _usage(pt, usage.completion_tokens or 0)

    # ---- completions -----------------------------------------------------------------------

    def completion(self, req: DerenderCompletionRequest) -> dict[str, Any]:
        """A ``text_completion`` response for one generate response per prompt."""
        model = self._model(req.model)
        if not req.generate_responses:
            raise RenderError("generate_responses must not be empty")
        self._check_bounds(req.generate_responses)
        for ids in req.prompt_token_ids or []:
            self._check_prompt_ids(ids)
        n = len(req.generate_responses)
        prompt_tokens = req.prompt_tokens if req.prompt_tokens is not None else [0] * n
        seeds = req.prompt_token_ids if req.prompt_token_ids is not None else [None] * n
        skip = _decode_params(req.completion_request)
        choices = []
        total_prompt = total_completion = index = 0
        for gen, pt, seed_ids in zip(req.generate_responses, prompt_tokens, seeds, strict=True):
            ids_for_seed = seed_ids if seed_ids is not None else gen.prompt_token_ids
            seed = seed_state(self.tok, ids_for_seed, skip_special_tokens=skip)
            for choice in gen.choices:
                if not choice.token_ids:
                    raise RenderError(
                        f"choice {choice.index} in response {gen.request_id} has empty or "
                        "null token_ids"
                    )
                text, _ = detokenize(self.tok, choice.token_ids, seed, skip_special_tokens=skip)
                logprobs = None
                if choice.logprobs is not None:
                    logprobs = self._completion_logprobs(self._logprobs(choice.logprobs))
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
                total_completion += len(choice.token_ids)
                index += 1
            total_prompt += pt
        first = req.generate_responses[0]
        kv = first.kv_transfer_params
        if any(r.kv_transfer_params != kv for r in req.generate_responses[1:]):
            kv = None
        return {
            "id": first.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": _usage(total_prompt, total_completion),
            "kv_transfer_params": kv,
            "ec_transfer_params": None,
            "metrics": first.metrics if n == 1 else None,
        }

    def completion_stream(self, req: DerenderCompletionStreamRequest) -> dict[str, Any]:
        """One ``text_completion`` chunk plus the next ``stream_state``."""
        model = self._model(req.model)
        chunk = req.generate_chunk
        if len(chunk.choices) > 1:
            raise RenderError("derender_completion_stream expects at most one choice per chunk")
        self._check_prompt_ids(req.prompt_token_ids)
        skip = _decode_params(req.completion_request)
        state, detok = self._stream_start(req, chunk, skip)
        choices = []
        update: dict[str, Any] = {}
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text, detok = detokenize(self.tok, delta_ids, detok, skip_special_tokens=skip)
            logprobs = None
            if choice.logprobs is not None:
                logprobs = self._completion_logprobs(
                    self._logprobs(choice.logprobs, state.logprob_context_token_ids),
                    state.logprob_text_offset,
                )
            update["logprob_context_token_ids"] = (
                list(state.logprob_context_token_ids) + list(delta_ids)
            )[-_LOGPROB_CONTEXT_WINDOW:]
            update["logprob_text_offset"] = state.logprob_text_offset + len(text)
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_token_ids": None,
                    "token_ids": None,
                }
            )
        update.update(
            prev_tokens=detok.prev_tokens,
            prefix_offset=detok.prefix_offset,
            read_offset=detok.read_offset,
        )
        new_state = state.model_copy(update=update)
        return {
            "chunk": {
                "id": chunk.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": self._stream_usage(chunk.usage, req.prompt_tokens),
                "system_fingerprint": None,
                "metrics": chunk.metrics,
            },
            "stream_state": new_state.model_dump(exclude_none=False),
        }


class StreamSession:
    """One streamed answer derendered over one long-lived call (``vllm_pd_ext.derender_stream``).

    The context (line 1) is validated once; each chunk then goes through the same
    ``chat_stream`` / ``completion_stream`` as a per-event call carrying that context and the
    ``stream_state`` the previous chunk left, which stays here. Pure CPU, no I/O; run it
    where the derenderer runs (one tokenizer user at a time).
    """

    def __init__(self, derenderer: Derenderer, route: str, context: dict[str, Any]) -> None:
        from vllm_pd_ext.derender_stream import PER_EVENT_KEYS

        carried = [key for key in PER_EVENT_KEYS if key in context]
        if carried:
            raise RenderError(
                f"the first line is the context: it must not carry {', '.join(carried)}",
                param=carried[0],
            )
        self.derenderer = derenderer
        self.chat = route == "chat"
        model = DerenderChatStreamRequest if self.chat else DerenderCompletionStreamRequest
        try:
            req = model.model_validate(
                {**context, "stream": True, "generate_chunk": {"choices": []}}
            )
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            message, param = validation_message(errors)
            raise SchemaError(message, param=param) from None
        # what a per-event call checks before its chunk: fail before the stream starts
        derenderer._model(req.model)
        derenderer._check_prompt_ids(req.prompt_token_ids)
        if self.chat:
            assert isinstance(req, DerenderChatStreamRequest)
            _check_chat_request(req.chat_request)
            if derenderer.has_parser and req.chat_request is None:
                raise RenderError(
                    "chat_request is required when a tool or reasoning parser is configured"
                )
            if derenderer.has_parser and req.prompt_token_ids is None:
                raise RenderError(
                    "prompt_token_ids is required when a tool or reasoning parser is configured"
                )
        self.request = req
        self.state: DerenderStreamState | None = None
        self.tokens = 0

    def chunk(self, generate_chunk: Any) -> dict[str, Any]:
        """The derendered ``chunk`` for one generate stream chunk (decoded JSON). Raises
        ``RenderError``; the session is not to be used after one."""
        if not isinstance(generate_chunk, dict):
            raise SchemaError("each line after the first must be a JSON object")
        try:
            chunk = GenerateStreamResponse.model_validate(generate_chunk)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            message, param = validation_message(errors, prefix="generate_chunk")
            raise SchemaError(message, param=param) from None
        self.tokens += sum(len(c.token_ids or []) for c in chunk.choices)
        d = self.derenderer
        if self.tokens > d.max_model_len:
            raise RenderError(
                f"the stream's tokens ({self.tokens}) exceed max_model_len ({d.max_model_len})."
            )
        req = self.request.model_copy(update={"generate_chunk": chunk, "stream_state": self.state})
        if isinstance(req, DerenderChatStreamRequest):
            answer = d.chat_stream(req)
        else:
            answer = d.completion_stream(req)
        self.state = DerenderStreamState.model_construct(**answer["stream_state"])
        return answer["chunk"]


def _check_chat_request(chat_request: ChatCompletionRequest | None) -> None:
    """The tool-choice checks vLLM's ``ChatCompletionRequest`` runs when it parses the
    ``chat_request`` a derender call carries (e.g. a named tool that is not in ``tools``)."""
    if chat_request is not None:
        check_tool_usage({"tools": chat_request.tools, "tool_choice": chat_request.tool_choice})


def _check_parser_state(parser: ChatParser, pstate: Any, limits: StateLimits) -> None:
    """The parser state a client carried, against the configured parser's declared shape
    (``parsers/state.py``): any mismatch -- a key missing or unknown, a type, a bound -- is a
    400 naming ``stream_state.parser_state``, before the parser reads the state."""
    try:
        parser.check_state(pstate, limits)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        message, _ = validation_message(errors, prefix="stream_state.parser_state")
        raise RenderError(
            f"invalid stream_state.parser_state: {message}", param="stream_state.parser_state"
        ) from None


def _parse_carried(
    parser: ChatParser,
    pstate: dict[str, Any],
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``parse_delta`` over a checked parser state the client carried. A state of the
    declared shape whose values still do not fit together (vLLM's parsers replaying chosen
    text may raise too) is the client's mistake, a 400, never a 500."""
    try:
        return parser.parse_delta(pstate, text, token_ids, finished=finish_reason is not None)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise RenderError(
            f"invalid stream_state.parser_state ({type(exc).__name__})",
            param="stream_state.parser_state",
        ) from None


def _check_window(state: DerenderStreamState) -> None:
    if state.read_offset > len(state.prev_tokens) or state.prefix_offset > state.read_offset:
        raise RenderError(
            "invalid stream_state: offsets do not fit prev_tokens", param="stream_state"
        )


def _check_state_bounds(state: DerenderStreamState, limits: StateLimits) -> None:
    """The bounds of the stream state's lists that depend on the model (the rest are in
    ``DerenderStreamState``): a window entry is one token's text, and the replay ids and
    tool-call ids are at most one per output token."""
    longest = limits.max_token_text
    for i, token in enumerate(state.prev_tokens):
        if len(token) > longest:
            raise RenderError(
                f"invalid stream_state: prev_tokens[{i}] is longer than any token "
                f"({longest} characters)",
                param="stream_state.prev_tokens",
            )
    for name in ("output_token_ids", "last_tool_call_ids"):
        count = len(getattr(state, name))
        if count > limits.max_tokens:
            raise RenderError(
                f"invalid stream_state: {name} has {count} entries, more than the longest "
                f"output's {limits.max_tokens} tokens",
                param=f"stream_state.{name}",
            )
