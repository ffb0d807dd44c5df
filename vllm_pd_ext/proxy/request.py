"""Checking a client request: its body (read within the client limits by the front door:
``app.py``, ``front_protocol.py``, ``client_limits.py``) parsed, minimal validation, routing
facts.

The engines validate the full OpenAI schema and their 400s pass through unchanged; here we
check only what the proxy itself relies on, so a malformed body never becomes a 500.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from fastapi import Request

from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.errors import ProxyError, schema_error
from vllm_pd_ext.proxy.front_protocol import FastCycle
from vllm_pd_ext.transfer_params import STEERING_FIELDS, without_steering
from vllm_pd_ext.util import jsonb

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.kv_events import Lookup
    from vllm_pd_ext.proxy.token_mode import TokenRequest

Route = Literal["chat", "completions"]
#: The engines' OpenAI routes (text mode), and their token-in token-out route (token mode).
PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
GENERATE_PATH = "/inference/v1/generate"

#: A client's request as the proxy reads it: Starlette's, or the ``FastCycle`` serving it.
ClientRequest = Request | FastCycle

#: Request ids the proxy makes up: a random per-process prefix and a counter (no system call
#: for randomness per request); 32 hex digits like a UUID's.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def _new_id_prefix() -> None:
    global _ID_PREFIX
    _ID_PREFIX = os.urandom(8).hex()


if hasattr(os, "register_at_fork"):  # a forked worker never repeats ids
    os.register_at_fork(after_in_child=_new_id_prefix)


class _Unset(enum.Enum):
    NOT_LOOKED_UP = enum.auto()


#: ``RequestContext.lookup`` before the prefix lookup was made (None is a made lookup's
#: "nothing to look up").
NOT_LOOKED_UP: Final = _Unset.NOT_LOOKED_UP


@dataclass
class RequestContext:
    route: Route
    body: dict[str, Any]
    #: The proxy's own id (engines, aborts, transfer ids): never one a client chose, so no
    #: client can name, and abort, another's request.
    request_id: str
    stream: bool
    est_prompt_tokens: int
    affinity_key: str
    splittable: bool
    received: float = field(default_factory=time.perf_counter)
    #: Token mode: the rendered request; the engines see it instead of ``body``.
    tokens: TokenRequest | None = None
    #: The client's body as it came, while ``body`` says the same (text mode sends it on
    #: unchanged instead of encoding ``body`` again).
    raw: bytes | None = None
    #: The client's ``X-Request-Id``, echoed in the answer and logged; nothing else uses it.
    client_request_id: str | None = None
    #: The prompt as the engines' prefix indexes look it up (``routing.lookup_of``), or
    #: ``NOT_LOOKED_UP`` until it is made.
    lookup: Lookup | Literal[_Unset.NOT_LOOKED_UP] | None = NOT_LOOKED_UP

    @property
    def echo_id(self) -> str:
        """The answer's ``X-Request-Id``: the client's own, else the proxy's."""
        return self.client_request_id or self.request_id

    @property
    def path(self) -> str:
        """The engines' route for this request."""
        return GENERATE_PATH if self.tokens is not None else PATHS[self.route]

    @property
    def engine_body(self) -> dict[str, Any]:
        """What the engines get (before each leg's ``kv_transfer_params``)."""
        return self.tokens.generate if self.tokens is not None else self.body


