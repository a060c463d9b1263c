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


def test_a_batch_stopped_before_spark_recorded_it_counts_from_its_replay():
    # run 1 stopped after batch 0's database commit: its report knows only the 152 rows
    # written; run 2 ran it again with Spark's progress (156 rows in, 4 dropped)
    cut = {**batch(1, 0, 152, 0), "from_progress": False}
    batches = [cut, batch(2, 0, 156, 4), batch(2, 1, 154, 6)]
    assert count_batches(batches) == (310, 10)
