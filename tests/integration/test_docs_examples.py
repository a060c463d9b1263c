"""Every ```python block of README.md and docs/*.md runs, as written, against a real broker.

Markers the markdown may put on the line right before a ```python fence:

* ``<!-- continues the block above -->``: the block goes on from the previous ```python
  block of the same page; the two (and the parts before them) run as one program.
* ``<!-- not run: REASON -->``: a fragment (a signature, a pattern) that is no program.

Every other block is a whole program. In each program the documented broker address
``127.0.0.1:9876`` becomes the address of a broker this test starts (a fresh one per
program, holding the topics the docs use: ``orders``, with a few JSON orders,
``orders-clean`` and ``reports``), the metrics port ``9101`` a free port, and the Spark
examples' absolute ``/data/...`` paths become paths under the program's own temporary
directory, which is also its working directory (``sqlite:///dedup.db`` lands there).
The examples with dedup stores build their listeners and consumers but start none, so no
store is written; their Redis URLs name the loopback server, and their PostgreSQL engines
(``app@db``) are built without connecting.

Programs without Spark run in a fresh interpreter each, a few at once. Programs with Spark
run one after the other in one interpreter (each in a namespace of its own), so that they
share one JVM: starting a JVM per program would cost about 20 s each.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from onceq import Admin, Message, Producer
from tests.helpers import free_port, spawn_broker

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_ADDR = "127.0.0.1:9876"  # the broker address the examples write
DOC_METRICS_PORT = "start_http_server(9101)"
DOC_DATA = '"/data/'  # the start of the Spark examples' absolute paths
CONTINUES = "<!-- continues the block above -->"
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")
SPARK = re.compile(r"spark|readStream|writeStream|\.write\.format")
# at least this many blocks run (without and with Spark): fewer means the extraction or
# the markdown broke; raise them when blocks are added
MIN_PLAIN_BLOCKS = 12
MIN_SPARK_BLOCKS = 5
BLOCK_TIMEOUT_S = 90
SPARK_TIMEOUT_S = 420
TOPICS = {"orders": 8, "orders-clean": 4, "reports": 4}


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    code: str
    before: str  # the line before the fence, stripped

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def continues(self) -> bool:
        return self.before == CONTINUES

    @property
    def not_run(self) -> str | None:
        """The reason this block does not run, or None."""
        m = NOT_RUN.fullmatch(self.before)
        return m.group(1) if m else None


@dataclass
class Program:
    """Blocks that run as one program: a whole block and the blocks that continue it."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def where(self) -> str:
        return "+".join(b.where for b in self.blocks)

    @property
    def code(self) -> str:
        return "\n".join(b.code for b in self.blocks)

    @property
    def spark(self) -> bool:
        return SPARK.search(self.code) is not None


def extract(page: Path) -> list[Block]:
    """The ```python blocks of a page, in order."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if lines[start].strip() == "```python":
            blocks.append(Block(str(page.relative_to(ROOT)), start + 1,
                                "\n".join(lines[start + 1:i]) + "\n",
                                lines[start - 1].strip() if start else ""))
        i += 1
    return blocks


def programs(blocks: list[Block]) -> list[Program]:
    """Join continued blocks to the program they continue; leave fragments out."""
    out: list[Program] = []
    previous: Block | None = None
    for b in blocks:
        if b.continues:
            assert previous is not None and previous.page == b.page, (
                f"{b.where}: continues no block of its page")
            assert previous.not_run is None, f"{b.where}: continues a block that does not run"
            out[-1].blocks.append(b)
        elif b.not_run is None:
            out.append(Program([b]))
        previous = b
    return out


ALL_BLOCKS = [b for page in PAGES for b in extract(page)]
PROGRAMS = programs(ALL_BLOCKS)


def test_block_inventory(record_property):
    """Each marker is one of the two, right before a ```python fence; enough blocks run."""
    fragments = [b for b in ALL_BLOCKS if b.not_run is not None]
    plain = sum(len(p.blocks) for p in PROGRAMS if not p.spark)
    spark = sum(len(p.blocks) for p in PROGRAMS if p.spark)
    record_property("python_blocks", len(ALL_BLOCKS))
    record_property("blocks_run", plain + spark)
    for b in ALL_BLOCKS:  # a misspelt marker would leave a block running on its own
        assert not b.before.startswith("<!--") or b.continues or b.not_run is not None, (
            f"{b.where}: unknown marker {b.before!r}")
    for page in PAGES:
        marked = sum(1 for b in ALL_BLOCKS
                     if b.page == str(page.relative_to(ROOT)) and b.before.startswith("<!--"))
        text = page.read_text()
        assert text.count("<!-- continues") + text.count("<!-- not run") == marked, (
            f"{page.name}: a marker that is not on the line right before a ```python fence")
    assert plain + spark + len(fragments) == len(ALL_BLOCKS)
    assert plain >= MIN_PLAIN_BLOCKS, f"only {plain} python blocks without Spark run"
    assert spark >= MIN_SPARK_BLOCKS, f"only {spark} python blocks with Spark run"
    print(f"\n{len(ALL_BLOCKS)} python blocks: {plain + spark} run ({plain} without Spark, "
          f"{spark} with) as {len(PROGRAMS)} programs, {len(fragments)} not run")
    for b in fragments:
        print(f"  not run: {b.where}: {b.not_run}")


def seed(addr: str) -> None:
    """The topics the docs use, and a few JSON orders in ``orders``."""
    now = datetime.now(UTC).isoformat()

    async def go() -> None:
        async with Admin(addr) as admin:
            for topic, queues in TOPICS.items():
                await admin.create_topic(topic, queues)
        async with Producer(addr) as producer:
            for i in range(12):
                order = {"order_id": f"order-{i}", "product": f"product-{i % 3}",
                         "quantity": i + 1, "qty": i + 1, "event_time": now}
                await producer.send("orders", Message(json.dumps(order).encode(),
                                                      tags="created", keys=f"order-{i}"))
    asyncio.run(go())


