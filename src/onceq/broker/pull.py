"""The pull service: consumers' pulls (``PULL``) under the queue-ownership rules
(``ownership.py``: the reset fence, the orderly lock, the access lock); long polling of
empty pulls (``longpoll.py``) and their retries when messages arrive; the offset queries
(``QUERY_OFFSETS``, ``SEARCH_OFFSET``, ``GET_OFFSET``).

A pull may carry a commit of the group's ack offset (piggy-backed; journaled with the next
batch, not waited for). A pull refused by a lock or the fence is answered ``LOCKED``: no
messages, the same next offset; the client retries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..log.record import tag_hash
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..storage.store import check_name
from .fields import Response, int_field, str_field, user_topic
from .longpoll import HeldPull, PullHold
from .ownership import Refusal

if TYPE_CHECKING:
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .connection import Connection
    from .metrics import BrokerMetrics
    from .ownership_service import OwnershipService
    from .trace import DeliveryTrace

log = logging.getLogger("onceq.broker")


class PullService:
    """Answers pulls and holds the empty ones (``holds``). ``metrics`` is set when the
    broker starts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, *,
                 owners: OwnershipService, trace: DeliveryTrace) -> None:
        self.config = config
        self.store = store
        self.owners = owners
        self.trace = trace
        self.holds = PullHold(self._retry_pull)
        self.metrics: BrokerMetrics | None = None

    # ---------------------------------------------------------------- held pulls
    def wake(self, topic: str, queue: int) -> None:
        """New messages on a queue (or its lock changed): retry the pulls held on it."""
        self.holds.notify((topic, queue))

    def wake_topic(self, topic: str) -> None:
        """The topic was deleted: its held pulls are answered (``TOPIC_NOT_EXIST``)."""
        for key in [k for k in self.holds.held if k[0] == topic]:
            self.holds.notify(key)

    def give_up(self, *, client: str, topic: str, queue: int) -> None:
        """``client`` gave the queue up: answer its held pulls of it ``LOCKED`` now."""
        for held in self.holds.drop_client((topic, queue), client):
            held.conn.respond(held.corr_id, 0,
                              self._locked(topic, queue, offset=held.request["offset"]))

    def _locked(self, topic: str, queue: int, *, offset: int) -> dict[str, Any]:
        """A refused pull: "queue is locked by another client", same next offset."""
        lo, hi = self.store.min_max(topic, queue)
        return {"st": int(PullStatus.LOCKED), "next": offset, "min": lo, "max": hi, "n": 0}

    # ---------------------------------------------------------------- pulls
    def _pull_request(self, h: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        req = {
            "topic": user_topic(str_field(h, "topic")),
            "queue": int_field(h, "queue"),
            "offset": int_field(h, "offset"),
            "max": min(max(int_field(h, "max", 32), 1), cfg.max_pull_msgs),
            "max_bytes": min(max(int_field(h, "max_bytes", cfg.max_pull_bytes), 1),
                             cfg.max_pull_bytes),
            "suspend_ms": max(int_field(h, "suspend_ms", 0), 0),
            "group": None,
            "client": None,
        }
        tags = h.get("tags")
        if tags is not None:
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, "tags must be a list of strings")
            req["tag_hashes"] = frozenset(tag_hash(t) for t in tags)
        else:
            req["tag_hashes"] = None
        return req

    def h_pull(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes) -> Response:
        req = self._pull_request(h)
        topic, queue = req["topic"], req["queue"]
        self.store.get_topic(topic)
        group = h.get("group")
        if group is not None:
            group = check_name("group", group)
        commit = int_field(h, "commit") if "commit" in h else -1
        client = h.get("client")
        if not isinstance(client, str):
            client = None
        behind = None
        if group is not None:
            owners = self.owners
            owners.seen(group, client, h.get("reset_gen"))
            traced = group in self.trace.groups  # delivery trace (trace.py)
            d = owners.pull(group, client, topic, queue, req["offset"])
            if d.refused is not None:  # fenced, or another client holds the queue: its
                return 0, self._locked(topic, queue, offset=req["offset"]), b""  # commit too
            if d.corrected:  # taken over and moved forward to the group's offset: the
                commit = -1  # client's commit is its stale start, not progress
            if d.lock is not None:  # under the access lock
                req["offset"] = d.offset
                req["group"], req["client"] = group, client
            if traced:
                acquired = d.lock is not None and d.lock.previous_holder != client
                req["trace"] = (group, client or "", acquired)
            if commit >= 0:
                # journaled with the next batch, not waited for: a consumer sends its
                # finished offsets again after a reconnect (and with its next pull)
                locked = d.lock is not None  # the pull just ran checks 1-3 under the lock
                v, _ = owners.commit(group, client, topic, queue, commit, later=True,
                                     checked=locked, locked=locked)
                if v.refused is Refusal.BEHIND:
                    behind = v.stored
        res = self._do_pull(req)
        if behind is not None:  # its process queue is stale: the group consumed further
            if res is None:
                res = self._do_pull(req, final=True)
            res[1]["behind"] = behind
        if res is None:
            seconds = min(req["suspend_ms"] / 1000, self.config.long_poll_max_s)
            if req["client"] is not None:  # a suspended holder is alive: keep its lock
                self.owners.touch(group, client, topic, queue)
            self.holds.hold((topic, queue), HeldPull(conn, corr, req), seconds)
            return None
        return res

    def _do_pull(self, req: dict[str, Any], final: bool = False) -> Response:
        """Run a pull; None means 'nothing yet, hold it' (only when it may be held)."""
        r = self.store.get(req["topic"], req["queue"], req["offset"], req["max"],
                           req["max_bytes"], req["tag_hashes"])
        if r.status == PullStatus.NO_NEW_MESSAGE and req["suspend_ms"] > 0 and not final:
            if r.next_offset != req["offset"]:
                req["offset"] = r.next_offset  # filtered entries skipped: wait from there
            return None
        if r.status == PullStatus.FOUND:
            if req["client"] is not None:
                self.owners.delivered(req["group"], req["topic"], req["queue"],
                                      r.next_offset)
            if "trace" in req:
                self.trace.delivered(*req["trace"], req["topic"], req["queue"], r.payload)
            if self.metrics is not None:
                self.metrics.on_pull(req["topic"], r.count, len(r.payload))
        hdr = {"st": int(r.status), "next": r.next_offset, "min": r.min_offset,
               "max": r.max_offset, "n": r.count}
        if r.status == PullStatus.DAMAGED:  # offsets [damaged[0], damaged[1]) are lost
            hdr["damaged"] = [req["offset"], r.next_offset]
        return 0, hdr, r.payload

    def _retry_pull(self, held: HeldPull, final: bool) -> bool:
        try:
            req = held.request
            if req["topic"] not in self.store.topics:
                raise OnceqError(ErrorCode.TOPIC_NOT_EXIST, "topic was deleted")
            if req["client"] is not None and self.owners.holder(
                    req["group"], req["topic"], req["queue"]) != req["client"]:
                held.conn.respond(held.corr_id, 0,
                                  self._locked(req["topic"], req["queue"], offset=req["offset"]))
                return True
            res = self._do_pull(req, final)
        except OnceqError as exc:
            held.conn.respond(held.corr_id, int(exc.code), {"message": exc.message})
            return True
        except Exception as exc:  # answer it: the puller must not wait for its timeout
            log.exception("held pull failed")
            held.conn.respond(held.corr_id, int(ErrorCode.SYSTEM_ERROR),
                              {"message": f"internal: {exc}"})
            return True
        if res is None:
            return False
        held.conn.respond(held.corr_id, *res)
        return True

    # ---------------------------------------------------------------- offset queries
    def h_query_offsets(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        lo, hi = self.store.min_max(str_field(h, "topic"), int_field(h, "queue"))
        return 0, {"min": lo, "max": hi}, b""

    def h_search_offset(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                        ) -> Response:
        off = self.store.search_offset(str_field(h, "topic"), int_field(h, "queue"),
                                       int_field(h, "ts"))
        return 0, {"offset": off}, b""

    def h_get_offset(self, conn: Connection, corr: int, h: dict[str, Any], p: bytes
                     ) -> Response:
        """The group's ack offset on a queue."""
        group = check_name("group", str_field(h, "group"))
        off = self.store.get_offset(group, str_field(h, "topic"), int_field(h, "queue"))
        return 0, {"offset": off}, b""
