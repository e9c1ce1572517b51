"""Service logging: JSON lines or text (``IBEDL_LOG_FORMAT``), the id of the request being served on every record
written while serving it (a context variable RequestGuard sets, read by a logging.Filter), and the access line."""

from __future__ import annotations

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

ACCESS = logging.getLogger("ibedl.serve.access")
# what an access line carries besides the message (LogRecord attributes set through ``extra``)
ACCESS_FIELDS = ("method", "route", "status", "latency_ms", "adapter")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamps every record with the id of the request being served (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, the access fields
    when present, and the traceback as ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        entry.update({k: getattr(record, k) for k in ACCESS_FIELDS if hasattr(record, k)})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str, fmt: str) -> logging.Handler:
    """Send every logger's records (uvicorn's too) to stderr in ``fmt`` (json or text) from ``level`` on."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own handlers would print its lines in its format
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    return handler


def access(method: str, route: str, status: int | str, seconds: float, adapter: str | None, request_id: str,
           probe: bool = False) -> None:
    """The access line of one request (probes and /metrics at DEBUG: a scrape every few seconds is noise)."""
    latency_ms = round(seconds * 1000, 2)
    ACCESS.log(logging.DEBUG if probe else logging.INFO, "%s %s %s %.1f ms", method, route, status, latency_ms,
               extra={"method": method, "route": route, "status": status, "latency_ms": latency_ms,
                      "adapter": adapter, "request_id": request_id})
