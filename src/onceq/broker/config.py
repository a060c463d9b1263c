"""Broker configuration (defaults as RocketMQ users know them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._net import is_loopback
from ..log.delay import DEFAULT_MAX_DELAY_S
from ..protocol.frame import HEADER_ALLOWANCE, max_frame_for_body
from ..storage.config import StoreConfig
from .fuse import parse_topic_limits
from .retry import DEFAULT_DELAY_LEVELS, parse_delay_levels

WRITE_HIGH_WATER = 8 * 1024 * 1024  # a client's requests wait while this much output is unsent


def min_output_bytes(max_pull_bytes: int) -> int:
    """What a client that pipelines pulls may have queued while it reads them normally."""
    return WRITE_HIGH_WATER + max_pull_bytes + HEADER_ALLOWANCE


@dataclass
class BrokerConfig:
    store: StoreConfig
    host: str = "127.0.0.1"
    port: int = 9876
    long_poll_max_s: float = 15.0  # longest hold of an empty pull
    heartbeat_expiry_s: float = 120.0  # a member without heartbeat for this long is removed
    expiry_check_s: float = 5.0
    offsets_save_s: float = 1.0
    offsets_journal_ms: int = 100  # commits carried by pulls are journaled this often
    retention_check_s: float = 60.0
    auto_create_topics: bool = False
    default_queues: int = 8
    # the queue-depth fuse (fuse.py): refuse sends to a queue the slowest consumer group is
    # this many messages behind on (0: off), per topic, closing again below the ratio
    fuse_depth: int = 0
    fuse_topics: str = ""  # "topic=depth,..." (0: no fuse for that topic)
    fuse_resume_ratio: float = 0.8
    max_pull_msgs: int = 1024
    max_pull_bytes: int = 8 * 1024 * 1024
    delay_levels: str = DEFAULT_DELAY_LEVELS  # retry delays, level 1 first
    # delayed messages (log/delay.py): the furthest delivery time accepted, from now
    timer_max_delay_s: float = DEFAULT_MAX_DELAY_S
    # transition-state queue access lock (CLUSTERING groups); see broker/access_lock.py
    access_lock: bool = True
    access_lock_hold_s: float = 30.0  # a connected holder not seen this long is displaced
    access_lock_stable_checks: int = 3
    # after a restart, a saved holder keeps its queue this long (from broker start) unless
    # it re-asserts or gives it up first; covers the clients' reconnect and first heartbeat
    access_lock_restore_hold_s: float = 20.0
    queue_lock_expiry_s: float = 60.0  # orderly queue locks not renewed this long are free
    # queues that follow a consumer group (queue_scaler.py, docs/queue_scaling.md): how long
    # producers may write with a topic's old write count (above their 5 s refresh of it),
    # and how long a group's size must hold before the counts follow it
    queue_scaling_grace_s: float = 10.0
    queue_scaling_settle_s: float = 5.0
    # per-connection limits (broker/connection.py, broker/limits.py; docs/broker.md)
    max_output_bytes: int = 64 * 1024 * 1024  # queued for one client: above, it is dropped
    read_timeout_s: float = 30.0  # a frame started must be complete within this (0: off)
    idle_timeout_s: float = 300.0  # a connection sending nothing this long is closed (0: off)
    max_connections: int = 0  # 0: as many as the fd limit allows, less fd_reserve
    fd_reserve: int = 128  # file descriptors always left free for the broker's own files
    # partial frames of all connections together (0: the larger of 256 MiB and 4 frames)
    max_input_buffer_bytes: int = 0
    # an idempotent writer's sequences are forgotten after this long without a send
    # (Kafka's producer id expiry: 7 days); see log/sequence.py
    writer_expiry_s: float = 7 * 24 * 3600.0
    # Prometheus endpoint (broker/metrics.py): -1 off, 0 any free port
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    metrics_tls: bool = False  # /metrics over TLS with tls_cert and tls_key
    # RocketMQ 5 clients' gRPC endpoint (onceq.rocketmq, docs/rocketmq.md): 0 off
    grpc_port: int = 0
    # security (broker/security.py, docs/security.md)
    acl: bool = False  # users authenticate (SCRAM-SHA-256) and every request is authorized
    insecure: bool = False  # allow listening beyond loopback without ACLs
    tls_cert: str = ""  # server certificate (PEM): TLS on the client port when set
    tls_key: str = ""
    tls_client_ca: str = ""  # CA of client certificates (mTLS: the subject CN is the user)
    tls_client_auth: str = "none"  # none, optional or required
    audit_log: str = ""  # JSON lines of decisions ("": <data_dir>/audit.log when acl is on)
    # broker groups (docs/cluster.md): off unless ``cluster`` names etcd endpoints
    cluster: str = ""  # etcd://host:port[,host:port...]
    cluster_name: str = "onceq"
    group: str = ""  # the broker group this broker replicates
    broker_id: str = ""  # unique in the group
    advertised_address: str = ""  # host:port others reach this broker at ("": host:port)
    session_ttl_s: float = 10.0  # the etcd lease of the broker's session
    acks: str = "all"  # "all": in-sync replicas have it; "leader": the leader's log only
    min_insync: int = 2  # replicas (the leader included) that must be in sync for a write
    unclean_election: bool = False  # any replica may lead (may lose acknowledged writes)
    replica_lag_max_ms: int = 10_000  # a follower not caught up this long leaves the ISR
    replica_ack_timeout_ms: int = 5_000  # a write not replicated this long: NOT_ENOUGH_...
    replica_fetch_wait_ms: int = 500  # a follower's fetch is held this long with no data
    replica_fetch_bytes: int = 1024 * 1024  # bytes of records per fetch answer (about)
    # with acl on: the user:password a follower logs in to its leader with (a file), and
    # the CA of the leader's certificate when the brokers speak TLS ("": the system's)
    replication_credentials_file: str = ""
    replication_tls_ca: str = ""
    extra: dict = field(default_factory=dict)

    def check_exposure(self) -> None:
        """Without ACLs anyone who reaches the port can do anything: refuse to listen
        beyond loopback then, unless ``insecure`` says so."""
        if self.acl or self.insecure or is_loopback(self.host):
            return
        raise ValueError(f"host {self.host!r} is not a loopback address and acl is off: "
                         "anyone who reaches the port could delete topics and read every "
                         "message. Turn acl on (docs/security.md), or set insecure to "
                         "listen anyway")

    def output_budget(self) -> int:
        """Bytes of output queued for all clients that do not read (above the write
        high-water mark) together: the larger of 256 MiB and four clients at the limit."""
        return max(256 * 1024 * 1024, 4 * self.max_output_bytes)

    def input_budget(self) -> int:
        """The effective ``max_input_buffer_bytes``."""
        if self.max_input_buffer_bytes:
            return self.max_input_buffer_bytes
        return max(256 * 1024 * 1024, 4 * max_frame_for_body(self.store.max_body))

    def validate(self) -> None:
        self.store.validate()
        if self.tls_client_auth not in ("none", "optional", "required"):
            raise ValueError("tls_client_auth must be none, optional or required")
        if self.metrics_tls and not self.tls_cert:
            raise ValueError("metrics_tls needs tls_cert (and tls_key)")
        if self.tls_client_auth != "none" and not (self.tls_cert and self.tls_client_ca):
            raise ValueError("tls_client_auth needs tls_cert and tls_client_ca")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, not {self.port}")
        if self.long_poll_max_s < 0 or self.heartbeat_expiry_s <= 0:
            raise ValueError("long_poll_max_s must be >= 0 and heartbeat_expiry_s > 0")
        if not 1 <= self.offsets_journal_ms <= 60_000:
            raise ValueError("offsets_journal_ms must be 1..60000")
        if self.fuse_depth < 0:
            raise ValueError("fuse_depth must be >= 0 (0: off)")
        if not 0 <= self.fuse_resume_ratio < 1:
            raise ValueError("fuse_resume_ratio must be in [0, 1)")
        parse_topic_limits(self.fuse_topics)
        if not 1 <= self.default_queues <= 1024:
            raise ValueError("default_queues must be 1..1024")
        parse_delay_levels(self.delay_levels)
        if self.access_lock_hold_s <= self.long_poll_max_s:
            raise ValueError("access_lock_hold_s must exceed long_poll_max_s: a holder whose "
                             "pull is suspended must not look idle")
        if not self.access_lock_restore_hold_s > 0:
            raise ValueError("access_lock_restore_hold_s must be > 0")
        if not self.queue_lock_expiry_s > 0:
            raise ValueError("queue_lock_expiry_s must be > 0")
        if self.max_output_bytes <= min_output_bytes(self.max_pull_bytes):
            raise ValueError(f"max_output_bytes must exceed "
                             f"{min_output_bytes(self.max_pull_bytes)} (the write high-water "
                             f"mark plus one pull answer of max_pull_bytes)")
        if self.read_timeout_s < 0 or self.idle_timeout_s < 0:
            raise ValueError("read_timeout_s and idle_timeout_s must be >= 0 (0: off)")
        if self.max_input_buffer_bytes and self.max_input_buffer_bytes < 2 * max_frame_for_body(
                self.store.max_body):
            raise ValueError("max_input_buffer_bytes must be 0 (auto) or at least two frames "
                             "of the largest size (2 x (max_body + 64 KiB))")
        if self.max_connections < 0 or self.fd_reserve < 16:
            raise ValueError("max_connections must be >= 0 (0: auto) and fd_reserve >= 16")
        if not self.writer_expiry_s > 0:
            raise ValueError("writer_expiry_s must be > 0")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 (off), 0 (any free port) or a port "
                             f"1..65535, not {self.metrics_port}")
        self.validate_grpc()
        self.validate_cluster()
        if self.queue_scaling_grace_s < 0 or self.queue_scaling_settle_s < 0:
            raise ValueError("queue_scaling_grace_s and queue_scaling_settle_s must be >= 0")
        if self.access_lock_stable_checks < 1:
            raise ValueError("access_lock_stable_checks must be >= 1")

    def validate_grpc(self) -> None:
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must be 0 (off) or a port 1..65535, not "
                             f"{self.grpc_port}")
        if self.grpc_port and self.grpc_port in (self.port, self.metrics_port):
            raise ValueError(f"grpc_port {self.grpc_port} is also the broker's port or "
                             "metrics_port")

    @property
    def clustered(self) -> bool:
        return bool(self.cluster)

    def validate_cluster(self) -> None:
        if not self.cluster:
            return
        if not (self.group and self.broker_id):
            raise ValueError("cluster needs group and broker_id (--group, --broker-id)")
        if self.acl and not self.replication_credentials_file:
            raise ValueError("replication_credentials_file: a broker group with acl on "
                             "needs the user:password its followers log in to the leader "
                             "with (a user with the cluster's Update grant: docs/cluster.md)")
        if self.acks not in ("all", "leader"):
            raise ValueError("acks must be 'all' or 'leader'")
        if self.min_insync < 1:
            raise ValueError("min_insync must be >= 1")
        if self.session_ttl_s < 1:
            raise ValueError("session_ttl_s must be >= 1 (etcd leases last whole seconds)")
        if self.replica_lag_max_ms < 1 or self.replica_ack_timeout_ms < 1:
            raise ValueError("replica_lag_max_ms and replica_ack_timeout_ms must be >= 1")

    def address(self, port: int) -> str:
        """The address the other brokers and the clients reach this broker at."""
        return self.advertised_address or f"{self.host}:{port}"
