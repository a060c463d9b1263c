"""The official RocketMQ 5 client against a broker with acl on: requests signed with an
onceq user's access key (made by ``onceq user access-key create``) are served under the
user's grants; a wrong secret key, an unknown access key, a garbled, missing or stale
signature, a missing grant are refused with RocketMQ's status codes; failed logins lock
the source out as onceq's own; and the gRPC port speaks TLS with the broker's certificate
(the official client trusting the test CA)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from onceq import Admin, ClientSecurity
from onceq.broker.acl import AclStore, make_grant
from onceq.broker.users import UserStore
from onceq.cli.main import main as cli
from onceq.rocketmq.access_keys import AccessKeys
from onceq.rocketmq.auth import DATE_FORMAT, sign

from .conftest import RmqBroker, rmq_broker

UNAUTHORIZED, FORBIDDEN = 40100, 40300
ROOT_PW = "root-password"


@dataclass
class Secured:
    rmq: RmqBroker
    keys: dict[str, tuple[str, str]]  # user -> (access key, secret key)
    tls: dict[str, Any]  # the client options for TLS ({} without)
    root: ClientSecurity

    def creds(self, user: str) -> dict[str, str]:
        ak, sk = self.keys[user]
        return {"ak": ak, "sk": sk, **self.tls}

    def topic(self, name: str) -> None:
        async def make() -> None:
            async with Admin(self.rmq.addr, security=self.root) as a:
                await a.create_topic(name, 2)

        asyncio.run(make())


@contextmanager
def secured(root: Path, *args: str, certs: dict[str, Path] | None = None
            ) -> Iterator[Secured]:
    """A broker with acl on: root (super user), alice (Pub and Sub on topics auth-*, Sub
    on groups auth-*) and bob (Sub only), each with an access key (alice's made with the
    command line)."""
    data = root / "data"
    data.mkdir(parents=True)
    users = UserStore(str(data), iterations=4096)
    users.create("root", ROOT_PW, super=True)
    users.create("alice", "alice-password")
    users.create("bob", "bob-password")
    acls = AclStore(str(data))
    for g in (make_grant("alice", "Topic", "auth-*", ["Pub", "Sub"]),
              make_grant("alice", "Group", "auth-*", ["Sub"]),
              make_grant("bob", "Topic", "auth-*", ["Sub"]),
              make_grant("bob", "Group", "*", ["Sub"])):
        acls.grant(g)
    acls.save()
    made = CliRunner().invoke(cli, ["user", "access-key", "create", "alice", "--data-dir",
                                    str(data), "--json"])
    assert made.exit_code == 0, made.output
    alice = json.loads(made.output)
    bob = AccessKeys(str(data)).create("bob", users.get("bob")["created"])
    keys = {"alice": (alice["access_key"], alice["secret_key"]),
            "bob": (bob.access_key, bob.secret)}
    tls: dict[str, Any] = {}
    rootsec = ClientSecurity("root", ROOT_PW)
    if certs is not None:
        args = (*args, "--tls-cert", str(certs["server"]), "--tls-key",
                str(certs["server_key"]))
        tls = {"tls": True, "ca": str(certs["ca"])}
        rootsec = ClientSecurity("root", ROOT_PW, tls=True, ca_file=str(certs["ca"]))
    with rmq_broker(root, "--acl", *args) as b:
        yield Secured(b, keys, tls, rootsec)


@pytest.fixture(scope="module")
def sec(tmp_path_factory: Any) -> Iterator[Secured]:
    with secured(tmp_path_factory.mktemp("rmq-acl")) as s:
        yield s


def _messages(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"body": f"{prefix}-{i}", "keys": [f"k-{i}"]} for i in range(n)]


def test_signed_producer_and_simple_consumer_are_served(sec: Secured):
    sec.topic("auth-orders")
    sent = sec.rmq.client("produce", topic="auth-orders", messages=_messages("a", 6),
                          **sec.creds("alice"))["sent"]
    assert len(sent) == 6
    got = sec.rmq.client("simple", topic="auth-orders", group="auth-g", n=6, drain=True,
                         **sec.creds("alice"))
    assert sorted(m["body"] for m in got["received"]) == [f"a-{i}" for i in range(6)]
    assert got["extra"] == []  # acknowledged: nothing comes again


def test_a_signed_push_consumer_is_served(sec: Secured):
    sec.topic("auth-push")
    sec.rmq.client("produce", topic="auth-push", messages=_messages("p", 4),
                   **sec.creds("alice"))
    seen = sec.rmq.client("push", topic="auth-push", group="auth-push-g", n=4,
                          **sec.creds("alice"))["seen"]
    assert sorted(seen) == [f"p-{i}" for i in range(4)]
    audit = (sec.rmq.home / "data" / "audit.log").read_text()
    assert '"event":"login"' in audit and "access key" in audit


def test_a_user_without_the_write_grant_is_refused_the_send(sec: Secured):
    sec.topic("auth-readonly")
    out = sec.rmq.client("produce_unknown", topic="auth-readonly", **sec.creds("bob"))
    assert out["code"] == FORBIDDEN, out
    assert "Pub on Topic:auth-readonly" in out["error"]
    assert "onceq" in out["error"]


def test_a_consumer_without_the_group_grant_is_refused(sec: Secured):
    sec.topic("auth-groups")
    sec.rmq.client("produce", topic="auth-groups", messages=_messages("g", 1),
                   **sec.creds("alice"))
    p = sec.rmq.start("simple", topic="auth-groups", group="not-alices", n=1, timeout=3,
                      **sec.creds("alice"))
    with pytest.raises(AssertionError, match="Sub on Group:not-alices"):
        sec.rmq.result(p)


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Secured]:
    """A broker of its own: failed logins lock its sources out."""
    with secured(tmp_path) as s:
        yield s


def _signed(sec: Secured, headers: list[dict[str, str]]) -> list[dict[str, Any]]:
    return sec.rmq.client("signed", topic="auth-orders", headers=headers)["answers"]


def _header(ak: str, sk: str, at: float) -> dict[str, str]:
    date_time = time.strftime(DATE_FORMAT, time.gmtime(at))
    return {"x-mq-date-time": date_time, "authorization": (
        f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, "
        f"Signature={sign(sk, date_time)}")}


def test_wrong_secrets_unknown_keys_and_bad_headers_are_unauthorized(fresh: Secured):
    fresh.topic("auth-orders")
    ak, sk = fresh.keys["alice"]
    # the client logs the refused route query (status code, message) and fails the send
    wrong = fresh.rmq.client("produce_unknown", topic="auth-orders",
                             **{**fresh.creds("alice"), "sk": "not-the-secret"})
    assert wrong["error"], wrong
    assert f"40100, the signature does not match access key '{ak}'" in fresh.rmq.client_log()
    unknown = fresh.rmq.client("produce_unknown", topic="auth-orders",
                               **{**fresh.creds("alice"), "ak": "oq-nobody"})
    assert unknown["error"], unknown
    assert "40100, access key 'oq-nobody' is not known" in fresh.rmq.client_log()
    now = time.time()
    stale = _header(ak, sk, now - 2 * 86400)
    answers = _signed(fresh, [
        {},  # not signed
        {"authorization": "Basic YWxpY2U6cHc=", "x-mq-date-time": stale["x-mq-date-time"]},
        {**stale, "x-mq-date-time": "yesterday"},
        stale,  # signed right, two days ago
        _header(ak, sk, now),  # right
    ])
    codes = [a["code"] for a in answers]
    assert codes == [UNAUTHORIZED] * 4 + [20000], answers
    assert "not signed" in answers[0]["message"]
    assert "MQv2-HMAC-SHA1" in answers[1]["message"]
    assert "20260101T120000Z" in answers[2]["message"]
    assert "h behind this onceq broker's UTC clock" in answers[3]["message"]


def test_failed_logins_lock_the_source_out(fresh: Secured):
    fresh.topic("auth-orders")
    ak, sk = fresh.keys["alice"]
    now = time.time()
    # five wrong signatures (each a different header: each counts) lock 127.0.0.1 out
    bad = [_header(ak, f"guess-{i}", now) for i in range(5)]
    answers = _signed(fresh, [*bad, bad[0], _header(ak, sk, now)])
    assert [a["code"] for a in answers] == [UNAUTHORIZED] * 7
    assert all("wrong secret key" in a["message"] for a in answers[:5])
    assert "too many failed logins" in answers[6]["message"]  # the right one, too


@pytest.fixture(scope="module")
def certs(tmp_path_factory: Any) -> dict[str, Path]:
    from onceq.cli.tls_dev_cert import make_dev_certs

    return make_dev_certs(tmp_path_factory.mktemp("rmq-tls"))


def test_the_official_client_over_tls(tmp_path: Path, certs: dict[str, Path]):
    with secured(tmp_path, certs=certs) as s:
        s.topic("auth-tls")
        sent = s.rmq.client("produce", topic="auth-tls", messages=_messages("t", 3),
                            **s.creds("alice"))["sent"]
        assert len(sent) == 3
        got = s.rmq.client("simple", topic="auth-tls", group="auth-g", n=3,
                           **s.creds("alice"))
        assert sorted(m["body"] for m in got["received"]) == ["t-0", "t-1", "t-2"]
        # without TLS the client gets nothing from the port
        plain = s.rmq.client("produce_unknown", topic="auth-tls",
                             **{**s.creds("alice"), "tls": False})
        assert plain["error"] is not None
