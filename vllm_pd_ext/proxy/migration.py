"""Request migration: an answer whose decode instance fails part-way is finished on another
instance, and the client sees one uninterrupted answer.

A streamed answer in text mode. States of its ``Migration`` (a token-mode stream's
``TokenMigration`` goes the same way): streaming (each event recorded
as it passes) -> broken (the engine's connection failed, or its stream ended without
``[DONE]``, or it sent an error event) -> continued on another instance (its events rewritten
into the first leg's ``id``, ``created`` and ``model``, usage summed) -> streaming ... ->
done; or given up: one SSE error event, as without migration. ``Migrator.resume`` moves it.

* The decode leg asks the engine for token ids (vLLM's ``return_token_ids``): the first
  event carries the prompt's ids (``prompt_token_ids``), every event its new ids
  (``token_ids``). The relay records them (``Migration.feed``) and shows the client what it
  would have got without asking: ``null`` in their place, and none of the empty chat
  events the engine adds for them; a client that asked sees them as they came.
* On a break, the continuation goes to another healthy instance, colocated: decode
  instances first, then any that serves. Its body is a completion on ``/v1/completions``:
  prompt = the prompt's ids + the ids generated so far, ``max_tokens`` what is left (of
  the request's limit, or of vLLM's 16 for a completion that gave none; null for an answer
  with no limit), ``min_tokens`` lowered alike, the request's sampling fields as they came. A chat
  continues the same way (its rendered prompt's ids; the completion's ``text`` goes out as
  the chat's ``delta.content``), which with greedy sampling gives the very tokens the first
  instance would have.
* Nothing generated yet: the request is sent again as it came. The finish already out (the
  break came before the usage or ``[DONE]``): the proxy writes what is missing itself.

Not continued (the error event, counted ``unsupported``): ``n`` > 1, ``best_of``, ``echo``,
``logprobs``, ``stop`` strings (vLLM holds back text that may begin one, so the text sent
can lag the ids sent), a chat with tools or a response format, a stream with reasoning
content, an engine that sent text without its ids.

A token-mode stream (``TokenMigration``): the engines answer ``/inference/v1/generate``
with ids anyway, so the proxy only records them from the engine's events on their way to the
derender. On a break the continuation is a generate request, colocated, of the rendered
prompt's ids + the ids generated so far, for what is left of the rendered ``max_tokens``;
its events go on into the same derender (its streaming call or ``stream_state``), so the
client's events need no rewriting but the usage's count. Not continued: as above, less the
reasoning (derendered by the proxy's render tier, which carries on where it was); a
completion with several prompts.

A whole (non-streamed) answer whose engine fails after its head is asked again of another
instance, colocated (``Migrator.rerun``): nothing has reached the client yet.

Each move is counted in ``vllm_pd_migrations_total{outcome}`` and logged; at most
``max_migrations`` per request.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any

from vllm_pd_ext.proxy import tracing
from vllm_pd_ext.proxy.client_channel import STREAM_END
from vllm_pd_ext.proxy.fleet import Fleet, Instance, Lease
from vllm_pd_ext.proxy.legs import decode_body
from vllm_pd_ext.proxy.relay import Opened
from vllm_pd_ext.proxy.request import GENERATE_PATH, PATHS, RequestContext
from vllm_pd_ext.proxy.upstream import Timeouts, UpstreamError
from vllm_pd_ext.util import jsonb

if TYPE_CHECKING:
    from vllm_pd_ext.proxy.call import Call
    from vllm_pd_ext.proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

#: ``vllm_pd_migrations_total``'s outcomes: continued on another instance; the finish was
#: out, the proxy wrote the rest; a whole answer asked again elsewhere; not continued: the
#: request's limit reached, a request that cannot be continued exactly, no instance answered.
OUTCOMES = ("continued", "finished", "rerun", "limit", "unsupported", "no_instance")

#: The field vLLM's OpenAI routes take to answer with token ids.
ASK_IDS = "return_token_ids"

#: What a completion continuation takes from a completion request as it came: all but these.
_NOT_CARRIED = (
    "prompt",
    "max_tokens",
    "min_tokens",
    "stream",
    "stream_options",
    ASK_IDS,
    "kv_transfer_params",
)
#: What a completion continuation takes from a chat request: its sampling fields.
_CHAT_CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "cache_salt",
    "user",
    "vllm_xargs",
)
#: A chat's fields that make a completion continuation differ from the chat's own answer.
_CHAT_ONLY = ("tools", "response_format", "structured_outputs", "guided_json", "guided_regex")

# What the relay looks for in an event's bytes (vLLM writes compact JSON; a space after the
# colon is allowed too)
_IDS = re.compile(rb'"token_ids": ?\[([0-9, ]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids": ?\[[0-9, ]*\]')
_FINISH = b'"finish_reason":"'
_FINISH_SPACED = b'"finish_reason": "'
_TEXT = re.compile(rb'"(?:text|content)": ?"[^"]')
_UNFINISHED = re.compile(rb'"finish_reason": ?null')
_EMPTY_DELTA = re.compile(rb'"delta": ?\{\}')
_FINAL_USAGE = re.compile(rb'"choices": ?\[\]')
_USAGE = re.compile(rb'"usage": ?\{')


def _unsupported(ctx: RequestContext) -> str | None:
    """Why the request's stream could not be continued exactly (None: it can)."""
    body = ctx.body
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    if body.get("echo"):
        return "echo"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs"
    if body.get("stop"):
        return "stop strings"
    if ctx.route == "chat":
        if any(body.get(k) for k in _CHAT_ONLY) and body.get("tool_choice") != "none":
            return "tools or a response format"
    elif not isinstance(body.get("prompt"), (str, list)) or (
        isinstance(body["prompt"], list) and body["prompt"] and type(body["prompt"][0]) is not int
    ):
        return "several prompts"
    return None


