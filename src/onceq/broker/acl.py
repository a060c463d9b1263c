"""Authorization: who may do what, in RocketMQ ACL 2.0's terms.

* **Resources**: a topic, a consumer group, or the cluster (the broker itself), named
  exactly (``orders``), by prefix (``orders-*``) or all of a type (``*``).
* **Actions**: ``Pub`` (send), ``Sub`` (consume: pull, commit, join the group), ``Create``,
  ``Update`` (change: reset offsets, resend dead letters, the delivery trace, users and
  ACLs), ``Delete``, ``Get`` (read state and metadata), ``List``. ``Pub`` and ``Sub`` imply
  ``Get`` on the same resource (a producer looks its topic up; a consumer reads offsets).
* **Decisions**: a grant allows or denies actions on a resource to a user, optionally only
  from some source networks; a deny wins over any allow, and without an allow the answer is
  deny. A super user may do everything.

``REQUIRED`` is the one table: each request type to the (resource, action) checks it needs,
computed from the request's fields. A request type missing from it is refused
(``required``). System topics are written by the broker alone whatever a grant says (the
send path refuses them: ``fields.client_written_topic``).

Pure: the table and ``AclTable.decide`` take values and return values; ``AclStore`` keeps
the grants in ``acls.json`` in the data directory (written atomically).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..protocol import requests as rq
from ..protocol.codes import DLQ_PREFIX, RETRY_PREFIX, SYSTEM_PREFIX
from ..protocol.schema import Message
from ..storage.metadata import write_atomic


class Kind(StrEnum):
    TOPIC = "Topic"
    GROUP = "Group"
    CLUSTER = "Cluster"


class Action(StrEnum):
    PUB = "Pub"
    SUB = "Sub"
    CREATE = "Create"
    UPDATE = "Update"
    DELETE = "Delete"
    GET = "Get"
    LIST = "List"


class Decision(StrEnum):
    ALLOW = "Allow"
    DENY = "Deny"


_IMPLIED = {Action.PUB: {Action.GET}, Action.SUB: {Action.GET}}


@dataclass(frozen=True, slots=True)
class Need:
    """One check a request needs: ``action`` on the resource ``kind`` named ``name``."""

    kind: Kind
    name: str
    action: Action

    def __str__(self) -> str:
        return f"{self.action} on {self.kind}:{self.name}"


def _t(name: str, action: Action) -> Need:
    """A topic's need; a group's own system topics (its retry and dead-letter topics) are
    the group's: its members consume them, its operators read them."""
    for prefix in (RETRY_PREFIX, DLQ_PREFIX):
        if name.startswith(prefix):
            return Need(Kind.GROUP, name[len(prefix):], action)
    return Need(Kind.TOPIC, name, action)


def _g(name: str, action: Action) -> Need:
    return Need(Kind.GROUP, name, action)


def _c(action: Action) -> Need:
    return Need(Kind.CLUSTER, "*", action)


P, S, C, U, D, G, L = (Action.PUB, Action.SUB, Action.CREATE, Action.UPDATE, Action.DELETE,
                       Action.GET, Action.LIST)


def _pull(r: rq.Pull) -> list[Need]:
    needs = [_t(r.topic, S)]
    if r.group is not None and _g(r.group, S) not in needs:
        needs.append(_g(r.group, S))
    return needs


def _send_back(r: rq.SendBack) -> list[Need]:
    if r.resend:  # an operator's dead-letter resend
        return [_g(r.group, U)]
    return [_g(r.group, S), _t(r.topic, S)]


def _trace(r: rq.GroupTrace) -> list[Need]:
    if r.enabled is not None:
        return [_g(str(r.group), U)]
    return [_g(str(r.group), G)] if r.group is not None else [_c(L)]


