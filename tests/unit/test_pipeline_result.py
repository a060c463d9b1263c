"""The pipeline's run figures: a batch Spark ran again (a stop before its commit) read the
same rows and changed nothing, so it is counted apart, not twice."""

from onceq.spark.pipeline import BatchReport, PipelineResult


def batch(bid: int, rows: int, dups: int, new: int, replayed: bool) -> BatchReport:
    return BatchReport(bid, rows, 0, 0, dups, 0, new if not replayed else 0, 3, replayed, 0.1)


def test_a_replayed_batch_is_not_counted_twice():
    first = PipelineResult("q", [batch(0, 156, 4, 152, False)])
    second = PipelineResult("q", [batch(0, 156, 4, 152, True), batch(1, 154, 6, 148, False)])
    assert first.rows_in + second.rows_in == 310
    assert first.duplicates_dropped + second.duplicates_dropped == 10
    assert first.orders_counted + second.orders_counted == 300
    assert second.replayed_batches == 1
