"""OpenAI request fields -> vLLM ``SamplingParams``, as JSON, without importing vLLM.

Mirrors vLLM 0.32's ``ChatCompletionRequest.to_sampling_params`` /
``CompletionRequest.to_sampling_params``, ``SamplingParams.from_optional`` and
``__post_init__``, and the wire form vLLM sends: a msgspec struct with ``omit_defaults``, which
drops a field only when its value *is* the declared default object. In practice: float fields
are always present, int/bool/None fields only when they differ from the default, list fields
that ``__post_init__`` fills (``stop``, ``stop_token_ids``, ``bad_words``) always.
"""

from __future__ import annotations

import json
import math
from typing import Any

from vllm_pd_ext.render_server.errors import RenderError
from vllm_pd_ext.render_server.protocol import ChatCompletionRequest, CompletionRequest

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2

#: Request -> server default -> OpenAI default, as vLLM resolves these.
_DEFAULT_SAMPLING_PARAMS: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}

#: Fields in ``SamplingParams`` declaration order with their defaults; floats always emitted.
_FIELDS: tuple[tuple[str, Any], ...] = (
    ("n", 1),
    ("presence_penalty", float),
    ("frequency_penalty", float),
    ("repetition_penalty", float),
    ("temperature", float),
    ("watermarking", None),
    ("top_p", float),
    ("top_k", 0),
    ("min_p", float),
    ("seed", None),
    ("stop", list),
    ("stop_token_ids", list),
    ("ignore_eos", False),
    ("max_tokens", 16),
    ("min_tokens", 0),
    ("logprobs", None),
    ("prompt_logprobs", None),
    ("logprob_token_ids", None),
    ("skip_special_tokens", True),
    ("spaces_between_special_tokens", True),
    ("include_stop_str_in_output", False),
    ("output_kind", 0),
    ("stream_interval", None),
    ("skip_clone", False),
    ("output_text_buffer_length", 0),
    ("structured_outputs", None),
    ("logit_bias", None),
    ("allowed_token_ids", None),
    ("extra_args", None),
    ("bad_words", list),
    ("skip_reading_prefix_cache", object),  # always a bool after __post_init__
    ("thinking_token_budget", None),
    ("routed_experts_prompt_start", 0),
)

#: ``RequestOutputKind``: DELTA for streams, FINAL_ONLY otherwise.
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2


#: Sentinel: take the structured outputs from the request itself.
_FROM_REQUEST: Any = object()

#: ``StructuredOutputsParams`` fields in declaration order with their defaults (the dataclass is
#: sent whole, private fields included).
_SO_FIELDS: tuple[tuple[str, Any], ...] = (
    ("json", None),
    ("regex", None),
    ("choice", None),
    ("grammar", None),
    ("json_object", None),
    ("disable_any_whitespace", False),
    ("disable_additional_properties", False),
    ("whitespace_pattern", None),
    ("structural_tag", None),
)
_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_outputs_wire(**fields: Any) -> dict[str, Any]:
    """A ``StructuredOutputsParams`` as vLLM sends it, checked as its ``__post_init__`` does."""
    out = {name: fields.get(name, default) for name, default in _SO_FIELDS}
    out["_backend"] = None
    out["_backend_was_auto"] = False
    count = sum(out[name] is not None for name in _SO_CONSTRAINTS)
    if count > 1:
        raise validation_error(
            "You can only use one kind of structured outputs constraint "
            f"but multiple are specified: {out!r}"
        )
    if count < 1:
        raise validation_error(
            "You must use one kind of structured outputs constraint "
            f"but none are specified: {out!r}"
        )
    return out


def _structured_outputs_fields(raw: Any) -> dict[str, Any]:
    """The request's ``structured_outputs`` object, with the field types vLLM accepts."""
    if not isinstance(raw, dict):
        raise validation_error("structured_outputs must be an object", "structured_outputs")
    names = {name for name, _ in _SO_FIELDS}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise validation_error(
            f"structured_outputs has unknown field(s): {', '.join(unknown)}", "structured_outputs"
        )
    checks: dict[str, tuple[type, ...]] = {
        "json": (str, dict),
        "regex": (str,),
        "choice": (list,),
        "grammar": (str,),
        "json_object": (bool,),
        "disable_any_whitespace": (bool,),
        "disable_additional_properties": (bool,),
        "whitespace_pattern": (str,),
        "structural_tag": (str,),
    }
    for name, value in raw.items():
        nullable = dict(_SO_FIELDS)[name] is None
        if (value is None and not nullable) or (
            value is not None and not isinstance(value, checks[name])
        ):
            raise validation_error(
                f"structured_outputs.{name} has an invalid type", "structured_outputs"
            )
    if raw.get("choice") is not None and not all(isinstance(c, str) for c in raw["choice"]):
        raise validation_error(
            "structured_outputs.choice must be a list of strings", "structured_outputs"
        )
    return dict(raw)


