"""The services' logs: text for a terminal, or one JSON object per line for a log pipeline.

Each line names the service; with `--log-format json` it also carries, when the line was written
while handling one, the request id (gateway), the batch id (scheduler, executor) and the trace id,
so that an operator can follow one request through the services' logs as a trace follows it
through their spans. The ids come from `context()`, which a service enters around the work.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
from typing import Iterator

FORMATS = ("text", "json")
_json = False  # configured for JSON lines: only those carry the context, so only then is it kept
# What a line written in a context() carries, by the field name it has in JSON.
_context: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("batchline_log_context", default={})


@contextlib.contextmanager
def context(**fields: str) -> Iterator[None]:
    """Lines logged inside carry these fields (request_id, batch_id, trace_id); empty ones are left out."""
    if not _json:
        yield
        return
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(
                record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            **_context.get(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, service: str, fmt: str = "text") -> None:
    """Log at `level` to stderr, as text or JSON lines (`fmt`), each line naming `service`."""
    global _json
    _json = fmt == "json"
    handler = logging.StreamHandler()
    if _json:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def structured() -> bool:
    """Whether lines carry their context (JSON): a caller may skip working out ids nobody logs."""
    return _json


def line(service: str, message: str, fmt: str = "text") -> str:
    """One line of a process that prints rather than logs (`batchline up`), in `fmt`."""
    if fmt != "json":
        return message
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    return json.dumps({"time": now, "level": "INFO", "service": service, "message": message}, ensure_ascii=False)
