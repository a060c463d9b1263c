"""Signed RocketMQ requests on a broker with acl on (``rocketmq/auth.py``,
``rocketmq/access_keys.py``): the ``authorization`` header as the official clients write
it, the signature, the date-time window, the access-key file, and the authenticator on a
real ``Security`` (users, grants, failed logins, the audit log)."""

from __future__ import annotations

import hmac
import json
import os
import stat
import string
import time
from datetime import UTC, datetime, timedelta
from hashlib import sha1
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("google.protobuf")

from onceq.broker.acl import make_grant
from onceq.broker.config import BrokerConfig
from onceq.broker.security import Security
from onceq.protocol.requests import CommitOffset, GetTopic, Pull, Send
from onceq.rocketmq.access_keys import FILE, AccessKeys, parse
from onceq.rocketmq.auth import (
    DATE_FORMAT,
    SKEW_S,
    ZONE_EAST_S,
    ZONE_WEST_S,
    Authenticator,
    AuthError,
    date_time_problem,
    parse_authorization,
    parse_date_time,
    peer_address,
    sign,
    signature_ok,
)
from onceq.rocketmq.mapping import Code, RmqError
from onceq.storage.config import StoreConfig


def client_header(ak: str, sk: str, date_time: str) -> str:
    """What rocketmq-python-client 5.1.2 sends (``rocketmq/v5/util/signature.py``)."""
    mac = hmac.new(sk.encode("utf-8"), date_time.encode("utf-8"), sha1).digest()
    return ("MQv2-HMAC-SHA1" + " " + "Credential" + "=" + ak + ", " + "SignedHeaders" + "="
            + "x-mq-date-time" + ", " + "Signature" + "=" + mac.hex())


ACCESS_KEYS = st.text(string.ascii_letters + string.digits + "_.@-", min_size=1, max_size=64)
SECRETS = st.text(min_size=1, max_size=80).filter(lambda s: "\x00" not in s)
TIMES = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2099, 12, 31))


# ------------------------------------------------------------------ the header
@given(ACCESS_KEYS, SECRETS, TIMES)
def test_the_clients_header_parses_and_its_signature_checks(ak, sk, when):
    date_time = when.strftime(DATE_FORMAT)
    auth = parse_authorization(client_header(ak, sk, date_time))
    assert auth.access_key == ak
    assert auth.signed_headers == ("x-mq-date-time",)
    assert signature_ok(sk, date_time, auth.signature)
    assert auth.signature == sign(sk, date_time)


@given(SECRETS, SECRETS, TIMES)
def test_another_secret_or_time_does_not_check(sk, other, when):
    date_time = when.strftime(DATE_FORMAT)
    signature = sign(sk, date_time)
    assert signature_ok(sk, date_time, signature.upper())  # hex in any case
    if other != sk:
        assert not signature_ok(other, date_time, signature)
    later = (when + timedelta(seconds=1)).strftime(DATE_FORMAT)
    assert not signature_ok(sk, later, signature)


@given(st.text(max_size=300))
def test_any_text_is_an_authorization_or_an_auth_error(value):
    try:
        auth = parse_authorization(value)
    except AuthError:
        return
    assert auth.access_key and len(auth.signature) == 40


@pytest.mark.parametrize("value, why", [
    ("", "scheme"),
    ("Basic YWxpY2U6cHc=", "scheme"),
    ("MQv2-HMAC-SHA1 Credential=ak, SignedHeaders=x-mq-date-time", "no Signature"),
    ("MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, Signature=" + "a" * 40,
     "no Credential"),
    ("MQv2-HMAC-SHA1 Credential=ak, SignedHeaders=host, Signature=" + "a" * 40,
     "SignedHeaders"),
    ("MQv2-HMAC-SHA1 Credential=ak, SignedHeaders=x-mq-date-time, Signature=xyz",
     "40 hex digits"),
    ("MQv2-HMAC-SHA1 Credential=ak, Credential=b, SignedHeaders=x-mq-date-time, "
     "Signature=" + "a" * 40, "twice"),
    ("MQv2-HMAC-SHA1 Credential ak", "name=value"),
    ("MQv2-HMAC-SHA1 Credential=" + "a" * 2000, "longer than"),
])
def test_garbled_headers_say_what_is_wrong(value, why):
    with pytest.raises(AuthError, match=why):
        parse_authorization(value)


