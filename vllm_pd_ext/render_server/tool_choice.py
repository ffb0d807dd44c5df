"""``tool_choice`` "required" / named tools: validation, the constraint render sends, and how
derender reads the output. Mirrors vLLM 0.32 without importing it.

vLLM's ``ChatCompletionRequest.check_tool_usage`` validates the choice. At render time the
parser's ``adjust_request`` turns the choice into ``sampling_params.structured_outputs``:

* A tool parser with a structural-tag model (``hermes``, ``llama3_json``, ``deepseek_v3``),
  while ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` is on (the default), gets an xgrammar structural
  tag in the parser's own call syntax (``Parser._apply_structural_tag``) and is read back like
  ``auto`` (``supports_required_and_named`` is False then). We build the ``hermes`` tag (vLLM's
  own builder, ``tool_parsers/structural_tag_registry.py``); the llama / deepseek tags come
  from xgrammar's builtin templates, which we do not reproduce, so those get a 400.
* Otherwise (strict tool calling off), a named tool constrains the output to the tool's
  parameters schema and "required" to a JSON array of ``{"name", "parameters"}``
  (``tool_parsers/utils.py: get_json_schema_from_tools``); derender turns that JSON into
  tool calls (:mod:`.parsers.forced`).
* ``mistral`` (``supports_required_and_named = False``, no structural tag) is read back like
  ``auto``; on a non-Mistral (HF) tokenizer, which is all this server loads, its
  ``adjust_request`` constrains required / named to a ``[{"name", "arguments"}]`` array
  (``parser/mistral.py: _build_guided_schema_pre_v11``).
* A parser taken from vLLM's registry (``--parser-source vllm``) runs vLLM's own
  ``adjust_request`` (see ``parsers/vllm_registry.py: adjusted_constraint``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from vllm_pd_ext.render_server.sampling import structured_outputs_wire, validation_error

#: Built-in tool parsers -> the structural-tag model vLLM's parser class names (None: none).
_STRUCTURAL_TAG_MODEL: dict[str, str | None] = {
    "hermes": "hermes",
    "llama3_json": "llama",
    "deepseek_v3": "deepseek_r1",
    "mistral": None,
}
#: Parsers whose class sets ``supports_required_and_named = False`` outright.
_NO_REQUIRED_AND_NAMED = frozenset({"mistral"})

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def strict_tool_calling() -> bool:
    """vLLM's ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` (default on), read the same way."""
    return os.getenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "True").lower() in ("true", "1")


def is_forced(tool_choice: Any) -> bool:
    """``tool_choice`` "required" or a named function."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def forced_name(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice``."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    return None


def check_tool_usage(data: dict[str, Any]) -> None:
    """vLLM's ``check_tool_usage`` on the raw request body, same wording and order."""
    tools = data.get("tools")
    if tools == []:
        raise validation_error(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    tool_choice = data.get("tool_choice", "auto" if tools else None)
    if "tool_choice" not in data and not tools:
        return
    if tool_choice == "none" or tool_choice is None:
        return
    if tools is None:
        raise validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice not in ("auto", "required") and not isinstance(tool_choice, dict):
        raise validation_error(
            f"Invalid value for `tool_choice`: {tool_choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if not isinstance(function, dict):
            raise validation_error(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise validation_error(
                f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or len(name) == 0:
            raise validation_error(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
                "tool_choice.function.name",
            )
        names = [
            (t.get("function") or {}).get("name") if isinstance(t, dict) else None for t in tools
        ]
        if name not in names:
            raise validation_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )


def forced_mode(tool_parser: str | None) -> str | None:
    """How ``tool_parser`` handles "required" / named: "json" (constrained JSON, read by
    :mod:`.parsers.forced`), "auto" (the parser reads its own syntax) or None (no parser)."""
    if tool_parser is None:
        return None
    if tool_parser in _NO_REQUIRED_AND_NAMED:
        return "auto"
    if _STRUCTURAL_TAG_MODEL.get(tool_parser) is not None and strict_tool_calling():
        return "auto"
    return "json"


# ---- render: the structured_outputs the tool choice sets ------------------------------------


def _params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def _json_schema_from_tools(
    tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None
) -> dict[str, Any]:
    """vLLM's ``get_json_schema_from_tools`` for a chat request (tools as ``_tool_dict``s)."""
    name = forced_name(tool_choice)
    if name is not None:
        by_name = {t["function"]["name"]: t for t in tools}
        return _params_or_empty_object(by_name[name]["function"]["parameters"])
    schemas: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        fn = tool["function"]
        params = fn["parameters"]
        schemas.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [fn["name"]]},
                    "parameters": None,  # filled below, after $defs is taken out
                },
                "required": ["name", "parameters"],
            }
        )
        if params is not None:
            params = dict(params)
            tool_defs = params.pop("$defs", {})
            if not isinstance(tool_defs, dict):
                raise validation_error(
                    f"`$defs` in the parameters of tool '{fn['name']}' must be an "
                    f"object, got {_py_type(tool_defs)}.",
                    "tools",
                )
            for def_name, def_schema in tool_defs.items():
                if def_name in defs and defs[def_name] != def_schema:
                    raise validation_error(
                        f"Tool definition '{def_name}' has multiple schemas, "
                        "which is not supported.",
                        "tools",
                    )
                defs[def_name] = def_schema
        schemas[-1]["properties"]["parameters"] = _params_or_empty_object(params)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": schemas},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _py_type(value: Any) -> str:
    return {list: "list", str: "str", int: "int", float: "float", bool: "bool"}.get(
        type(value), type(value).__name__
    )