# every request type -> the checks it needs (an empty list: any authenticated user)
REQUIRED: dict[type[Message], Callable[[Any], list[Need]]] = {
    rq.Ping: lambda r: [],
    rq.Send: lambda r: [_t(r.topic, P)],
    rq.SendBatch: lambda r: [_t(r.topic, P)],
    rq.SendRecords: lambda r: [_t(r.topic, P)],
    rq.SendSequenced: lambda r: [_t(r.topic, P)],
    rq.SendBack: _send_back,
    rq.Pull: _pull,
    rq.QueryOffsets: lambda r: [_t(r.topic, G)],
    rq.SearchOffset: lambda r: [_t(r.topic, G)],
    rq.GetOffset: lambda r: [_g(r.group, G)],
    rq.CommitOffset: lambda r: [_g(r.group, S), _t(r.topic, S)],
    rq.ReleaseQueue: lambda r: [_g(r.group, S)],
    rq.ResetOffsets: lambda r: [_g(r.group, U)],
    rq.DeleteGroup: lambda r: [_g(r.group, U)],
    rq.CreateTopic: lambda r: [_t(r.topic, C)],
    rq.DeleteTopic: lambda r: [_t(r.topic, D)],
    rq.ListTopics: lambda r: [_c(L)],
    rq.GetTopic: lambda r: [_t(r.topic, G)],
    rq.TopicStatus: lambda r: [_t(r.topic, G)],
    rq.Heartbeat: lambda r: [_g(str(g.group), S) for g in r.groups],
    rq.Unregister: lambda r: [_g(r.group, S)],
    rq.ListGroupMembers: lambda r: [_g(r.group, G)],
    rq.ListGroups: lambda r: [_c(L)],
    rq.QueryAccessLocks: lambda r: [_g(r.group, G)],
    rq.LockQueues: lambda r: [_g(str(r.group), S)],
    rq.UnlockQueues: lambda r: [_g(str(r.group), S)],
    rq.BrokerStatus: lambda r: [_c(G)],
    rq.QueryMessage: lambda r: [_t(str(r.topic), G)],
    rq.GroupTrace: _trace,
    rq.Authenticate: lambda r: [],  # the way in (answered before any check)
    rq.UserCreate: lambda r: [_c(U)],
    rq.UserUpdate: lambda r: [_c(U)],
    rq.UserDelete: lambda r: [_c(U)],
    rq.UserList: lambda r: [_c(G)],
    rq.AclGrant: lambda r: [_c(U)],
    rq.AclRevoke: lambda r: [_c(U)],
    rq.AclList: lambda r: [_c(G)],
    # a broker group's replication reads the whole log: the cluster's Update grant (the
    # user of a follower's replication_credentials_file: docs/cluster.md)
    rq.ReplicaFetch: lambda r: [_c(U)],
    rq.ReplicaEpochEnd: lambda r: [_c(U)],
    # request-reply: naming one's reply channel needs a user only; a reply needs Sub on the
    # request's topic (its responder consumed the request there)
    rq.GetRoute: lambda r: [_t(r.topic, G)],
    # moving a queue between broker groups reads and writes whole queues: the cluster's
    # Update grant, as replication
    rq.QueueState: lambda r: [_c(U)],
    rq.CopyQueue: lambda r: [_c(U)],
    rq.ReplyChannel: lambda r: [],
    rq.RouteReply: lambda r: [_t(r.topic, S)],
}


def required(request: Message) -> list[Need] | None:
    """The checks ``request`` needs; None for a request type the table does not know (it is
    refused)."""
    rule = REQUIRED.get(type(request))
    return None if rule is None else rule(request)


@dataclass(frozen=True, slots=True)
class Grant:
    """``decision`` of ``actions`` on resources of ``kind`` named ``pattern`` (``name``,
    ``prefix*`` or ``*``) for ``user``, from ``sources`` (networks; empty: anywhere)."""

    user: str
    kind: Kind
    pattern: str
    actions: frozenset[Action]
    decision: Decision = Decision.ALLOW
    sources: tuple[str, ...] = ()

    def matches(self, need: Need, source: str | None) -> bool:
        if need.kind is not self.kind or not _name_matches(self.pattern, need.name):
            return False
        if not any(a is need.action or need.action in _IMPLIED.get(a, ())
                   for a in self.actions):
            return False
        return not self.sources or _from(source, self.sources)

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "kind": str(self.kind), "pattern": self.pattern,
                "actions": sorted(str(a) for a in self.actions),
                "decision": str(self.decision), "sources": list(self.sources)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Grant:
        return make_grant(d["user"], d["kind"], d["pattern"], d["actions"],
                          d.get("decision", "Allow"), d.get("sources", ()))