# ------------------------------------------------------------------ the date-time
@given(TIMES)
def test_the_date_time_reads_as_utc(when):
    value = when.strftime(DATE_FORMAT)
    assert parse_date_time(value) == when.replace(tzinfo=UTC, microsecond=0).timestamp()


@pytest.mark.parametrize("value", ["", "yesterday", "20260101T120000", "20261301T120000Z",
                                   "2026-01-01T12:00:00Z", "20260101T250000Z"])
def test_other_date_times_are_refused(value):
    with pytest.raises(AuthError, match="20260101T120000Z"):
        parse_date_time(value)


@given(st.floats(-ZONE_WEST_S - SKEW_S, ZONE_EAST_S + SKEW_S))
def test_a_client_clock_in_any_time_zone_within_the_skew_is_accepted(offset):
    now = 1_800_000_000.0
    assert date_time_problem(now + offset, now) is None


@given(st.floats(1, 10 * 86400))
def test_a_date_time_beyond_the_window_is_refused(beyond):
    now = 1_800_000_000.0
    behind = date_time_problem(now - ZONE_WEST_S - SKEW_S - beyond, now)
    ahead = date_time_problem(now + ZONE_EAST_S + SKEW_S + beyond, now)
    assert behind is not None and "behind" in behind
    assert ahead is not None and "ahead" in ahead


@pytest.mark.parametrize("peer, address", [
    ("ipv4:127.0.0.1:41234", "127.0.0.1"),
    ("ipv6:[::1]:41234", "::1"),
    ("ipv6:%5B2001:db8::5%5D:5000", "2001:db8::5"),
    ("unix:/tmp/sock", None),
    ("", None),
])
def test_peer_addresses(peer, address):
    assert peer_address(peer) == address


# ------------------------------------------------------------------ the access-key file
def test_access_keys_are_made_listed_and_deleted_in_a_private_file(tmp_path: Path):
    keys = AccessKeys(str(tmp_path), clock=lambda: 5.0)
    a = keys.create("alice", 1.0)
    b = keys.create("alice", 1.0)
    assert a.access_key != b.access_key and a.secret != b.secret
    assert a.access_key.startswith("oq") and len(a.secret) >= 40
    path = tmp_path / FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = AccessKeys(str(tmp_path))
    assert again.get(a.access_key) == a
    assert [k.public() for k in again.list("alice")] == [
        {"access_key": k.access_key, "user": "alice", "created": 5.0}
        for k in sorted((a, b), key=lambda k: k.access_key)]
    assert again.delete(a.access_key) and not again.delete(a.access_key)
    assert keys.refresh() and keys.get(a.access_key) is None  # the change is seen
    assert not keys.refresh()  # and only once


def test_a_damaged_access_key_file_is_refused_at_start_and_kept_out_later(tmp_path: Path):
    keys = AccessKeys(str(tmp_path))
    k = keys.create("alice", 1.0)
    path = tmp_path / FILE
    path.write_text("{not json")
    assert not keys.refresh()  # the keys read before stay
    assert keys.get(k.access_key) == k and "cannot read" in keys.problem
    with pytest.raises(ValueError, match=FILE):
        AccessKeys(str(tmp_path))
    for doc in ({"version": 2, "keys": {}}, {"version": 1, "keys": {"a b": {}}},
                {"version": 1, "keys": {"ak": {"user": "u", "secret": ""}}}):
        with pytest.raises(ValueError):
            parse(json.dumps(doc).encode())


# ------------------------------------------------------------------ the authenticator
PEER = "ipv4:10.1.2.3:5555"


