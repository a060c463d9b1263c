"""The demo's results: the final table on the terminal, the checks that prove the
outcome, a JSON file of every figure and the self-contained HTML report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape
from typing import Any

from rich.console import Console
from rich.table import Table

from . import svg
from .counting import CAUSES, Delivery, Summary, timeline
from .scenario import RunData
from .spark_step import SparkOutcome


@dataclass
class RunReport:
    """One run: its raw data, its figures and its deliveries (for the charts)."""

    name: str
    data: RunData
    summary: Summary
    deliveries: list[Delivery]


@dataclass
class DemoReport:
    protected: RunReport
    contrast: RunReport | None = None
    spark: SparkOutcome | None = None
    spark_skipped: str | None = None  # why the Spark step did not run
    spark_error: str | None = None  # the Spark step failed
    seconds: float = 0.0
    checks: list[tuple[str, bool]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.checks)

    def check(self) -> None:
        s = self.protected.summary
        self.checks = [
            ("business effects applied == orders sent", s.applied == s.orders),
            ("lost == 0", s.lost == 0),
            ("duplicate effects == 0", s.duplicate_effects == 0),
            ("stock consumed == the orders' quantities",
             s.stock_consumed == s.stock_expected == s.effects_qty),
            ("duplicates by cause add up to deliveries - unique",
             sum(s.duplicates_by_cause.values()) == s.deliveries - s.unique_delivered),
            ("every stored message was consumed (group drained)", s.drained),
        ]
        if self.spark is not None:
            self.checks.append(("Spark inventory table == the orders, each counted once",
                                self.spark.totals_match))
        if self.spark_error is not None:
            self.checks.append((f"Spark step ran ({self.spark_error})", False))
        if self.contrast is not None:
            c = self.contrast.summary
            self.checks.append(("protections off: duplicates by cause add up",
                                sum(c.duplicates_by_cause.values())
                                == c.deliveries - c.unique_delivered))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "protected": self.protected.summary.to_json(),
            "contrast": self.contrast.summary.to_json() if self.contrast else None,
            "spark": self.spark.__dict__ if self.spark else None,
            "spark_skipped": self.spark_skipped,
            "spark_error": self.spark_error,
            "seconds": self.seconds,
            "checks": {name: ok for name, ok in self.checks},
            "ok": self.ok,
        }
        return out


# ---------------------------------------------------------------- terminal
def _rows(s: Summary) -> list[tuple[str, str]]:
    r = [("orders (distinct order ids)", f"{s.orders:,}"),
         ("messages sent (orders + application re-sends)", f"{s.sent:,} ({s.resends} re-sends)"),
         ("send replies lost (producer retried)", f"{s.lost_replies:,}"),
         ("sends repeated while the broker was down", f"{s.app_send_retries:,}"),
         ("stored on the broker", f"{s.stored:,}"),
         ("delivered to the consumer group", f"{s.deliveries:,}"),
         ("duplicate deliveries (deliveries - distinct orders)",
          f"{s.duplicate_deliveries:,}")]
    r += [(f"  caused by {c}", f"{s.duplicates_by_cause[c]:,}") for c in CAUSES]
    r += [("duplicates removed by the broker dedup window (retried sends)",
           f"{s.broker_dedup_hits:,}"),
          ("pulls the transition lock held back during hand-overs", f"{s.locked_pulls:,}"),
          ("duplicate deliveries stopped by the idempotency layer",
           f"{s.idempotency_removed:,}"),
          ("business effects applied (rows in my_order)", f"{s.applied:,}"),
          ("duplicate business effects", f"{s.duplicate_effects:,}"),
          ("lost (orders without an effect)", f"{s.lost:,}"),
          ("stock consumed / the orders' quantities",
           f"{s.stock_consumed:,} / {s.stock_expected:,}"),
          ("produce rate (msg/s, paced)", f"{s.produce_rate:,.0f}"),
          ("delivery rate (msg/s)", f"{s.delivery_rate:,.0f}"),
          ("run time (s)", f"{s.total_s:.1f}")]
    return r


def print_report(rep: DemoReport, console: Console) -> None:
    table = Table(title="onceq demo: orders -> consumer group 'shop' -> my_order / my_inv")
    table.add_column("measured")
    table.add_column("protections on", justify="right")
    if rep.contrast is not None:
        table.add_column("protections off", justify="right")
    on = _rows(rep.protected.summary)
    off = _rows(rep.contrast.summary) if rep.contrast else None
    for i, (label, value) in enumerate(on):
        table.add_row(label, value, *([off[i][1]] if off else []))
    console.print(table)
    if rep.spark is not None:
        sp = rep.spark
        t = Table(title="Spark exactly-once pipeline (same topic -> inventory table)")
        t.add_column("measured")
        t.add_column("value", justify="right")
        t.add_row("runs (the second restarts from the checkpoint)", str(sp.runs))
        t.add_row("micro-batches", str(len(sp.batches)))
        t.add_row("rows read", f"{sp.rows_in:,}")
        t.add_row("duplicates removed by Spark dedup", f"{sp.duplicates_dropped:,}")
        t.add_row("orders counted", f"{sp.orders_counted:,}")
        t.add_row("replayed batches left unchanged", str(sp.replayed_batches))
        t.add_row("inventory table == orders sent", str(sp.totals_match))
        t.add_row("time (s)", f"{sp.seconds:.1f}")
        console.print(t)
    elif rep.spark_skipped:
        console.print(f"[yellow]Spark step not run: {rep.spark_skipped}[/]")
    for name, ok in rep.checks:
        console.print(f"{'[green]ok  ' if ok else '[red]FAIL'}[/] {name}")


# ---------------------------------------------------------------- HTML
def _timeline_charts(run: RunReport) -> list[str]:
    """Deliveries over time, and the duplicates on their own scale, events marked."""
    d = run.data
    tl = timeline(run.deliveries, d.t0, d.t_end)
    w = tl["width"]
    points = {k: [(i * w, v) for i, v in enumerate(vals)] for k, vals in tl["series"].items()}
    events = [(t - d.t0, label) for t, label in d.events if t <= d.t_end]
    ticks = ("lost send reply", [t - d.t0 for t in d.lost_replies])
    return [
        svg.line_chart(f"{run.name}: deliveries per {w:.2f} s", {
            "deliveries": points["deliveries"]}, ylabel="deliveries", events=events,
            xmax=d.t_end - d.t0, ticks=ticks),
        svg.line_chart(f"{run.name}: duplicates per {w:.2f} s", {
            "duplicate deliveries": points["duplicates"],
            "duplicate effects": points["duplicate effects"]}, ylabel="duplicates",
            events=events, xmax=d.t_end - d.t0, ticks=ticks),
    ]


def _lag_chart(run: RunReport) -> str:
    d = run.data
    queues = sorted({q for _, lags in d.lag_samples for q in lags})
    series = {q: [(t - d.t0, lags.get(q, 0)) for t, lags in d.lag_samples] for q in queues}
    events = [(t - d.t0, label) for t, label in d.events if t <= d.t_end]
    return svg.line_chart(f"{run.name}: lag per queue", series, ylabel="messages behind",
                          events=events, xmax=d.t_end - d.t0)


def _table(rep: DemoReport) -> str:
    on = _rows(rep.protected.summary)
    off = _rows(rep.contrast.summary) if rep.contrast else None
    head = "<tr><th>measured</th><th>protections on</th>" + (
        "<th>protections off</th>" if off else "") + "</tr>"
    body = "".join(
        f"<tr><td>{escape(label)}</td><td>{escape(v)}</td>"
        + (f"<td>{escape(off[i][1])}</td>" if off else "") + "</tr>"
        for i, (label, v) in enumerate(on))
    return f"<table>{head}{body}</table>"


def write_html(rep: DemoReport, path: str) -> None:
    p = rep.protected
    charts = _timeline_charts(p)
    if rep.contrast is not None:
        charts += _timeline_charts(rep.contrast)
    charts.append(_lag_chart(p))
    groups = {"protections on": [p.summary.duplicates_by_cause[c] for c in CAUSES]}
    if rep.contrast is not None:
        groups["protections off"] = [rep.contrast.summary.duplicates_by_cause[c]
                                     for c in CAUSES]
    charts.append(svg.bar_chart("Duplicate deliveries by cause", list(CAUSES), groups,
                                xlabel="duplicate deliveries"))
    layers = ["broker dedup window", "transition lock (pulls held back)",
              "idempotency layer", "Spark dedup"]
    spark_dups = rep.spark.duplicates_dropped if rep.spark else 0
    charts.append(svg.bar_chart(
        "Duplicates removed by each layer (protections on)", layers,
        {"removed": [p.summary.broker_dedup_hits, p.summary.locked_pulls,
                     p.summary.idempotency_removed, spark_dups]}, xlabel="count"))
    if rep.contrast is not None:
        c = rep.contrast.summary
        charts.append(svg.bar_chart(
            "Business effects: protections on vs off", ["orders", "effects applied",
                                                        "duplicate effects", "lost"],
            {"protections on": [p.summary.orders, p.summary.applied,
                                p.summary.duplicate_effects, p.summary.lost],
             "protections off": [c.orders, c.applied, c.duplicate_effects, c.lost]},
            xlabel="count"))
    checks = "".join(f'<li class="{"ok" if ok else "fail"}">{"ok" if ok else "FAIL"}: '
                     f"{escape(name)}</li>" for name, ok in rep.checks)
    spark = ""
    if rep.spark is not None:
        rows = "".join(
            f"<tr><td>{b['run']}</td><td>{b['batch']}</td><td>{b['rows_in']}</td>"
            f"<td>{b['spark_duplicates'] + b['late_duplicates']}</td>"
            f"<td>{b['orders_new']}</td><td>{b['replayed']}</td></tr>"
            for b in rep.spark.batches)
        spark = ("<h2>Spark exactly-once pipeline</h2><table><tr><th>run</th><th>batch</th>"
                 "<th>rows in</th><th>duplicates dropped</th><th>orders counted</th>"
                 f"<th>replayed</th></tr>{rows}</table><p>Inventory table equals the orders "
                 f"sent, each counted once: <b>{rep.spark.totals_match}</b></p>")
    elif rep.spark_skipped:
        spark = f"<p>Spark step not run: {escape(rep.spark_skipped)}</p>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>onceq demo report</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #111827; max-width: 1600px; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
td, th {{ border: 1px solid #d1d5db; padding: 3px 8px; font-size: 13px; }}
td:not(:first-child) {{ text-align: right; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.chart {{ border: 1px solid #e5e7eb; }}
li.ok {{ color: #166534; }} li.fail {{ color: #b91c1c; font-weight: 600; }}
</style></head><body>
<h1>onceq demo: each order's effect happens once</h1>
<p>Orders produced through lost send replies and application re-sends, consumed by a
push-consumer group while members join, leave and one is SIGKILLed, with the broker
SIGKILLed and restarted; then the same run with the broker dedup window, the transition
lock and the idempotency layer switched off. Every figure is counted from the run's
records. Total time {rep.seconds:.1f} s.</p>
<ul>{checks}</ul>
<div class="charts">{''.join(charts)}</div>
<h2>Figures</h2>{_table(rep)}{spark}
</body></html>
"""
    with open(path, "w") as f:
        f.write(page)


def write_json(rep: DemoReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(rep.to_json(), f, indent=2, default=str)
