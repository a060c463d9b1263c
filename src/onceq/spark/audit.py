"""The duplicate audit (``onceq audit``): a Spark batch job over the delivery trace.

It reads the trace topic ``%TRACE%`` (written by the broker for the groups with tracing
on, see ``broker/trace.py``) through the ``onceq`` source, and reports every duplicate
delivery: a delivery to a group of a unique key the group was delivered before. Each
duplicate ``d`` is attributed to one cause, from the trace fields alone:

* the same stored copy (topic, queue, offset) was delivered to the group before, last at
  ``p`` (by client ``p.client``):

  - ``broker_restart``: the broker started between ``p`` and ``d`` (a ``broker start``
    trace record in (p.time, d.time]): offsets committed after ``p`` were lost with it;
  - ``crash``: ``p.client`` left the group without unregistering (its connection closed,
    or it stopped heartbeating: a ``disconnect`` or ``expired`` record in
    [p.time, d.time]): what it had pulled and not committed is delivered again;
  - ``rebalance``: otherwise: the queue moved to another member (or away and back), and
    the new holder read from the committed offset. ``handover`` tells whether ``d``'s
    pull made its client the queue's access-lock holder.

* the copy is new to the group, but its unique key is not:

  - ``retry``: ``d.reconsume > 0``: a copy from the group's retry topic, sent back after
    the consumer failed the message or its consume timeout expired (or resent from the
    dead-letter queue);
  - ``producer_resend``: ``d.reconsume == 0``: the origin topic holds the key twice, a
    producer sent it again after the broker's dedup window (or to another queue).

Only the broker's records count: each carries the property ``src=broker``, which only the
broker writes into ``%TRACE%`` (clients can neither send to the topic nor delete it, see
``broker/trace.py``); records without it are ignored, so no record the broker did not
write adds deliveries, events or causes.

So per group, duplicates == deliveries - distinct unique keys, and the causes add up to
the duplicates. Deliveries are the broker's: a message pulled by a consumer counts even if
the consumer dropped it before its handler ran (a queue taken away, a crash).
A window of the summary is a tumbling window of delivery time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from ..protocol.codes import PROP_TRACE_SOURCE, TRACE_SOURCE_BROKER, TRACE_TOPIC

CAUSES = ("rebalance", "crash", "broker_restart", "retry", "producer_resend")
_ROW = ["group", "topic", "queue", "offset", "client", "ts", "reconsume"]  # one delivery
_DELIVERED = "array<struct<o: bigint, k: string, r: int>>"  # a trace message's body


def audit_session(master: str = "local[2]") -> tuple[SparkSession, bool]:
    """The active SparkSession (when called from a Spark driver), else a new one on
    ``master``; with the ``onceq`` source registered. The flag: whether it is new (the
    caller stops it)."""
    from . import register

    spark = SparkSession.getActiveSession()
    new = spark is None
    if spark is None:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = (SparkSession.builder.master(master).appName("onceq-audit")
                 .config("spark.ui.enabled", "false")
                 .config("spark.sql.shuffle.partitions", "4")
                 .config("spark.sql.session.timeZone", "UTC").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark, new


def read_trace(spark: SparkSession, servers: str, topic: str = TRACE_TOPIC) -> DataFrame:
    """The trace topic as rows, one per delivered message and one per event: kind, group,
    client, topic, queue, offset, handover, event, unique_key, reconsume, ts (delivery or
    event time), seq (orders the records of one broker run within a millisecond). Records
    without the broker's mark are left out (module doc)."""
    raw = spark.read.format("onceq").option("servers", servers).option("topic", topic).load()
    p = F.col("properties")
    raw = raw.filter(F.coalesce(p[PROP_TRACE_SOURCE] == TRACE_SOURCE_BROKER, F.lit(False)))
    common = [p["kind"].alias("kind"), p["group"].alias("group"), p["client"].alias("client"),
              p["topic"].alias("topic"), p["queue"].cast("int").alias("queue"),
              F.coalesce(p["seq"].cast("long"), F.lit(0)).alias("seq")]
    pulls = raw.filter(p["kind"] == "deliver").select(
        *common, (p["handover"] == "1").alias("handover"),
        F.col("born_timestamp").alias("ts"),
        F.explode(F.from_json(F.col("body").cast("string"), _DELIVERED)).alias("m"))
    deliveries = pulls.select(
        "kind", "group", "client", "topic", "queue", "seq", F.col("m.o").alias("offset"),
        "handover", F.lit(None).cast("string").alias("event"),
        F.col("m.k").alias("unique_key"), F.col("m.r").alias("reconsume"), "ts")
    events = raw.filter(p["kind"] != "deliver").select(
        *common, F.lit(None).cast("long").alias("offset"), F.lit(False).alias("handover"),
        p["event"].alias("event"), F.lit(None).cast("string").alias("unique_key"),
        F.lit(None).cast("int").alias("reconsume"), F.col("born_timestamp").alias("ts"))
    return deliveries.unionByName(events)