#: vLLM's ``max_tokens`` for a completion that gives none (a chat's: what the context leaves).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _limit(route: str, body: dict[str, Any]) -> int | None:
    """The most tokens the request's answer may have (None: what the context leaves)."""
    if route != "chat" and "max_tokens" not in body:
        return COMPLETION_DEFAULT_MAX_TOKENS
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    return value if type(value) is int else None


class _Record:
    """What every stream's record keeps, text or token mode: the ids generated so far (as
    the engine wrote them, parsed when needed: most streams never break), the limits the
    continuation must respect, and how the current leg ended."""

    __slots__ = (
        "_generated",
        "_unparsed",
        "before",
        "chat",
        "done",
        "error",
        "finish",
        "include_usage",
        "limit",
        "min_tokens",
        "moves",
        "usage_sent",
        "via",
        "why_not",
    )
    #: Set by each kind of record from its request: the most tokens the answer may have
    #: (None: what the context leaves), its ``min_tokens``, whether usage was asked for.
    limit: int | None
    min_tokens: int | None
    include_usage: bool

    def __init__(self, ctx: RequestContext) -> None:
        self.chat = ctx.route == "chat"
        self._generated: list[int] = []
        #: The ids as the engine wrote them (``b"9,8"``), parsed when needed.
        self._unparsed: list[bytes] = []
        #: Ids generated before the current leg (its usage counts from here).
        self.before = 0
        self.finish: str | None = None  # the finish_reason sent
        self.usage_sent = False
        self.done = False  # [DONE] seen
        self.error: str | None = None  # an error event from the engine (dropped)
        self.why_not: str | None = None  # found while streaming: cannot be continued
        self.moves = 0
        self.via = ""  # "from a via b" for the request's log line

    @property
    def generated(self) -> list[int]:
        """The ids generated so far, in order."""
        if self._unparsed:
            try:
                for raw in self._unparsed:
                    self._generated.extend(int(t) for t in raw.split(b",") if t.strip())
            except ValueError:
                self.why_not = "token ids that are not integers"
            self._unparsed.clear()
        return self._generated

    def broken(self) -> str | None:
        """After a leg's body ended cleanly: why the stream is incomplete (None: it is
        whole)."""
        if self.error is not None:
            return f"error event {self.error}"
        return None if self.done else "stream ended before [DONE]"

    def left(self) -> int | None:
        """Tokens the request may still generate (None: no limit known)."""
        return None if self.limit is None else max(0, self.limit - len(self.generated))


