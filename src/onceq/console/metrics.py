"""The broker's Prometheus endpoint (``--metrics-port``), read when a page asks for it.

The console is told its address (``onceq console --metrics URL``): the broker does not
announce it on the wire.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 8 * 1024 * 1024  # a scrape larger than this is cut off (lag series are bounded)


class MetricsError(Exception):
    """The endpoint could not be read or did not answer Prometheus text."""


@dataclass
class Scrape:
    """Samples by name (a counter's samples end in ``_total``): (labels, value) pairs."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(
        default_factory=lambda: defaultdict(list))

    def value(self, name: str, default: float | None = None) -> float | None:
        """The sum of the samples named ``name`` (``default`` when there is none)."""
        rows = self.samples.get(name)
        if not rows:
            return default
        return sum(v for _labels, v in rows)

    def by(self, name: str, label: str) -> dict[str, float]:
        """The samples named ``name`` summed per value of ``label``."""
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.samples.get(name, ()):
            out[labels.get(label, "")] += v
        return dict(out)


def parse(text: str) -> Scrape:
    out = Scrape()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.samples[s.name].append((dict(s.labels), float(s.value)))
    except ValueError as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from None
    return out


def _get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read(MAX_BYTES).decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise MetricsError(f"cannot read {url}: {reason}") from None


async def scrape(url: str, timeout: float = 3.0) -> Scrape:
    return parse(await asyncio.to_thread(_get, url, timeout))
