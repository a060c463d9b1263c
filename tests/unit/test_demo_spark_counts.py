"""The demo's Spark figures count each micro-batch once: a batch Spark ran again after the
stop read the same rows and dropped the same duplicates."""

from onceq.cli.demo.spark_step import count_batches


def batch(run: int, bid: int, rows: int, dups: int, late: int = 0) -> dict:
    return {"run": run, "batch": bid, "rows_in": rows, "spark_duplicates": dups,
            "late_duplicates": late}


def test_a_batch_run_again_after_the_stop_counts_once():
    batches = [batch(1, 0, 156, 4), batch(2, 0, 156, 4), batch(2, 1, 154, 5, 1)]
    assert count_batches(batches) == (310, 10)


def test_without_a_replay_every_batch_counts():
    assert count_batches([batch(1, 0, 156, 4), batch(2, 1, 154, 6)]) == (310, 10)