class Migration(_Record):
    """One stream's record: enough to continue it elsewhere, and to make the continuation's
    events read as the first leg's. See the module docstring for its states.

    While the first leg streams (every stream, nearly always to the end), its events are
    only scanned, never parsed: the first event's bytes are kept as they came (its
    ``id``, ``created``, ``model`` and the prompt's ids are read from them on a break),
    each later event's ids as the engine wrote them."""

    __slots__ = (
        "_first_event",
        "_head",
        "_prompt_ids",
        "_role_sent",
        "client_ids",
        "continuous",
        "convert",
    )

    def __init__(self, ctx: RequestContext, client_ids: bool):
        super().__init__(ctx)
        body = ctx.body
        #: Did the client ask for token ids itself (then it sees them)?
        self.client_ids = client_ids
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous = bool(options.get("continuous_usage_stats"))
        self.limit = _limit(ctx.route, body)
        self.min_tokens = body.get("min_tokens") if type(body.get("min_tokens")) is int else None
        #: The first leg's first event as the engine sent it (None: none yet), read on a
        #: break (``_read_first``) into what follows.
        self._first_event: bytes | None = None
        self._head: dict[str, Any] | None = None
        self._prompt_ids: list[int] | None = None
        self._role_sent = False
        #: The current leg is a completion continuing a chat (its events converted).
        self.convert = False

    @property
    def head(self) -> dict[str, Any] | None:
        """The first event's ``id``, ``created``, ``model`` (the continuation's are
        replaced with them); None before the first event."""
        self._read_first()
        return self._head

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's ids, from the first event (None: it carried none)."""
        self._read_first()
        return self._prompt_ids

    @property
    def role_sent(self) -> bool:
        """Did the client get a chat's ``role`` delta already?"""
        self._read_first()
        return self._role_sent

    @role_sent.setter
    def role_sent(self, value: bool) -> None:
        self._read_first()
        self._role_sent = value

    def _read_first(self) -> None:
        """Read the first event kept as it came (once): its head, the prompt's ids and
        whether it gave a chat's role."""
        event = self._first_event
        if event is None or self._head is not None:
            return
        data = _loads(event) or {}
        self._head = {k: data[k] for k in ("id", "created", "model") if k in data}
        ids = data.get("prompt_token_ids")
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if ids is None and isinstance(choice, dict):
            ids = choice.get("prompt_token_ids")
        if isinstance(ids, list):
            self._prompt_ids = ids
        if isinstance(choice, dict):
            delta = choice.get("delta")
            self._role_sent = isinstance(delta, dict) and "role" in delta

    # -- events on their way to the client ---------------------------------------------

    def feed(self, ready: bytes) -> bytes:
        """Complete events from the current leg, recorded; what the client gets of them
        (may be empty). Runs inside the engine connection's ``data_received``: never
        raises.

        The rule, one later event of the first leg as vLLM writes it (compact JSON, its
        ``id`` first, the ids last), is recorded here in this one call: scanned, not
        parsed (one choice per event: ``n`` > 1 is not continued), its ids kept as they
        came, the client's copy with ``null`` in their place; anything else takes
        ``_feed_one`` (one event) or ``_feed_each``."""
        start = ready.rfind(b'"token_ids":[')
        end = ready.find(b"]", start)
        if (
            end < 0
            or start < 0
            or self._first_event is None
            or self.moves
            or self.error is not None
            or not ready.startswith(b'data: {"id"')
            or ready.find(b"\n\n") != len(ready) - 2
        ):
            return self._feed_one(ready)
        self._unparsed.append(ready[start + 13 : end])
        # from here as ``_feed_one``'s scans, without its call (this runs for every event):
        # a change to one is a change to both
        if self.finish is None and (_FINISH in ready or _FINISH_SPACED in ready):
            self.finish = "sent"
        if b'"usage"' in ready and _USAGE.search(ready) and _FINAL_USAGE.search(ready):
            self.usage_sent = True
        if b'"reasoning' in ready:
            self.why_not = "reasoning content"
        if self.client_ids:
            return ready
        if (
            self.chat
            and b"{}" in ready
            and _EMPTY_DELTA.search(ready)
            and _UNFINISHED.search(ready)
        ):
            return b""  # sent only for its ids
        return ready[:start] + b'"token_ids":null' + ready[end + 1 :]

    def _feed_one(self, ready: bytes) -> bytes:
        """``feed`` for anything but its rule: the first event, an event without compact
        ids, several events, a continuation's."""
        if self.moves or self.error is not None or ready.find(b"\n\n") != len(ready) - 2:
            return self._feed_each(ready)
        if not ready.startswith(b"data: {"):
            if ready.startswith(b"data: [DONE]"):
                self.done = True
            return ready
        if ready.startswith(b'data: {"error"'):
            return self._engine_error(ready)
        first = self._first_event is None
        if first:
            self._first_event = ready
        start = ready.rfind(b'"token_ids":[')
        end = ready.find(b"]", start) + 1 if start >= 0 else 0
        if end:
            self._unparsed.append(ready[start + 13 : end - 1])
        elif b'"token_ids"' in ready and (ids := _IDS.search(ready)) is not None:
            start, end = ids.span()
            self._unparsed.append(ids.group(1))
        elif self.why_not is None and _TEXT.search(ready):
            self.why_not = "text without token ids"
        if self.finish is None and (_FINISH in ready or _FINISH_SPACED in ready):
            self.finish = "sent"
        if b'"usage"' in ready and _USAGE.search(ready) and _FINAL_USAGE.search(ready):
            self.usage_sent = True
        if b'"reasoning' in ready:
            self.why_not = "reasoning content"
        if self.client_ids:
            return ready
        if (
            self.chat
            and b"{}" in ready
            and _EMPTY_DELTA.search(ready)
            and _UNFINISHED.search(ready)
        ):
            return b""  # sent only for its ids
        if end:
            ready = ready[:start] + b'"token_ids":null' + ready[end:]
        return _PROMPT_IDS.sub(b'"prompt_token_ids":null', ready, 1) if first else ready

    def _feed_each(self, ready: bytes) -> bytes:
        """``feed`` for several events, or a continuation's: event by event."""
        out: list[bytes] = []
        for event in ready[:-2].split(b"\n\n"):
            if self.error is not None:
                continue  # after an engine's error event: its [DONE]
            if self.moves == 0:
                out.append(self._feed_one(event + b"\n\n"))
            elif event.startswith(b"data: {"):
                kept = self._rewrite(event)
                if kept is not None:
                    out.append(kept + b"\n\n")
            else:
                if event.startswith(b"data: [DONE]"):
                    self.done = True
                out.append(event + b"\n\n")
        return b"".join(out)

    def _engine_error(self, event: bytes) -> bytes:
        """An engine's error event: kept back (the stream is broken), nothing shown."""
        self.error = event[6:200].decode("utf-8", "replace")
        return b""

    def _rewrite(self, event: bytes) -> bytes | None:
        """A continuation's event as the first leg's would read."""
        data = _loads(event)
        if data is None:
            return None
        if "error" in data:
            self._engine_error(event)
            return None
        head = self.head or {}
        data.update(head)
        if self.convert:
            data["object"] = "chat.completion.chunk"
        data.pop("prompt_token_ids", None)
        choices = []
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            kept = self._choice(choice)
            if kept is not None:
                choices.append(kept)
        usage = data.get("usage")
        if isinstance(usage, dict):
            if not data.get("choices") and not self.include_usage:
                return None  # asked for by the proxy only
            self._usage(usage)
            if not data.get("choices"):
                self.usage_sent = True
        elif not choices:
            return None
        data["choices"] = choices
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        ids = choice.get("token_ids")
        ids = ids if isinstance(ids, list) else []
        self.generated.extend(ids)
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finish = str(finish)
        choice["index"] = 0
        shown = ids if self.client_ids else None
        if self.convert:
            text = choice.get("text") or ""
            if not text and finish is None and not (shown and ids):
                return None
            out: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if "stop_reason" in choice:
                out["stop_reason"] = choice["stop_reason"]
            out["token_ids"] = shown
            return out
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None  # the client has them from the first leg
        choice["token_ids"] = shown
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if "role" in delta and self.role_sent:
                del delta["role"]
                if not delta.get("content") and finish is None:
                    return None
            self.role_sent = self.role_sent or "role" in delta
            if not delta and finish is None and not shown:
                return None
        return choice

    def _usage(self, usage: dict[str, Any]) -> None:
        completion = self.before + int(usage.get("completion_tokens") or 0)
        prompt = len(self.prompt_ids) if self.prompt_ids is not None else usage.get("prompt_tokens")
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = completion
        usage["total_tokens"] = int(prompt or 0) + completion
        usage.pop("prompt_tokens_details", None)

    # -- the break -----------------------------------------------------------------------

    def ending(self) -> bytes:
        """What the client still needs once everything was generated: the finish (when the
        limit was reached unsaid), the usage (when asked for), ``[DONE]``."""
        head = self.head or {}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = b""
        if self.finish is None:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            out += _event({**head, "object": obj, "choices": [choice]})
        if self.include_usage and not self.usage_sent:
            prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
            done = len(self.generated)
            usage = {"prompt_tokens": prompt, "completion_tokens": done}
            usage["total_tokens"] = prompt + done
            out += _event({**head, "object": obj, "choices": [], "usage": usage})
        return out + STREAM_END

    def continuation(self, ctx: RequestContext) -> tuple[str, dict[str, Any]]:
        """The next leg: its engine route and body (see the module docstring)."""
        body = ctx.body
        if not self.generated:  # nothing generated yet: the request again
            self.convert = False
            return PATHS[ctx.route], {k: v for k, v in body.items() if k != "kv_transfer_params"}
        assert self.prompt_ids is not None
        self.convert = self.chat
        if self.chat:
            out = {k: body[k] for k in _CHAT_CARRIED if k in body}
        else:
            out = {k: v for k, v in body.items() if k not in _NOT_CARRIED}
        out["prompt"] = self.prompt_ids + self.generated
        # no limit: null, as a completion that gives none stops at 16
        out["max_tokens"] = self.left()
        if self.min_tokens is not None:
            out["min_tokens"] = max(0, self.min_tokens - len(self.generated))
        out["stream"] = True
        out[ASK_IDS] = True
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": self.continuous}
        return PATHS["completions"], out


