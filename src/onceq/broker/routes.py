"""A broker's side of topics spread over several broker groups (docs/cluster.md, "Topics
over several groups"): the routes kept in etcd (``cluster/_routes.py``).

* ``CREATE_TOPIC`` on a broker of a cluster first makes sure the topic has a route: an even
  spread of its queues over the groups registered now (create-if-absent), then creates
  the topic here as before; the leaders of the other groups holding queues of it create it
  on their next read of the routes. Every group knows the topic with all its queues (ids
  are global) and serves only its own.
* A send, pull, commit or offset query naming a queue that lives on another group is
  refused ``WRONG_GROUP`` (57, retriable), naming the group and its leader: the client
  fetches the route again.
* Routes and the groups' members and leaders follow etcd's watch of the cluster's keys
  (read every ``ROUTES_POLL_S`` while the watch is broken).
* ``GET_ROUTE``: any broker (followers too) answers where a topic's queues live and how to
  reach each group (its members and leader). A topic without a route (auto-created, or
  made before routes) has every queue on the group that holds it, as before.

A standalone broker has no routes: ``GET_ROUTE`` answers an empty placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..cluster import (
    HANDOVER,
    EtcdError,
    GroupDirectory,
    TopicRoute,
    apply_events,
    create_route,
    place,
    read_directory,
    read_route,
    read_routes,
    read_routes_at,
    routes_prefix,
)
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import RouteInfo
from ..protocol.requests import GetRoute, Send, SendBatch, SendRecords, SendSequenced
from .store_errors import StorageError, as_wire_error

if TYPE_CHECKING:
    from ..cluster import EtcdClient
    from ..protocol.schema import Message
    from ..storage.store import MessageStore
    from .fields import Call, Handler

log = logging.getLogger("onceq.broker")

ROUTES_POLL_S = 1.0
ROUTES_RECHECK_S = 30.0  # while watched: read again this often, in case the watch stalls
SENDS = (Send, SendBatch, SendRecords, SendSequenced)


class Routes:
    def __init__(self, store: MessageStore, default_queues: int, group: str | None = None,
                 is_leader: Callable[[], bool] = lambda: False,
                 create_local: Callable[[str, int], Awaitable[Any]] | None = None) -> None:
        """``group``: this broker's group (None: standalone, no routes);
        ``create_local(topic, queues)``: create a topic here as ``CREATE_TOPIC`` does."""
        self.store = store
        self.default_queues = default_queues
        self.group = group
        self.is_leader = is_leader
        self.create_local = create_local
        self.client: EtcdClient | None = None
        self.cluster = ""
        self.routes: dict[str, TopicRoute] = {}
        self.directory = GroupDirectory({}, {})
        self.problem = ""
        self.loaded = False  # the routes were read once (until then queues are refused)
        self._looked: dict[str, float] = {}  # unknown topics whose route was read, when
        # topics whose route is being read (and created here): requests on them wait
        self._arriving: dict[str, asyncio.Future[None]] = {}
        self.watching = False  # the routes follow etcd's watch (else they are polled)
        self.changes = 0  # route changes applied from the watch
        # a route changed (from the watch): the broker tells its clients
        self.on_change: Callable[[str, TopicRoute | None], None] = lambda t, r: None

    def attach(self, client: EtcdClient, cluster: str) -> None:
        self.client, self.cluster = client, cluster

    def handlers(self) -> dict[type[Message], Handler]:
        return {GetRoute: self.h_get_route}

    # ---------------------------------------------------------------- requests
    def h_get_route(self, call: Call, req: GetRoute) -> RouteInfo | None:
        topic = req.topic
        known = self.routes.get(topic)
        unknown_group = known is not None and any(
            not self.directory.members.get(g) for g in known.groups)
        if self.client is not None and (unknown_group or (
                known is None and (topic in self._arriving or self._may_be_new(topic)))):
            # made on another broker a moment ago (this one may even hold the topic: a
            # follower, or a leader that created it): read it rather than answer "no
            # route" (a client keeps that answer, and would send where the route says
            # not); a group registered since the last read of the groups: read them
            client = self.client
            arriving = None if known is not None else self._arrival(topic)

            async def first() -> None:
                if arriving is not None:
                    with contextlib.suppress(OnceqError, StorageError):  # (not created)
                        await asyncio.shield(arriving)
                route = self.routes.get(topic)
                if route is not None and any(not self.directory.members.get(g)
                                             for g in route.groups):
                    self.directory = await read_directory(client, self.cluster)

            _serve_after(call, req, lambda c, r: self._route_info(topic), first(),
                         "read from")
            return None
        return self._route_info(topic)

    def _route_info(self, topic: str) -> RouteInfo:
        route = self.routes.get(topic)
        if route is None:
            return RouteInfo(topic, here=self.group)
        return RouteInfo(topic, list(route.placement), route.version,
                         self._groups(route), self.group)

    def _groups(self, route: TopicRoute) -> dict[str, Any]:
        d = self.directory
        return {g: {"members": d.members.get(g, []), "leader": d.leaders.get(g)}
                for g in route.groups}

    def check(self, topic: str, queue: object, send: bool = False) -> None:
        """``WRONG_GROUP`` for a queue of a routed topic that lives on another group;
        ``QUEUE_MOVING`` for a send to a queue of this group that is moving to another
        (and for any request on it once it is handed over)."""
        route = self.routes.get(topic)
        if route is None or type(queue) is not int or not 0 <= queue < route.queues:
            return
        group = route.placement[queue]
        move = route.move_of(queue)
        if move is not None and group == self.group and (send or move[1] == HANDOVER):
            raise OnceqError(ErrorCode.QUEUE_MOVING, (
                f"queue {queue} of topic {topic!r} is moving from broker group {group!r} "
                f"to {move[0]!r}: try again shortly"), {"group": group, "to": move[0]})
        if group != self.group:
            leader = self.directory.leaders.get(group)
            raise OnceqError(ErrorCode.WRONG_GROUP, (
                f"queue {queue} of topic {topic!r} lives on broker group {group!r}"
                f"{f' (leader at {leader})' if leader else ''}, not on {self.group!r}: "
                "fetch the topic's route"), {"group": group, "leader": leader or ""})

    def guard(self, handlers: dict[type[Message], Handler],
              *kinds: type[Message]) -> None:
        """Refuse requests of ``kinds`` naming a queue of another group."""
        for kind in kinds:
            handlers[kind] = self._guarded(handlers[kind])

    def _guarded(self, handler: Handler) -> Handler:
        def guarded(call: Call, req: Any) -> Any:
            if not self.loaded:
                raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, "this broker has not read "
                                 "the topics' routes from etcd yet: try again")
            topic = req.topic
            if topic not in self.store.topics and (
                    topic in self._arriving or (
                        self._placed_here(topic) if topic in self.routes
                        else self._may_be_new(topic))):
                # its route may be newer than ours (or is being read), or this group has
                # not created the topic its route places here yet (a moment after it was
                # made elsewhere)
                self.serve_created(call, req, handler)
                return None
            if self.routes:
                self.check(topic, getattr(req, "queue", None), isinstance(req, SENDS))
            return handler(call, req)
        return guarded

    def _placed_here(self, topic: str) -> bool:
        route = self.routes.get(topic)
        return route is not None and self.create_local is not None and (
            self.group in route.placement or any(to == self.group
                                                 for _, to, _ in route.moving))

    def _may_be_new(self, topic: str) -> bool:
        """Whether a topic this broker knows nothing of is worth a read of its route
        (not more than once per ``ROUTES_POLL_S``: a client naming unknown topics must not
        turn into a flood of etcd reads)."""
        now = time.monotonic()
        if now - self._looked.get(topic, float("-inf")) < ROUTES_POLL_S:
            return False
        self._looked[topic] = now
        if len(self._looked) > 10_000:
            self._looked = {t: w for t, w in self._looked.items()
                            if now - w < ROUTES_POLL_S}
        return True

    def serve_created(self, call: Call, req: Any, handler: Handler,
                      check: bool = True) -> None:
        """A request on a topic this broker does not know: read its route first (made on
        another group a moment ago, before this broker's next read), create the topic here
        with the route's queue count when the route places queues here (one moving here
        included; not with ``default_queues``, as creating it on first use would), then
        serve the request (after the queue check of ``guard`` with ``check``). Requests
        arriving meanwhile wait for the same read and creation."""
        topic = req.topic
        arriving = self._arrival(topic)

        async def first() -> None:
            await asyncio.shield(arriving)
            if check:
                self.check(topic, getattr(req, "queue", None), isinstance(req, SENDS))

        _serve_after(call, req, handler, first(), "read from")

    def _arrival(self, topic: str) -> asyncio.Future[None]:
        """The read of ``topic``'s route in flight (started now if none)."""
        arriving = self._arriving.get(topic)
        if arriving is None:
            arriving = self._arriving[topic] = asyncio.ensure_future(self._arrive(topic))
            arriving.add_done_callback(lambda _: self._arriving.pop(topic, None))
        return arriving

    async def _arrive(self, topic: str) -> None:
        """Read ``topic``'s route (kept unless older than the one known); a leader of a
        group it places queues on creates the topic here."""
        assert self.client is not None
        route = await read_route(self.client, self.cluster, topic)
        if route is None:
            return
        known = self.routes.get(topic)
        if known is None or known.version <= route.version:
            self.routes[topic] = route
        if self._placed_here(topic) and topic not in self.store.topics \
                and self.is_leader():
            assert self.create_local is not None
            await self.create_local(topic, route.queues)

    def deleting(self, handler: Handler) -> Handler:
        """``DELETE_TOPIC`` of a topic spread over several groups is refused (its queues
        would have to go on every group at once)."""
        def delete(call: Call, req: Any) -> Message | None:
            route = self.routes.get(req.topic)
            if route is not None and len(route.groups) > 1:
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                    f"topic {req.topic!r} is spread over broker groups "
                    f"{', '.join(route.groups)}: deleting it is not supported yet"))
            return handler(call, req)
        return delete

    def creating(self, handler: Handler) -> Handler:
        """``CREATE_TOPIC`` in a cluster: the topic's route first (``route_for``), then the
        topic here as ``handler`` makes it."""
        def create(call: Call, req: Any) -> Message | None:
            placement = req.placement
            if placement is not None and (self.client is None or not isinstance(
                    placement, list) or not placement
                    or (req.queues is not None and len(placement) != req.queues)):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                    "a placement is a broker group for each queue of the topic, on a "
                    "broker of a cluster" if self.client is not None else
                    "this broker is not in a cluster: a topic's placement over broker "
                    "groups needs --cluster"))
            if self.client is None or req.follow_group is not None:
                return handler(call, req)
            _serve_after(call, req, handler,
                         self.route_for(req.topic, req.queues, placement), "written to")
            return None
        return create

    async def route_for(self, topic: str, queues: int | None,
                        placement: list[Any] | None = None) -> TopicRoute | None:
        """The topic's route, made now when it has none and the topic is new here (an
        existing topic without a route keeps all its queues where it is): ``placement``
        if given (every group registered), else an even spread over the groups."""
        assert self.client is not None
        known = self.routes.get(topic)
        if known is not None or topic in self.store.topics:
            if placement is not None and (known is None or list(known.placement)
                                          != placement):
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                    f"topic {topic!r} exists with another placement: move its queues "
                    "with onceq topic reassign"))
            return known
        directory = await read_directory(self.client, self.cluster)
        self.directory = directory
        n = queues or self.default_queues
        if placement is not None:
            unknown = sorted({str(g) for g in placement} - set(directory.members))
            if unknown:
                raise OnceqError(ErrorCode.INVALID_ARGUMENT, (
                    f"broker group(s) {', '.join(map(repr, unknown))} not registered in "
                    f"the cluster (groups: {', '.join(sorted(directory.members))})"))
        where = tuple(str(g) for g in placement) if placement is not None else place(
            n, list(directory.members))
        route = await create_route(self.client, self.cluster, TopicRoute(topic, where))
        self.routes[topic] = route
        log.info("topic %s: %d queues placed over groups %s", topic, route.queues,
                 ", ".join(route.groups))
        return route

    # ---------------------------------------------------------------- upkeep
    async def run(self) -> None:
        """Follow the routes and the groups' members and leaders as etcd reports their
        changes (one watch of the cluster's keys: a change reaches every broker at once
        and nothing is read while nothing changes); while the watch is broken, read them
        every ``ROUTES_POLL_S``. A leader creates here the topics routed to its group that
        it does not know yet."""
        watcher = asyncio.get_running_loop().create_task(self._follow())
        checked = time.monotonic()
        try:
            while True:
                try:
                    if not self.watching:
                        await self.refresh()
                        self.problem = ""
                    elif time.monotonic() - checked >= ROUTES_RECHECK_S:
                        checked = time.monotonic()
                        await self._recheck()
                except (EtcdError, OSError) as exc:
                    self._trouble(exc)
                await asyncio.sleep(ROUTES_POLL_S)
        finally:
            watcher.cancel()

    async def _recheck(self) -> None:
        """A safety net under the watch (a stream that stalls without an error, e.g. a
        connection dropped on the way): read the routes every ``ROUTES_RECHECK_S`` and
        take any newer than the watch delivered."""
        assert self.client is not None
        missed = []
        for topic, route in (await read_routes(self.client, self.cluster)).items():
            known = self.routes.get(topic)
            if known is None or known.version < route.version:
                self.routes[topic] = route
                missed.append(topic)
        if missed:
            self.changes += len(missed)
            log.warning("routes: %d change(s) not delivered by the watch, read instead: %s",
                        len(missed), ", ".join(sorted(missed)[:10]))
            await self._create_missing()
            for topic in missed:
                self.on_change(topic, self.routes.get(topic))

    def state(self) -> dict[str, object]:
        """How the routes are kept: followed by the watch (or polled), the changes applied,
        the routes known, the last problem with etcd."""
        return {"watching": self.watching, "changes": self.changes,
                "topics": len(self.routes), "problem": self.problem}

    def _trouble(self, exc: Exception) -> None:
        if not self.problem:
            log.warning("routes: cannot read them from etcd: %s", exc)
        self.problem = str(exc)

    async def _follow(self) -> None:
        """Read the routes and the directory, then apply the changes etcd reports after
        that revision (a route: decoded; a broker or a group's leader: the directory read
        again); after a broken watch, read again (the polling loop reads meanwhile)."""
        assert self.client is not None
        client, cluster = self.client, self.cluster
        routes_at = routes_prefix(cluster)
        root = routes_at[:-len(b"routes/")]
        members_at = (root + b"brokers/", root + b"groups/")
        while True:
            try:
                routes, revision = await read_routes_at(client, cluster)
                self.directory = await read_directory(client, cluster)
                self.routes, self.loaded, self.watching = routes, True, True
                self.problem = ""
                await self._create_missing()
                async for events in client.watch(root, prefix=True,
                                                 start_revision=revision + 1):
                    if any(ev.kv.key.startswith(members_at) for ev in events):
                        self.directory = await read_directory(client, cluster)
                    changed = apply_events(cluster, self.routes, [
                        ev for ev in events if ev.kv.key.startswith(routes_at)])
                    if not changed:
                        continue
                    self.changes += len(changed)
                    await self._create_missing()
                    for topic in changed:
                        self.on_change(topic, self.routes.get(topic))
            except (EtcdError, OSError) as exc:
                self._trouble(exc)
            except Exception:  # never a silent end: the routes would stay as they were
                log.exception("routes: following etcd failed; reading the routes again")
            self.watching = False
            await asyncio.sleep(ROUTES_POLL_S)

    async def refresh(self) -> None:
        assert self.client is not None
        self.routes = await read_routes(self.client, self.cluster)
        self.directory = await read_directory(self.client, self.cluster)
        self.loaded = True
        await self._create_missing()

    async def _create_missing(self) -> None:
        if not self.is_leader() or self.create_local is None:
            return
        for topic, route in list(self.routes.items()):
            if self._placed_here(topic) and topic not in self.store.topics:
                log.info("routes: topic %s holds queues %s on this group: creating it",
                         topic, route.queues_of(self.group or ""))
                try:
                    await self.create_local(topic, route.queues)
                except (OnceqError, StorageError) as exc:  # (made meanwhile by a request)
                    log.warning("routes: topic %s not created here: %s", topic, exc)


def _serve_after(call: Call, req: Any, handler: Handler, first: Awaitable[Any],
                 verb: str) -> None:
    """Serve ``req`` with ``handler`` once ``first`` (work on the topic's route in etcd)
    is done; an error of either is the request's answer."""

    async def run() -> None:
        try:
            await first
        except (EtcdError, OSError) as exc:
            call.fail(OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                f"the topic's route cannot be {verb} etcd ({exc}): try again")))
            return
        except Exception as exc:  # answered, as the broker answers errors
            call.fail(as_wire_error(exc))
            return
        try:
            reply = handler(call, req)
        except Exception as exc:  # answered, as the broker answers errors
            call.fail(as_wire_error(exc))
            return
        if reply is not None:
            call.answer(reply)

    task = asyncio.get_running_loop().create_task(run())
    _RUNNING.add(task)  # held until done (the loop keeps only a weak reference)
    task.add_done_callback(_RUNNING.discard)


_RUNNING: set[asyncio.Task[None]] = set()

