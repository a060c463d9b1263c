"""ProcessQueue: the commit offset of a queue and its flow-control thresholds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.client.allocation import MessageQueue
from onceq.client.process_queue import ProcessQueue
from onceq.client.push_config import PushConsumerConfig
from onceq.log.record import MessageExt

MQ = MessageQueue("T", 0)
CFG = PushConsumerConfig()
LIMITS = (CFG.flow_count, CFG.flow_bytes, CFG.flow_span)


def msg(offset: int, size: int = 1) -> MessageExt:
    return MessageExt("T", 0, offset, b"x" * size, f"K{offset}")


def pulled(pq: ProcessQueue, offsets: list[int], next_offset: int | None = None,
           size: int = 1) -> list[MessageExt]:
    """What the pull loop does with one pull result: add, then move next_offset."""
    msgs = [msg(o, size) for o in offsets]
    pq.add(msgs)
    pq.next_offset = next_offset if next_offset is not None else offsets[-1] + 1
    return msgs


def test_defaults_match_the_reference():
    assert (CFG.flow_count, CFG.flow_bytes, CFG.flow_span) == (1000, 100 * 1024 * 1024, 2000)
    assert CFG.pull_expire_s == 120.0 and CFG.pull_batch_size == 32


def test_commit_offset_is_lowest_in_flight():
    pq = ProcessQueue(MQ, 10, 0.0)
    m = pulled(pq, list(range(10, 20)))
    assert pq.commit_offset == 10
    assert pq.remove([m[3], m[5]]) == 10  # a slow message holds the commit back
    assert pq.remove([m[0]]) == 11
    assert pq.remove([m[1], m[2]]) == 14  # 13 and 15 were done: 14 is the lowest left
    assert pq.remove([m[4]]) == 16
    assert len(pq) == 4


def test_commit_offset_equals_next_offset_when_empty():
    pq = ProcessQueue(MQ, 7, 0.0)
    assert pq.commit_offset == 7
    m = pulled(pq, [7, 8, 9])
    pq.remove(m)
    assert pq.commit_offset == 10 == pq.next_offset
    # a pull whose messages were all filtered out (tags) still moves the commit
    pq.next_offset = 42
    assert pq.commit_offset == 42


def test_commit_offset_moves_forward_only():
    pq = ProcessQueue(MQ, 100, 0.0)
    m = pulled(pq, [100, 101])
    pq.remove(m)
    assert pq.commit_offset == 102
    pq.next_offset = 50  # e.g. a bogus pull answer: the commit must not go back
    assert pq.commit_offset == 102
    pq.add([msg(60)])  # below max_offset: ignored (already seen)
    assert len(pq) == 0 and pq.commit_offset == 102


def test_remove_twice_and_unknown_messages_are_harmless():
    pq = ProcessQueue(MQ, 0, 0.0)
    m = pulled(pq, [0, 1, 2], size=10)
    pq.remove([m[1]])
    pq.remove([m[1], msg(99)])
    assert len(pq) == 2 and pq.cached_bytes == 20 and pq.commit_offset == 0


def test_flow_control_count_threshold():
    pq = ProcessQueue(MQ, 0, 0.0)
    pulled(pq, list(range(1000)))
    assert pq.flow_blocked(*LIMITS) is None  # 1,000 cached: still pulls
    pulled(pq, [1000])
    assert pq.flow_blocked(*LIMITS) == "count"  # above 1,000
    pq.remove([msg(0), msg(1)])
    assert pq.flow_blocked(*LIMITS) is None


def test_flow_control_bytes_threshold():
    pq = ProcessQueue(MQ, 0, 0.0)
    pulled(pq, [0, 1], size=50)
    assert pq.cached_bytes == 100
    assert pq.flow_blocked(1000, 100, 2000) is None
    pulled(pq, [2], size=1)
    assert pq.flow_blocked(1000, 100, 2000) == "bytes"
    pq.remove([msg(0, 50)])
    assert pq.cached_bytes == 51 and pq.flow_blocked(1000, 100, 2000) is None
    # the default: 100 MiB
    big = ProcessQueue(MQ, 0, 0.0)
    pulled(big, [0, 1], size=50 * 1024 * 1024)
    assert big.flow_blocked(*LIMITS) is None
    pulled(big, [2])
    assert big.flow_blocked(*LIMITS) == "bytes"


def test_flow_control_span_threshold():
    pq = ProcessQueue(MQ, 0, 0.0)
    pulled(pq, [0])
    pulled(pq, [2000])  # span 2000: still pulls
    assert len(pq) == 2 and pq.span == 2000
    assert pq.flow_blocked(*LIMITS) is None
    pulled(pq, [2001])
    assert pq.span == 2001 and pq.flow_blocked(*LIMITS) == "span"
    pq.remove([msg(0)])  # the slow one finished: the span collapses
    assert pq.span == 1 and pq.flow_blocked(*LIMITS) is None


def test_pull_expired_after_120s():
    pq = ProcessQueue(MQ, 0, now=1000.0)
    assert not pq.pull_expired(1000.0 + 120.0, CFG.pull_expire_s)
    assert pq.pull_expired(1000.0 + 120.01, CFG.pull_expire_s)
    pq.last_pull = 1100.0  # a pull came back
    assert not pq.pull_expired(1200.0, CFG.pull_expire_s)


# ---------------------------------------------------------------- property
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("pull"), st.integers(0, 40), st.integers(0, 5)),  # count, gap
        st.tuples(st.just("done"), st.integers(0, 10_000), st.integers(1, 8)),  # pick, n
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 1000), ops=_ops)
def test_commit_offset_never_decreases_nor_passes_lowest_in_flight(start, ops):
    pq = ProcessQueue(MQ, start, 0.0)
    in_flight: dict[int, MessageExt] = {}
    last_ack = pq.commit_offset
    assert last_ack == start
    for op in ops:
        if op[0] == "pull":
            _, count, gap = op
            # offsets strictly increase; some are skipped (filtered by tags)
            first = pq.next_offset + gap
            msgs = [msg(o) for o in range(first, first + count)]
            pq.add(msgs)
            pq.next_offset = first + count
            in_flight.update((m.queue_offset, m) for m in msgs)
        else:
            _, pick, n = op
            if not in_flight:
                continue
            keys = sorted(in_flight)
            chosen = [keys[(pick + i * 7) % len(keys)] for i in range(n)]
            pq.remove([in_flight.pop(k) for k in set(chosen)])
        ack = pq.commit_offset
        assert ack >= last_ack
        if in_flight:
            assert ack == min(in_flight)
        else:
            assert ack == pq.next_offset
        assert len(pq) == len(in_flight)
        last_ack = ack
