"""The one place that sets up logging for the ``onceq`` command and the broker.

``setup_logging(level, fmt)``: ``fmt`` is ``"text"`` (time, level, logger, message) or
``"json"``: one JSON object per line with ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
``message``, ``exc`` (the traceback, when there is one) and any ``extra=`` fields.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# attributes every LogRecord has: anything else came in through ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and k not in out:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exc"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send the root logger's records at ``level`` and above to ``stream`` (stderr) in
    ``fmt``; replaces the handlers a previous call installed."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
