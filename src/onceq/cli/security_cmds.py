"""``onceq user``, ``onceq acl`` and ``onceq tls``: users, grants and certificates.

Passwords are read from a hidden prompt or from stdin (``--password-stdin``), never from
the command line, where ``ps`` would show them. The client's own user comes from
``ONCEQ_USER``/``ONCEQ_PASSWORD`` or ``ONCEQ_CREDENTIALS_FILE`` (``client/security.py``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from ..broker.users import UserError, UserStore
from ..client.admin import Admin
from .common import async_command, broker_option, fail

if TYPE_CHECKING:
    from ..rocketmq.access_keys import AccessKeys

console = Console()
ACTIONS = ("Pub", "Sub", "Create", "Update", "Delete", "Get", "List")


def _password(stdin: bool) -> str:
    if stdin:
        value = sys.stdin.readline().rstrip("\r\n")
    else:
        value = click.prompt("password", hide_input=True, confirmation_prompt=True)
    if not value:
        fail("the password is empty")
    return value


@click.group()
def user() -> None:
    """Users of a broker with ACLs on (SCRAM-SHA-256)."""


@user.command("create")
@click.argument("name")
@click.option("--super", "is_super", is_flag=True, help="A super user may do everything.")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin.")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help="Write the user into this data directory instead of asking a running "
                   "broker (the first super user, while the broker is stopped).")
@broker_option
@async_command
async def user_create(name: str, is_super: bool, password_stdin: bool, data_dir: str | None,
                      broker: str) -> None:
    """Create user NAME."""
    password = _password(password_stdin)
    if data_dir is not None:
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            UserStore(data_dir).create(name, password, super=is_super)
        except (UserError, OSError) as exc:
            fail(str(exc))
    else:
        async with Admin(broker) as admin:
            await admin.create_user(name, password, super=is_super)
    click.echo(f"user {name} created{' (super user)' if is_super else ''}")


@user.command("update")
@click.argument("name")
@click.option("--password", "new_password", is_flag=True, help="Set a new password (asked).")
@click.option("--password-stdin", is_flag=True, help="Read the new password from stdin.")
@click.option("--super/--no-super", "is_super", default=None, help="Make or unmake super.")
@broker_option
@async_command
async def user_update(name: str, new_password: bool, password_stdin: bool,
                      is_super: bool | None, broker: str) -> None:
    """Change user NAME's password or super flag (a password rotation)."""
    password = _password(password_stdin) if new_password or password_stdin else None
    async with Admin(broker) as admin:
        await admin.update_user(name, password=password, super=is_super)
    click.echo(f"user {name} updated")


@user.command("delete")
@click.argument("name")
@broker_option
@async_command
async def user_delete(name: str, broker: str) -> None:
    """Delete user NAME and its grants."""
    async with Admin(broker) as admin:
        await admin.delete_user(name)
    click.echo(f"user {name} deleted")


@user.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@broker_option
@async_command
async def user_list(as_json: bool, broker: str) -> None:
    """List users (no secret is ever shown)."""
    async with Admin(broker) as admin:
        users = await admin.list_users()
    if as_json:
        click.echo(json.dumps(users, indent=1))
        return
    table = Table("user", "super", "mechanism")
    for u in users:
        table.add_row(u["name"], "yes" if u["super"] else "", u["mechanism"])
    console.print(table)


# ---------------------------------------------------------------- RocketMQ access keys
@user.group("access-key")
def access_key() -> None:
    """RocketMQ access keys of users: the accessKey/secretKey pairs the official RocketMQ
    clients sign their requests with (docs/rocketmq.md). Kept in the broker's data
    directory; a running broker takes a change within a second."""


def _access_keys(data_dir: str) -> AccessKeys:
    from ..rocketmq.access_keys import AccessKeys

    try:
        return AccessKeys(data_dir)
    except ValueError as exc:
        fail(str(exc))


_DATA_DIR = click.option("--data-dir", required=True,
                         type=click.Path(file_okay=False, exists=True),
                         help="The broker's data directory (its users.json).")


@access_key.command("create")
@click.argument("name")
@_DATA_DIR
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def access_key_create(name: str, data_dir: str, as_json: bool) -> None:
    """Make a new access key and secret key for user NAME (printed here)."""
    try:
        created = UserStore(data_dir).get(name)["created"]
        key = _access_keys(data_dir).create(name, created)
    except (UserError, OSError) as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps({"user": name, "access_key": key.access_key,
                               "secret_key": key.secret}))
        return
    click.echo(f"user:       {name}\naccess key: {key.access_key}\nsecret key: {key.secret}")


