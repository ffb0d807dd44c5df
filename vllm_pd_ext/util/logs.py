"""How our processes log: text (the default) or one JSON object a line (``--log-format json``).

``vllm-pd proxy``, ``vllm-pd render`` and ``vllm-pd up`` call :func:`setup_logging` in their
``main()`` (library code never configures handlers). In JSON, every line carries the
request it belongs to: the request path calls :func:`bind_request` once it knows the id,
and each line logged in that request's context (its task, and the tasks it starts) gets
``request_id``, and ``trace_id`` when the request is traced. A line can also name its
request itself: ``logger.info(..., extra={"request_id": rid})``.

uvicorn configures its own loggers when it starts (in each worker process, too): in JSON,
:func:`uvicorn_log_config` is the ``log_config`` that sends them through the same handler.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from contextvars import ContextVar
from typing import Any, Literal

LogFormat = Literal["text", "json"]
#: The values of ``--log-format``.
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

#: The request the current context serves: (request id, trace id or None).
_REQUEST: ContextVar[tuple[str, str | None] | None] = ContextVar("vllm_pd_request", default=None)

#: uvicorn's loggers: in JSON they hand their records to the root logger's handler.
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def bind_request(request_id: str | None, trace_id: str | None = None) -> None:
    """From now on, lines logged in the current context (and in tasks it starts) belong to
    ``request_id`` (None: to no request)."""
    _REQUEST.set((request_id, trace_id) if request_id else None)


def trace_id_of(traceparent: str | bytes | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header value (``00-<trace id>-<span id>-<flags>``);
    None when there is none or it is malformed."""
    if traceparent is None:
        return None
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("latin-1")
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``; ``request_id`` and ``trace_id`` when the record belongs to a request;
    ``exc_info`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        bound = _REQUEST.get()
        request_id = getattr(record, "request_id", None) or (bound[0] if bound else None)
        trace_id = getattr(record, "trace_id", None) or (bound[1] if bound else None)
        if request_id:
            out["request_id"] = request_id
        if trace_id:
            out["trace_id"] = trace_id
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def json_line(message: str, logger: str, level: str = "INFO", **fields: Any) -> str:
    """``message`` as one JSON log line (what :class:`JsonFormatter` writes), for a CLI that
    writes its own lines; ``fields`` are added to the object."""
    record = logging.LogRecord(logger, logging.getLevelName(level), "", 0, message, None, None)
    line = json.loads(JsonFormatter().format(record))
    return json.dumps({**line, **fields}, ensure_ascii=False, default=str)


def _dict_config(level: str, log_format: LogFormat, text_format: str) -> dict[str, Any]:
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"format": text_format}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["default"]},
        "loggers": {
            name: {"handlers": [], "propagate": True, "level": level.upper()}
            for name in _UVICORN_LOGGERS
        },
    }


def setup_logging(level: str, log_format: LogFormat, text_format: str) -> None:
    """Configure this process's logging: ``text_format`` lines, or JSON objects, on stderr,
    at ``level``. A CLI's ``main()`` calls it once."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: one of {', '.join(LOG_FORMATS)}")
    if log_format == "text":
        logging.basicConfig(level=level.upper(), format=text_format)
        return
    logging.config.dictConfig(_dict_config(level, log_format, text_format))


def uvicorn_log_config(level: str, log_format: LogFormat, text_format: str) -> dict[str, Any]:
    """``uvicorn.run``'s ``log_config``: uvicorn's defaults in text (its own lines and
    colours, unchanged), else the JSON configuration :func:`setup_logging` installs (applied
    again in each worker process uvicorn starts)."""
    if log_format == "text":
        import uvicorn.config

        return uvicorn.config.LOGGING_CONFIG
    return _dict_config(level, log_format, text_format)