def prepare(program: Program, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A seeded broker of the program's own, and the program's code pointed at it and at
    ``work``."""
    work.mkdir(parents=True)
    proc, addr = spawn_broker(str(work / "broker-data"))
    try:
        seed(addr)
    except BaseException:
        proc.kill()
        raise
    code = (program.code.replace(DOC_ADDR, addr)
            .replace(DOC_METRICS_PORT, f"start_http_server({free_port()})")
            .replace(DOC_DATA, f'"{work}/data/'))
    return proc, code


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEQ_")}
    env["PYSPARK_PYTHON"] = sys.executable  # executors run the interpreter that has onceq
    env["PYTHONUNBUFFERED"] = "1"
    # no web UI: Spark tests running at the same time would contend for its port
    env["PYSPARK_SUBMIT_ARGS"] = "--conf spark.ui.enabled=false pyspark-shell"
    return env


def numbered(code: str) -> str:
    return "\n".join(f"{n:4} {line}" for n, line in enumerate(code.splitlines(), 1))


def failure_report(failures: list[tuple[Program, str]]) -> str:
    return "\n\n".join(f"{p.where}\n{numbered(p.code)}\n--> {why}" for p, why in failures)


def run_one(program: Program, work: Path) -> str | None:
    """Run a program in a fresh interpreter: None when it exits 0 in time, else why not."""
    proc, code = prepare(program, work)
    try:
        (work / "example.py").write_text(code)
        t0 = time.monotonic()
        try:
            res = subprocess.run([sys.executable, "example.py"], cwd=work, env=child_env(),
                                 capture_output=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"did not end within {BLOCK_TIMEOUT_S} s"
        print(f"  {program.where}: exit {res.returncode} in {time.monotonic() - t0:.1f} s")
        if res.returncode != 0:
            return f"exit {res.returncode}:\n{res.stderr.decode()[-3000:]}"
        return None
    finally:
        stop(proc)


@pytest.mark.timeout(2 * BLOCK_TIMEOUT_S + 60)
@pytest.mark.slow
def test_python_blocks(tmp_path, record_property):
    """Every program without Spark exits 0 within its time."""
    todo = [p for p in PROGRAMS if not p.spark]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda ip: run_one(ip[1], tmp_path / f"p{ip[0]}"),
                                enumerate(todo)))
    failures = [(p, why) for p, why in zip(todo, results, strict=True) if why is not None]
    ran = sum(len(p.blocks) for p, why in zip(todo, results, strict=True) if why is None)
    record_property("blocks_run", ran)
    assert not failures, failure_report(failures)
    assert ran >= MIN_PLAIN_BLOCKS, f"only {ran} python blocks without Spark ran"
    print(f"{ran} python blocks without Spark ran ({len(todo)} programs, "
          f"{len(failures)} failed)")


# Runs the programs listed in argv[1] one after the other, each with its own namespace and
# working directory (the JVM keeps the first one: the programs' paths are absolute), and
# writes what each one raised to argv[2].
SPARK_RUNNER = textwrap.dedent("""
    import json, os, sys, time, traceback
    results = []
    for item in json.load(open(sys.argv[1])):
        os.chdir(item["cwd"])
        print("running", item["where"], flush=True)
        t0 = time.monotonic()
        try:
            exec(compile(item["code"], item["where"], "exec"), {"__name__": "__main__"})
            error = None
        except BaseException:
            error = traceback.format_exc()
        results.append({"where": item["where"], "error": error,
                        "seconds": time.monotonic() - t0})
    json.dump(results, open(sys.argv[2], "w"))
""")


@pytest.mark.timeout(SPARK_TIMEOUT_S + 60)
@pytest.mark.slow
def test_spark_blocks(tmp_path, record_property):
    """Every program with Spark runs to its end, all in one Python process."""
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java 17+")
    todo = [p for p in PROGRAMS if p.spark]
    brokers, items = [], []
    try:
        for i, p in enumerate(todo):
            work = tmp_path / f"s{i}"
            proc, code = prepare(p, work)
            brokers.append(proc)
            items.append({"where": p.where, "code": code, "cwd": str(work)})
        (tmp_path / "programs.json").write_text(json.dumps(items))
        try:
            res = subprocess.run(
                [sys.executable, "-c", SPARK_RUNNER, str(tmp_path / "programs.json"),
                 str(tmp_path / "results.json")],
                cwd=tmp_path, env=child_env(), capture_output=True, timeout=SPARK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            started = re.findall(r"running (\S+)", (e.stdout or b"").decode())
            pytest.fail(f"the Spark programs did not end within {SPARK_TIMEOUT_S} s; "
                        f"the last one started: {started[-1:]}")
    finally:
        for proc in brokers:
            stop(proc)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for r in results:
        print(f"  {r['where']}: {'ok' if r['error'] is None else 'FAILED'} "
              f"in {r['seconds']:.1f} s")
    failures = [(p, r["error"]) for p, r in zip(todo, results, strict=True)
                if r["error"] is not None]
    ran = sum(len(p.blocks) for p, r in zip(todo, results, strict=True) if r["error"] is None)
    record_property("blocks_run", ran)
    assert not failures, failure_report(failures)
    assert ran >= MIN_SPARK_BLOCKS, f"only {ran} python blocks with Spark ran"
    print(f"{ran} python blocks with Spark ran ({len(todo)} programs, "
          f"{len(failures)} failed)")