@access_key.command("list")
@_DATA_DIR
@click.option("--user", "user_name", help="Only this user's keys.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
def access_key_list(data_dir: str, user_name: str | None, as_json: bool) -> None:
    """List access keys (never their secret keys)."""
    keys = [k.public() for k in _access_keys(data_dir).list(user_name)]
    if as_json:
        click.echo(json.dumps(keys, indent=1))
        return
    table = Table("user", "access key", "created")
    for k in keys:
        table.add_row(k["user"], k["access_key"],
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(k["created"])))
    console.print(table)


@access_key.command("delete")
@click.argument("access_key_id", metavar="ACCESS_KEY")
@_DATA_DIR
def access_key_delete(access_key_id: str, data_dir: str) -> None:
    """Delete an access key: requests signed with it are refused."""
    try:
        gone = _access_keys(data_dir).delete(access_key_id)
    except OSError as exc:
        fail(str(exc))
    if not gone:
        fail(f"no access key {access_key_id!r} in {data_dir}")
    click.echo(f"access key {access_key_id} deleted")


# ---------------------------------------------------------------- grants
@click.group()
def acl() -> None:
    """Grants: which user may do which action on which resource."""


def _grant_options(fn):
    fn = click.argument("actions", nargs=-1, required=True,
                        type=click.Choice(ACTIONS, case_sensitive=False))(fn)
    fn = click.argument("pattern")(fn)
    fn = click.argument("kind", type=click.Choice(("Topic", "Group", "Cluster"),
                                                  case_sensitive=False))(fn)
    fn = click.argument("user_name")(fn)
    fn = click.option("--deny", is_flag=True, help="A deny (it wins over any allow).")(fn)
    fn = click.option("--source", "sources", multiple=True,
                      help="Only from this address or network (repeatable).")(fn)
    return broker_option(fn)


@acl.command("grant")
@_grant_options
@async_command
async def acl_grant(user_name: str, kind: str, pattern: str, actions: tuple[str, ...],
                    deny: bool, sources: tuple[str, ...], broker: str) -> None:
    """Allow USER ACTIONS on resources of KIND named PATTERN (a name, prefix* or *).

    Example: onceq acl grant alice Topic 'orders-*' Pub Sub"""
    async with Admin(broker) as admin:
        new = await admin.grant(user_name, kind, pattern, actions,
                                decision="Deny" if deny else "Allow", sources=sources)
    click.echo("granted" if new else "already granted")


@acl.command("revoke")
@_grant_options
@async_command
async def acl_revoke(user_name: str, kind: str, pattern: str, actions: tuple[str, ...],
                     deny: bool, sources: tuple[str, ...], broker: str) -> None:
    """Remove a grant (the same arguments as it was granted with)."""
    async with Admin(broker) as admin:
        gone = await admin.revoke(user_name, kind, pattern, actions,
                                  decision="Deny" if deny else "Allow", sources=sources)
    click.echo("revoked" if gone else "no such grant")


@acl.command("list")
@click.option("--user", "user_name", help="Only this user's grants.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@broker_option
@async_command
async def acl_list(user_name: str | None, as_json: bool, broker: str) -> None:
    """List grants."""
    async with Admin(broker) as admin:
        grants = await admin.list_grants(user_name)
    if as_json:
        click.echo(json.dumps(grants, indent=1))
        return
    table = Table("user", "decision", "resource", "actions", "from")
    for g in grants:
        table.add_row(g["user"], g["decision"], f"{g['kind']}:{g['pattern']}",
                      " ".join(g["actions"]), " ".join(g["sources"]) or "anywhere")
    console.print(table)


# ---------------------------------------------------------------- certificates
@click.group()
def tls() -> None:
    """Certificates for TLS."""


@tls.command("dev-cert")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--host", "hosts", multiple=True, default=("localhost", "127.0.0.1"),
              show_default=True, help="A name or address of the broker (repeatable).")
@click.option("--client-user", "client_users", multiple=True,
              help="Also a client certificate whose CN is this user (repeatable).")
def tls_dev_cert(directory: str, hosts: tuple[str, ...], client_users: tuple[str, ...]) -> None:
    """A local CA and certificates for tests and the quick start (not for production)."""
    from .tls_dev_cert import make_dev_certs

    try:
        paths = make_dev_certs(directory, hosts=hosts, client_users=client_users)
    except RuntimeError as exc:  # cryptography missing
        fail(str(exc))
    for key, path in paths.items():
        click.echo(f"{key}: {path}")


def register(main: click.Group) -> None:
    main.add_command(user)
    main.add_command(acl)
    main.add_command(tls)
