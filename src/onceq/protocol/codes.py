"""Request codes of the onceq wire protocol (numeric and stable)."""

from __future__ import annotations

from enum import IntEnum


class RequestCode(IntEnum):
    PING = 1
    SEND = 10
    SEND_BATCH = 11
    PULL = 20
    QUERY_OFFSETS = 21  # min/max offset of a queue
    SEARCH_OFFSET = 22  # first offset stored at or after a timestamp
    COMMIT_OFFSET = 30
    GET_OFFSET = 31
    CREATE_TOPIC = 40
    DELETE_TOPIC = 41
    LIST_TOPICS = 42
    GET_TOPIC = 43
    HEARTBEAT = 50
    UNREGISTER = 51
    LIST_GROUP_MEMBERS = 52
    LIST_GROUPS = 53


class PushCode(IntEnum):
    """One-way server pushes."""

    GROUP_CHANGED = 100


class PullStatus(IntEnum):
    FOUND = 0
    NO_NEW_MESSAGE = 1
    OFFSET_MOVED = 2  # requested offset is below the queue's minimum (retention)
    OFFSET_ILLEGAL = 3  # requested offset is beyond the queue's maximum