def make_grant(user: str, kind: str, pattern: str, actions: Iterable[str],
               decision: str = "Allow", sources: Iterable[str] = ()) -> Grant:
    """A checked grant; ``ValueError`` naming what is wrong."""
    try:
        k = Kind(_title(kind))
        acts = frozenset(Action(_title(a)) for a in actions)
        dec = Decision(_title(decision))
    except ValueError as exc:
        raise ValueError(f"{exc}: kinds are {', '.join(Kind)}, actions "
                         f"{', '.join(Action)}, decisions Allow, Deny") from None
    if not acts:
        raise ValueError("a grant names at least one action")
    if not pattern or ("*" in pattern and not pattern.endswith("*")) or pattern.count("*") > 1:
        raise ValueError(f"resource pattern {pattern!r}: a name, a prefix ending in *, or *")
    nets = []
    for s in sources:
        try:
            nets.append(str(ipaddress.ip_network(s, strict=False)))
        except ValueError:
            raise ValueError(f"source {s!r} is not an address or network") from None
    return Grant(user, k, pattern, acts, dec, tuple(nets))


def _title(s: str) -> str:
    return s[:1].upper() + s[1:].lower()


def _name_matches(pattern: str, name: str) -> bool:
    if pattern.endswith("*"):
        prefix = pattern[:-1]
        # a wildcard never reaches the broker's own topics: they are named exactly
        return name.startswith(prefix) and (bool(prefix) or not name.startswith(SYSTEM_PREFIX))
    return pattern == name


def _from(source: str | None, nets: tuple[str, ...]) -> bool:
    if source is None:
        return False
    try:
        addr = ipaddress.ip_address(source)
    except ValueError:
        return False
    return any(addr in ipaddress.ip_network(n) for n in nets)


class AclTable:
    """The grants of every user; ``decide`` answers one check."""

    def __init__(self, grants: Iterable[Grant] = ()) -> None:
        self.grants: list[Grant] = list(grants)

    def decide(self, user: str, need: Need, source: str | None) -> tuple[Decision, str]:
        """Allow or deny, and why (for the audit log and the error message)."""
        allowed = False
        for g in self.grants:
            if g.user == user and g.matches(need, source):
                if g.decision is Decision.DENY:
                    return Decision.DENY, f"denied by grant {g.kind}:{g.pattern}"
                allowed = True
        if allowed:
            return Decision.ALLOW, "allowed"
        return Decision.DENY, f"user {user!r} has no grant for {need}"

    def grant(self, g: Grant) -> bool:
        """Add a grant (the same one twice is one); whether it is new."""
        if g in self.grants:
            return False
        self.grants.append(g)
        return True

    def revoke(self, g: Grant) -> bool:
        try:
            self.grants.remove(g)
        except ValueError:
            return False
        return True

    def revoke_user(self, user: str) -> int:
        before = len(self.grants)
        self.grants = [g for g in self.grants if g.user != user]
        return before - len(self.grants)

    def list(self, user: str | None = None) -> list[Grant]:
        return [g for g in self.grants if user is None or g.user == user]


class AclStore(AclTable):
    """The grants, kept in ``acls.json`` in the data directory (written atomically on every
    change; a damaged file is refused at start with a clear error)."""

    FILE = "acls.json"

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, self.FILE)
        grants: list[Grant] = []
        if os.path.exists(self.path):
            try:
                with open(self.path, "rb") as f:
                    doc = json.loads(f.read())
                grants = [Grant.from_json(d) for d in doc["grants"]]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.path}: cannot read the ACL grants: {exc}") from None
        super().__init__(grants)

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.export(), indent=1).encode())

    def export(self) -> dict[str, Any]:
        """The grants' document (as in ``acls.json``)."""
        return {"version": 1, "grants": [g.to_json() for g in self.grants]}

    def replace(self, doc: dict[str, Any]) -> bool:
        """Take every grant of ``doc`` (an ``export``) in place of these, written to disk;
        ValueError for a document that is not one; False when nothing changes."""
        try:
            grants = [Grant.from_json(d) for d in doc["grants"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a grants document: {exc}") from None
        if grants == list(self.grants):
            return False
        self.grants = grants
        self.save()
        return True
