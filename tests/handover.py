"""Evidence that queues changed hands during a consumer-group run.

A run that reports "no duplicates" only means something if queues moved between members
while messages flowed. Listeners record ``(queue, offset, member)`` per delivery (record
only: an assert inside a listener would just turn into a retry); the test then asks which
queues were consumed by one member and, at later offsets, by another.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def holder_runs(deliveries: Iterable[tuple[Hashable, int, str]]
                ) -> dict[Hashable, list[str]]:
    """Per queue, the members that consumed it in offset order, repeats collapsed.

    ``deliveries`` are ``(queue, offset, member)`` in the order they happened; an offset
    delivered twice counts for the member that got it first. ``{q: ["a", "c"]}`` means q's
    lower offsets went to a and the rest to c: one handover.
    """
    first: dict[Hashable, dict[int, str]] = {}
    for queue, offset, member in deliveries:
        first.setdefault(queue, {}).setdefault(offset, member)
    runs: dict[Hashable, list[str]] = {}
    for queue, by_offset in first.items():
        seq: list[str] = []
        for offset in sorted(by_offset):
            if not seq or seq[-1] != by_offset[offset]:
                seq.append(by_offset[offset])
        runs[queue] = seq
    return runs


def moved(deliveries: Iterable[tuple[Hashable, int, str]]) -> dict[Hashable, list[str]]:
    """The queues that changed holder while messages flowed, with their holders in order."""
    return {q: seq for q, seq in holder_runs(deliveries).items() if len(seq) > 1}
