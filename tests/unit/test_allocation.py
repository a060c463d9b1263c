"""Tests for onceq.client.allocation (queue allocation strategies)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceq.client.allocation import (
    STRATEGIES,
    AllocateConfig,
    AllocateConsistentHash,
    AllocateNearby,
    MessageQueue,
    allocate_average,
    allocate_average_by_circle,
    get_strategy,
)

ZONES = ("az1", "az2", "az3")


def mqs(n: int, topic: str = "t") -> list[MessageQueue]:
    return [MessageQueue(topic, i) for i in range(n)]


def client_zone(cid: str) -> str:
    return cid.split(":", 1)[0]


def queue_zone(mq: MessageQueue) -> str:
    return ZONES[mq.queue_id % len(ZONES)]


NEARBY = AllocateNearby(client_zone, queue_zone)

PARTITIONING = {
    "AVERAGE": allocate_average,
    "AVERAGE_BY_CIRCLE": allocate_average_by_circle,
    "CONSISTENT_HASH": AllocateConsistentHash(),
    "NEARBY": NEARBY,
    "NEARBY_CIRCLE": AllocateNearby(client_zone, queue_zone, allocate_average_by_circle),
}

# --- hypothesis input strategies -------------------------------------------------------

queue_lists = st.lists(
    st.builds(MessageQueue, st.sampled_from(["a", "b", "orders"]), st.integers(0, 40)),
    max_size=40,
    unique=True,
)
client_lists = st.lists(
    st.builds(
        lambda zone, name: f"{zone}:{name}",
        st.sampled_from(ZONES),
        st.text("abcdefgh0123456789", min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=8,
    unique=True,
)
FAST = settings(max_examples=60, deadline=None)


def allocate_all(strategy, queues, clients) -> dict[str, list[MessageQueue]]:
    return {cid: strategy(cid, queues, clients) for cid in clients}


# --- MessageQueue ----------------------------------------------------------------------


def test_message_queue_is_frozen_and_ordered() -> None:
    q = MessageQueue("t", 1)
    assert MessageQueue("a", 9) < MessageQueue("b", 0) < MessageQueue("b", 1)
    assert hash(q) == hash(MessageQueue("t", 1))
    with pytest.raises(AttributeError):
        q.queue_id = 2  # type: ignore[misc]


# --- AVERAGE ---------------------------------------------------------------------------


def test_average_8_queues_3_clients() -> None:
    queues = mqs(8)
    result = allocate_all(allocate_average, queues, ["c0", "c1", "c2"])
    assert result == {"c0": queues[0:3], "c1": queues[3:6], "c2": queues[6:8]}


def test_average_fewer_queues_than_clients() -> None:
    queues = mqs(2)
    result = allocate_all(allocate_average, queues, ["c0", "c1", "c2", "c3"])
    assert result == {"c0": [queues[0]], "c1": [queues[1]], "c2": [], "c3": []}


def test_average_sorts_inputs() -> None:
    queues = mqs(6)
    assert allocate_average("b", queues[::-1], ["c", "a", "b"]) == queues[2:4]


# --- AVERAGE_BY_CIRCLE -----------------------------------------------------------------


def test_average_by_circle_8_queues_3_clients() -> None:
    queues = mqs(8)
    result = allocate_all(allocate_average_by_circle, queues, ["c2", "c0", "c1"])
    assert result == {
        "c0": [queues[0], queues[3], queues[6]],
        "c1": [queues[1], queues[4], queues[7]],
        "c2": [queues[2], queues[5]],
    }


# --- CONSISTENT_HASH -------------------------------------------------------------------


def test_consistent_hash_is_deterministic_and_partitions() -> None:
    queues = mqs(32)
    clients = ["c0", "c1", "c2", "c3"]
    strategy = AllocateConsistentHash(virtual_nodes=50)
    first = allocate_all(strategy, queues, clients)
    second = allocate_all(AllocateConsistentHash(virtual_nodes=50), queues, clients)
    assert first == second
    assert sorted(q for qs in first.values() for q in qs) == queues
    assert all(qs == sorted(qs) for qs in first.values())


def test_consistent_hash_single_client_gets_everything() -> None:
    queues = mqs(10)
    assert AllocateConsistentHash(1)("only", queues, ["only"]) == queues


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_consistent_hash_rejects_bad_virtual_nodes(bad) -> None:
    with pytest.raises(ValueError, match="virtual_nodes"):
        AllocateConsistentHash(bad)


# --- CONFIG ----------------------------------------------------------------------------


def test_config_filters_by_existence_and_ignores_members() -> None:
    configured = [MessageQueue("t", 5), MessageQueue("t", 1), MessageQueue("gone", 0)]
    strategy = AllocateConfig(configured)
    queues = mqs(8)
    for cid in ("a", "b"):
        assert strategy(cid, queues, ["a", "b"]) == [MessageQueue("t", 5), MessageQueue("t", 1)]
    assert strategy("a", [], ["a"]) == []


def test_config_rejects_non_queue() -> None:
    with pytest.raises(ValueError, match="MessageQueue"):
        AllocateConfig([("t", 1)])  # type: ignore[list-item]


# --- NEARBY ----------------------------------------------------------------------------


def test_nearby_local_and_orphan_zones() -> None:
    # queue_id % 3 -> az1, az2, az3; clients only in az1 and az2.
    queues = mqs(9)
    clients = ["az1:a", "az1:b", "az2:c"]
    result = allocate_all(NEARBY, queues, clients)
    az1 = [q for q in queues if queue_zone(q) == "az1"]  # ids 0, 3, 6
    az2 = [q for q in queues if queue_zone(q) == "az2"]  # ids 1, 4, 7
    az3 = [q for q in queues if queue_zone(q) == "az3"]  # ids 2, 5, 8 (no clients)
    assert result["az1:a"] == sorted(az1[0:2] + az3[0:1])
    assert result["az1:b"] == sorted(az1[2:3] + az3[1:2])
    assert result["az2:c"] == sorted(az2 + az3[2:3])


def test_nearby_uses_fallback() -> None:
    queues = mqs(6)
    strategy = AllocateNearby(lambda c: "z", lambda q: "z", allocate_average_by_circle)
    assert strategy("a", queues, ["a", "b"]) == queues[0::2]


# --- validation and registry -----------------------------------------------------------

ALL_STRATEGIES = [*PARTITIONING.values(), AllocateConfig(mqs(2))]


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_unknown_current_client_raises(strategy) -> None:
    with pytest.raises(ValueError, match="not in the client list"):
        strategy("zz", mqs(3), ["a", "b"])
    with pytest.raises(ValueError, match="not in the client list"):
        strategy("a", mqs(3), [])


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_empty_string_ids_raise(strategy) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        strategy("", mqs(3), ["", "a"])
    with pytest.raises(ValueError, match="non-empty"):
        strategy("a", mqs(3), ["a", ""])


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_empty_queue_list_returns_empty(strategy) -> None:
    assert strategy("az1:a", [], ["az1:a", "az2:b"]) == []


def test_registry_and_get_strategy() -> None:
    assert set(STRATEGIES) == {"AVERAGE", "AVERAGE_BY_CIRCLE", "CONSISTENT_HASH"}
    assert get_strategy("AVERAGE") is allocate_average
    assert get_strategy("average_by_circle") is allocate_average_by_circle
    assert isinstance(get_strategy("CONSISTENT_HASH"), AllocateConsistentHash)
    with pytest.raises(ValueError, match="AVERAGE, AVERAGE_BY_CIRCLE, CONSISTENT_HASH"):
        get_strategy("RANDOM")


# --- property tests --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PARTITIONING))
@FAST
@given(queues=queue_lists, clients=client_lists)
def test_every_queue_has_exactly_one_owner(name, queues, clients) -> None:
    owned = allocate_all(PARTITIONING[name], queues, clients)
    flat = [q for qs in owned.values() for q in qs]
    assert len(flat) == len(set(flat))  # pairwise disjoint, no duplicates
    assert set(flat) == set(queues)


@pytest.mark.parametrize("name", sorted(PARTITIONING))
@FAST
@given(queues=queue_lists, clients=client_lists, seed=st.integers(0, 2**32 - 1))
def test_result_independent_of_input_order(name, queues, clients, seed) -> None:
    strategy = PARTITIONING[name]
    rng = random.Random(seed)
    shuffled_q, shuffled_c = queues[:], clients[:]
    rng.shuffle(shuffled_q)
    rng.shuffle(shuffled_c)
    for cid in clients:
        assert strategy(cid, queues, clients) == strategy(cid, shuffled_q, shuffled_c)


@FAST
@given(queues=queue_lists, clients=client_lists)
def test_average_sizes_differ_by_at_most_one_and_are_contiguous(queues, clients) -> None:
    owned = allocate_all(allocate_average, queues, clients)
    sizes = [len(owned[c]) for c in sorted(clients)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert [q for c in sorted(clients) for q in owned[c]] == sorted(queues)


@FAST
@given(
    queues=queue_lists,
    clients=client_lists,
    newcomer=st.text("ABCDEFGH", min_size=1, max_size=6),
    vnodes=st.integers(1, 20),
)
def test_consistent_hash_only_moves_queues_to_new_client(queues, clients, newcomer, vnodes) -> None:
    strategy = AllocateConsistentHash(vnodes)
    before = allocate_all(strategy, queues, clients)
    after = allocate_all(strategy, queues, [*clients, newcomer])
    for cid in clients:
        assert set(after[cid]) <= set(before[cid])
        moved = set(before[cid]) - set(after[cid])
        assert moved <= set(after[newcomer])


@FAST
@given(
    configured=queue_lists,
    queues=queue_lists,
    clients=client_lists,
)
def test_config_every_client_gets_configured_existing(configured, queues, clients) -> None:
    strategy = AllocateConfig(configured)
    expected = [q for q in configured if q in set(queues)]
    for cid in clients:
        assert strategy(cid, queues, clients) == expected
