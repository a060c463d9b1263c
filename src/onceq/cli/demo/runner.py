"""``onceq demo`` end to end: the run with the protections on; then, at the same time,
the Spark step over that run's topic and the contrast run with the protections off; the
checks, the final table and the reports."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live

from .counting import summarise
from .live import Dashboard, LiveView
from .report import DemoReport, RunReport, print_report, write_html, write_json
from .scenario import RunConfig, RunData, Scenario
from .spark_step import SparkStep, unavailable_reason


@dataclass
class DemoOptions:
    orders: int = 4000
    contrast_orders: int = 1500  # 0: no contrast run
    queues: int = 8
    rate: float = 400.0
    spark: bool = True
    data_dir: str | None = None  # kept after the run; default a temp dir, removed
    keep: bool = False
    report: str = "onceq-demo-report.html"
    seed: int = 12


async def run_demo(opts: DemoOptions, console: Console) -> DemoReport:
    t0 = time.time()
    if opts.data_dir:
        Path(opts.data_dir).mkdir(parents=True, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="run-", dir=opts.data_dir)
    else:
        workdir = tempfile.mkdtemp(prefix="onceq-demo-")
    keep = opts.keep or bool(opts.data_dir)
    console.print(f"data in {workdir}" + ("" if keep else " (removed at the end; --keep)"))
    # the clients' warnings (the broker is down on purpose) go to a file, not over the
    # live progress
    handler = logging.FileHandler(f"{workdir}/demo.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    onceq_log = logging.getLogger("onceq")
    onceq_log.addHandler(handler)
    onceq_log.setLevel(logging.INFO)
    onceq_log.propagate = False
    skipped = None if opts.spark else "switched off (--no-spark)"
    skipped = skipped or unavailable_reason()
    step = None if skipped else SparkStep(f"{workdir}/spark")
    if step is not None:
        Path(step.workdir).mkdir(parents=True)
        step.start_session()
    try:
        cfg = RunConfig(f"{workdir}/protected", opts.orders, True, opts.queues, opts.rate,
                        seed=opts.seed)
        ccfg = RunConfig(f"{workdir}/contrast", opts.contrast_orders, False, opts.queues,
                         opts.rate, seed=opts.seed + 1)
        box: dict[str, object] = {}
        with Live(console=console, refresh_per_second=4) as live:
            dash = Dashboard(live)

            async def spark(broker: str, data: RunData) -> None:
                assert step is not None
                try:
                    box["spark"] = await step.run(broker, data.orders, data.stored)
                except Exception as exc:  # reported as a failed check, with the reason
                    box["spark_error"] = f"{type(exc).__name__}: {exc}"

            async def contrast() -> None:
                view = LiveView("protections off (contrast): no dedup window, no lock, "
                                "no idempotency layer", dash)
                box["contrast"] = await Scenario(ccfg, view).run()

            async def then(broker: str, data: RunData) -> None:
                # while this run's broker is still up for Spark, the contrast run goes
                jobs = ([spark(broker, data)] if step is not None else []) + (
                    [contrast()] if opts.contrast_orders else [])
                await asyncio.gather(*jobs)

            view = LiveView("protections on: broker dedup window, transition lock, "
                            "idempotency layer, Spark dedup", dash,
                            step.progress if step else None)
            data = await Scenario(cfg, view).run(after=then)
        summary, deliveries = summarise(data)
        rep = DemoReport(RunReport("protections on", data, summary, deliveries),
                         spark_skipped=skipped)
        rep.spark = box.get("spark")  # type: ignore[assignment]
        rep.spark_error = box.get("spark_error")  # type: ignore[assignment]
        if rep.spark is not None:
            summary.spark = {"duplicates_dropped": rep.spark.duplicates_dropped,
                             "totals_match": rep.spark.totals_match}
        cdata = box.get("contrast")
        if isinstance(cdata, RunData):
            csum, cdel = summarise(cdata)
            rep.contrast = RunReport("protections off", cdata, csum, cdel)
        rep.seconds = time.time() - t0
        rep.check()
        print_report(rep, console)
        html = Path(opts.report).resolve()
        write_html(rep, str(html))
        write_json(rep, str(html.with_suffix(".json")))
        console.print(f"HTML report: {html}\nfigures as JSON: {html.with_suffix('.json')}")
        return rep
    finally:
        onceq_log.removeHandler(handler)
        handler.close()
        onceq_log.propagate = True
        if step is not None:
            step.stop()
        if keep:
            console.print(f"data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
