"""vLLM's own parser registry for the parser names we do not build in (``--parser-source vllm``).

Imported only when a configured parser name is not built in; everything here needs vLLM. The
configured names are composed with vLLM's ``ParserManager.get_parser`` exactly as ``vllm launch
render`` composes them, and that parser then does all reasoning and tool-call parsing.

vLLM's parsers keep their streaming state in Python objects, so streaming here works as vLLM's
own render server does: every chunk builds a fresh parser and replays the earlier chunks through
it (O(output so far) per chunk, not the O(1) of the built-in parsers). The stream state carries
each earlier chunk's text and token ids (:class:`ReplayState`), checked like the built-in
parsers' states; vLLM's parsers then run their own code, regular expressions included, over
that text, which a client may choose.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError, ValidationInfo, model_validator

from vllm_pd_ext.render_server.errors import RenderError, SchemaError, validation_message
from vllm_pd_ext.render_server.parsers.state import (
    Items,
    ParserState,
    StateLimits,
    Text,
    check_state,
    limits_of,
)
from vllm_pd_ext.render_server.protocol import TokenId

if TYPE_CHECKING:
    from vllm_pd_ext.render_server.protocol import ChatCompletionRequest
    from vllm_pd_ext.render_server.settings import RenderSettings
    from vllm_pd_ext.render_server.tokenizer import TokenizerInfo


@functools.cache
def _parser_class(tool: str | None, reasoning: str | None, auto_tools: bool, tok: Any) -> Any:
    from vllm.parser import ParserManager

    try:
        return ParserManager.get_parser(
            tool_parser_name=tool,
            reasoning_parser_name=reasoning,
            enable_auto_tools=auto_tools,
            tokenizer=tok,
        )
    except TypeError as exc:  # vLLM's wording for a parser the tokenizer cannot serve
        raise ValueError(str(exc)) from None


def parser_class(settings: RenderSettings, tok: TokenizerInfo) -> Any:
    """vLLM's composed ``Parser`` class for ``settings`` (validated against the tokenizer the
    first time, as vLLM validates at startup; raises ``ValueError`` then)."""
    return _parser_class(
        settings.tool_call_parser,
        settings.reasoning_parser,
        settings.enable_auto_tool_choice,
        tok.hf,
    )


def _vllm_request(request: ChatCompletionRequest) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChatCompletionRequest,
    )

    try:
        return VllmChatCompletionRequest.model_validate(request.model_dump(exclude_unset=True))
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        message, param = validation_message(errors, prefix="body.chat_request")
        raise SchemaError(f"chat_request: {message}", param=param) from None


def adjusted_constraint(
    settings: RenderSettings,
    tok: TokenizerInfo,
    request: ChatCompletionRequest,
    template_kwargs: dict[str, Any],
) -> tuple[dict[str, Any] | None, bool]:
    """``(structured_outputs, skip_special_tokens)`` after vLLM's parser ``adjust_request``, as
    ``OnlineRenderer.preprocess_chat`` runs it, in the wire form of the dataclass."""
    import dataclasses

    cls = parser_class(settings, tok)
    vreq = _vllm_request(request)
    if cls is not None:
        parser = cls(tok.hf, vreq.tools, chat_template_kwargs=template_kwargs)
        vreq = parser.adjust_request(request=vreq)
    try:
        so = vreq.extract_structured_outputs()
    except ValueError as exc:  # VLLMValidationError: the request's own constraint is invalid
        raise RenderError(str(exc)) from None
    if so is None:
        return None, vreq.skip_special_tokens
    wire = {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    return wire, vreq.skip_special_tokens


def reasoning_ended(
    settings: RenderSettings,
    tok: TokenizerInfo,
    request: ChatCompletionRequest,
    prompt_ids: list[int],
    template_kwargs: dict[str, Any],
) -> bool | None:
    """vLLM's ``resolve_reasoning_ended`` after ``include_reasoning``: the reasoning parser's
    verdict on the prompt, None without one."""
    cls = parser_class(settings, tok)
    if cls is None or getattr(cls, "reasoning_parser_cls", None) is None:
        return None
    vreq = _vllm_request(request)
    parser = cls(tok.hf, vreq.tools, chat_template_kwargs=template_kwargs)
    return bool(parser.is_reasoning_end(prompt_ids))


def _delta_dict(delta: Any) -> dict[str, Any]:
    """A vLLM ``DeltaMessage`` as the dict :class:`ChatParser.parse_delta` returns."""
    out: dict[str, Any] = {}
    if delta is None:
        return out
    if delta.content:
        out["content"] = delta.content
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
    calls = []
    for tc in delta.tool_calls or []:
        function: dict[str, Any] = {}
        if tc.function is not None:
            if tc.function.name is not None:
                function["name"] = tc.function.name
            if tc.function.arguments is not None:
                function["arguments"] = tc.function.arguments
        call: dict[str, Any] = {"index": tc.index, "function": function}
        if tc.id is not None:
            call["id"] = tc.id
            call["type"] = "function"
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out


class ReplayState(ParserState):
    """The streaming state of :class:`VllmChatParser`: each earlier chunk with tokens, as
    the engine sent it (its text and its ids), at most one output's worth in all."""

    texts: Items[Text]
    token_ids: Items[Items[TokenId]]

    @model_validator(mode="after")
    def _one_output(self, info: ValidationInfo) -> ReplayState:
        limits = limits_of(info)
        if len(self.texts) != len(self.token_ids):
            raise ValueError("texts and token_ids list different chunks")
        if not all(self.token_ids):
            raise ValueError("a replayed chunk has no token ids")
        if sum(map(len, self.token_ids)) > limits.max_tokens:
            raise ValueError(f"more than {limits.max_tokens} token ids (the longest output)")
        if sum(map(len, self.texts)) > limits.max_text:
            raise ValueError(f"more than {limits.max_text} characters (the longest output)")
        return self