def _structural_tag_payload(rf: dict[str, Any]) -> str:
    """``json.dumps(response_format.model_dump(by_alias=True))`` of a structural-tag format."""
    bad = validation_error(
        "Invalid response_format structural_tag specification.", "response_format"
    )
    if "format" in rf and "structures" not in rf:
        return json.dumps({"type": "structural_tag", "format": rf["format"]})
    structures, triggers = rf.get("structures"), rf.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise bad
    if not all(isinstance(t, str) for t in triggers):
        raise bad
    out = []
    for item in structures:
        if not isinstance(item, dict):
            raise bad
        begin, end, schema = item.get("begin"), item.get("end"), item.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise bad
        if schema is not None and not isinstance(schema, dict):
            raise bad
        out.append({"begin": begin, "schema": schema, "end": end})
    return json.dumps({"type": "structural_tag", "structures": out, "triggers": triggers})


def check_response_format(request: ChatCompletionRequest | CompletionRequest) -> None:
    """The request-level checks vLLM's models run on ``response_format`` and
    ``structured_outputs`` (before anything is rendered)."""
    rf = request.response_format
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in (
            "text",
            "json_object",
            "json_schema",
            "structural_tag",
        ):
            raise validation_error(
                "response_format.type must be one of 'text', 'json_object', 'json_schema' or "
                "'structural_tag'",
                "response_format",
            )
        if rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if js is None:
                raise validation_error(
                    "When response_format type is 'json_schema', the "
                    "'json_schema' field must be provided.",
                    "response_format",
                )
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise validation_error(
                    "response_format.json_schema needs a string 'name'", "response_format"
                )
            if js.get("schema") is not None and not isinstance(js["schema"], dict):
                raise validation_error(
                    "response_format.json_schema.schema must be an object", "response_format"
                )
        if rf["type"] == "structural_tag":
            _structural_tag_payload(rf)
    so = request.structured_outputs
    if so is not None:
        fields = _structured_outputs_fields(so)
        if isinstance(request, ChatCompletionRequest):
            count = sum(fields.get(k) is not None for k in ("json", "regex", "choice"))
            if count > 1:
                raise validation_error(
                    "You can only use one kind of constraints for structured "
                    "outputs ('json', 'regex' or 'choice')."
                )
            if count > 0 and request.tool_choice not in ("none", "auto", "required"):
                raise validation_error(
                    "You can only either use constraints for structured outputs or tools, not both."
                )
        structured_outputs_wire(**fields)  # vLLM builds the dataclass while parsing


def request_structured_outputs(
    request: ChatCompletionRequest | CompletionRequest,
) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs_from_response_format``: ``response_format`` overrides the
    matching constraint of ``structured_outputs``; None when neither constrains."""
    check_response_format(request)
    fields = (
        _structured_outputs_fields(request.structured_outputs)
        if (request.structured_outputs is not None)
        else None
    )
    rf = request.response_format
    if rf is None or rf["type"] == "text":
        return None if fields is None else structured_outputs_wire(**fields)
    if rf["type"] == "json_object":
        overrides: dict[str, Any] = {"json_object": True}
    elif rf["type"] == "json_schema":
        overrides = {"json": rf["json_schema"].get("schema")}
    else:
        overrides = {"structural_tag": _structural_tag_payload(rf)}
    return structured_outputs_wire(**{**(fields or {}), **overrides})


def validation_error(message: str, param: str | None = None, value: Any = None) -> RenderError:
    """vLLM's ``VLLMValidationError``: the message ends with ``(parameter=.., value=..)``."""
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    if extras:
        message = f"{message} ({', '.join(extras)})"
    return RenderError(message, param=param)


def get_max_tokens(
    max_model_len: int,
    max_tokens: int | None,
    input_length: int,
    default_sampling_params: dict[str, Any],
    truncate_prompt_tokens: int | None = None,
) -> int:
    """The ``max_tokens`` vLLM sends: the request's value capped by what the context leaves."""
    if truncate_prompt_tokens is not None:
        limit = truncate_prompt_tokens
        input_length = min(input_length, max_model_len if limit == -1 else limit)
    if max_model_len < input_length:
        raise validation_error(
            f"Input length ({input_length}) exceeds model's maximum "
            f"context length ({max_model_len})."
        )
    fallback = max_tokens if max_tokens is not None else default_sampling_params.get("max_tokens")
    return min(v for v in (max_model_len - input_length, fallback) if v is not None)


