"""Push-consumer settings, with RocketMQ's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .allocation import AllocateStrategy, allocate_average


class MessageModel(StrEnum):
    CLUSTERING = "CLUSTERING"  # each queue is owned by one member at a time
    BROADCASTING = "BROADCASTING"  # every member gets every message; offsets kept locally


class ConsumeFrom(StrEnum):
    LAST = "LAST"  # a new group starts at the end of each queue (retry topics at 0)
    FIRST = "FIRST"
    TIMESTAMP = "TIMESTAMP"


@dataclass
class PushConsumerConfig:
    model: MessageModel = MessageModel.CLUSTERING
    consume_from: ConsumeFrom = ConsumeFrom.LAST
    consume_timestamp_ms: int | None = None  # TIMESTAMP start; default now - 30 min
    allocate: AllocateStrategy = allocate_average
    batch_size: int = 1  # messages per listener call
    pull_batch_size: int = 32  # messages per pull
    concurrency: int = 20  # listener calls running at once
    max_reconsume: int = 16  # after this many retries a message goes to the DLQ
    consume_timeout_s: float = 15 * 60  # a listener running longer counts as failed
    rebalance_interval_s: float = 20.0
    heartbeat_interval_s: float = 10.0
    pull_suspend_s: float = 15.0  # long polling: how long the broker may hold a pull
    pull_expire_s: float = 120.0  # a queue that has not pulled for this long is dropped
    flow_count: int = 1000  # pause pulling a queue above this many cached messages
    flow_bytes: int = 100 * 1024 * 1024  # ... above this many cached body bytes
    flow_span: int = 2000  # ... or above this offset span in flight
    flow_pause_s: float = 0.05
    commit_interval_s: float = 5.0
    drain_timeout_s: float = 10.0  # on revoke: wait this long for in-flight listeners
    access_lock: bool = True  # use the broker's transition-state queue lock (CLUSTERING)
    locked_backoff_s: float = 0.1  # pause after a pull refused by the access lock
    send_back_retry_s: float = 5.0  # when the broker cannot take a retry, retry locally
    # orderly consumption (see consume_orderly.py); an ``orderly`` listener also selects it
    orderly: bool = False
    suspend_s: float = 1.0  # after SUSPEND: pause the queue this long (10 ms..30 s)
    orderly_max_retries: int | None = None  # None: retry in place forever; else then DLQ
    lock_renew_s: float = 20.0  # renew the broker queue locks this often
    lock_max_age_s: float = 30.0  # a queue whose lock is older stops until relocked
    lock_retry_s: float = 0.5  # a queue whose lock was refused is tried again after this
    orderly_yield_s: float = 60.0  # one consume run of a queue yields after this long
    offset_dir: str | None = None  # BROADCASTING: where local offsets live
    instance_name: str = "DEFAULT"
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.batch_size < 1 or self.pull_batch_size < 1 or self.concurrency < 1:
            raise ValueError("batch_size, pull_batch_size and concurrency must be >= 1")
        if self.max_reconsume < 0:
            raise ValueError("max_reconsume must be >= 0")
        if not 0.01 <= self.suspend_s <= 30:
            raise ValueError("suspend_s must be between 0.01 and 30 seconds")
        if self.orderly_max_retries is not None and self.orderly_max_retries < 0:
            raise ValueError("orderly_max_retries must be >= 0 (or None: unlimited)")
        if self.lock_max_age_s <= self.lock_renew_s:
            raise ValueError("lock_max_age_s must be above lock_renew_s")
        for name in ("lock_renew_s", "lock_retry_s", "orderly_yield_s",
                     "consume_timeout_s", "rebalance_interval_s", "heartbeat_interval_s",
                     "pull_expire_s", "commit_interval_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        # settings given as strings ("BROADCASTING", "FIRST") become the enums
        self.model = MessageModel(self.model)
        self.consume_from = ConsumeFrom(self.consume_from)