class TokenMigration(_Record):
    """A token-mode stream's record: the engine events (vLLM's generate stream) on their
    way to the derender, their ids kept, so that the answer can go on elsewhere with the
    derender's state as it was (the client's events are made after this, by the derender,
    so they need no rewriting).

    The prompt's ids are the render's. The first leg's events are scanned, never parsed,
    and pass unchanged (but an error event, kept back); a continuation's events are parsed
    to count its usage from the first leg's (its prompt holds the ids generated before)."""

    __slots__ = ("_generate", "prompt_ids")

    def __init__(self, ctx: RequestContext):
        assert ctx.tokens is not None
        super().__init__(ctx)
        self._generate = ctx.tokens.generate
        self.prompt_ids: list[int] | None = ctx.tokens.prompt_ids
        sampling = self._generate.get("sampling_params") or {}
        limit = sampling.get("max_tokens")
        self.limit = limit if type(limit) is int else _limit(ctx.route, ctx.body)
        least = sampling.get("min_tokens")
        self.min_tokens = least if type(least) is int and least > 0 else None
        options = self._generate.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))

    def feed(self, ready: bytes) -> bytes:
        """Complete engine events, recorded; what goes on to the derender (may be empty).
        Never raises."""
        out: list[bytes] = []
        for event in ready[:-2].split(b"\n\n"):
            if self.error is not None:
                continue  # after an engine's error event: its [DONE]
            if not event.startswith(b"data: {"):
                if event.startswith(b"data: [DONE]"):
                    self.done = True
                out.append(event + b"\n\n")
                continue
            if event.startswith(b'data: {"error"'):
                self.error = event[6:200].decode("utf-8", "replace")
                continue
            if self.moves:
                event = self._rewrite(event)
            elif (ids := _IDS.search(event)) is not None:
                self._unparsed.append(ids.group(1))
            if self.finish is None and (_FINISH in event or _FINISH_SPACED in event):
                self.finish = "sent"
            if b'"usage"' in event and _USAGE.search(event) and _FINAL_USAGE.search(event):
                self.usage_sent = True
            out.append(event + b"\n\n")
        return b"".join(out)

    def _rewrite(self, event: bytes) -> bytes:
        """A continuation's event as the first leg's would read: its ids recorded, its
        usage counted from the first leg's, no prompt ids of its own."""
        data = _loads(event)
        if data is None:
            return event
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if isinstance(ids, list):
                self.generated.extend(ids)
        data.pop("prompt_token_ids", None)
        usage = data.get("usage")
        if isinstance(usage, dict):
            done = self.before + int(usage.get("completion_tokens") or 0)
            prompt = len(self.prompt_ids or ())
            usage.update(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()

    def ending(self) -> bytes:
        """Engine events for what the derender still needs once everything was generated:
        the finish (when the limit was reached unsaid), the usage (when asked for),
        ``[DONE]``."""
        rid = self._generate.get("request_id")
        out = b""
        if self.finish is None:
            choice = {"index": 0, "token_ids": [], "finish_reason": "length"}
            out += _event({"request_id": rid, "choices": [choice]})
        if self.include_usage and not self.usage_sent:
            prompt, done = len(self.prompt_ids or ()), len(self.generated)
            usage = {"prompt_tokens": prompt, "completion_tokens": done}
            usage["total_tokens"] = prompt + done
            out += _event({"request_id": rid, "choices": [], "usage": usage})
        return out + STREAM_END

    def continuation(self, ctx: RequestContext) -> tuple[str, dict[str, Any]]:
        """The next leg: a generate request, colocated, of the prompt's ids and those
        generated so far, for what is left of the limit."""
        body = dict(self._generate)
        body["token_ids"] = list(self.prompt_ids or ()) + self.generated
        sampling = dict(body.get("sampling_params") or {})
        sampling["max_tokens"] = self.left()
        if self.min_tokens is not None:
            sampling["min_tokens"] = max(0, self.min_tokens - len(self.generated))
        body["sampling_params"] = sampling
        body["kv_transfer_params"] = {}
        body["stream"] = True
        return GENERATE_PATH, body


class Migrator:
    """Moves requests whose engine failed part-way (one per proxy)."""

    def __init__(
        self,
        max_migrations: int,
        fleet: Fleet,
        metrics: ProxyMetrics,
        timeout: Timeouts,
    ):
        self.max_migrations = max_migrations
        self.fleet = fleet
        self.metrics = metrics
        self.timeout = timeout

    def prepare(self, ctx: RequestContext) -> Migration | TokenMigration | None:
        """Before a stream's legs are sent: its record (text mode: and the engines asked for
        token ids, the body changed in place, its bytes kept in step); None when it will not
        be continued (migration off, several prompts, or a request that cannot be continued
        exactly)."""
        if self.max_migrations == 0 or not ctx.stream:
            return None
        if _unsupported(ctx) is not None:
            return None
        if ctx.tokens is not None:  # the engines answer with ids anyway
            return None if ctx.tokens.more else TokenMigration(ctx)
        body = ctx.body
        asked = body.get(ASK_IDS)
        if asked is True:
            return Migration(ctx, client_ids=True)
        if ASK_IDS not in body and ctx.raw is not None:
            # the client's bytes, one field longer (a body holds a prompt or messages)
            ctx.raw = b'{"' + ASK_IDS.encode() + b'":true,' + ctx.raw[1:].lstrip()
        else:
            ctx.raw = None
        body[ASK_IDS] = True
        return Migration(ctx, client_ids=False)

    def _count(self, outcome: str) -> None:
        self.metrics.child(self.metrics.migrations, outcome).inc()

    def _pool(self, failed: Instance) -> list[Instance]:
        """Where a request may go on, in order: the healthy decode instances, then the
        other healthy ones; the least loaded first."""
        healthy = [i for i in self.fleet.instances() if i.healthy and i is not failed]
        return sorted(healthy, key=lambda i: (not i.serves("decode"), i.load()))

    async def resume(
        self, call: Call, m: Migration | TokenMigration, failed: Instance, reason: str
    ) -> Opened | bytes | None:
        """The stream ``m`` broke on ``failed`` (``reason``): the continuation opened on
        another instance (its lease held by ``call``), or the bytes that end the stream when
        nothing is left to generate (token mode: engine events, for the derender), or None
        when it cannot go on (logged and counted; the caller ends the stream with the error
        event). Runs inside the client's response: a client that leaves cancels it."""
        ctx = call.ctx
        if m.finish is not None or m.left() == 0:
            self._count("finished")
            self._traced("finished", failed, reason, None, len(m.generated))
            logger.warning(
                "request %s: stream from %s broke (%s) after its last token; ended by the proxy",
                ctx.request_id,
                failed.label,
                reason,
            )
            return m.ending()
        generated = m.generated  # parsed first: ids that do not parse set ``why_not``
        why = m.why_not or _unsupported(ctx)
        if why is None and generated and m.prompt_ids is None:
            why = "no prompt token ids from the engine"
        if why is not None:
            self._give_up(ctx, "unsupported", failed, reason, why)
            return None
        if m.moves >= self.max_migrations:
            self._give_up(ctx, "limit", failed, reason, f"{m.moves} migrations")
            return None
        m.moves += 1
        m.error = None
        m.before = len(m.generated)
        path, body = m.continuation(ctx)
        # token mode: the request's own id, which the engine aborts of a client gone name
        rid = ctx.request_id if ctx.tokens is not None else f"{ctx.request_id}-m{m.moves}"
        opened = await self._open(call, failed, path, body, rid)
        if opened is None:
            self._give_up(ctx, "no_instance", failed, reason, "no instance answered")
            return None
        if ctx.tokens is not None and opened.instance not in call.engines:
            call.engines.append(opened.instance)
        self._count("continued")
        self._traced("continued", failed, reason, opened.instance, m.before)
        m.via = f" (migrated from {failed.label} after {m.before} tokens)"
        logger.warning(
            "request %s: stream from %s broke (%s) after %d tokens; continued on %s",
            ctx.request_id,
            failed.label,
            reason,
            m.before,
            opened.instance.label,
        )
        return opened

    async def rerun(self, call: Call, failed: Instance, reason: str, moves: int) -> Opened | None:
        """A whole answer from ``failed`` broke after its head (``reason``): the request
        again on another instance, colocated, its lease held by ``call``; None when the
        limit is reached or none answers (logged and counted)."""
        ctx = call.ctx
        if self.max_migrations == 0:
            return None
        if moves >= self.max_migrations:
            self._give_up(ctx, "limit", failed, reason, f"{moves} migrations")
            return None
        call.colocate()
        body = decode_body(ctx, None)
        opened = await self._open(call, failed, ctx.path, body, f"{ctx.request_id}-m{moves + 1}")
        if opened is None:
            self._give_up(ctx, "no_instance", failed, reason, "no instance answered")
            return None
        self._count("rerun")
        self._traced("rerun", failed, reason, opened.instance, None)
        logger.warning(
            "request %s: answer from %s broke (%s); asked again of %s",
            ctx.request_id,
            failed.label,
            reason,
            opened.instance.label,
        )
        return opened

    def _give_up(
        self, ctx: RequestContext, outcome: str, failed: Instance, reason: str, why: str
    ) -> None:
        """Not moved: counted, logged and traced (the caller ends the answer with its
        error)."""
        self._count(outcome)
        self._traced(outcome, failed, reason, None, None)
        logger.warning(
            "request %s: answer from %s broke (%s); not migrated: %s",
            ctx.request_id,
            failed.label,
            reason,
            why,
        )

    @staticmethod
    def _traced(
        outcome: str, failed: Instance, reason: str, to: Instance | None, after: int | None
    ) -> None:
        """The request's ``migration`` trace event, when tracing is on."""
        trace = tracing.current()
        if trace is not None:
            trace.migrated(outcome, failed.label, reason, to.label if to else None, after)

    async def _open(
        self, call: Call, failed: Instance, path: str, body: Any, request_id: str
    ) -> Opened | None:
        """The first instance of the pool (least loaded first) to answer ``body`` with 200
        (with the request span's ``traceparent`` when tracing is on)."""
        headers = {"X-Request-Id": request_id}
        trace = tracing.current()
        if trace is not None:
            headers["traceparent"] = trace.traceparent()
        for inst in self._pool(failed):
            with Lease(inst) as lease:
                try:
                    resp = await inst.client.send("POST", path, self.timeout, body, headers)
                except UpstreamError as exc:
                    self.fleet.upstream_failed(inst, exc)
                    continue
                if resp.status != 200:
                    resp.close()
                    logger.warning(
                        "request %s: %s answered a migration with HTTP %d",
                        call.ctx.request_id,
                        inst.label,
                        resp.status,
                    )
                    continue
                call.hold(lease)
                return Opened(resp, inst)
        return None


def _loads(event: bytes) -> dict[str, Any] | None:
    try:
        data = jsonb.loads(event[6:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
