"""Leader election of a broker group, with leader epochs (the standard etcd election).

A candidate becomes leader with one transaction::

    if   create_revision(leader) == 0                  # nobody leads
    and  mod_revision(epoch) == the revision it read   # nobody bumped the epoch since
    then put leader = {broker_id, epoch+1, address} under its session lease
         put epoch  = epoch+1
    else range leader                                  # who leads instead

so the group's epoch rises by exactly one per term, and two terms never share an epoch.
With clean elections (the default) a broker runs only while it is in the in-sync
replicas the last leader published (``_isr.py``), and the transaction also compares the
ISR key's mod revision with the one it read: a broker that lacks acknowledged writes is
never elected.
Followers watch the leader key and campaign when it goes (lease expired, resigned). The
leader stops being leader locally as soon as its session can no longer count on its lease,
which is before etcd expires it and so before anyone else can be elected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ._etcd import (
    Compare,
    EtcdClient,
    EtcdError,
    EtcdRequestError,
    delete_op,
    put_op,
    range_op,
)
from ._keys import (
    IsrRecord,
    LeaderRecord,
    decode_epoch,
    encode_epoch,
    epoch_key,
    isr_key,
    leader_key,
)
from ._role import Leadership, Role, decide, may_campaign, next_epoch, retry_interval
from ._session import Session

log = logging.getLogger("onceq.cluster")


class Election:
    """Campaign for the leadership of ``group`` while ``session`` holds its lease."""

    def __init__(self, session: Session, cluster: str, group: str, broker_id: str,
                 address: str, *,
                 on_elected: Callable[[Leadership], None] | None = None,
                 on_step_down: Callable[[Leadership, str], None] | None = None,
                 on_leader: Callable[[LeaderRecord], None] | None = None,
                 clean: bool = True) -> None:
        """``clean``: run only while in the published ISR (False: Kafka's unclean
        election, which may lose acknowledged writes)."""
        self.session = session
        self.clean = clean
        self.client = session.client
        self.group = group
        self.broker_id = broker_id
        self.address = address
        self.leader_key = leader_key(cluster, group)
        self.epoch_key = epoch_key(cluster, group)
        self.isr_key = isr_key(cluster, group)
        self.out_of_isr = False  # at the last campaign: not in the published ISR
        self.role = Role.CANDIDATE
        self.leader: LeaderRecord | None = None  # the leader as last observed
        self.elected = asyncio.Event()  # set while this broker leads
        self.stopped = asyncio.Event()  # set when the election loop has ended
        self._leadership: Leadership | None = None
        self._on_elected = on_elected
        self._on_step_down = on_step_down
        self._on_leader = on_leader
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        session.add_lost_callback(lambda reason: self._step_down(f"session lost: {reason}"))

    # ------------------------------------------------------------------ the fencing view
    def is_leader(self) -> bool:
        """Whether this broker leads now: elected, and its lease still counted on by the
        session's clock (true only until ``ttl - margin`` after the last renewal)."""
        return self._leadership is not None and self.session.valid()

    @property
    def leadership(self) -> Leadership | None:
        """This term's fencing token (epoch, lease id, revision) while leader, else None."""
        return self._leadership if self.is_leader() else None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"election-{self.group}")

    async def resign(self) -> None:
        """Stop campaigning; step down and delete the leader key if it is still ours."""
        self._stop.set()
        self._step_down("resigned")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.stopped.set()
        if self.session.lease_id and self.session.valid():
            # compare the lease, not a remembered revision: a campaign cancelled in flight
            # may have made this session leader without this object learning of it
            await self.client.txn([Compare(self.leader_key, "LEASE", "EQUAL",
                                           self.session.lease_id)],
                                  [delete_op(self.leader_key)])

    async def close(self) -> None:
        """Resign, ignoring an unreachable etcd (the lease expiry cleans up then)."""
        try:
            await self.resign()
        except EtcdError as e:
            log.info("election %s: resign failed: %s", self.group, e)

    # ------------------------------------------------------------------ role changes
    def _step_down(self, reason: str) -> None:
        term, self._leadership = self._leadership, None
        self.elected.clear()
        stopped = self.session.lost.is_set() or self._stop.is_set()
        self.role = Role.INACTIVE if stopped else Role.CANDIDATE
        if term is not None:
            log.warning("group %s: broker %s steps down as leader of epoch %d: %s",
                        self.group, self.broker_id, term.epoch, reason)
            self._call(self._on_step_down, term, reason)

    def _become_leader(self, record: LeaderRecord) -> None:
        self._observe(record)
        if not self.session.valid():
            return
        self._leadership = Leadership.of(record)
        self.role = Role.LEADER
        self.elected.set()
        log.warning("group %s: broker %s is leader, epoch %d", self.group, self.broker_id,
                    record.epoch)
        self._call(self._on_elected, self._leadership)

    def _observe(self, record: LeaderRecord) -> None:
        if record != self.leader:
            self.leader = record
            self._call(self._on_leader, record)

    def _call(self, callback: Callable[..., None] | None, *args: object) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("election %s: callback failed", self.group)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if not await self._round():
                        return
                except (EtcdError, ValueError) as e:
                    if isinstance(e, EtcdRequestError) and "lease not found" in e.message:
                        self.session.mark_lost("etcd says the lease is gone")
                        return
                    log.info("election %s: %s; retrying", self.group, e)
                    await asyncio.sleep(retry_interval(self.session.ttl))
        finally:
            self._step_down("election stopped")
            self.stopped.set()

    async def _round(self) -> bool:
        """One campaign, then lead or follow until the term ends; False: stop."""
        if not self.session.valid():
            return False
        observed, revision = await self._campaign()
        role = decide(observed, self.session.lease_id, self.session.valid())
        if role is Role.INACTIVE:
            return False
        if role is Role.CANDIDATE or observed is None:
            if observed is None and self.out_of_isr:  # nobody leads: look again soon
                await asyncio.sleep(retry_interval(self.session.ttl))
            return True  # the epoch or ISR moved between our read and our transaction
        if role is Role.LEADER:
            self._become_leader(observed)
        else:
            self.role = Role.FOLLOWER
            self._observe(observed)
        await self._until_term_ends(observed, revision)
        if role is Role.LEADER:
            self._step_down("the leader key was deleted or replaced")
        return True

    async def _campaign(self) -> tuple[LeaderRecord | None, int]:
        epoch_kv, _ = await self.client.get(self.epoch_key)
        isr_kv, _ = await self.client.get(self.isr_key)
        out = not may_campaign(IsrRecord.from_kv(isr_kv), self.broker_id, self.clean)
        if out and not self.out_of_isr:
            log.warning("group %s: broker %s does not run for leader: it is not in the "
                        "published in-sync replicas (it may lack acknowledged writes)",
                        self.group, self.broker_id)
        self.out_of_isr = out
        if self.out_of_isr:
            kvs, revision = await self.client.range(self.leader_key)
            return (LeaderRecord.from_kv(kvs[0]) if kvs else None), revision
        epoch = next_epoch(decode_epoch(epoch_kv))
        value = LeaderRecord.encode(self.broker_id, epoch, self.address)
        result = await self.client.txn(
            [Compare(self.leader_key, "CREATE", "EQUAL", 0),
             Compare(self.epoch_key, "MOD", "EQUAL", epoch_kv.mod_revision if epoch_kv else 0),
             Compare(self.isr_key, "MOD", "EQUAL", isr_kv.mod_revision if isr_kv else 0)],
            [put_op(self.leader_key, value, self.session.lease_id),
             put_op(self.epoch_key, encode_epoch(epoch))],
            [range_op(self.leader_key)])
        if result.succeeded:
            return LeaderRecord(self.broker_id, epoch, self.address, self.session.lease_id,
                                result.revision), result.revision
        kvs = result.ranges[0] if result.ranges else []
        return (LeaderRecord.from_kv(kvs[0]) if kvs else None), result.revision

    async def _until_term_ends(self, term: LeaderRecord, revision: int) -> None:
        """Return when the leader key of ``term`` is deleted or replaced, the session is
        lost, or the election is stopped; a broken watch is re-read and resumed."""
        watcher = asyncio.create_task(self._watch_term(term, revision))
        lost = asyncio.create_task(self.session.lost.wait())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({watcher, lost, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, lost, stop):
                task.cancel()
            await asyncio.gather(watcher, lost, stop, return_exceptions=True)

    async def _watch_term(self, term: LeaderRecord, revision: int) -> None:
        while True:
            try:
                async for events in self.client.watch(self.leader_key,
                                                      start_revision=revision + 1):
                    for ev in events:
                        if ev.type == "DELETE" or ev.kv.create_revision != term.revision:
                            return
                        revision = ev.kv.mod_revision
            except EtcdError as e:
                log.info("election %s: watch of the leader broke: %s", self.group, e)
                await asyncio.sleep(retry_interval(self.session.ttl))
                while True:
                    try:
                        kv, revision = await self.client.get(self.leader_key)
                        break
                    except EtcdError:
                        await asyncio.sleep(retry_interval(self.session.ttl))
                if kv is None or kv.create_revision != term.revision:
                    return


async def current_leader(client: EtcdClient, cluster: str, group: str
                         ) -> tuple[LeaderRecord | None, int]:
    """The group's leader (None when nobody leads) and its last epoch, as stored."""
    kvs, _ = await client.range(leader_key(cluster, group))
    epoch_kv, _ = await client.get(epoch_key(cluster, group))
    return (LeaderRecord.from_kv(kvs[0]) if kvs else None), decode_epoch(epoch_kv)
