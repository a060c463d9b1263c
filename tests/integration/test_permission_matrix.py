"""The permission matrix: every request code x {no credentials, wrong password, a user
without the permission, a user with it, a super user}, against a broker process started
with ``--acl``. The expected answers come from the one table (``broker/acl.py``): the user
"with it" is granted exactly what ``required`` names for the request, nothing more."""

from __future__ import annotations

import os

import pytest

from onceq import Admin, ClientSecurity, ErrorCode, OnceqError
from onceq.broker.acl import required
from onceq.broker.users import UserStore
from onceq.client.connection import BrokerConnection, call
from onceq.log.batch import encode_batch
from onceq.log.record import encode_part
from onceq.protocol import requests as rq
from onceq.protocol.codes import RequestCode
from onceq.protocol.scram import make_credentials
from tests.helpers import spawn_broker
from tests.integration.test_bad_input import batch

AUTH = (ErrorCode.UNAUTHENTICATED, ErrorCode.ACCESS_DENIED, ErrorCode.AUTH_FAILED)
CREDS = make_credentials("pw-x").to_dict()
PART = encode_part(b"v", "UK", 1)

# one well-formed request of every type (a new request type must be added here)
SAMPLES: dict[type, rq.Message] = {s.__class__: s for s in (
    rq.Ping(), rq.Send("T", 0, batch(PART)), rq.SendBatch("T", 0, batch(PART, PART)),
    rq.SendRecords("T", 0, encode_batch([PART, encode_part(b"w", "UK2", 1)])),
    rq.SendSequenced("T", 0, "w-1", 0, 0, batch(PART)),
    rq.SendBack("G", "T", 0, 0), rq.Pull("T", 0, 0, group="G", client="c-m"),
    rq.QueryOffsets("T", 0), rq.SearchOffset("T", 0, 0), rq.GetOffset("G", "T", 0),
    rq.CommitOffset("G", "T", 0, 0, client="c-m"), rq.ReleaseQueue("G", "c-m", "T", 0),
    rq.ResetOffsets("G2", "T", [[0, 0]]), rq.DeleteGroup("G3"), rq.CreateTopic("Tnew", 1),
    rq.DeleteTopic("Tdel"), rq.ListTopics(), rq.GetTopic("T"), rq.TopicStatus("T"),
    rq.Heartbeat("c-m", [rq.GroupBeat("G", {"T": "*"})]), rq.Unregister("G", "c-m"),
    rq.ListGroupMembers("G"), rq.ListGroups(), rq.QueryAccessLocks("G"),
    rq.LockQueues("G", "c-m", [rq.QueueRef("T", 0)]),
    rq.UnlockQueues("G", "c-m", [rq.QueueRef("T", 0)]), rq.BrokerStatus(),
    rq.QueryMessage("T", "UK"), rq.GroupTrace("G", True), rq.Authenticate("n,,n=x,r=abc"),
    rq.UserCreate("made", CREDS), rq.UserUpdate("made", super=False), rq.UserDelete("gone"),
    rq.UserList(), rq.AclGrant("x", "Topic", "T", ["Pub"]),
    rq.AclRevoke("x", "Topic", "T", ["Pub"]), rq.AclList(),
    rq.ReplicaFetch("g1", "2", 1, 0), rq.ReplicaEpochEnd("g1", "2", 1),
    rq.ReplyChannel("rc-1"), rq.RouteReply("rc-gone", "1", "T", payload=b"r"),
    rq.GetRoute("T"), rq.QueueState("T", 0), rq.CopyQueue("T", 0),
)}
ROWS = ("none", "wrong password", "without", "with", "super")


def expected(row: str, request: rq.Message) -> str:
    """What the table says the answer is: "refused: CODE" or "not refused"."""
    if row == "wrong password":
        return "refused: AUTH_FAILED"  # at connect: no request is ever read
    if isinstance(request, rq.Authenticate):  # the way in; a connection has one user
        return "not refused" if row == "none" else "refused: AUTH_FAILED"
    if row == "none":
        return "refused: UNAUTHENTICATED"
    if row == "without" and required(request):
        return "refused: ACCESS_DENIED"
    return "not refused"


async def answer(conn: BrokerConnection, request: rq.Message) -> str:
    try:
        await call(conn, request)
    except OnceqError as exc:
        if exc.code in AUTH:
            return f"refused: {exc.code.name}"
        # another error (the request reached its service): allowed
        if isinstance(request, rq.Authenticate) and exc.code != ErrorCode.AUTH_FAILED:
            return "not refused"
    return "not refused"


@pytest.fixture
def broker_proc(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    users = UserStore(str(data))
    users.create("root", "root-pw", super=True)
    users.create("plain", "plain-pw")
    users.create("gone", "gone-pw")
    proc, addr = spawn_broker(str(data), "--acl", "--auto-create-topics")
    try:
        yield addr
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
async def test_every_request_code_against_every_kind_of_client(broker_proc):
    addr = broker_proc
    assert set(SAMPLES) == set(rq.REQUESTS.values())
    assert {s.CODE for s in SAMPLES.values()} == set(RequestCode)
    root = ClientSecurity("root", "root-pw")
    async with Admin(addr, security=root) as admin:
        for topic in ("T", "Tdel"):
            await admin.create_topic(topic, 1)
        for i, sample in enumerate(SAMPLES.values()):
            user = f"u{i}"  # its own user, granted exactly what the table needs
            await admin.create_user(user, "pw")
            for need in required(sample) or ():
                await admin.grant(user, need.kind, need.name, [need.action])
            await admin.create_topic("Tdel", 1)  # deleted again by its row
    results: dict[tuple[str, str], tuple[str, str]] = {}
    for i, (cls, sample) in enumerate(SAMPLES.items()):
        for row in ROWS:
            sec = {"none": ClientSecurity(), "wrong password": ClientSecurity("plain", "bad"),
                   "without": ClientSecurity("plain", "plain-pw"),
                   "with": ClientSecurity(f"u{i}", "pw"), "super": root}[row]
            try:
                conn = await BrokerConnection.open(addr, security=sec)
            except OnceqError as exc:
                got = f"refused: {exc.code.name}"
            else:
                try:
                    got = await answer(conn, sample)
                finally:
                    conn.close()
            results[(cls.__name__, row)] = (expected(row, sample), got)
        if isinstance(sample, rq.DeleteTopic):
            async with Admin(addr, security=root) as admin:
                await admin.create_topic("Tdel", 1)
    wrong = {k: v for k, v in results.items() if v[0] != v[1]}
    assert not wrong, wrong
    anonymous_ok = [k[0] for k, (_, got) in results.items()
                    if k[1] == "none" and got == "not refused"]
    assert anonymous_ok == ["Authenticate"]
    print(f"permission matrix: {len(results)} cells as the table says; anonymous requests "
          f"that run: {anonymous_ok} of {len(SAMPLES)}; pid {os.getpid()}")
