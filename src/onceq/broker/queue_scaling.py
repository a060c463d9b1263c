"""Queues that follow a consumer group: the decisions, as pure functions (no I/O, no
clock). ``queue_scaler.py`` applies them to a broker's topics; docs/queue_scaling.md
explains the whole.

A topic that follows group G writes ``write`` queues (0..write-1) and is read on ``read``
queues (0..read-1), ``read >= write``: queues write..read-1 are *draining*, written no
more and read until every group that reads the topic has consumed them to their end.

- ``target_queues``: the write count a group of n members asks for: the smallest power of
  two >= n, within [lo, hi]. Powers of two move the fewest keys: a doubling splits each
  queue in two (half of its keys move), a halving merges pairs (the keys of one queue of
  each pair move).
- ``decide``: the next (read, write) from the target, the current counts and which
  draining queues are drained. The write count changes only when no change is in flight
  (``changing``); the read count never drops below the write count, and drops only by
  removing drained queues from the top.
- ``moved_from``: for a change of the write count from ``old`` to ``new``, the queues each
  queue of the new layout receives keys from (a key goes to ``hash % count``). With
  ``g = gcd(old, new)`` a key on old queue ``i`` may land on new queue ``j`` exactly when
  ``i ≡ j (mod g)``. Those are the queues the new one waits for (``gates``) when key order is
  kept across changes.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Layout:
    """A topic's read and write queue counts."""

    read: int
    write: int


def target_queues(members: int, lo: int, hi: int) -> int:
    """The write count a group of ``members`` members asks for: the smallest power of two
    at least ``members`` (1 for an empty group), clamped to ``lo..hi``."""
    if not 1 <= lo <= hi:
        raise ValueError(f"queue bounds must be 1 <= min <= max (got {lo}..{hi})")
    n = 1 << max(members - 1, 0).bit_length()
    return min(max(n, lo), hi)


def decide(*, members: int, current: Layout, lo: int, hi: int, changing: bool,
           drained: Collection[int]) -> Layout:
    """The next layout of a topic that follows a group of ``members`` members.

    ``changing``: a write-count change is in flight (its grace time runs: producers may
    still use the old count): the write count stays. ``drained``: the draining queues
    (``current.write``..``current.read - 1``) every reading group has consumed to their
    final end. Queues leave reading only from the top and only when drained, so the read
    count is never below the write count and no undrained queue stops being read.
    """
    write = current.write if changing else target_queues(members, lo, hi)
    read = max(current.read, write)
    while read > write and read - 1 in drained:
        read -= 1
    return Layout(read, write)


def moved_from(old: int, new: int) -> dict[int, list[int]]:
    """Queue of the new layout -> the other queues of the old layout whose keys may move
    to it when the write count goes from ``old`` to ``new`` (a key's queue is
    ``hash % count``); queues that receive no moved key are left out."""
    if old < 1 or new < 1:
        raise ValueError("queue counts are at least 1")
    g = math.gcd(old, new)
    out: dict[int, list[int]] = {}
    for j in range(new):
        parents = [i for i in range(j % g, old, g) if i != j]
        if parents:
            out[j] = parents
    return out


@dataclass(slots=True)
class Gate:
    """Reads of a queue from offset ``start`` on wait until every reading group has
    consumed each parent queue up to its end (``parents``: queue -> end offset, None while
    the change's grace time runs and producers may still write it)."""

    start: int
    parents: dict[int, int | None]


@dataclass(slots=True)
class ScalingState:
    """What the broker keeps (in the topics table) for a topic that follows a group.

    ``group`` None: the counts are frozen (the topic follows no group any more; draining
    queues still drain). ``grace_until_ms`` (0: none): a write-count change is in flight;
    until then queues below ``grace_from`` (the write count before it) still take writes.
    ``drains``: draining queue -> its final end (None during the grace). ``gates``: queue
    -> the gates its reads wait at (key order across changes, when ``key_order``)."""

    group: str | None
    lo: int
    hi: int
    key_order: bool = True
    grace_until_ms: int = 0
    grace_from: int = 0
    drains: dict[int, int | None] = field(default_factory=dict)
    gates: dict[int, list[Gate]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "min": self.lo, "max": self.hi,
                "key_order": self.key_order, "grace_until_ms": self.grace_until_ms,
                "grace_from": self.grace_from,
                "drains": {str(q): p for q, p in sorted(self.drains.items())},
                "gates": {str(q): [{"start": g.start,
                                    "parents": {str(i): p for i, p in g.parents.items()}}
                                   for g in gs] for q, gs in sorted(self.gates.items())}}

    @classmethod
    def from_json(cls, raw: object) -> ScalingState:
        """``ValueError`` when ``raw`` is not a state ``to_json`` writes."""
        if not isinstance(raw, dict):
            raise ValueError("scaling state is not a map")
        try:
            group = raw["group"]
            if group is not None and not isinstance(group, str):
                raise ValueError("group is not a string")
            st = cls(group, _int(raw["min"]), _int(raw["max"]), bool(raw["key_order"]),
                     _int(raw["grace_until_ms"]), _int(raw["grace_from"]))
            st.drains = {_int(q): _end(p) for q, p in raw["drains"].items()}
            st.gates = {_int(q): [Gate(_int(g["start"]),
                                       {_int(i): _end(p) for i, p in g["parents"].items()})
                                  for g in gs] for q, gs in raw["gates"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed scaling state: {exc!r}") from None
        if not 1 <= st.lo <= st.hi:
            raise ValueError(f"queue bounds {st.lo}..{st.hi} are not 1 <= min <= max")
        return st


def _int(v: object) -> int:
    n = int(v)  # type: ignore[call-overload]
    if n < 0:
        raise ValueError(f"{v!r} is negative")
    return n


def _end(v: object) -> int | None:
    return None if v is None else _int(v)
