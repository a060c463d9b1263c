"""``onceq pipeline`` as a user runs it, in a child process: the CLI's error contract
(``error: ...``, exit 3 without a broker, 2 for the broker's refusal) and Ctrl-C as a
clean stop (exit 0, the totals printed, no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from onceq.spark.orders import make_orders, send_orders
from tests.helpers import free_port

from .conftest import create_topic

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "onceq.cli.main", "pipeline"]
ENV = {**os.environ, "PYSPARK_PYTHON": sys.executable}


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=240)


def test_pipeline_errors_are_one_line_with_the_cli_exit_codes(broker_addr, tmp_path):
    db = f"sqlite:///{tmp_path}/inv.db"
    dead = f"127.0.0.1:{free_port()}"
    unreachable = run_cli("-b", dead, "--database", db, cwd=tmp_path)
    no_topic = run_cli("-b", broker_addr, "--topic", "cli_no_such_topic", "--database", db,
                       cwd=tmp_path)
    for r, code in ((unreachable, 3), (no_topic, 2)):
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == code, r.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
        assert "Traceback" not in r.stderr
    assert f"cannot connect to broker at {dead}" in unreachable.stderr
    assert "error: TOPIC_NOT_EXIST: " in no_topic.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_pipeline_cleanly(broker_addr, tmp_path):
    topic = "cli_sigint"
    create_topic(broker_addr, topic, 2)
    send_orders(broker_addr, topic, make_orders(200, products=3, seed=5, prefix="sigint"))
    child = subprocess.Popen(
        [*CLI, "-b", broker_addr, "--topic", topic, "--database",
         f"sqlite:///{tmp_path}/inv.db", "--checkpoint", str(tmp_path / "ckpt"),
         "--trigger", "1 second", "--max-messages-per-trigger", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    out: list[str] = []
    progress = threading.Event()

    def read_stdout() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            out.append(line)
            if line.startswith("batch "):
                progress.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        assert progress.wait(180), "no progress line"
        os.killpg(child.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
        assert child.stderr is not None
        err = child.stderr.read()
        child.wait(120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
    reader.join(10)
    stdout = "".join(out)
    assert child.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "query " in stdout and "orders counted" in stdout  # the totals
    assert "inventory" in stdout and "product-" in stdout
