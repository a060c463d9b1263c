"""What every page shares: the console's state, rendering, failures shown on the page,
and the checks a form that changes the broker goes through."""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from markupsafe import Markup
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from .._net import is_loopback
from ..client.security import ClientSecurity
from .access import ConsoleAdmin, Problem, describe
from .forms import iso_ms
from .samples import History, Rates

HERE = Path(__file__).parent


@dataclass
class ConsoleConfig:
    broker: str = "127.0.0.1:9876"
    host: str = "127.0.0.1"  # where the console listens (shown in the header)
    port: int = 8080
    metrics_url: str | None = None  # the broker's Prometheus endpoint, if it serves one
    security: ClientSecurity | None = None  # None: from the environment (ONCEQ_USER...)
    read_only: bool = False  # no form that changes the broker
    dedup_store: str | None = None  # the idempotency layer's store, for message lookups
    refresh_ms: int = 2000  # how often an open page refreshes its live parts
    max_trace_records: int = 5000  # trace messages read per queue of %TRACE% (the newest)
    audit_window_s: int = 60
    # the cluster's etcd endpoints, for the Cluster page's moving queues (None: from
    # ONCEQ_CLUSTER, if set; the page works from the brokers without it) and its name
    # (None: ONCEQ_CLUSTER_NAME, else "onceq")
    cluster: str | None = None
    cluster_name: str | None = None


def _num(n: Any) -> str:
    """A count with thousands separators ("-" for None)."""
    if n is None:
        return "-"
    return f"{n:,}" if isinstance(n, int | float) else str(n)


def _bytes(n: Any) -> str:
    """1536 -> "1.5 KiB" ("-" for None)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class Console:
    config: ConsoleConfig
    security: ClientSecurity = field(init=False)
    lag: History = field(init=False)
    rates: Rates = field(default_factory=Rates)
    # a form that changes the broker carries this token: a page of another site open in
    # the same browser cannot post to the console
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # the group leaders' status at the Cluster page's last view: its rates are taken
    # between two views (monotonic time, status)
    cluster_reads: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.security = (self.config.security if self.config.security is not None
                         else ClientSecurity.from_env())
        # an open page adds a sample per refresh; two pages on one group, no more
        self.lag = History(min_interval_s=self.config.refresh_ms / 2000)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        env = self.templates.env
        env.filters["q"] = lambda s: quote(str(s), safe="")
        env.filters["ms"] = iso_ms
        env.filters["num"] = _num
        env.filters["bytes"] = _bytes
        env.globals["svg"] = Markup  # charts are built by charts.py, escaped there

    def cluster_etcd(self) -> tuple[str | None, str]:
        """The cluster's etcd endpoints (None: not given) and the cluster's name."""
        c = self.config
        return (c.cluster or os.environ.get("ONCEQ_CLUSTER") or None,
                c.cluster_name or os.environ.get("ONCEQ_CLUSTER_NAME") or "onceq")

    def admin(self) -> ConsoleAdmin:
        return ConsoleAdmin(self.config.broker, security=self.security)

    def header(self) -> dict[str, Any]:
        c = self.config
        return {"broker": c.broker, "bind": f"{c.host}:{c.port}",
                "loopback": is_loopback(c.host), "user": self.security.user,
                "tls": self.security.tls, "read_only": c.read_only,
                "metrics_url": c.metrics_url, "token": self.token,
                "refresh_ms": c.refresh_ms}


def console_of(request: Request) -> Console:
    return request.app.state.console  # type: ignore[no-any-return]


def render(request: Request, template: str, http_status: int = 200, **ctx: Any) -> HTMLResponse:
    c = console_of(request)
    return c.templates.TemplateResponse(request, template, {"h": c.header(), **ctx},
                                        status_code=http_status)


def problem(request: Request, exc: BaseException) -> Problem:
    return describe(exc, console_of(request).config.broker)


def failed(request: Request, exc: BaseException, template: str = "error.html",
           **ctx: Any) -> HTMLResponse:
    """``template`` with the failure in its error box, and the failure's status."""
    p = problem(request, exc)
    return render(request, template, p.status, error=p, **ctx)


class Refused(Exception):
    """A form that may not change the broker: read-only console, or a missing token."""


async def mutation_form(request: Request) -> FormData:
    """The form of a request that changes the broker, after its checks."""
    c = console_of(request)
    if c.config.read_only:
        raise Refused("this console is read-only (started with --read-only)")
    form = await request.form()
    sent = str(form.get("token", ""))
    if not hmac.compare_digest(sent.encode(), c.token.encode()):
        raise Refused("the form is stale or was not made by this console: reload the page "
                      "and try again")
    return form


def refused(request: Request, exc: Refused) -> HTMLResponse:
    return render(request, "error.html", 403,
                  error=Problem("Not allowed", str(exc), 403))
