"""The ``apache.rocketmq.v2.MessagingService`` RPCs onceq answers, each through the
broker's services with onceq's typed requests (``bridge.py``).

* ``QueryRoute``: the topic (``GET_TOPIC``: created on first use when
  ``auto_create_topics`` is on) as message queues of one broker, id 0, at the endpoint the
  client reached; ``Heartbeat`` and ``Telemetry`` settings: a consumer is a member of its
  group (``HEARTBEAT``, ``UNREGISTER`` at ``NotifyClientTermination``);
* ``SendMessage``: one ``SEND`` (the messages as onceq message parts, their message ids
  as unique keys) to the topic's next queue, round robin; a FIFO message to the queue its
  message group hashes to (``mapping.queue_of``, as onceq's ``sharding_key``);
* ``ReceiveMessage``, ``AckMessage``, ``ChangeInvisibleDuration``: POP consumption for
  SimpleConsumers (``consume.py``); for PushConsumers (``auto_renew`` receives), receives
  of the queues ``QueryAssignment`` gave them by onceq's allocation, under the access lock
  (``assign.py``); ``ForwardMessageToDeadLetterQueue``: to ``%DLQ%<group>``, acknowledged.
  A group's FIFO mark and maximum of delivery attempts (``groups.py``) go to its
  consumers in their ``Settings`` (``subscription.fifo``, ``backoff_policy``).

With acl on, each RPC is authenticated by its signature and authorized as the onceq
requests it stands for (``_client``, ``auth.py``); a client id belongs to one user.

Errors are statuses with RocketMQ's codes (``mapping.status_of``), never gRPC errors.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..log.delay import is_delayed
from ..protocol.errors import OnceqError
from ..protocol.replies import SendReply, TopicInfo
from ..protocol.requests import (
    CLUSTERING,
    CommitOffset,
    GetTopic,
    GroupBeat,
    Heartbeat,
    Pull,
    Send,
    SendBack,
    Unregister,
)
from ..protocol.schema import Message
from ._pb import definition_pb2 as pb
from ._pb import service_pb2 as sv
from .assign import AUTO_RENEW_S, PUSH, QueueConsumers
from .auth import Authenticator, Identity, peer_address
from .bridge import Bridge, FrontConnection
from .consume import PopService, Receive, check_invisible
from .mapping import (
    Code,
    RmqError,
    endpoints,
    parse_filter,
    queue_of,
    route,
    status,
    status_of,
    to_send,
)

if TYPE_CHECKING:
    from ..broker.config import BrokerConfig

log = logging.getLogger("onceq.rocketmq")

DEFAULT_INVISIBLE_S = 60.0  # a PushConsumer's receive names none
DEFAULT_WAIT_S = 20.0  # a receive without a long polling timeout
DEADLINE_MARGIN_S = 1.0  # a long poll answers this long before the client's deadline
STREAM_GRACE_S = 3.0  # a client without a Telemetry stream this long after its last left
_U32 = struct.Struct("<I")
R = TypeVar("R")


@dataclass(slots=True)
class Client:
    """A RocketMQ client (its ``x-mq-client-id``) as the front end knows it."""

    client_id: str
    conn: FrontConnection
    client_type: int = pb.CLIENT_TYPE_UNSPECIFIED
    group: str = ""
    subs: dict[str, str] = field(default_factory=dict)  # topic -> tag expression
    seen: float = 0.0
    streams: int = 0  # Telemetry streams open
    user: str | None = None  # with acl on: the user its requests are signed for

    @property
    def push(self) -> bool:
        return self.client_type == pb.PUSH_CONSUMER


def _metadata(context: Any) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _seconds(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


class MessagingService:
    def __init__(self, config: BrokerConfig, bridge: Bridge, pop: PopService,
                 port: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 auth: Authenticator | None = None) -> None:
        self.config = config
        self.auth = auth  # with acl on: every request is signed and checked (auth.py)
        self.bridge = bridge
        self.pop = pop
        self.queues = QueueConsumers(pop, bridge.broker.groups, clock)
        self.port = port
        self.clock = clock
        self.clients: dict[str, Client] = {}
        self.conn = FrontConnection("rocketmq")  # requests of no client in particular
        self._next_queue: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- clients
    def _client(self, context: Any, rpc: str, *needs: Message) -> Client:
        """The client of a request, once the request is authenticated and ``needs`` (the
        onceq requests standing for ``rpc``) are authorized (with acl on: ``auth.py``)."""
        md = _metadata(context)
        who = None
        if self.auth is not None:
            who = self.auth.authenticate(md, context.peer() or "")
            self.auth.authorize(who, rpc, needs)
        user = who.user if who is not None else None
        cid = md.get("x-mq-client-id", "")
        if not 1 <= len(cid) <= 255:
            raise RmqError(Code.CLIENT_ID_REQUIRED, "the x-mq-client-id header (1-255 "
                           "characters) is required")
        c = self.clients.get(cid)
        if c is None:
            c = self.clients[cid] = Client(cid, FrontConnection(context.peer() or "grpc"),
                                           user=user)
            if self.auth is not None and who is not None:
                self.auth.security.audit.record(
                    "login", user=user, source=who.source,
                    reason=f"rocketmq client {cid}, access key {who.access_key}")
        elif c.user != user:
            raise RmqError(Code.FORBIDDEN, f"client id {cid} is in use by another user of "
                           "this onceq broker: each client has an id of its own")
        c.seen = self.clock()
        return c

    def _sweep(self) -> None:
        """Forget clients silent for longer than a member's expiry."""
        limit = self.clock() - self.config.heartbeat_expiry_s
        for cid in [cid for cid, c in self.clients.items() if c.seen < limit]:
            self.clients.pop(cid).conn.close()
            self._spawn(self.queues.gone(cid))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _join(self, c: Client) -> None:
        """The consumer is a member of its group (onceq's member registry)."""
        if not c.group or c.client_type == pb.PRODUCER:
            return
        # a PushConsumer holds queues: the access lock applies to it; a SimpleConsumer
        # holds none (POP consumption)
        beat = GroupBeat(c.group, dict(c.subs), CLUSTERING,
                         {"rocketmq": pb.ClientType.Name(c.client_type),
                          "access_lock": c.push})
        await self.bridge.call(c.conn, Heartbeat(c.client_id, [beat]))

    async def _member(self, c: Client, group: str, topic: str, expr: str = "*") -> None:
        """A PushConsumer asking for ``topic`` is a member subscribed to it (also when
        its settings were sent before a broker restart)."""
        c.group = c.group or group
        m = self.bridge.broker.groups.member(group, c.client_id)
        if topic not in c.subs or m is None or topic not in m.subscriptions:
            c.subs.setdefault(topic, expr)
            await self._join(c)

    def _group_of_onceq(self, group: str, push: bool | None = None) -> None:
        """A group is consumed by onceq's own consumers or by RocketMQ clients, not both:
        their offsets would move under each other; and by PushConsumers (queues held
        under the access lock) or by SimpleConsumers (POP), not both."""
        members = self.bridge.broker.groups.members(group)
        others = [m.client_id for m in members if not m.meta.get("rocketmq")]
        if others:
            raise RmqError(Code.ILLEGAL_CONSUMER_GROUP, f"group {group} has onceq consumers "
                           f"({', '.join(others[:3])}): a group is consumed either by "
                           "onceq's own consumers or by RocketMQ clients")
        if push is None:
            return
        kinds = ({m.meta.get("rocketmq") for m in members}
                 - {None, "PRODUCER", "CLIENT_TYPE_UNSPECIFIED"})
        mixed = kinds - {PUSH} if push else kinds & {PUSH}
        if mixed:
            raise RmqError(Code.ILLEGAL_CONSUMER_GROUP, f"group {group} is consumed by "
                           f"{' and '.join(sorted(str(k) for k in mixed))} members: a group "
                           "is consumed either by PushConsumers or by SimpleConsumers")

    # ---------------------------------------------------------------- routes, members
    async def _topic(self, topic: str) -> int:
        try:
            info = await self.bridge.call(self.conn, GetTopic(topic))
        except OnceqError as exc:
            code, message = status_of(exc)
            if code == Code.TOPIC_NOT_FOUND:
                message = (f"topic {topic!r} does not exist on this onceq broker: create it "
                           f"(onceq topic create {topic}) or turn auto_create_topics on")
            raise RmqError(code, message) from None
        assert isinstance(info, TopicInfo)
        return info.queues

    async def query_route(self, req: sv.QueryRouteRequest, context: Any
                          ) -> sv.QueryRouteResponse:
        topic = req.topic.name
        self._client(context, "QueryRoute", GetTopic(topic))
        queues = await self._topic(topic)
        given = list(req.endpoints.addresses)
        where = (req.endpoints if given else endpoints(self.config.host, self.port()))
        out = sv.QueryRouteResponse(status=status())
        out.message_queues.extend(route(topic, queues, namespace=req.topic.resource_namespace,
                                        broker=self.config.broker_id or "onceq", where=where))
        return out

    async def heartbeat(self, req: sv.HeartbeatRequest, context: Any) -> sv.HeartbeatResponse:
        consumer = req.HasField("group") and req.client_type != pb.PRODUCER
        c = self._client(context, "Heartbeat", *_member_of(req.group.name if consumer else ""))
        c.client_type = req.client_type
        if req.HasField("group"):
            c.group = req.group.name
        await self._join(c)
        self._sweep()
        return sv.HeartbeatResponse(status=status())

    async def notify_client_termination(self, req: sv.NotifyClientTerminationRequest,
                                        context: Any) -> sv.NotifyClientTerminationResponse:
        named = req.group.name if req.HasField("group") else ""
        c = self._client(context, "NotifyClientTermination",
                         *([Unregister(named, "rocketmq")] if named else []))
        group = named or c.group
        await self._gone(c, group)
        return sv.NotifyClientTerminationResponse(status=status())

    async def _gone(self, c: Client, group: str) -> None:
        """The client left: its queues are released, it is a member no more."""
        await self.queues.gone(c.client_id)
        if group and c.client_type != pb.PRODUCER:
            await self.bridge.call(c.conn, Unregister(group, c.client_id))
        self.clients.pop(c.client_id, None)
        c.conn.close()

    async def _stream_ended(self, c: Client) -> None:
        """A Telemetry stream ended: without a new one soon, the client is gone (its
        process ended without ``NotifyClientTermination``): it leaves its group at once,
        as a onceq consumer whose connection closed."""
        await asyncio.sleep(STREAM_GRACE_S)
        if c.streams == 0 and self.clients.get(c.client_id) is c and c.push:
            log.info("rocketmq client %s: Telemetry stream closed, leaving group %s",
                     c.client_id, c.group)
            try:
                await self._gone(c, c.group)
            except OnceqError as exc:
                log.warning("rocketmq client %s: %s", c.client_id, exc)

    async def telemetry(self, requests: AsyncIterator[sv.TelemetryCommand], context: Any
                        ) -> AsyncIterator[sv.TelemetryCommand]:
        """Answer each settings command with the broker's (the clients wait for them)."""
        try:
            c = self._client(context, "Telemetry")
        except RmqError as exc:
            yield sv.TelemetryCommand(status=status(exc.code, exc.message))
            return
        c.streams += 1
        try:
            async for cmd in self._settings_of(c, requests):
                yield cmd
        finally:
            c.streams -= 1
            if c.streams == 0 and not self.bridge.closing:
                self._spawn(self._stream_ended(c))

    async def _settings_of(self, c: Client, requests: AsyncIterator[sv.TelemetryCommand]
                           ) -> AsyncIterator[sv.TelemetryCommand]:
        async for cmd in requests:
            if not cmd.HasField("settings"):
                continue
            s = cmd.settings
            c.client_type = s.client_type
            if s.HasField("subscription"):
                sub = s.subscription
                if self.auth is not None and c.user is not None:
                    try:  # the user may be a member of the group (checked again as used)
                        self.auth.authorize(_identity(c), "Telemetry", _member_of(
                            sub.group.name))
                    except RmqError as exc:
                        yield sv.TelemetryCommand(status=status(exc.code, exc.message))
                        continue
                c.group = sub.group.name
                c.subs = {e.topic.name: e.expression.expression or "*"
                          for e in sub.subscriptions}
                try:
                    await self._join(c)
                except OnceqError as exc:
                    log.warning("rocketmq client %s: %s", c.client_id, exc)
            yield sv.TelemetryCommand(status=status(), settings=self._settings(s, c.group))

    def _settings(self, asked: pb.Settings, group: str = "") -> pb.Settings:
        out = pb.Settings()
        out.CopyFrom(asked)
        if asked.HasField("publishing"):
            out.publishing.max_body_size = self.config.store.max_body
            out.publishing.validate_message_type = True
        if asked.HasField("subscription"):
            gs = self.pop.settings(asked.subscription.group.name or group)
            sub = out.subscription
            sub.fifo = gs.fifo
            # the clients take max_attempts only with a customized back-off (no delays:
            # their own, 1 s)
            out.backoff_policy.Clear()
            out.backoff_policy.max_attempts = gs.max_attempts
            out.backoff_policy.customized_backoff.SetInParent()
            for delay in gs.retry_delays:
                out.backoff_policy.customized_backoff.next.add().FromMilliseconds(
                    int(delay * 1000))
            sub.receive_batch_size = 32
            wait = _seconds(asked.subscription.long_polling_timeout) or DEFAULT_WAIT_S
            sub.long_polling_timeout.FromMilliseconds(
                int(min(wait, self.config.long_poll_max_s) * 1000))
        return out

    # ---------------------------------------------------------------- sends
    async def send_message(self, req: sv.SendMessageRequest, context: Any
                           ) -> sv.SendMessageResponse:
        msgs = list(req.messages)
        out = sv.SendMessageResponse()
        try:
            topic = msgs[0].topic.name if msgs else ""
            self._client(context, "SendMessage",
                         *{m.topic.name: Send(m.topic.name, 0) for m in msgs}.values())
            if not msgs:
                raise RmqError(Code.BAD_REQUEST, "a SendMessage needs at least one message")
            if any(m.topic.name != topic for m in msgs):
                raise RmqError(Code.BAD_REQUEST, "the messages of one SendMessage must be "
                               "for one topic")
            now_ms = int(time.time() * 1000)
            parts, groups = zip(*(to_send(m, now_ms, self.config.timer_max_delay_s)
                                  for m in msgs), strict=True)
            queues = await self._topic(topic)
            n = self._next_queue.get(topic, 0)
            self._next_queue[topic] = n + 1
            targets = [n % queues if g is None else queue_of(g, queues) for g in groups]
            offsets: list[int] = []
            i = 0
            while i < len(parts):  # one SEND per run of messages for one queue
                j = i + 1
                while (j < len(parts) and targets[j] == targets[i]
                       and not is_delayed(parts[i]) and not is_delayed(parts[j])):
                    j += 1  # a delayed message is sent alone
                payload = b"".join(_U32.pack(len(p)) + p for p in parts[i:j])
                reply = await self.bridge.call(self.conn, Send(topic, targets[i], payload))
                assert isinstance(reply, SendReply)
                offsets += reply.offsets
                i = j
        except (RmqError, OnceqError) as exc:
            st = _status_of(exc)
            out.status.CopyFrom(st)
            for m in msgs:
                out.entries.add(status=st, message_id=m.system_properties.message_id)
            return out
        out.status.CopyFrom(status())
        for m, offset in zip(msgs, offsets, strict=True):
            out.entries.add(status=status(), message_id=m.system_properties.message_id,
                            offset=offset)
        return out

    # ---------------------------------------------------------------- consumption
    async def receive_message(self, req: sv.ReceiveMessageRequest, context: Any
                              ) -> AsyncIterator[sv.ReceiveMessageResponse]:
        try:
            group, topic = req.group.name, req.message_queue.topic.name
            c = self._client(context, "ReceiveMessage",
                             Pull(topic, req.message_queue.id, 0, group=group))
            push = req.auto_renew or c.push  # a PushConsumer: queues under the lock
            if push:
                c.client_type = pb.PUSH_CONSUMER
            self._group_of_onceq(group, push)
            queues = await self._topic(topic)
            wait = (_seconds(req.long_polling_timeout) if req.HasField("long_polling_timeout")
                    else DEFAULT_WAIT_S)
            remaining = context.time_remaining()
            if remaining is not None:
                wait = min(wait, remaining - DEADLINE_MARGIN_S)
            invisible = (_seconds(req.invisible_duration) if req.HasField("invisible_duration")
                         else AUTO_RENEW_S if req.auto_renew else DEFAULT_INVISIBLE_S)
            expr = req.filter_expression if req.HasField("filter_expression") else None
            tags = parse_filter(expr)
            c.group = c.group or group
            r = Receive(group, topic, tags,
                        min(max(req.batch_size, 1), self.config.max_pull_msgs), invisible,
                        max(min(wait, self.config.long_poll_max_s), 0.0),
                        req.message_queue.topic.resource_namespace)
            if push:
                await self._member(c, group, topic, (expr.expression if expr else "") or "*")
                msgs = await self.queues.receive(r, c.client_id, req.message_queue.id,
                                                 queues)
            else:
                msgs = await self.pop.receive(r)
        except (RmqError, OnceqError) as exc:
            yield sv.ReceiveMessageResponse(status=_status_of(exc))
            return
        except Exception as exc:
            log.exception("rocketmq ReceiveMessage failed")
            yield sv.ReceiveMessageResponse(status=status(Code.INTERNAL_SERVER_ERROR,
                                                          f"internal: {exc}"))
            return
        if not msgs:
            yield sv.ReceiveMessageResponse(status=status(Code.MESSAGE_NOT_FOUND,
                                                          "no new message"))
            return
        yield sv.ReceiveMessageResponse(status=status())
        ts = sv.ReceiveMessageResponse()
        ts.delivery_timestamp.GetCurrentTime()
        yield ts
        for m in msgs:
            yield sv.ReceiveMessageResponse(message=m)

    async def ack_message(self, req: sv.AckMessageRequest, context: Any
                          ) -> sv.AckMessageResponse:
        c = self._client(context, "AckMessage",
                         CommitOffset(req.group.name, req.topic.name, 0, 0))
        out = sv.AckMessageResponse()
        failed = 0
        for e in req.entries:
            try:
                if c.push:
                    await self.queues.ack(c.client_id, req.group.name, req.topic.name,
                                          e.receipt_handle)
                else:
                    await self.pop.ack(req.group.name, req.topic.name, e.receipt_handle)
                st = status()
            except (RmqError, OnceqError) as exc:
                st = _status_of(exc)
                failed += 1
            out.entries.add(message_id=e.message_id, receipt_handle=e.receipt_handle,
                            status=st)
        if failed and failed == len(req.entries):
            out.status.CopyFrom(out.entries[0].status)
        elif failed:
            out.status.CopyFrom(status(Code.MULTIPLE_RESULTS, f"{failed} of "
                                       f"{len(req.entries)} acknowledgements failed"))
        else:
            out.status.CopyFrom(status())
        return out

    async def change_invisible_duration(self, req: sv.ChangeInvisibleDurationRequest,
                                        context: Any) -> sv.ChangeInvisibleDurationResponse:
        c = self._client(context, "ChangeInvisibleDuration",
                         CommitOffset(req.group.name, req.topic.name, 0, 0))
        seconds = _seconds(req.invisible_duration)
        if c.push:
            handle = self.queues.change(c.client_id, req.group.name, req.topic.name,
                                        req.receipt_handle, check_invisible(seconds))
        else:
            handle = self.pop.change(req.group.name, req.topic.name, req.receipt_handle,
                                     seconds)
        return sv.ChangeInvisibleDurationResponse(status=status(), receipt_handle=handle)

    async def forward_message_to_dead_letter_queue(
            self, req: sv.ForwardMessageToDeadLetterQueueRequest, context: Any
    ) -> sv.ForwardMessageToDeadLetterQueueResponse:
        """The consumer gave up on a message (a FIFO PushConsumer after its local
        retries): it goes to the group's dead-letter queue and counts as acknowledged."""
        group, topic = req.group.name, req.topic.name
        c = self._client(context, "ForwardMessageToDeadLetterQueue",
                         SendBack(group, topic, 0, 0),
                         CommitOffset(group, topic, 0, 0))
        limit = req.max_delivery_attempts or self.pop.settings(group).max_attempts
        if c.push:
            await self.queues.forward(c.client_id, group, topic, req.receipt_handle,
                                      req.delivery_attempt, limit)
        else:
            await self.pop.forward_pop(group, topic, req.receipt_handle,
                                       req.delivery_attempt, limit)
        return sv.ForwardMessageToDeadLetterQueueResponse(status=status())

    async def query_assignment(self, req: sv.QueryAssignmentRequest, context: Any
                               ) -> sv.QueryAssignmentResponse:
        """The asking PushConsumer's share of the topic's queues by onceq's allocation
        (``assign.py``); it receives from those only, under the access lock."""
        group, topic = req.group.name, req.topic.name
        c = self._client(context, "QueryAssignment", Pull(topic, 0, 0, group=group))
        c.client_type = pb.PUSH_CONSUMER
        self._group_of_onceq(group, True)
        queues = await self._topic(topic)
        await self._member(c, group, topic)
        await self.queues.release_revoked(group, topic, queues)
        mine = set(self.queues.assigned(group, topic, queues, c.client_id))
        given = list(req.endpoints.addresses)
        where = req.endpoints if given else endpoints(self.config.host, self.port())
        out = sv.QueryAssignmentResponse(status=status())
        for mq in route(topic, queues, namespace=req.topic.resource_namespace,
                        broker=self.config.broker_id or "onceq", where=where):
            if mq.id in mine:
                out.assignments.add().message_queue.CopyFrom(mq)
        return out


def _member_of(group: str) -> list[Message]:
    """The onceq request a consumer of ``group`` stands for (none without a group)."""
    return [Heartbeat("rocketmq", [GroupBeat(group, {})])] if group else []


def _identity(c: Client) -> Identity:
    assert c.user is not None
    return Identity(c.user, peer_address(c.conn.peer), "")


def _status_of(exc: RmqError | OnceqError) -> pb.Status:
    if isinstance(exc, RmqError):
        return status(exc.code, exc.message)
    return status(*status_of(exc))


async def guarded(kind: type[R], coro: Awaitable[R]) -> R:
    """The response of a unary RPC, or one of ``kind`` with the status of its error (an
    unexpected one is logged and answered INTERNAL_SERVER_ERROR)."""
    try:
        return await coro
    except (RmqError, OnceqError) as exc:
        return kind(status=_status_of(exc))  # type: ignore[call-arg]
    except Exception as exc:
        log.exception("rocketmq %s failed", kind.__name__)
        return kind(status=status(Code.INTERNAL_SERVER_ERROR,  # type: ignore[call-arg]
                                  f"internal: {exc}"))
