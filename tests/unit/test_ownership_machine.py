"""The queue-ownership core under random members, pulls, commits, heartbeats, orderly locks,
resets, expiries, crashes and restarts (a hypothesis state machine; the core is pure, so a
run takes milliseconds).

Invariants after every step:

* one owner per queue and group: never an access-lock holder and an orderly-lock holder
  that are different clients;
* a new owner never reads below the committed offset: a pull that takes a queue over from
  another member reads at the group's offset or later;
* a committed offset never moves back, except by an explicit reset.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from onceq.broker.ownership import QueueOwnership

G, T, QUEUES, END = "g", "t", 3, 60
CONCURRENT = ["a", "b", "c"]  # the access lock applies to them
ORDERLY = ["o", "p"]  # they lock explicitly
clients = st.sampled_from(CONCURRENT + ORDERLY)
queue = st.integers(0, QUEUES - 1)
offset = st.integers(0, END)


def _locked(client: str | None) -> bool:
    return client in CONCURRENT


class OwnershipMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.core = QueueOwnership(hold_timeout=30.0, stable_checks=3, restore_hold=20.0,
                                   lock_expiry=60.0)
        self.stored = [-1] * QUEUES  # the store's committed offsets, as the broker keeps them
        self.floor = list(self.stored)  # what an explicit reset last set, or the last commit

    # -- helpers ---------------------------------------------------------------------------

    def _commit(self, client: str | None, q: int, off: int, checked: bool = False) -> None:
        d = self.core.commit(G, client, T, q, off, locked=_locked(client),
                             stored=self.stored[q], queue_max=END, now=self.now,
                             checked=checked)
        if d.write is not None:
            self.stored[q] = d.write

    # -- rules -------------------------------------------------------------------------------

    @rule(client=clients, q=queue, off=offset, commit=st.none() | offset)
    def pull(self, client: str, q: int, off: int, commit: int | None) -> None:
        before = self.core.access.holder(G, T, q)
        d = self.core.pull(G, client, T, q, off, locked=_locked(client), ack=self.stored[q],
                           now=self.now)
        if d.refused is not None:
            return
        if d.lock is not None:
            if before is not None and before != client:  # a takeover from another member
                assert d.offset >= self.stored[q], (d, self.stored[q])
            if d.offset < END:
                self.core.delivered(G, T, q, min(d.offset + 8, END))
        if commit is not None and not d.corrected:
            self._commit(client, q, commit, checked=d.lock is not None)

    @rule(client=st.sampled_from([*CONCURRENT, *ORDERLY, None]), q=queue, off=offset)
    def commit(self, client: str | None, q: int, off: int) -> None:
        self._commit(client, q, off)

    @rule(client=st.sampled_from(CONCURRENT), q=queue, off=st.none() | offset)
    def release(self, client: str, q: int, off: int | None) -> None:
        _released, d = self.core.release(G, client, T, q, off, locked=True,
                                         stored=self.stored[q], queue_max=END, now=self.now)
        if d is not None and d.write is not None:
            self.stored[q] = d.write

    @rule(client=st.sampled_from(CONCURRENT),
          held=st.lists(st.tuples(queue, offset), max_size=QUEUES, unique_by=lambda x: x[0]),
          gen=st.none() | st.integers(0, 2**40))
    def heartbeat(self, client: str, held: list[tuple[int, int]], gen: int | None) -> None:
        self.core.heartbeat(G, client, [(T, q, o) for q, o in held], gen, locked=True,
                            now=self.now)
        self.core.touch_client(client, self.now)

    @rule(client=st.sampled_from(ORDERLY), qs=st.sets(queue, max_size=QUEUES))
    def lock(self, client: str, qs: set[int]) -> None:
        self.core.lock(G, client, [(T, q) for q in sorted(qs)], self.now)

    @rule(client=st.sampled_from(ORDERLY), qs=st.sets(queue, min_size=1, max_size=QUEUES),
          off=offset)
    def unlock(self, client: str, qs: set[int], off: int) -> None:
        self.core.unlock(G, client, [(T, q) for q in sorted(qs)], self.now,
                         lambda tq: self._commit(client, tq[1], off))

    @rule(client=clients)
    def member_gone(self, client: str) -> None:
        self.core.member_gone(G, client)

    @rule(seconds=st.sampled_from([0.5, 5.0, 21.0, 31.0, 61.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @rule(q=queue, off=offset, fenced=st.lists(clients, unique=True))
    def reset(self, q: int, off: int, fenced: list[str]) -> None:
        self.core.reset(G, fenced, {(T, q)}, self.now)
        self.stored[q] = self.floor[q] = off  # the explicit way back

    @rule(down=st.sampled_from([0.0, 3.0, 3600.0]))
    def restart(self, down: float) -> None:
        """The broker stops (or is killed after its last save) and starts again."""
        data = self.core.encode(self.now)
        self.now += down
        self.core = QueueOwnership(hold_timeout=30.0, stable_checks=3, restore_hold=20.0,
                                   lock_expiry=60.0)
        self.core.restore(data, self.now, lambda t, q: t == T and 0 <= q < QUEUES)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def one_owner_per_queue(self) -> None:
        for q in range(QUEUES):
            access = self.core.access.holder(G, T, q)
            orderly = self.core.orderly.holder(G, T, q, self.now)
            assert access is None or orderly is None or access == orderly, (q, access,
                                                                             orderly)

    @invariant()
    def committed_offsets_never_move_back(self) -> None:
        for q in range(QUEUES):
            assert self.stored[q] >= self.floor[q], (q, self.stored, self.floor)
            self.floor[q] = self.stored[q]


OwnershipMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                              deadline=None)
test_ownership_rules = OwnershipMachine.TestCase