def _verify(sp: dict[str, Any]) -> None:
    """``SamplingParams._verify_args`` (the checks a client can trip), same wording."""
    n = sp["n"]
    if n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
    if n > 16384:
        raise validation_error(
            f"n must be at most 16384, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    if not -2.0 <= sp["presence_penalty"] <= 2.0:
        raise validation_error(
            f"presence_penalty must be in [-2, 2], got {sp['presence_penalty']}."
        )
    if not -2.0 <= sp["frequency_penalty"] <= 2.0:
        raise validation_error(
            f"frequency_penalty must be in [-2, 2], got {sp['frequency_penalty']}."
        )
    rep = sp["repetition_penalty"]
    if not math.isfinite(rep):
        raise validation_error(f"repetition_penalty must be a finite number, got {rep}.")
    if rep <= 0.0:
        raise validation_error(f"repetition_penalty must be greater than zero, got {rep}.")
    temp = sp["temperature"]
    if not math.isfinite(temp):
        raise validation_error(
            f"temperature must be a finite number, got {temp}.", "temperature", temp
        )
    if temp < 0.0:
        raise validation_error(
            f"temperature must be non-negative, got {temp}.", "temperature", temp
        )
    if temp > 2.0:
        raise validation_error(f"temperature must be in [0, 2], got {temp}.", "temperature", temp)
    if not 0.0 < sp["top_p"] <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {sp['top_p']}.", "top_p", sp["top_p"])
    if sp["top_k"] < -1:
        raise validation_error(f"top_k must be 0 (disable), or at least 1, got {sp['top_k']}.")
    if not 0.0 <= sp["min_p"] <= 1.0:
        raise validation_error(f"min_p must be in [0, 1], got {sp['min_p']}.")
    max_tokens = sp["max_tokens"]
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if sp["min_tokens"] < 0:
        raise validation_error(
            f"min_tokens must be greater than or equal to 0, got {sp['min_tokens']}."
        )
    if max_tokens is not None and sp["min_tokens"] > max_tokens:
        raise validation_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {sp['min_tokens']}."
        )
    interval = sp["stream_interval"]
    if interval is not None and interval < 1:
        raise validation_error(
            f"stream_interval must be at least 1, got {interval}.", "stream_interval", interval
        )
    logprobs = sp["logprobs"]
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise validation_error(
            f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs
        )
    plp = sp["prompt_logprobs"]
    if plp is not None and plp != -1 and plp < 0:
        raise validation_error(
            f"prompt_logprobs must be non-negative or -1, got {plp}.", "prompt_logprobs", plp
        )
    if any(not s for s in sp["stop"]):
        raise validation_error("stop cannot contain an empty string.")
    if any(not w for w in sp["bad_words"]):
        raise validation_error(
            f"bad_words cannot contain an empty string. Got bad_words={sp['bad_words']}"
        )
    if sp["temperature"] < _SAMPLING_EPS and n > 1:
        raise validation_error(f"n must be 1 when using greedy sampling, got {n}.")


