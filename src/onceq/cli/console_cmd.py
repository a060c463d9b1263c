"""``onceq console``: the web console for operators (``onceq.console``, the console
extra)."""

from __future__ import annotations

import click

from .._net import is_loopback
from ..client.security import ClientSecurity, CredentialsError
from .common import broker_option, fail


@click.command("console")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the console listens on (loopback: this machine only).")
@click.option("--port", "-p", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--allow-remote", is_flag=True,
              help="Allow a --host other than loopback: whoever reaches the port acts with "
                   "the console's broker user (put an authenticating proxy in front).")
@click.option("--metrics", "metrics_url", default=None, metavar="URL",
              envvar="ONCEQ_CONSOLE_METRICS",
              help="The broker's Prometheus endpoint (http://127.0.0.1:9877/metrics with "
                   "--metrics-port 9877): live rates, connections and error counters.")
@click.option("--read-only", is_flag=True, help="No form that changes the broker.")
@click.option("--dedup-store", default=None, metavar="URL",
              help="The idempotency layer's store (sqlite:///path, redis://..., ...): message "
                   "lookups show its records.")
@click.option("--refresh", default=2.0, show_default=True, type=click.FloatRange(0.25, 3600),
              help="Seconds between the refreshes of an open page's live parts.")
@click.option("--max-trace", default=5000, show_default=True, type=click.IntRange(1, 10**7),
              help="Trace messages the Duplicates page reads per queue of %TRACE% (the "
                   "newest).")
@click.option("--cluster", "endpoints", default=None, envvar="ONCEQ_CLUSTER",
              metavar="ENDPOINTS",
              help="The cluster's etcd endpoints, etcd://host:port[,host:port...]: the "
                   "Cluster page shows the queues moving between groups and every spread "
                   "topic (it works from the brokers without it).")
@click.option("--cluster-name", default="onceq", show_default=True,
              envvar="ONCEQ_CLUSTER_NAME", help="Name of the cluster in etcd.")
@broker_option
def console(host: str, port: int, allow_remote: bool, metrics_url: str | None,
            read_only: bool, dedup_store: str | None, refresh: float, max_trace: int,
            endpoints: str | None, cluster_name: str, broker: str) -> None:
    """Serve the web console for the broker at --broker: overview, topics, consumer groups
    with lag over time, messages, duplicates by cause, dead letters, the cluster's broker
    groups (docs/console.md).

    It uses the credentials of any client (ONCEQ_USER and ONCEQ_PASSWORD, or
    ONCEQ_CREDENTIALS_FILE; ONCEQ_TLS...), and reads the broker only while a page is open."""
    try:
        from ..console import ConsoleConfig, serve
    except ImportError as exc:
        raise click.ClickException(f"onceq console needs the console extra "
                                   f"(pip install 'onceq[console]'): {exc}") from None
    if not is_loopback(host) and not allow_remote:
        raise click.UsageError(f"--host {host} is reachable from other machines: add "
                               "--allow-remote to serve the console there")
    try:
        security = ClientSecurity.from_env()
    except CredentialsError as exc:
        fail(str(exc))
    where = "loopback only" if is_loopback(host) else "reachable from the network"
    click.echo(f"onceq console on http://{host}:{port}/ ({where}) for the broker at {broker}"
               f"{' as ' + security.user if security.user else ''}", err=True)
    serve(ConsoleConfig(broker=broker, host=host, port=port, metrics_url=metrics_url,
                        security=security, read_only=read_only, dedup_store=dedup_store,
                        refresh_ms=int(refresh * 1000), max_trace_records=max_trace,
                        cluster=endpoints or None, cluster_name=cluster_name))


def register(main: click.Group) -> None:
    main.add_command(console)