def _json_schema_format(schema: Any) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _hermes_tags(tools: list[dict[str, Any]], param_strict: bool) -> list[dict[str, Any]]:
    """vLLM's ``_hermes_tool_tags``: two spellings per tool; arguments free unless strict."""
    tags = []
    for tool in tools:
        fn = tool["function"]
        strict = param_strict or fn.get("strict") is True
        params = fn["parameters"] if strict and fn["parameters"] is not None else True
        for begin, end in (
            ('<tool_call>\n{"name": "', "}\n</tool_call>"),
            ('<tool_call>{"name": "', "}</tool_call>"),
        ):
            tags.append(
                {
                    "type": "tag",
                    "begin": begin + fn["name"] + '", "arguments": ',
                    "content": _json_schema_format(params),
                    "end": end,
                }
            )
    return tags


def tool_structured_outputs(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    tool_parser: str | None,
    request_structured_outputs: Callable[[], dict[str, Any] | None],
    request_fields: tuple[Any, Any] = (None, None),
) -> tuple[bool, dict[str, Any] | None]:
    """``(replaced, structured_outputs)``: whether the tool parser's ``adjust_request``
    replaces the request's own structured outputs, and with what.

    ``tools`` are the request's tools as ``_tool_dict`` gives them. Raises a 400 where vLLM's
    constraint comes from a builder we do not reproduce. ``request_structured_outputs``
    gives the request's own constraint (only the structural-tag path reads it, as vLLM's);
    ``request_fields`` are the request's raw ``structured_outputs`` and ``response_format``.
    """
    if not tools or tool_parser is None or tool_choice in (None, "none"):
        return False, None
    tag_model = _STRUCTURAL_TAG_MODEL.get(tool_parser)
    if tag_model is not None and strict_tool_calling():
        return _structural_tag(
            tools, tool_choice, parallel_tool_calls, tag_model, request_structured_outputs()
        )
    if tool_parser == "mistral":
        return _mistral_schema(tools, tool_choice, request_fields)
    if tool_parser in _NO_REQUIRED_AND_NAMED or not is_forced(tool_choice):
        return False, None
    schema = _json_schema_from_tools(tools, tool_choice, parallel_tool_calls)
    return True, structured_outputs_wire(json=schema)


def _structural_tag(
    tools: list[dict[str, Any]],
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    tag_model: str,
    request_so: dict[str, Any] | None,
) -> tuple[bool, dict[str, Any] | None]:
    """vLLM's ``Parser._apply_structural_tag`` (strict level "auto", no reasoning tag)."""
    is_auto = tool_choice == "auto"
    single_call = parallel_tool_calls is False
    function_level = single_call and not (is_auto and request_so is not None)
    any_strict = any(t["function"].get("strict") is True for t in tools)
    if is_auto and not function_level and not any_strict:
        return False, None  # resolve_tool_strictness: no structural tag
    if is_auto and request_so is not None:
        raise validation_error(
            "tool_choice 'auto' with strict tools and structured outputs is not supported by "
            "this render server (vLLM combines both into an xgrammar structural tag)",
            "tool_choice",
        )
    if tag_model != "hermes":
        raise validation_error(
            f"this render server does not build the '{tag_model}' xgrammar structural tag "
            "vLLM constrains tool calls with (tool_choice required / named, strict tools, "
            "parallel_tool_calls false); run vLLM with VLLM_ENFORCE_STRICT_TOOL_CALLING=0 and "
            "this server with the same variable to use JSON-constrained tool calls",
            "tool_choice",
        )
    name = forced_name(tool_choice)
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    tags = _hermes_tags(chosen, param_strict=False)
    if is_auto:
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": single_call,
            "excludes": [],
        }
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "",
            "at_least_one": True,
            "stop_after_first": name is not None or single_call,
        }
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    return True, structured_outputs_wire(structural_tag=tag)


def _mistral_schema(
    tools: list[dict[str, Any]], tool_choice: Any, request_fields: tuple[Any, Any]
) -> tuple[bool, dict[str, Any] | None]:
    """vLLM's mistral parser on a non-Mistral (HF) tokenizer: ``_build_guided_schema_pre_v11``
    constrains required / named to ``[{"name", "arguments"}]`` unless the request brings its
    own ``structured_outputs`` or a structural-tag ``response_format``."""
    own_so, response_format = request_fields
    rf_type = response_format.get("type") if isinstance(response_format, dict) else None
    if not is_forced(tool_choice) or own_so is not None or rf_type == "structural_tag":
        return False, None
    name = forced_name(tool_choice)
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    extra: dict[str, Any] = {} if name is None else {"maxItems": 1}
    any_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"]["parameters"] or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in chosen
    ]
    schema = {"type": "array", "minItems": 1, **extra, "items": {"type": "object", "anyOf": any_of}}
    return True, structured_outputs_wire(json=schema)
