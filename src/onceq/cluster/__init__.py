"""Coordination of replicated broker groups through etcd.

What lives here: a small asyncio etcd client (its JSON gateway over HTTP/1.1), sessions
(a lease kept alive in the background), group membership, and leader election with leader
epochs. See docs/cluster.md for the key layout, the election rules and the timings.
"""

from ._election import Election, current_leader
from ._etcd import (
    EtcdClient,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailable,
    parse_endpoints,
)
from ._isr import publish_isr, read_isr
from ._keys import (
    IsrRecord,
    LeaderRecord,
    Member,
    broker_key,
    epoch_key,
    isr_key,
    leader_key,
    security_key,
)
from ._membership import MemberChange, Members, deregister, members, register, watch_members
from ._role import (
    Leadership,
    LeaseClock,
    Role,
    decide,
    default_margin,
    is_stale,
    may_campaign,
)
from ._routes import (
    HANDOVER,
    SEALED,
    GroupDirectory,
    TopicRoute,
    apply_events,
    create_route,
    place,
    read_directory,
    read_route,
    read_routes,
    read_routes_at,
    replace_route,
    routes_prefix,
)
from ._session import Session

__all__ = [
    "HANDOVER",
    "SEALED",
    "Election",
    "EtcdClient",
    "EtcdError",
    "EtcdRequestError",
    "EtcdUnavailable",
    "GroupDirectory",
    "IsrRecord",
    "LeaderRecord",
    "Leadership",
    "LeaseClock",
    "Member",
    "MemberChange",
    "Members",
    "Role",
    "Session",
    "TopicRoute",
    "apply_events",
    "broker_key",
    "create_route",
    "current_leader",
    "decide",
    "default_margin",
    "deregister",
    "epoch_key",
    "is_stale",
    "isr_key",
    "leader_key",
    "may_campaign",
    "members",
    "parse_endpoints",
    "place",
    "publish_isr",
    "read_directory",
    "read_isr",
    "read_route",
    "read_routes",
    "read_routes_at",
    "register",
    "replace_route",
    "routes_prefix",
    "security_key",
    "watch_members",
]
