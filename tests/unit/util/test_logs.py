"""``util/logs.py``: the JSON log line, the request a line belongs to, traceparent parsing."""

from __future__ import annotations

import asyncio
import json
import logging

from vllm_pd_ext.util.logs import JsonFormatter, bind_request, json_line, trace_id_of

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _record(message: str, *args, **extra) -> logging.LogRecord:
    record = logging.LogRecord("some.module", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_a_line_is_one_json_object_with_the_bound_request():
    async def serve(rid: str, trace: str | None) -> dict:
        bind_request(rid, trace)
        await asyncio.sleep(0)  # another request's task runs meanwhile
        return json.loads(JsonFormatter().format(_record("request %s: %s", rid, "ok\nnext")))

    async def both() -> list[dict]:
        return list(await asyncio.gather(serve("r1", TRACE), serve("r2", None)))

    one, two = asyncio.run(both())
    assert one["message"] == "request r1: ok\nnext"
    assert (one["request_id"], one["trace_id"]) == ("r1", TRACE)
    assert (one["level"], one["logger"]) == ("WARNING", "some.module")
    assert one["ts"].endswith("Z")
    assert two["request_id"] == "r2" and "trace_id" not in two


def test_a_line_outside_any_request_has_no_request_fields_unless_it_names_one():
    async def outside() -> tuple[dict, dict]:
        plain = json.loads(JsonFormatter().format(_record("started")))
        named = json.loads(JsonFormatter().format(_record("drained", request_id="r9")))
        return plain, named

    plain, named = asyncio.run(outside())
    assert "request_id" not in plain and "trace_id" not in plain
    assert named["request_id"] == "r9"


def test_an_exception_goes_into_the_same_object():
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = __import__("sys").exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc_info"]


def test_json_line_and_trace_ids():
    line = json.loads(json_line("ready", "vllm_pd_ext.tools.launcher", endpoint="http://x/v1"))
    assert (line["message"], line["level"], line["endpoint"]) == ("ready", "INFO", "http://x/v1")
    assert trace_id_of(f"00-{TRACE}-00f067aa0ba902b7-01") == TRACE
    assert trace_id_of(f"00-{TRACE}-00f067aa0ba902b7-01".encode()) == TRACE
    for bad in (None, "", "garbage", f"00-{'0' * 32}-00f067aa0ba902b7-01", "00-xyz-1-01"):
        assert trace_id_of(bad) is None
