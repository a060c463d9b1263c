"""Which broker a client talks to: one address, or a broker group's bootstrap list
(``"h1:9876,h2:9876,h3:9876"``) of which the client talks to the leader.

The one place that knows the group's leader. It learns it from a ``NOT_LEADER`` answer
(its ``leader`` detail) or, when that names nobody or the leader is out of reach, by
asking the brokers of the list for their status (a follower's names its leader). Pure but
for ``find_leader``, which asks through the function it is given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import StatusReply
from ..protocol.requests import BrokerStatus
from .connection import BrokerConnection, ConnectionLost, call, parse_address
from .security import ClientSecurity

# address -> the ``cluster`` section of the broker's status (None: unreachable or
# standalone)
AskStatus = Callable[[str], Awaitable[dict[str, Any] | None]]


def split_addresses(spec: str) -> list[str]:
    """``"h1:p1,h2:p2"`` -> the addresses, checked (``host:port`` each), duplicates out."""
    out: list[str] = []
    for part in spec.split(","):
        address = part.strip()
        if address:
            parse_address(address)
            if address not in out:
                out.append(address)
    if not out:
        raise ValueError(f"no broker address in {spec!r}")
    return out


class BrokerRoute:
    def __init__(self, spec: str) -> None:
        self.addresses = split_addresses(spec)
        self.current = self.addresses[0]  # the broker the client talks to (the leader)
        self.leader_changes = 0  # times the client moved to another broker
        # the highest leader epoch seen in an answer: answers of older leaders are refused
        # (``BrokerConnection.fence``)
        self.epoch = 0
        self.group_name: str | None = None  # the broker group of the leader, once known

    @property
    def group(self) -> bool:
        """Whether the client was given several brokers (a group: it follows the leader)."""
        return len(self.addresses) > 1

    def move(self, address: str) -> bool:
        """Talk to ``address`` from now on; False when it is already the current one."""
        if address == self.current:
            return False
        if address not in self.addresses:
            self.addresses.append(address)
        self.current = address
        self.leader_changes += 1
        return True

    def redirect(self, exc: OnceqError) -> bool:
        """A ``NOT_LEADER`` answer that names the leader: move there (True)."""
        if exc.code != ErrorCode.NOT_LEADER:
            return False
        leader = (exc.details or {}).get("leader")
        if not isinstance(leader, str) or not leader:
            return False
        try:
            parse_address(leader)
        except ValueError:
            return False
        epoch = (exc.details or {}).get("epoch")
        if type(epoch) is int and epoch > self.epoch:
            self.epoch = epoch
        self.move(leader)
        return True

    async def find_leader(self, ask: AskStatus) -> str | None:
        """Ask the brokers of the list (the current one last) who leads; the leader's
        address, or None when none knows (an election is going on)."""
        order = [a for a in self.addresses if a != self.current] + [self.current]
        for address in order:
            st = await ask(address)
            if not st:
                continue
            leader = address if st.get("role") == "leader" else st.get("leader")
            if isinstance(leader, str) and leader:
                self._in_group(st.get("group"))
                return leader
        return None

    def _in_group(self, name: object) -> None:
        """The leader found is of broker group ``name``: epochs are counted per group, so
        moving to another group's leader (a bootstrap list naming several groups) starts
        the fence again."""
        if not isinstance(name, str) or name == self.group_name:
            return
        if self.group_name is not None:
            self.epoch = 0
        self.group_name = name


def follows(exc: OnceqError) -> bool:
    """Whether a client of a group tries the leader again after ``exc``: the broker is
    not (or no longer) the leader, or out of reach."""
    return exc.code == ErrorCode.NOT_LEADER or isinstance(exc, ConnectionLost)


async def cluster_status(address: str, security: ClientSecurity | None = None,
                         timeout: float = 1.0) -> dict[str, Any] | None:
    """The ``cluster`` section of the status of the broker at ``address`` (None when it is
    out of reach or not in a group)."""
    try:
        conn = await BrokerConnection.open(address, timeout=1.0, security=security)
    except OnceqError:
        return None
    try:
        reply: StatusReply = await call(conn, BrokerStatus(), timeout)
        return reply.cluster
    except OnceqError:
        return None
    finally:
        conn.close()
