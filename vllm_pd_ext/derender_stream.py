"""The streaming derender call: one long-lived call per streamed answer (our render server).

vLLM's streaming derender is one call per engine event, each carrying the prompt's token ids,
the client's request and the ``stream_state`` (its cost grows with the prompt). Our render
server also serves one call per streamed answer, on the route :data:`PATHS` names:

* request: ``POST`` with a chunked body of newline-delimited JSON (``application/x-ndjson``).
  Line 1 is the answer's context, the fields of vLLM's streaming derender request but
  ``stream``, ``generate_chunk`` and ``stream_state`` (``model``, ``prompt_tokens``,
  ``prompt_token_ids``, ``chat_request`` or ``completion_request``); every further line is one
  generate stream chunk (what the engine's ``/inference/v1/generate`` stream sent). The body
  ends with the answer (or the caller closes the connection to give up).
* response: a bad context is answered as any bad request (an OpenAI error body, 4xx) before
  any chunk is read. Otherwise ``200 text/event-stream``, and for each chunk line, in order,
  one event ``data: <derendered chunk>`` (the ``chunk`` the per-event call would answer for
  the same chunk, encoded the same way); the ``stream_state`` stays on the server. A line that
  fails ends the response with one event ``data: {"error": {...}}`` (the OpenAI error body,
  ``code`` its HTTP status).

A render tier without the route (vLLM's) answers 404 or 405: the caller then derenders per
event. No other module spells the route or the framing.
"""

from __future__ import annotations

import json
from typing import Any

#: The route per OpenAI route kind.
PATHS = {
    "chat": "/v1/chat/completions/derender_stream",
    "completions": "/v1/completions/derender_stream",
}
CONTENT_TYPE = "application/x-ndjson"
#: The keys of a per-event streaming derender request that line 1 must not carry.
PER_EVENT_KEYS = ("stream", "generate_chunk", "stream_state")
#: What a render tier without the route answers to it.
ROUTE_MISSING = (404, 405)


def line(obj: dict[str, Any]) -> bytes:
    """One body line: ``obj`` as compact JSON and a newline."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def event(payload: bytes) -> bytes:
    """One response event around an encoded JSON payload."""
    return b"data: " + payload + b"\n\n"


def error_of(payload: Any) -> dict[str, Any] | None:
    """The error body of a response event's decoded payload; None when it is a chunk."""
    if isinstance(payload, dict) and set(payload) == {"error"}:
        error = payload["error"]
        return error if isinstance(error, dict) else {"message": str(error)}
    return None
