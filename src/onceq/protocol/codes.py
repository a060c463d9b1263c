"""Request codes of the onceq wire protocol (numeric and stable)."""

from __future__ import annotations

from enum import IntEnum


class RequestCode(IntEnum):
    PING = 1
    SEND = 10
    SEND_BATCH = 11
    SEND_SEQUENCED = 12  # an idempotent writer's numbered batch (log/sequence.py)
    SEND_RECORDS = 13  # a producer's record batch, stored as sent (log/batch.py)
    PULL = 20
    QUERY_OFFSETS = 21  # min/max offset of a queue
    SEARCH_OFFSET = 22  # first offset stored at or after a timestamp
    BROKER_STATUS = 23  # store health: damaged offset and commit-log ranges
    COMMIT_OFFSET = 30
    GET_OFFSET = 31
    CONSUMER_SEND_BACK = 32  # a failed message goes to the group's retry topic (or DLQ)
    RELEASE_QUEUE = 33  # commit and give up a queue's access lock (end of a drain)
    RESET_OFFSETS = 34  # admin: move a group's offsets (refused while members are live)
    DELETE_GROUP = 35  # admin: forget a group's offsets (refused while members are live)
    CREATE_TOPIC = 40
    DELETE_TOPIC = 41
    LIST_TOPICS = 42
    GET_TOPIC = 43
    HEARTBEAT = 50
    UNREGISTER = 51
    LIST_GROUP_MEMBERS = 52
    LIST_GROUPS = 53
    QUERY_ACCESS_LOCKS = 54  # per queue: lock holder, deliver/ack offsets, pending handover
    LOCK_QUEUES = 55  # orderly: lock (or renew) queues of a group; answers those now held
    UNLOCK_QUEUES = 56  # orderly: commit each queue's offset, then release its lock
    TOPIC_STATUS = 60  # admin: per queue min/max offsets and last store time
    QUERY_MESSAGE = 61  # admin: find messages by unique key or business key (bounded scan)
    GROUP_TRACE = 62  # admin: turn a group's delivery trace on/off, or show which are on
    AUTHENTICATE = 70  # one step of a SCRAM-SHA-256 exchange (protocol/scram.py)
    USER_CREATE = 71  # admin (super user): users and their SCRAM credentials
    USER_UPDATE = 72
    USER_DELETE = 73
    USER_LIST = 74
    ACL_GRANT = 75  # admin (super user): grants of actions on resources (broker/acl.py)
    ACL_REVOKE = 76
    ACL_LIST = 77
    # broker groups (docs/cluster.md): a follower's fetch of the leader's commit log, and
    # where an epoch of the leader's log ends (to cut a divergent tail after a failover)
    REPLICA_FETCH = 80
    REPLICA_EPOCH_END = 81
    # request-reply (docs/request_reply.md): a requester names its reply channel on its
    # connection; a responder's reply goes to that connection as a REPLY push
    REPLY_CHANNEL = 90
    REPLY = 91
    # a topic spread over several broker groups: which group holds each queue, and how to
    # reach each group (docs/cluster.md, "Topics over several groups")
    GET_ROUTE = 95
    # moving a queue to another broker group (``onceq topic reassign``): the queue's ends
    # and consumer offsets on its group, and a copy of its messages and offsets to the next
    QUEUE_STATE = 96
    COPY_QUEUE = 97


class PushCode(IntEnum):
    """One-way server pushes."""

    GROUP_CHANGED = 100
    OFFSETS_RESET = 101  # a forced offset reset: drop those queues and take them again
    REPLY = 102  # the reply to a request this client made (request-reply), never coalesced
    ROUTE_CHANGED = 103  # a topic's route changed: fetch it again (and rebalance)


SYSTEM_PREFIX = "%"  # topic names the broker keeps for itself start with it (below)
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
SCHEDULE_TOPIC = "%SCHEDULE%"
TRACE_TOPIC = "%TRACE%"  # deliveries of the groups with tracing on (see broker/trace.py)
# every record the broker stores in TRACE_TOPIC carries this property and value; the audit
# reads only those (see spark/audit.py)
PROP_TRACE_SOURCE = "src"
TRACE_SOURCE_BROKER = "broker"

# message properties set by the broker on retried messages
PROP_ORIGIN_TOPIC = "ORIGIN_TOPIC"
PROP_ORIGIN_QUEUE = "ORIGIN_QUEUE"
PROP_ORIGIN_OFFSET = "ORIGIN_OFFSET"
PROP_DELAY_LEVEL = "DELAY"
PROP_REAL_TOPIC = "REAL_TOPIC"
PROP_REAL_QUEUE = "REAL_QID"
PROP_DELIVER_AT = "DELIVER_AT_MS"
# why a message is in a DLQ (the send-back's optional ``dlq_reason``, or the broker's own)
PROP_DLQ_REASON = "DLQ_REASON"
MAX_DLQ_REASON = 1024  # characters of a send-back's dlq_reason at most
# the largest reconsume count a message holds (a u16 in the message part, log/record.py):
# a send-back of a message at this count dead-letters it, the count stays at the limit
MAX_RECONSUME_TIMES = 0xFFFF


def retry_topic(group: str) -> str:
    return f"{RETRY_PREFIX}{group}"


def dlq_topic(group: str) -> str:
    return f"{DLQ_PREFIX}{group}"


class PullStatus(IntEnum):
    FOUND = 0
    NO_NEW_MESSAGE = 1
    OFFSET_MOVED = 2  # requested offset is below the queue's minimum (retention)
    OFFSET_ILLEGAL = 3  # requested offset is beyond the queue's maximum
    LOCKED = 4  # the queue is locked by another client of the group (transition state)
    DAMAGED = 5  # offsets [requested, next) were lost to disk damage: continue at next