def to_sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    default_sampling_params: dict[str, Any],
    *,
    max_logprobs: int = 20,
    structured_outputs: Any = _FROM_REQUEST,
) -> dict[str, Any]:
    """The ``sampling_params`` object of the GenerateRequest vLLM builds for ``request``.

    ``structured_outputs`` (a wire dict or None) replaces what the request's
    ``structured_outputs`` / ``response_format`` give, as vLLM's tool parsers do for
    ``tool_choice`` "required" or a named tool. Raises :class:`RenderError` with vLLM's wording
    for values vLLM rejects.
    """
    so = (
        structured_outputs
        if structured_outputs is not _FROM_REQUEST
        else (request_structured_outputs(request))
    )
    sp: dict[str, Any] = {}
    for name, default in _DEFAULT_SAMPLING_PARAMS.items():
        value = getattr(request, name)
        sp[name] = value if value is not None else default_sampling_params.get(name, default)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature"):
        sp[name] = float(sp[name])
    sp["top_p"] = float(sp["top_p"])
    sp["min_p"] = float(sp["min_p"])

    stop_token_ids = request.stop_token_ids
    default_stop_ids = default_sampling_params.get("stop_token_ids")
    if default_stop_ids:
        stop_token_ids = list(dict.fromkeys([*(stop_token_ids or []), *default_stop_ids]))

    if isinstance(request, ChatCompletionRequest):
        top_logprobs = request.top_logprobs
        if request.logprobs and top_logprobs is None:
            top_logprobs = 0
        logprobs = top_logprobs if request.logprobs and not request.logprob_token_ids else None
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.top_logprobs
        out_max_tokens = max_tokens
    else:
        logprobs = None if request.logprob_token_ids else request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        out_max_tokens = 1 if (request.echo and request.max_tokens == 0) else max_tokens
    _check_logprobs(request, logprobs, prompt_logprobs, max_logprobs)

    extra_args: dict[str, Any] = dict(request.vllm_xargs) if request.vllm_xargs else {}
    if request.kv_transfer_params:
        extra_args["kv_transfer_params"] = request.kv_transfer_params
    if request.ec_transfer_params:
        extra_args["ec_transfer_params"] = request.ec_transfer_params

    logit_bias = None
    if request.logit_bias is not None:
        invalid = []
        logit_bias = {}
        for token, bias in request.logit_bias.items():
            try:
                logit_bias[int(token)] = min(100.0, max(-100.0, bias))
            except (TypeError, ValueError):
                invalid.append(token)
        if invalid:
            raise validation_error(
                "logit_bias contains key(s) that cannot be converted to integer token "
                f"IDs: {invalid!r}",
                "logit_bias",
            )

    stop = request.stop
    stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    seed = None if request.seed == -1 else request.seed
    temperature = sp["temperature"]
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    sp.update(
        n=1 if request.n is None else request.n,
        temperature=temperature,
        watermarking=request.watermarking,
        seed=seed,
        stop=stop,
        stop_token_ids=list(dict.fromkeys(stop_token_ids or [])),
        ignore_eos=request.ignore_eos,
        max_tokens=out_max_tokens,
        min_tokens=request.min_tokens,
        logprobs=1 if logprobs is True else logprobs,
        prompt_logprobs=1 if prompt_logprobs is True else prompt_logprobs,
        logprob_token_ids=request.logprob_token_ids or None,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        output_kind=OUTPUT_KIND_DELTA if request.stream else OUTPUT_KIND_FINAL_ONLY,
        stream_interval=request.stream_interval,
        skip_clone=True,
        output_text_buffer_length=(
            max(len(s) for s in stop) - 1 if stop and not request.include_stop_str_in_output else 0
        ),
        structured_outputs=so,
        logit_bias=logit_bias,
        allowed_token_ids=request.allowed_token_ids,
        extra_args=extra_args or None,
        bad_words=list(dict.fromkeys(request.bad_words or [])),
        skip_reading_prefix_cache=prompt_logprobs is not None,
        thinking_token_budget=request.thinking_token_budget,
        routed_experts_prompt_start=request.routed_experts_prompt_start,
    )
    _verify(sp)
    out = _wire(sp)
    if sp["temperature"] < _SAMPLING_EPS:
        # greedy: __post_init__ resets these to the declared defaults, which msgspec omits
        for name in ("top_p", "top_k", "min_p"):
            out.pop(name, None)
    return out


def _check_logprobs(
    request: ChatCompletionRequest | CompletionRequest,
    logprobs: int | None,
    prompt_logprobs: int | None,
    max_logprobs: int,
) -> None:
    if prompt_logprobs is not None and request.stream:
        raise validation_error(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    if isinstance(request, ChatCompletionRequest):
        top = request.top_logprobs
        if top is not None and top < 0 and top != -1:
            raise validation_error("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if top and not request.logprobs:
            raise validation_error(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
    elif logprobs is not None and logprobs < 0 and logprobs != -1:
        raise validation_error("`logprobs` must be a positive value or -1.", "logprobs")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and max_logprobs >= 0 and value > max_logprobs:
            raise validation_error(
                f"Requested {name.replace('_', ' ')} of {value}, which is greater than "
                f"max allowed: {max_logprobs}",
                name,
            )


def _wire(sp: dict[str, Any]) -> dict[str, Any]:
    """Drop the fields msgspec would omit (see the module docstring); JSON-safe keys."""
    out: dict[str, Any] = {}
    for name, default in _FIELDS:
        value = sp.get(name, default if default not in (float, list, object) else None)
        if (
            default in (float, list, object)
            or (value is not default and value != default)
            or type(value) is not type(default)
        ):
            out[name] = value
    if out.get("logit_bias") is not None:
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out