@pytest.fixture
def setup(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    sec = Security(BrokerConfig(store=StoreConfig(data_dir=str(data)), acl=True),
                   clock=time.time)
    sec.users.iterations = 4096
    sec.users.create("alice", "alice-password")
    sec.users.create("root", "root-password", super=True)
    sec.acls.grant(make_grant("alice", "Topic", "orders", ["Pub"]))
    keys = AccessKeys(str(data))
    alice = keys.create("alice", sec.users.get("alice")["created"])
    root = keys.create("root", sec.users.get("root")["created"])
    return sec, keys, Authenticator(sec, keys), alice, root


def _md(ak: str, sk: str, at: float | None = None) -> dict[str, str]:
    date_time = time.strftime(DATE_FORMAT, time.gmtime(time.time() if at is None else at))
    return {"x-mq-date-time": date_time, "authorization": client_header(ak, sk, date_time)}


def _refused(auth: Authenticator, md: dict[str, str], code: int, match: str) -> None:
    with pytest.raises(RmqError, match=match) as e:
        auth.authenticate(md, PEER)
    assert e.value.code == code


def test_a_signed_request_names_its_user_and_is_checked_by_the_grants(setup):
    sec, _keys, auth, alice, root = setup
    who = auth.authenticate(_md(alice.access_key, alice.secret), PEER)
    assert (who.user, who.source) == ("alice", "10.1.2.3")
    auth.authorize(who, "SendMessage", (Send("orders", 0), GetTopic("orders")))
    with pytest.raises(RmqError, match="Sub on Topic:orders") as e:
        auth.authorize(who, "ReceiveMessage", (Pull("orders", 0, 0, group="g"),))
    assert e.value.code == Code.FORBIDDEN and "onceq's ACL" in e.value.message
    with pytest.raises(RmqError, match="Group:g"):
        auth.authorize(who, "AckMessage", (CommitOffset("g", "orders", 0, 0),))
    boss = auth.authenticate(_md(root.access_key, root.secret), PEER)
    auth.authorize(boss, "ReceiveMessage", (Pull("orders", 0, 0, group="g"),))
    assert sec.audit.counts.get("deny", 0) == 2


def test_each_way_of_failing_is_unauthorized_with_its_reason(setup):
    sec, _keys, auth, alice, _root = setup
    _refused(auth, {}, Code.UNAUTHORIZED, "not signed")
    _refused(auth, {"authorization": "MQv2-HMAC-SHA1 nonsense"}, Code.UNAUTHORIZED,
             "cannot be read")
    _refused(auth, _md("oq-nobody", "x"), Code.UNAUTHORIZED, "'oq-nobody' is not known")
    _refused(auth, _md(alice.access_key, "wrong"), Code.UNAUTHORIZED, "wrong secret key")
    _refused(auth, _md(alice.access_key, alice.secret, time.time() - 86400),
             Code.UNAUTHORIZED, "behind this onceq broker's UTC clock")
    # a client in UTC+9 writes its local time with a Z: accepted
    auth.authenticate(_md(alice.access_key, alice.secret, time.time() + 9 * 3600),
                      PEER)
    assert sec.audit.counts["login-failed"] == 5


def test_a_deleted_user_or_one_made_again_has_no_key(setup):
    sec, _keys, auth, alice, _root = setup
    sec.users.delete("alice")
    _refused(auth, _md(alice.access_key, alice.secret), Code.UNAUTHORIZED,
             "no longer exists")
    sec.users.create("alice", "another-password")
    _refused(auth, _md(alice.access_key, alice.secret), Code.UNAUTHORIZED,
             "no longer exists")


def test_keys_made_or_deleted_while_the_broker_runs_count_at_once(setup):
    sec, keys, auth, alice, _root = setup
    other = AccessKeys(os.path.dirname(keys.path))  # as the command line makes them
    new = other.create("alice", sec.users.get("alice")["created"])
    assert auth.authenticate(_md(new.access_key, new.secret), PEER).user == "alice"
    other.delete(alice.access_key)
    auth._looked -= 2  # a second later
    _refused(auth, _md(alice.access_key, alice.secret), Code.UNAUTHORIZED, "is not known")


def test_failed_logins_lock_the_source_out_and_repeats_count_once(setup):
    _sec, _keys, auth, alice, _root = setup
    md = _md(alice.access_key, "guess")
    for _ in range(10):  # the same header again is not another guess
        _refused(auth, md, Code.UNAUTHORIZED, "wrong secret key")
    for i in range(4):
        _refused(auth, _md(alice.access_key, f"guess-{i}"), Code.UNAUTHORIZED,
                 "wrong secret key")
    _refused(auth, _md(alice.access_key, alice.secret), Code.UNAUTHORIZED,
             "too many failed logins")
    # another source is not locked out
    assert auth.authenticate(_md(alice.access_key, alice.secret),
                             "ipv4:10.9.9.9:1").user == "alice"
