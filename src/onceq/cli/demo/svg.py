"""Small SVG charts, drawn as text (the report carries them inline: no script, no CDN)."""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04",
           "#db2777", "#4b5563", "#65a30d"]
_W, _H = 760, 280
_L, _R, _T, _B = 60, 190, 30, 44  # margins: left axis, legend, title, time axis


def _nice_max(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above ``v``."""
    if v <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * p >= v:
            return float(m * p)
    return float(10 * p)


def _frame(title: str, ymax: float, xmax: float, ylabel: str, xlabel: str, height: int
           ) -> list[str]:
    pw, ph = _W - _L - _R, height - _T - _B
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
           f'viewBox="0 0 {_W} {height}" class="chart" role="img" '
           f'aria-label="{escape(title)}">',
           '<rect width="100%" height="100%" fill="#ffffff"/>',
           f'<text x="{_L}" y="18" font-size="14" font-weight="600">{escape(title)}</text>']
    step = _step(ymax)
    for i in range(round(ymax / step) + 1):
        y = _T + ph - ph * i * step / ymax
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#e5e7eb"/>')
        out.append(f'<text x="{_L - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">'
                   f'{i * step:,.0f}</text>')
    step = _nice_max(xmax / 5)
    for i in range(int(xmax / step + 1e-9) + 1):
        x = _L + pw * i * step / xmax
        out.append(f'<text x="{x:.1f}" y="{_T + ph + 16}" font-size="11" '
                   f'text-anchor="middle">{i * step:g}</text>')
    out.append(f'<text x="{_L + pw / 2}" y="{height - 6}" font-size="11" '
               f'text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="14" y="{_T + ph / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 14 {_T + ph / 2})">{escape(ylabel)}</text>')
    out.append(f'<line x1="{_L}" x2="{_L}" y1="{_T}" y2="{_T + ph}" stroke="#6b7280"/>')
    out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{_T + ph}" y2="{_T + ph}" '
               'stroke="#6b7280"/>')
    return out


def _step(top: float) -> float:
    """A round step giving 4 or 5 gridlines up to ``top``, at least 1 (counts)."""
    return max(_nice_max(top / 5), 1.0)


def _axis_max(v: float) -> float:
    """A count axis: ``v`` rounded up to a whole number of round steps."""
    step = _step(max(v, 1))
    return step * math.ceil(max(v, 1) / step)


def _xmax(v: float) -> float:
    """Round the time axis up so that its five steps are round numbers."""
    step = _nice_max(v / 5)
    return step * math.ceil(v / step - 1e-9) if v > 0 else 1.0


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], *,
               xlabel: str = "seconds since start", ylabel: str = "",
               events: list[tuple[float, str]] = (), xmax: float | None = None,
               ticks: tuple[str, list[float]] | None = None) -> str:
    """Lines of (x, y) points; ``events`` are numbered vertical markers (x, label), listed
    in the legend; ``ticks`` are small marks on the time axis (label, xs)."""
    legend_rows = len(series) + (ticks is not None)
    height = max(_H, _T + _B + 16 * legend_rows + 14 * len(events) + 20)
    pw, ph = _W - _L - _R, height - _T - _B
    xs = [x for pts in series.values() for x, _ in pts] + [x for x, _ in events]
    xmax = _xmax(xmax or max([*xs, 1.0]))
    ymax = _axis_max(max([y for pts in series.values() for _, y in pts] + [1]))
    out = _frame(title, ymax, xmax, ylabel, xlabel, height)

    def sx(x: float) -> float:
        return _L + pw * min(max(x / xmax, 0), 1)

    def sy(y: float) -> float:
        return _T + ph - ph * y / ymax

    last_x, level = -100.0, 0
    ey = _T + 16 * legend_rows + 18
    for i, (x, label) in enumerate(events, 1):
        level = level + 1 if sx(x) - last_x < 12 else 0
        last_x = sx(x)
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{_T}" y2="{_T + ph}" '
                   'stroke="#111827" stroke-dasharray="4 3" stroke-width="1"/>')
        out.append(f'<text x="{sx(x) + 2:.1f}" y="{_T + 10 + (level % 4) * 11}" '
                   f'font-size="10" font-weight="600" fill="#111827">{i}</text>')
        out.append(f'<text x="{_W - _R + 12}" y="{ey + (i - 1) * 14}" font-size="10">'
                   f'{i}: {escape(label)} ({x:.1f} s)</text>')
    if ticks is not None:
        tick_label, tick_xs = ticks
        for x in tick_xs:
            out.append(f'<path d="M{sx(x):.1f},{_T + ph} l-4,7 h8 z" fill="#b91c1c"/>')
        ly = _T + 14 + len(series) * 16
        out.append(f'<path d="M{_W - _R + 18},{ly - 9} l-5,9 h10 z" fill="#b91c1c"/>')
        out.append(f'<text x="{_W - _R + 28}" y="{ly}" font-size="11">'
                   f'{escape(tick_label)} ({len(tick_xs)})</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        if pts:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            # a second or third line that coincides with the first stays visible
            dash = ' stroke-dasharray="6 3"' if i and len(series) <= 3 else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       f'stroke-width="2"{dash} class="series"/>')
        ly = _T + 14 + i * 16
        out.append(f'<rect x="{_W - _R + 12}" y="{ly - 9}" width="12" height="10" '
                   f'fill="{color}"/>')
        out.append(f'<text x="{_W - _R + 28}" y="{ly}" font-size="11">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(title: str, categories: list[str], groups: dict[str, list[float]], *,
              xlabel: str = "") -> str:
    """Horizontal bars: one row per category, one bar per group in each row."""
    n, g = len(categories), max(len(groups), 1)
    row = 12 * g + 10
    left, right = 230, 130
    h = _T + n * row + 40
    pw = _W - left - right
    # headroom for the value printed after the longest bar
    vmax = _axis_max(1.15 * max([v for vals in groups.values() for v in vals] + [1]))
    step = _step(vmax)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" '
           f'viewBox="0 0 {_W} {h}" class="chart" role="img" aria-label="{escape(title)}">',
           '<rect width="100%" height="100%" fill="#ffffff"/>',
           f'<text x="10" y="18" font-size="14" font-weight="600">{escape(title)}</text>']
    for i in range(round(vmax / step) + 1):
        x = left + pw * i * step / vmax
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_T}" y2="{_T + n * row}" '
                   'stroke="#e5e7eb"/>')
        out.append(f'<text x="{x:.1f}" y="{_T + n * row + 14}" font-size="11" '
                   f'text-anchor="middle">{i * step:,.0f}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" font-size="11" '
               f'text-anchor="middle">{escape(xlabel)}</text>')
    for r, cat in enumerate(categories):
        y0 = _T + r * row + 5
        out.append(f'<text x="{left - 8}" y="{y0 + 6 * g + 4}" font-size="11" '
                   f'text-anchor="end">{escape(cat)}</text>')
        for j, vals in enumerate(groups.values()):
            v = vals[r]
            w = pw * v / vmax
            color = PALETTE[j % len(PALETTE)]
            out.append(f'<rect x="{left}" y="{y0 + j * 12}" width="{max(w, 0.5):.1f}" '
                       f'height="10" fill="{color}" class="bar"/>')
            out.append(f'<text x="{left + w + 4:.1f}" y="{y0 + j * 12 + 9}" '
                       f'font-size="10">{v:,.0f}</text>')
    for j, name in enumerate(groups):
        ly = _T + 10 + j * 16
        out.append(f'<rect x="{_W - right + 10}" y="{ly - 9}" width="12" height="10" '
                   f'fill="{PALETTE[j % len(PALETTE)]}"/>')
        out.append(f'<text x="{_W - right + 26}" y="{ly}" font-size="11">'
                   f'{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
