"""TLS on the broker's client port, against a running broker: clients verify the broker,
plain text and TLS do not mix, and a client certificate signed by the broker's client CA
names the connection's user (mTLS); an expired or foreign certificate gets nothing."""

from __future__ import annotations

import asyncio

import pytest

from onceq import Admin, ClientSecurity, ErrorCode, OnceqError
from onceq.broker.users import UserStore
from onceq.cli.tls_dev_cert import (
    make_client_cert,
    make_dev_certs,
    make_untrusted_client_cert,
)
from onceq.client.connection import BrokerConnection, ConnectionLost, call
from onceq.protocol.requests import DeleteTopic, ListTopics
from tests.helpers import running_broker


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("tls"), client_users=("alice",))


def _tls(certs, user=None, password=None, cert=None, key=None) -> ClientSecurity:
    return ClientSecurity(user, password, tls=True, ca_file=str(certs["ca"]),
                          cert_file=str(cert) if cert else None,
                          key_file=str(key) if key else None)


@pytest.fixture
async def broker(tmp_path, certs):
    data = tmp_path / "d"
    data.mkdir()
    users = UserStore(str(data))
    users.create("root", "root-pw", super=True)
    users.create("alice", "alice-pw")
    async with running_broker(str(data), acl=True, tls_cert=str(certs["server"]),
                              tls_key=str(certs["server_key"]),
                              tls_client_ca=str(certs["ca"]),
                              tls_client_auth="optional") as b:
        yield b


async def test_a_verified_tls_client_authenticates_and_works(broker, certs):
    async with Admin(f"127.0.0.1:{broker.port}", security=_tls(certs, "root", "root-pw")) as a:
        await a.create_topic("T", 1)
        assert "T" in [t["topic"] for t in await a.list_topics()]


async def test_a_plain_text_client_gets_nothing_from_a_tls_port(broker):
    with pytest.raises(ConnectionLost):
        conn = await BrokerConnection.open(f"127.0.0.1:{broker.port}",
                                           security=ClientSecurity("root", "root-pw"))
        try:
            await call(conn, ListTopics(), timeout=5)
        finally:
            conn.close()


async def test_a_tls_client_cannot_talk_to_a_plain_text_port(tmp_path, certs):
    async with running_broker(str(tmp_path / "plain")) as b:
        with pytest.raises(ConnectionLost):
            await BrokerConnection.open(f"127.0.0.1:{b.port}", security=_tls(certs),
                                        timeout=5)


async def test_a_client_refuses_a_broker_signed_by_another_ca(tmp_path, broker):
    other = make_dev_certs(tmp_path / "other")
    with pytest.raises(ConnectionLost, match="certificate verify failed"):
        await BrokerConnection.open(f"127.0.0.1:{broker.port}", security=ClientSecurity(
            tls=True, ca_file=str(other["ca"])), timeout=5)


async def test_a_client_certificate_names_the_user(broker, certs):
    sec = _tls(certs, cert=certs["client:alice"], key=certs["client_key:alice"])
    conn = await BrokerConnection.open(f"127.0.0.1:{broker.port}", security=sec)
    try:
        # authenticated as alice (no password sent): denied, not unauthenticated
        with pytest.raises(OnceqError) as ei:
            await call(conn, DeleteTopic("T"))
        assert ei.value.code == ErrorCode.ACCESS_DENIED and "alice" in ei.value.message
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["expired", "another CA"])
async def test_an_expired_or_foreign_client_certificate_gets_nothing(broker, certs, kind):
    if kind == "expired":
        cert, key = make_client_cert(certs["ca"].parent, "alice", expired=True)
    else:
        cert, key = make_untrusted_client_cert(certs["ca"].parent, "alice")
    with pytest.raises(ConnectionLost):
        conn = await BrokerConnection.open(f"127.0.0.1:{broker.port}",
                                           security=_tls(certs, cert=cert, key=key), timeout=5)
        try:
            await call(conn, ListTopics(), timeout=5)
        finally:
            conn.close()


async def test_the_metrics_port_speaks_tls_when_asked(tmp_path, certs):
    import ssl
    import urllib.error
    import urllib.request

    async with running_broker(str(tmp_path / "d"), tls_cert=str(certs["server"]),
                              tls_key=str(certs["server_key"]), metrics_port=0,
                              metrics_tls=True) as b:
        ctx = ssl.create_default_context(cafile=str(certs["ca"]))
        url = f"127.0.0.1:{b.metrics.port}/metrics"

        def get(scheme: str, context: ssl.SSLContext | None) -> str:
            with urllib.request.urlopen(f"{scheme}://{url}", timeout=5, context=context) as r:
                return r.read().decode()

        assert "onceq_connections" in await asyncio.to_thread(get, "https", ctx)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            await asyncio.to_thread(get, "http", None)  # plain text gets nothing
