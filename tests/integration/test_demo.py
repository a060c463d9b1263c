"""``onceq demo`` at a small scale: its report's invariants, and its HTML report rendered
by headless Chromium with the charts drawn.

The demo runs once (a child process, as a user runs it) for the module; the Spark step is
left out here (the pipeline has its own tests; ``tests/spark/test_demo_spark.py`` runs the
demo's Spark step).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter

import pytest

from tests.pngread import read_png

CLI = [sys.executable, "-m", "onceq.cli.main"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    html = out / "report.html"
    args = [*CLI, "demo", "-n", "400", "--contrast-orders", "200", "--no-spark", "--report",
            str(html)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "120"}, start_new_session=True)
    try:  # within the test's own timeout, so that a stuck run shows where it was
        stdout, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the onceq command prints its threads' stacks
        try:
            stdout, stderr = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the demo, its brokers and members
            stdout, stderr = proc.communicate()
        pytest.fail(f"the demo did not end within 100 s; its output:\n{stdout[-3000:]}\n"
                    f"{stderr[-12000:]}")
    r = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    return r, html, json.loads(html.with_suffix(".json").read_text())


@pytest.mark.slow
def test_demo_report_invariants(demo_run):
    r, html, rep = demo_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"HTML report: {html}" in r.stdout
    assert rep["ok"] and all(rep["checks"].values()), rep["checks"]
    on = rep["protected"]
    assert on["orders"] == 400
    assert on["sent"] == on["orders"] + on["resends"] and on["resends"] >= 1
    assert on["applied"] == on["orders"] == on["applied_orders"]
    assert on["lost"] == 0 and on["duplicate_effects"] == 0
    assert sum(on["duplicates_by_cause"].values()) == on["deliveries"] - on["unique_delivered"]
    assert on["unique_delivered"] == on["orders"]
    # the trouble happened and was removed where the story says
    # (a lost reply of a retry is retried again and recognised once; a send cut by the
    # broker's SIGKILL after it was stored is recognised as well)
    assert on["lost_replies"] >= 1 and on["broker_dedup_hits"] >= 1
    assert on["stored"] == on["sent"]  # no retried send stored twice
    assert on["duplicates_by_cause"]["application re-send"] == on["resends"]
    assert on["idempotency_removed"] >= on["resends"]
    assert on["stock_consumed"] == on["stock_expected"]
    assert on["drained"]
    assert rep["spark"] is None and "--no-spark" in rep["spark_skipped"]
    # protections off: the same kinds of trouble reach the business effect
    off = rep["contrast"]
    assert sum(off["duplicates_by_cause"].values()) == off["deliveries"] - off["unique_delivered"]
    assert off["lost"] == 0 and off["broker_dedup_hits"] == 0
    assert off["stored"] >= off["sent"] + off["lost_replies"]  # each lost reply stored twice
    assert off["applied"] - off["applied_orders"] == off["duplicate_effects"]
    assert off["duplicate_effects"] >= off["resends"] + off["lost_replies"]
    assert off["stock_consumed"] > off["stock_expected"]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs it "
                    "(scripts/chromium.sh)")
    return exe


def test_html_report_renders_charts(demo_run):
    _r, html, _rep = demo_run
    page = html.read_text()
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "<script" not in page  # self-contained
    shot = html.with_name("shot.png")
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             f"--screenshot={shot}", "--window-size=1600,2400", html.as_uri()],
            capture_output=True, timeout=90, check=True)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    width, height, rows, bpp = read_png(str(shot))
    assert (width, height) == (1600, 2400)
    colours: Counter[bytes] = Counter()
    for row in rows[::2]:
        for i in range(0, len(row), bpp * 2):
            colours[row[i:i + 3]] += 1
    # the charts' palette (svg.PALETTE): the lines and bars, not just the legend swatches
    blue, red = bytes.fromhex("2563eb"), bytes.fromhex("dc2626")
    assert colours[blue] > 2000, colours.most_common(10)
    assert colours[red] > 800, colours.most_common(10)
    from onceq.cli.demo.svg import PALETTE
    drawn = [c for c in PALETTE if colours[bytes.fromhex(c[1:])] > 40]
    # the lag chart: a line per queue and the total, in colours of their own; lines that
    # coincide or stay too short are hidden on the screen (how many depends on the run's
    # timing): each has its line in the page, and more than the two above are seen
    strokes = set(re.findall(r'<polyline [^>]*stroke="(#[0-9a-f]{6})"[^>]*class="series"',
                             page))
    assert len(strokes) >= 4 and strokes <= set(PALETTE), strokes
    assert len(drawn) >= 3, drawn
