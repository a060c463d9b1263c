"""JSON and text logs from the one logging setup."""

from __future__ import annotations

import io
import json
import logging

import pytest

from onceq.logconfig import setup_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines(restore_logging):
    out = io.StringIO()
    setup_logging("info", "json", out)
    log = logging.getLogger("onceq.test")
    log.debug("not shown")
    log.info("sent %d to %s", 3, "T", extra={"topic": "T", "n": 3})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "INFO" and first["logger"] == "onceq.test"
    assert first["message"] == "sent 3 to T"
    assert first["topic"] == "T" and first["n"] == 3
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert "exc" not in first
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


def test_text_and_reconfiguration(restore_logging):
    out = io.StringIO()
    setup_logging("WARNING", "text", out)
    logging.getLogger("onceq.x").info("quiet")
    logging.getLogger("onceq.x").warning("loud")
    assert out.getvalue().count("\n") == 1 and "WARNING onceq.x loud" in out.getvalue()
    again = io.StringIO()
    setup_logging("DEBUG", "json", again)  # replaces the handler: no line twice
    logging.getLogger("onceq.x").debug("d")
    assert out.getvalue().count("\n") == 1
    assert json.loads(again.getvalue())["message"] == "d"
    with pytest.raises(ValueError, match="log format"):
        setup_logging("INFO", "xml", out)
