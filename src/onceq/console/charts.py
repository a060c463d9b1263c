"""Charts drawn as inline SVG on the server: the lag of a group over time and the
duplicates of the audit per time window. No script is needed to show them; an open page
swaps in a fresh copy now and then."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any

from .samples import Sample

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777",
           "#65a30d", "#475569", "#b45309")
CAUSE_COLOURS = {"rebalance": "#2563eb", "crash": "#dc2626", "broker_restart": "#7c3aed",
                 "retry": "#d97706", "producer_resend": "#0891b2"}


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def _tick(v: float) -> str:
    return f"{v:,.0f}" if v == int(v) else f"{v:,.1f}"


def _nice_max(v: float) -> int:
    """A round number at or above ``v`` for the top of an axis."""
    if v <= 0:
        return 1
    step = 1
    while step * 10 <= v:
        step *= 10
    for m in (1, 2, 5, 10):
        if m * step >= v:
            return m * step
    return 10 * step


def lag_chart(samples: Sequence[Sample], *, width: int = 1180, height: int = 300,
              max_series: int = 8) -> str:
    """The lag per queue (the ``max_series`` queues with the most lag now) and the total,
    over the samples' time span. Time on x (UTC), messages on y."""
    left, right, top, bottom = 64, 190, 16, 40
    pw, ph = width - left - right, height - top - bottom
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
             '<title>lag over time</title>']
    if not samples:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" '
                     'class="muted">no sample yet</text></svg>')
        return "".join(parts)
    last = samples[-1].values
    labels = sorted(last, key=lambda k: (-last[k], k))[:max_series]
    totals = [sum(s.values.values()) for s in samples]
    ymax = _nice_max(max([*totals, 1]))
    t0, t1 = samples[0].t, samples[-1].t
    span = t1 - t0 if t1 > t0 else 1.0

    def x(t: float) -> float:
        return left + (t - t0) / span * pw if len(samples) > 1 else left + pw

    def y(v: float) -> float:
        return top + ph - v / ymax * ph

    # axes and grid
    for i in range(5):
        v = ymax * i / 4
        yy = y(v)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     'class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end" '
                     f'class="tick">{_tick(v)}</text>')
    parts.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
                 'text-anchor="middle" class="axis">messages behind</text>')
    parts.append(f'<text x="{left}" y="{height - 8}" class="tick">{_clock(t0)}</text>')
    parts.append(f'<text x="{left + pw}" y="{height - 8}" text-anchor="end" '
                 f'class="tick">{_clock(t1)} UTC</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" '
                 f'class="axis">time ({len(samples)} samples over {t1 - t0:.0f} s)</text>')

    def line(values: list[float], colour: str, cls: str, name: str) -> None:
        pts = " ".join(f"{x(s.t):.1f},{y(v):.1f}" for s, v in zip(samples, values, strict=True))
        if len(samples) == 1:
            parts.append(f'<circle cx="{x(t1):.1f}" cy="{y(values[0]):.1f}" r="3" '
                         f'fill="{colour}" class="{cls}"><title>{escape(name)}</title></circle>')
        else:
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" '
                         f'class="{cls}"><title>{escape(name)}</title></polyline>')

    line([float(v) for v in totals], "#111827", "series total", "total")
    for i, label in enumerate(labels):
        line([float(s.values.get(label, 0)) for s in samples], PALETTE[i % len(PALETTE)],
             "series", label)
    # legend
    lx = left + pw + 14
    entries = [("total", "#111827", totals[-1])] + [
        (label, PALETTE[i % len(PALETTE)], last[label]) for i, label in enumerate(labels)]
    for i, (name, colour, value) in enumerate(entries):
        ly = top + 8 + i * 18
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 16}" y="{ly + 1}" class="legend">{escape(name)}: '
                     f'{value:,}</text>')
    hidden = len(last) - len(labels)
    if hidden > 0:
        ly = top + 8 + len(entries) * 18
        parts.append(f'<text x="{lx}" y="{ly + 1}" class="legend muted">+{hidden} more '
                     'queue(s) in the total</text>')
    parts.append("</svg>")
    return "".join(parts)


def duplicates_chart(windows: Sequence[dict[str, Any]], causes: Sequence[str], *,
                     width: int = 1180, height: int = 240) -> str:
    """Stacked bars: duplicates per time window, by cause (windows of every group
    added up)."""
    left, right, top, bottom = 56, 160, 16, 40
    pw, ph = width - left - right, height - top - bottom
    by_start: dict[int, dict[str, int]] = {}
    for w in windows:
        acc = by_start.setdefault(int(w["start_ms"]), dict.fromkeys(causes, 0))
        for c in causes:
            acc[c] += int(w["causes"][c])
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
             '<title>duplicates per time window by cause</title>']
    if not by_start:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" '
                     'class="muted">no traced delivery</text></svg>')
        return "".join(parts)
    starts = sorted(by_start)
    ymax = _nice_max(max([sum(by_start[s].values()) for s in starts] + [1]))
    bw = min(pw / len(starts), 80.0)
    for i in range(5):
        v = ymax * i / 4
        yy = top + ph - v / ymax * ph
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     'class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end" '
                     f'class="tick">{_tick(v)}</text>')
    for i, s in enumerate(starts):
        base = top + ph
        for c in causes:
            n = by_start[s][c]
            if not n:
                continue
            h = n / ymax * ph
            base -= h
            parts.append(f'<rect x="{left + i * bw + 1:.1f}" y="{base:.1f}" '
                         f'width="{max(bw - 2, 1):.1f}" height="{h:.1f}" '
                         f'fill="{CAUSE_COLOURS.get(c, "#475569")}"><title>{_clock(s / 1000)} '
                         f'{c}: {n}</title></rect>')
    parts.append(f'<text x="{left}" y="{height - 8}" class="tick">{_clock(starts[0] / 1000)}'
                 '</text>')
    parts.append(f'<text x="{left + pw}" y="{height - 8}" text-anchor="end" class="tick">'
                 f'{_clock(starts[-1] / 1000)} UTC</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" '
                 'class="axis">window start</text>')
    lx = left + pw + 14
    for i, c in enumerate(causes):
        ly = top + 8 + i * 18
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" '
                     f'fill="{CAUSE_COLOURS.get(c, "#475569")}"/>')
        parts.append(f'<text x="{lx + 16}" y="{ly + 1}" class="legend">{c}: '
                     f'{sum(by_start[s][c] for s in starts):,}</text>')
    parts.append("</svg>")
    return "".join(parts)
