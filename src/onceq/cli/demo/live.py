"""Live progress while a run goes: a table redrawn a few times a second.

It reads what the run records (the producer's sends, the members' delivery files, the
shop's effect rows, the sampled lag) as it grows; the final figures come from
``counting`` after the run, not from here.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from rich.console import Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .scenario import RunData


class _Tail:
    """Counts the delivery lines of every member file, reading only what was appended."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._pos: dict[Path, int] = {}
        self.deliveries = 0
        self.orders: set[str] = set()

    def poll(self) -> None:
        for path in self.directory.glob("*.jsonl"):
            with path.open("rb") as f:
                f.seek(self._pos.get(path, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self._pos[path] = self._pos.get(path, 0) + end
            for line in chunk[:end].splitlines():
                r = json.loads(line)
                if r["k"] == "d":
                    self.deliveries += 1
                    self.orders.add(r["o"])


class Dashboard:
    """One live display for the runs going on at once, one panel each."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.panels: dict[str, RenderableType] = {}

    def show(self, key: str, panel: RenderableType) -> None:
        self.panels[key] = panel
        self.live.update(Group(*self.panels.values()))


class LiveView:
    """The progress callback of one run (``Scenario(progress=...)``)."""

    def __init__(self, title: str, dashboard: Dashboard, notes: list[str] | None = None
                 ) -> None:
        self.title = title
        self.dashboard = dashboard
        self.notes = notes  # lines another step appends (the Spark pipeline's batches)
        self._tail: _Tail | None = None
        self._effects = 0
        self._last_db = 0.0

    def __call__(self, data: RunData) -> None:
        cfg = data.config
        if self._tail is None:
            self._tail = _Tail(f"{cfg.workdir}/deliveries")
        tail = self._tail
        tail.poll()
        now = time.time()
        if now - self._last_db > 0.5:
            self._last_db = now
            try:
                with sqlite3.connect(f"{cfg.workdir}/shop.db", timeout=1) as db:
                    self._effects = db.execute("SELECT count(*) FROM my_order").fetchone()[0]
            except sqlite3.Error:
                pass
        lags = data.lag_samples[-1][1] if data.lag_samples else {}
        sent = len(data.sends)
        dups = tail.deliveries - len(tail.orders)
        t = Table(title=self.title, show_header=False, min_width=72)
        t.add_column("what")
        t.add_column("value", justify="right")
        t.add_row("orders produced", f"{sum(1 for s in data.sends if not s.resend):,} "
                  f"of {cfg.orders:,}")
        t.add_row("application re-sends", f"{sum(1 for s in data.sends if s.resend):,}")
        t.add_row("send retries the broker recognised (dedup window)",
                  f"{sum(1 for s in data.sends if s.duplicate):,}")
        t.add_row("delivered to the group", f"{tail.deliveries:,}")
        t.add_row("duplicate deliveries so far", f"{dups:,}")
        if cfg.protected:
            t.add_row("pulls the transition lock held back (in-process members)",
                      f"{data.locked_pulls_live:,}")
        t.add_row("deliveries without an effect (stopped as duplicates, or in flight)",
                  f"{max(tail.deliveries - self._effects, 0):,}")
        t.add_row("business effects applied", f"{self._effects:,}")
        t.add_row("lag (messages not yet consumed)", f"{sum(lags.values()):,}")
        busy = sorted(((v, k) for k, v in lags.items() if v), reverse=True)[:4]
        t.add_row("  busiest queues", ", ".join(f"{k}={v}" for v, k in busy) or "-")
        t.add_row("last event", data.events[-1][1] if data.events else "-")
        bar = ProgressBar(total=max(cfg.orders, 1),
                          completed=min(len(tail.orders), cfg.orders), width=60)
        parts = [t, Text(f"orders delivered {len(tail.orders):,}/{cfg.orders:,}  "
                         f"(sent {sent:,})"), bar]
        if self.notes:
            parts.append(Text("Spark pipeline:\n" + "\n".join(self.notes[-4:])))
        self.dashboard.show(self.title, Group(*parts))
