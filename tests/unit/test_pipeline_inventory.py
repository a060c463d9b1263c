"""The pipeline's database side alone (SQLite): once per (query, batch), once per order."""

from __future__ import annotations

import sqlite3

import pytest

from onceq.spark.inventory import BatchOutcome, InventoryStore, ProductTotal, open_dialect


def test_a_batch_applies_once_and_an_order_counts_once(tmp_path):
    store = InventoryStore(f"sqlite:///{tmp_path}/inv.db", "t1")
    batch0 = [("o1", "apple", 2), ("o2", "pear", 1), ("o3", "apple", 5)]
    assert store.apply_batch("q", 0, orders=batch0) == BatchOutcome(False, 3, 0, 2)
    # the same batch again (a replay): nothing changes, whatever it holds now
    assert store.apply_batch("q", 0, orders=[("o9", "fig", 1)]) == BatchOutcome(True, 0, 0, 0)
    # a later batch with a late duplicate of o1 and a duplicate inside the batch
    batch1 = [("o1", "apple", 2), ("o4", "pear", 3), ("o4", "pear", 3)]
    assert store.apply_batch("q", 1, orders=batch1) == BatchOutcome(False, 1, 2, 1)
    # an empty batch is recorded too
    assert store.apply_batch("q", 2, orders=[]) == BatchOutcome(False, 0, 0, 0)
    assert store.totals() == {"apple": ProductTotal(7, 2), "pear": ProductTotal(4, 2)}
    assert store.applied_batches("q") == [0, 1, 2]
    # another query (a new checkpoint) still does not count o2 again
    assert store.apply_batch("q2", 0, orders=[("o2", "pear", 1)]).late_duplicates == 1
    store.close()
    # what was committed is in the file, for any reader
    again = InventoryStore(f"sqlite:///{tmp_path}/inv.db", "t1")
    assert again.totals()["pear"] == ProductTotal(4, 2)
    again.drop_tables()


def test_totals_mode_and_a_failed_batch_leaves_nothing(tmp_path):
    store = InventoryStore(f"sqlite:///{tmp_path}/inv.db", "t2")
    assert store.apply_batch("q", 0, totals=[("apple", 9, 3)]).products == 1
    assert store.apply_batch("q", 0, totals=[("apple", 9, 3)]).replayed
    with pytest.raises(sqlite3.Error):  # a NULL product: the whole batch rolls back
        store.apply_batch("q", 1, orders=[("o1", "apple", 1), ("o2", None, 1)])
    assert store.applied_batches("q") == [0]
    assert store.apply_batch("q", 1, orders=[("o1", "apple", 1)]).orders_new == 1
    assert store.totals() == {"apple": ProductTotal(10, 4)}
    with pytest.raises(ValueError, match="orders or totals"):
        store.apply_batch("q", 2)


@pytest.mark.parametrize("url, message", [
    ("sqlite://", "database file"), ("sqlite:///:memory:", "database file"),
    ("redis://localhost", "unknown database URL scheme 'redis'"),
])
def test_bad_urls(url, message):
    with pytest.raises(ValueError, match=message):
        open_dialect(url)
