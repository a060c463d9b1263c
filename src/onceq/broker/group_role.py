"""A broker's role in its broker group: an etcd session, its registration and the
election of the group's leader (``onceq.cluster``), kept up for the broker's lifetime.

A lost session (its lease gone or no longer counted on) ends the term at once, through
the election's step-down callback; a new session is then opened, and the broker registers
and campaigns again. ``is_leader()`` checks the lease against the clock on every call:
what acts as leader asks it when it acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..cluster import (
    Election,
    EtcdClient,
    EtcdError,
    LeaderRecord,
    Leadership,
    Session,
    publish_isr,
    read_isr,
    register,
)
from ..cluster import members as read_members
from ..protocol.errors import ErrorCode, OnceqError

log = logging.getLogger("onceq.broker")


class GroupRole:
    """``on_elected(term)``, ``on_step_down(term, why)`` and ``on_leader(record)`` are the
    election's callbacks (``on_leader``: the leader as observed, this broker or another)."""

    def __init__(self, endpoints: str, cluster: str, group: str, broker_id: str, address: str,
                 ttl: float, *, on_elected: Callable[[Leadership], None],
                 on_step_down: Callable[[Leadership, str], None],
                 on_leader: Callable[[LeaderRecord], None], clean: bool = True) -> None:
        """``clean``: run for leader only while in the published ISR."""
        self.client = EtcdClient(endpoints)
        self.endpoints = endpoints
        self.clean = clean
        self.cluster = cluster
        self.group = group
        self.broker_id = broker_id
        self.address = address
        self.ttl = ttl
        self._on_elected = on_elected
        self._on_step_down = on_step_down
        self._on_leader = on_leader
        self.election: Election | None = None
        self.session: Session | None = None
        self.leader: LeaderRecord | None = None  # the leader as last observed
        self._members: set[str] = set()
        self._members_read = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---------------------------------------------------------------- what others ask
    def is_leader(self) -> bool:
        e = self.election
        return e is not None and e.is_leader()

    @property
    def term(self) -> Leadership | None:
        e = self.election
        return None if e is None else e.leadership

    def leader_address(self) -> str | None:
        """The address of the group's leader when it is another broker, else None."""
        rec = self.leader
        if rec is None or rec.broker_id == self.broker_id:
            return None
        return rec.address

    def not_leader(self) -> OnceqError:
        """The ``NOT_LEADER`` answer: it names the leader when one is known."""
        address = self.leader_address()
        details: dict[str, object] = {}
        if address is not None and self.leader is not None:
            details = {"leader": address, "epoch": self.leader.epoch}
            msg = (f"broker {self.broker_id} does not lead group {self.group}: the leader "
                   f"is {self.leader.broker_id} at {address} (epoch {self.leader.epoch})")
        else:
            msg = (f"broker {self.broker_id} does not lead group {self.group}, and no "
                   "leader is known yet: try again")
            session = self.session
            if session is None or not session.valid():
                why = "" if session is None else session.lost_reason
                msg += (f" (no valid etcd session{': ' + why if why else ''}; is etcd at "
                        f"{self.endpoints} reachable?)")
        return OnceqError(ErrorCode.NOT_LEADER, msg, details)

    async def is_member(self, broker_id: str) -> bool:
        """Whether ``broker_id`` is registered in the group (read again at most once a
        quarter of a second when it is not known)."""
        if broker_id in self._members:
            return True
        now = time.monotonic()
        if now - self._members_read >= 0.25:
            self._members_read = now
            try:
                found = await read_members(self.client, self.cluster, self.group)
                self._members = set(found.by_id)
            except EtcdError as exc:
                log.info("group %s: cannot read the members: %s", self.group, exc)
        return broker_id in self._members

    async def term_start(self) -> tuple[tuple[str, ...], set[str]]:
        """What a new leader starts its ISR from: the ISR published in etcd (empty when
        none was) and the brokers registered now."""
        isr = await read_isr(self.client, self.cluster, self.group)
        found = await read_members(self.client, self.cluster, self.group)
        self._members = set(found.by_id)
        return (() if isr is None else isr.members), set(found.by_id)

    async def publish_isr(self, term: Leadership, members: list[str]) -> bool:
        """Write the ISR of ``term`` to etcd; False when the term is over."""
        return await publish_isr(self.client, self.cluster, self.group, term, members)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="group-role")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._end_session()

    async def _end_session(self) -> None:
        election, self.election = self.election, None
        session, self.session = self.session, None
        with contextlib.suppress(EtcdError, OSError):
            if election is not None:
                await election.close()  # resigns when leading: a successor at once
        with contextlib.suppress(EtcdError, OSError):
            if session is not None:
                await session.close()

    def _observed(self, record: LeaderRecord) -> None:
        self.leader = record
        self._on_leader(record)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                session = self.session = await Session(self.client, self.ttl).start()
                await register(session, self.cluster, self.group, self.broker_id,
                               self.address, {})
                election = self.election = Election(
                    session, self.cluster, self.group, self.broker_id, self.address,
                    on_elected=self._on_elected, on_step_down=self._on_step_down,
                    on_leader=self._observed, clean=self.clean)
                election.start()
                log.info("group %s: broker %s registered at %s", self.group, self.broker_id,
                         self.address)
                await session.lost.wait()
                log.warning("group %s: session lost (%s); registering again", self.group,
                            session.lost_reason)
            except (EtcdError, OSError, RuntimeError) as exc:
                log.warning("group %s: etcd: %s; retrying", self.group, exc)
            await self._end_session()
            await asyncio.sleep(min(1.0, self.ttl / 4))
