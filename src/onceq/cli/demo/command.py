"""The ``onceq demo`` command."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from ...protocol.errors import ErrorCode, OnceqError


def _zero_or_20(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if 0 < value < 20:
        raise click.BadParameter("0 (no contrast run) or at least 20")
    return value


@click.command("demo")
@click.option("--orders", "-n", default=4000, show_default=True, type=click.IntRange(20),
              help="Orders in the run with the protections on (scale up here).")
@click.option("--contrast-orders", default=1500, show_default=True,
              type=click.IntRange(0), callback=_zero_or_20,
              help="Orders in the run with the protections off (0: no contrast run).")
@click.option("--rate", default=400.0, show_default=True, type=click.FloatRange(1),
              help="Orders per second the application produces.")
@click.option("--queues", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the brokers' data, the databases and the records under this "
                   "directory (default: a temp dir, removed).")
@click.option("--keep", is_flag=True, help="Keep the temp dir with the data.")
@click.option("--no-spark", is_flag=True, help="Skip the Spark pipeline step.")
@click.option("--report", default="onceq-demo-report.html", show_default=True,
              type=click.Path(dir_okay=False),
              help="Where to write the HTML report (the figures go beside it as .json).")
@click.option("--seed", default=12, show_default=True, type=int)
def demo(orders: int, contrast_orders: int, rate: float, queues: int, data_dir: str | None,
         keep: bool, no_spark: bool, report: str, seed: int) -> None:
    """The main job: orders through lost replies, re-sends, rebalances, a SIGKILLed member
    and broker, consumed exactly once (and the same without protections, for contrast).

    Runs a broker in a child process on a temp dir, SQLite for the shop and the dedup
    store, and Spark in local mode. Exit code 0 when every check holds.
    """
    # the scenario's imports only when it runs
    from .runner import DemoOptions, run_demo

    try:  # before the run, not after it: a report that cannot be written wastes the run
        Path(report).resolve().parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create its directory: {exc}",
                                 param_hint="--report") from None
    console = Console()
    opts = DemoOptions(orders, contrast_orders, queues, rate, not no_spark, data_dir, keep,
                       report, seed)
    try:
        rep = asyncio.run(run_demo(opts, console))
    except OnceqError as exc:
        if exc.code != ErrorCode.DISK_FULL:
            raise
        console.print(f"[red]demo stopped, the broker refuses writes:[/red] {exc.message}. "
                      "Free some space, or give --data-dir on another disk.")
        raise SystemExit(1) from None
    console.print(f"demo finished in {rep.seconds:.1f}s")
    raise SystemExit(0 if rep.ok else 1)
