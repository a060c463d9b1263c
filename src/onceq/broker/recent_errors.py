"""The broker's recent warnings and errors, kept in memory for ``BROKER_STATUS``.

A logging handler on the ``onceq`` logger keeps the last ``RECENT_ERRORS`` records at
``WARNING`` and above (time, level, logger, message; the message cut to ``MAX_CHARS``), so
an operator's console or ``onceq broker status`` shows what went wrong lately without
reading the broker's log. Nothing is kept on disk; a restart starts an empty list.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

RECENT_ERRORS = 50
MAX_CHARS = 500


class RecentErrors(logging.Handler):
    def __init__(self, size: int = RECENT_ERRORS) -> None:
        super().__init__(logging.WARNING)
        self._records: deque[dict[str, Any]] = deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: keep its template
            message = str(record.msg)
        self._records.append({"ts_ms": int(record.created * 1000), "level": record.levelname,
                              "logger": record.name, "message": message[:MAX_CHARS]})

    def recent(self) -> list[dict[str, Any]]:
        """The kept records, newest last."""
        return list(self._records)

    def install(self) -> None:
        logging.getLogger("onceq").addHandler(self)

    def remove(self) -> None:
        logging.getLogger("onceq").removeHandler(self)
