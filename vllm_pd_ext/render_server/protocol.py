"""Wire models of the render server: our own pydantic models with vLLM's field names.

They cover the fields a render/derender server needs and accept (and ignore) the rest, as
vLLM's ``OpenAIBaseModel`` does, so requests written for ``vllm launch render`` work here
unchanged. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vllm_pd_ext.transfer_params import STEERING_FIELDS

#: A token id: non-negative and small enough for the Rust tokenizer (u32).
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]

#: The longest tool-call id a stream state may carry: ours are 30 characters
#: (``chatcmpl-tool-`` and 16 hex), vLLM's 46 (a uuid's 32 hex), Mistral's 9; vLLM's kimi_k2
#: ids are ``functions.<name>:<index>``, under 90 with OpenAI's 64-character function names.
MAX_TOOL_CALL_ID_CHARS = 256


class _Open(BaseModel):
    """Accepts unknown fields, as vLLM's OpenAI models do."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Open):
    """Request fields that map to ``SamplingParams`` (shared by chat and completions)."""

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stop_token_ids: list[int] | None = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] = Field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    #: vLLM's type: string or numeric values (or lists of them), for custom extensions
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    thinking_token_budget: int | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    return_token_ids: bool | None = None
    echo: bool = False
    watermarking: bool | None = None
    routed_experts_prompt_start: int = 0

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return data

    @field_validator("vllm_xargs", mode="before")
    @classmethod
    def _xargs_steer_nothing(cls, value: Any) -> Any:
        # vLLM copies vllm_xargs into extra_args, where its KV connectors read their params
        for name in STEERING_FIELDS:
            if isinstance(value, dict) and name in value:
                raise ValueError(f"vllm_xargs may not carry {name!r}: it steers KV connectors")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value


class ChatCompletionRequest(_SamplingFields):
    """An OpenAI chat completion request, as ``/v1/chat/completions/render`` takes it."""

    messages: list[dict[str, Any]] = Field(
        json_schema_extra={  # documents the common shape (the server accepts any message dict)
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "tool"]},
                    "content": {"type": ["string", "null"]},
                },
            },
        }
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_default(cls, data: Any) -> Any:
        # OpenAI: "none" without tools, "auto" with tools.
        if isinstance(data, dict) and data.get("tools") and "tool_choice" not in data:
            data = {**data, "tool_choice": "auto"}
        return data

    @model_validator(mode="after")
    def _check_generation_flags(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self


class CompletionRequest(_SamplingFields):
    """An OpenAI completion request, as ``/v1/completions/render`` takes it."""

    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


# ---- generate wire (engine side), as derender receives it --------------------------------------


class GenerateLogProb(_Open):
    token_id: TokenId
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(_Open):
    content: list[GenerateLogProbsContent] | None = None


class UsageInfo(_Open):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class GenerateChoice(_Open):
    index: int = 0
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateStreamChoice(GenerateChoice):
    finish_reason: str | None = None


class GenerateResponse(_Open):
    request_id: str = ""
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[TokenId] | None = None
    prompt_logprobs: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class GenerateStreamResponse(_Open):
    request_id: str = ""
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[TokenId] | None = None
    metrics: dict[str, Any] | None = None


class DerenderStreamState(_Open):
    """Client-carried state of one streamed sequence.

    The first fields are vLLM's (same names and meaning). ``parser_state`` is ours: the
    reasoning / tool parser's own small state, so no call replays the output (vLLM's
    ``output_token_ids`` replay buffer stays empty here).
    """

    prev_tokens: list[str] = Field(default_factory=list, max_length=1024)
    prefix_offset: int = Field(default=0, ge=0)
    read_offset: int = Field(default=0, ge=0)
    role_sent: bool = False
    logprob_context_token_ids: list[TokenId] = Field(default_factory=list, max_length=4)
    logprob_text_offset: int = Field(default=0, ge=0)
    output_token_ids: list[TokenId] = Field(default_factory=list)
    output_chunk_lens: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[Annotated[str, Field(max_length=MAX_TOOL_CALL_ID_CHARS)]] = Field(
        default_factory=list
    )
    #: checked against the configured parser's declared shape by derender (its bounds
    #: depend on the model: ``parsers/state.py``)
    parser_state: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chunk_lens_cover_the_ids(self) -> DerenderStreamState:
        # vLLM's check: the replay chunks are the replay ids, cut up
        total = sum(self.output_chunk_lens)
        if total != len(self.output_token_ids):
            raise ValueError(
                f"output_chunk_lens must sum to len(output_token_ids) (got sum={total}, "
                f"len(output_token_ids)={len(self.output_token_ids)})"
            )
        return self


class DerenderChatRequest(_Open):
    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateResponse
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderChatStreamRequest(_Open):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionRequest(_Open):
    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[GenerateResponse]
    prompt_tokens: list[int] | None = None
    prompt_token_ids: list[list[TokenId] | None] | None = None
    completion_request: CompletionRequest | None = None

    @model_validator(mode="after")
    def _parallel_lengths(self) -> DerenderCompletionRequest:
        n = len(self.generate_responses)
        if self.prompt_tokens is not None and len(self.prompt_tokens) != n:
            raise ValueError(
                f"prompt_tokens length ({len(self.prompt_tokens)}) must equal "
                f"generate_responses length ({n})"
            )
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != n:
            raise ValueError(
                f"prompt_token_ids length ({len(self.prompt_token_ids)}) must "
                f"equal generate_responses length ({n})"
            )
        return self


class DerenderCompletionStreamRequest(_Open):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    completion_request: CompletionRequest | None = None