class VllmChatParser:
    """vLLM's composed parser behind the :class:`ChatParser` interface (batch and streaming)."""

    def __init__(
        self,
        settings: RenderSettings,
        tok: TokenizerInfo,
        request: ChatCompletionRequest,
        template_kwargs: dict[str, Any],
    ) -> None:
        self._cls = parser_class(settings, tok)
        self._tok = tok.hf
        self._request = _vllm_request(request)
        self._template_kwargs = template_kwargs
        self._auto_tools = settings.enable_auto_tool_choice
        self._prompt_ids: list[int] | None = None

    def _new(self) -> Any:
        return self._cls(self._tok, self._request.tools, chat_template_kwargs=self._template_kwargs)

    def new_tool_call_id(self) -> str:
        from vllm.utils import random_uuid

        return f"chatcmpl-tool-{random_uuid()}"

    def set_prompt_token_ids(self, prompt_token_ids: list[int] | None) -> None:
        """The prompt the output continues (vLLM's parsers look for open reasoning in it)."""
        self._prompt_ids = prompt_token_ids

    def parse(
        self, text: str, token_ids: list[int], prompt_token_ids: list[int] | None
    ) -> tuple[str | None, str | None, list[dict[str, str]]]:
        """``(reasoning, content, tool_calls)`` of a complete output, from vLLM's ``parse``."""
        parser = self._new()
        if prompt_token_ids is not None:
            parser.set_prompt_token_ids(prompt_token_ids)
        reasoning, content, calls = parser.parse(
            text,
            self._request,
            enable_auto_tools=self._auto_tools,
            model_output_token_ids=token_ids,
        )
        return reasoning, content, [{"name": c.name, "arguments": c.arguments} for c in calls or []]

    def check_state(self, state: Any, limits: StateLimits) -> None:
        """Check a carried streaming state against :class:`ReplayState` within ``limits``
        (derender runs it before :meth:`parse_delta`; raises ``pydantic.ValidationError``)."""
        check_state(ReplayState, state, limits)

    def initial_state(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """The streaming state before the first output token: no chunks to replay."""
        if self._prompt_ids is None:
            self._prompt_ids = prompt_token_ids
        return {"texts": [], "token_ids": []}

    def parse_delta(
        self, state: dict[str, Any], text: str, token_ids: list[int], *, finished: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The delta for one chunk: replays the earlier chunks through a fresh vLLM parser."""
        texts = list(state["texts"])
        ids = [list(i) for i in state["token_ids"]]
        parser = self._new()
        for old_text, old_ids in zip(texts, ids, strict=True):
            parser.parse_delta(
                old_text, old_ids, self._request, prompt_token_ids=self._prompt_ids, finished=False
            )
        delta = parser.parse_delta(
            text,
            list(token_ids),
            self._request,
            prompt_token_ids=self._prompt_ids,
            finished=finished,
        )
        if token_ids:
            texts.append(text)
            ids.append(list(token_ids))
        return _delta_dict(delta), {"texts": texts, "token_ids": ids}