def attribute(trace: DataFrame, groups: Sequence[str] | None = None) -> DataFrame:
    """Every delivery of the trace with ``duplicate`` (bool) and ``cause`` (one of
    ``CAUSES`` for a duplicate, else null), ``prev_client`` and ``prev_ts`` (the previous
    delivery of the same stored copy to the group, if any)."""
    d = trace.filter(F.col("kind") == "deliver")
    if groups:
        d = d.filter(F.col("group").isin(list(groups)))
    by_key = Window.partitionBy("group", "unique_key").orderBy(
        "ts", "seq", "reconsume", "topic", "queue", "offset", "client")
    by_copy = Window.partitionBy("group", "topic", "queue", "offset").orderBy(
        "ts", "seq", "reconsume", "client")
    d = (d.withColumn("duplicate", F.row_number().over(by_key) > 1)
          .withColumn("prev_client", F.lag("client").over(by_copy))
          .withColumn("prev_ts", F.lag("ts").over(by_copy))
          .withColumn("prev_seq", F.lag("seq").over(by_copy)))
    again = d.filter(F.col("duplicate") & F.col("prev_ts").isNotNull()).select(
        *_ROW, "seq", "prev_client", "prev_ts", "prev_seq")
    # the event tables (broker starts, members gone) are small: broadcast, no shuffle
    starts = F.broadcast(trace.filter(F.col("kind") == "broker").select(
        F.col("ts").alias("ev_ts"), F.col("seq").alias("ev_seq")))
    restarted = (again.join(starts, _after(starts, again, "prev_")
                            & ~_after(starts, again, ""), "left_semi")
                 .select(*_ROW).withColumn("restarted", F.lit(True)))
    gone = F.broadcast(trace.filter((F.col("kind") == "member")
                        & F.col("event").isin("disconnect", "expired")).select(
        F.col("group").alias("ev_group"), F.col("client").alias("ev_client"),
        F.col("ts").alias("ev_ts"), F.col("seq").alias("ev_seq")))
    crashed = (again.join(gone, (gone.ev_group == again.group)
                          & (gone.ev_client == again.prev_client)
                          & _after(gone, again, "prev_") & ~_after(gone, again, ""),
                          "left_semi").select(*_ROW).withColumn("crashed", F.lit(True)))
    # joined back on the delivery's own fields (identical deliveries get identical flags)
    d = (d.join(restarted.dropDuplicates(), _ROW, "left")
         .join(crashed.dropDuplicates(), _ROW, "left"))
    cause = (F.when(~F.col("duplicate"), F.lit(None))
             .when(F.col("prev_ts").isNotNull(),
                   F.when(F.col("restarted"), "broker_restart")
                   .when(F.col("crashed"), "crash").otherwise("rebalance"))
             .when(F.col("reconsume") > 0, "retry").otherwise("producer_resend"))
    return d.withColumn("cause", cause).drop("restarted", "crashed", "kind", "event",
                                              "prev_seq")


def _after(ev: DataFrame, d: DataFrame, prefix: str) -> Any:
    """Whether the event ``ev`` (ev_ts, ev_seq) came after the delivery ``d``'s
    (``prefix``ts, ``prefix``seq): by time, then by order within one millisecond."""
    ts, seq = d[prefix + "ts"], d[prefix + "seq"]
    return (ev.ev_ts > ts) | ((ev.ev_ts == ts) & (ev.ev_seq > seq))


@dataclass
class AuditReport:
    """Totals per group, counts per group, topic, queue and time window, and the
    attributed deliveries (a DataFrame: write it to Parquet or query it further)."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    deliveries: DataFrame | None = None

    def to_json(self) -> dict[str, Any]:
        return {"causes": list(CAUSES), "groups": self.groups, "windows": self.windows}


def _cause_counts() -> list[Any]:
    return [F.sum(F.when(F.col("cause") == c, 1).otherwise(0)).alias(c) for c in CAUSES]


def run_audit(spark: SparkSession, servers: str, *, groups: Sequence[str] | None = None,
              window: str = "1 minute", topic: str = TRACE_TOPIC) -> AuditReport:
    """Read the trace from the broker at ``servers`` and attribute its duplicates (one
    Spark job for the counts; ``deliveries`` is cached for further use)."""
    trace = read_trace(spark, servers, topic).cache()  # read from the broker once
    d = attribute(trace, groups).cache()
    windows = (d.groupBy("group", "topic", "queue", F.window("ts", window).alias("w"))
               .agg(F.count("*").alias("deliveries"),
                    F.sum(F.col("duplicate").cast("int")).alias("duplicates"),
                    F.sum(F.col("handover").cast("int")).alias("handover_deliveries"),
                    *_cause_counts())
               .select("group", "topic", "queue", F.col("w.start").alias("window_start"),
                       F.col("w.end").alias("window_end"), "deliveries", "duplicates",
                       "handover_deliveries", *CAUSES))
    report = AuditReport(deliveries=d)
    totals: dict[str, dict[str, Any]] = {}
    for r in windows.collect():
        row = r.asDict()
        row["window_start"] = row["window_start"].isoformat()
        row["window_end"] = row["window_end"].isoformat()
        row["causes"] = {c: int(row.pop(c)) for c in CAUSES}
        report.windows.append(row)
        t = totals.setdefault(row["group"], {
            "group": row["group"], "deliveries": 0, "unique_keys": 0, "duplicates": 0,
            "handover_deliveries": 0, "causes": dict.fromkeys(CAUSES, 0)})
        for k in ("deliveries", "duplicates", "handover_deliveries"):
            t[k] += row[k]
        for c in CAUSES:
            t["causes"][c] += row["causes"][c]
    for t in totals.values():  # each key's first delivery is the one that is no duplicate
        t["unique_keys"] = t["deliveries"] - t["duplicates"]
    report.groups = [totals[g] for g in sorted(totals)]
    report.windows.sort(key=lambda w: (w["group"], w["window_start"], w["topic"], w["queue"]))
    return report