def header(request: ClientRequest, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), straight from the ASGI scope."""
    # (a dict of the headers, the first value of a name kept, made in C: no Python step
    # per header)
    return dict(reversed(request.scope["headers"])).get(name)


def parse_body(raw: bytes, limit: int) -> dict[str, Any]:
    """The JSON object in a request body read within the client limits (the fast path
    keeps ``limit`` + 1 bytes of a longer body: 413 then); 400 when malformed."""
    if len(raw) > limit:
        raise ProxyError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    return _json_object(raw)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = jsonb.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        # (RecursionError: nested deeper than the decoder goes, e.g. thousands of "[")
        raise schema_error(f"request body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise schema_error("request body must be a JSON object", "body")
    return body


#: The fields whose JSON type the proxy relies on: (key, its type, what the error says, must
#: not be negative). Exact types, as ``json.loads`` makes them: an integer field takes no bool.
_TYPED: tuple[tuple[str, type, str, bool], ...] = (
    ("model", str, "a string", False),
    ("stream", bool, "a boolean", False),
    ("max_tokens", int, "an integer", True),
    ("max_completion_tokens", int, "an integer", True),
    ("n", int, "an integer", False),
    ("stream_options", dict, "an object", False),
)


#: ``_TYPED`` by key: the type, and whether it must not be negative.
_TYPE_OF: dict[str, tuple[type, bool]] = {key: (kind, nn) for key, kind, _, nn in _TYPED}
_TYPED_KEYS = frozenset(_TYPE_OF)


def _check_types(body: dict[str, Any]) -> None:
    # the typed fields the body has (found in C), each looked at once; a wrong one is
    # reported by the ordered check below (the first wrong in ``_TYPED``'s order)
    for key in _TYPED_KEYS.intersection(body):
        value = body[key]
        if value is None:
            continue
        kind, non_negative = _TYPE_OF[key]
        if type(value) is not kind or (non_negative and value < 0):  # type: ignore[operator]
            _type_error(body)


def _type_error(body: dict[str, Any]) -> None:
    for key, kind, what, non_negative in _TYPED:
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not kind:
            raise schema_error(f"'{key}' must be {what}", f"body.{key}")
        if non_negative and value < 0:  # type: ignore[operator]  # an int, checked above
            raise ProxyError(400, f"'{key}' must be non-negative", param=key)


def _text_of_messages(messages: list) -> str:
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise schema_error("each message must be an object", "body.messages")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return "\n".join(parts)


_STEERING = frozenset(STEERING_FIELDS)


def _strip_steering(body: dict[str, Any], config: ProxyConfig) -> bool:
    """Remove what would steer the engines' connectors (``STEERING_FIELDS``, at the top level
    or in ``vllm_xargs``), or refuse it with a 400 (``client_kv_transfer_params: reject``).
    Whether anything was removed."""
    xargs = body.get("vllm_xargs")
    if _STEERING.isdisjoint(body) and not isinstance(xargs, dict):
        return False  # (as a rule: found in C)
    found = [name for name in STEERING_FIELDS if name in body]
    if isinstance(xargs, dict):
        found += [f"vllm_xargs.{name}" for name in STEERING_FIELDS if name in xargs]
    if not found:
        return False
    if config.client_kv_transfer_params == "reject":
        raise ProxyError(400, f"'{found[0]}' is set by the proxy, not by clients", param=found[0])
    for name in STEERING_FIELDS:
        body.pop(name, None)
    if isinstance(xargs, dict):
        body["vllm_xargs"] = without_steering(xargs)
    return True


def parse_request(
    route: Route,
    body: dict[str, Any],
    request: ClientRequest,
    config: ProxyConfig,
    raw: bytes | None = None,
) -> RequestContext:
    """Validate what routing needs and strip what the proxy owns. ``raw``: the bytes
    ``body`` was read from, kept on the context while nothing was stripped."""
    _check_types(body)

    if _strip_steering(body, config):
        raw = None

    cpt = config.decision.chars_per_token
    splittable = body.get("n") in (None, 1) and not body.get("best_of")
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise schema_error("'messages' must be a non-empty list", "body.messages")
        text = _text_of_messages(messages)
        est = int(len(text) / cpt) + 4 * len(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text, est = prompt, int(len(prompt) / cpt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            text, est = " ".join(map(str, prompt[:256])), len(prompt)
        elif isinstance(prompt, list) and prompt:
            # A batch of prompts: the engine answers it as one request; never split.
            text, est, splittable = json.dumps(prompt[:1])[:4096], 0, False
        else:
            raise schema_error(
                "'prompt' must be a string, a list of token ids or a non-empty list of prompts",
                "body.prompt",
            )
    given = header(request, b"x-request-id")
    return RequestContext(
        route=route,
        body=body,
        request_id=f"pdx-{_ID_PREFIX}{next(_ID_COUNTER):016x}",
        client_request_id=given[:256].decode("latin-1") if given else None,
        stream=bool(body.get("stream")),
        est_prompt_tokens=est,
        affinity_key=text[: config.affinity_prefix_chars],
        splittable=splittable,
        raw=raw if raw is not None and raw[:1] == b"{" else None,  # plain UTF-8 only
    )
