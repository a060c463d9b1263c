"""The gRPC front end: RocketMQ 5's ``MessagingService`` on the broker's own event loop
(``grpc.aio``), started and stopped by the broker (``Broker.front_ends``) when
``grpc_port`` is set (``onceq broker start --grpc-port N``; docs/rocketmq.md).

With the broker's ``acl`` on, every request must be signed with a RocketMQ access key of
an onceq user and is checked against the user's grants (``auth.py``); with ``tls_cert`` the
port speaks TLS with the broker's certificate (and asks for client certificates of
``tls_client_ca`` when ``tls_client_auth`` is ``required``).

Consumer groups' FIFO mark and maximum of delivery attempts are read from
``rocketmq_groups.json`` in the data directory (``groups.py``).

RPCs onceq does not build yet (transactions, recalls, the offset-based pull of
PullConsumer, lite topics) answer a status ``UNSUPPORTED`` naming
what is missing rather than a bare gRPC error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from ._pb import service_pb2 as sv
from .access_keys import AccessKeys
from .auth import Authenticator
from .bridge import Bridge
from .consume import PopService
from .groups import GroupSettingsFile
from .journal import PopJournal, load_key
from .mapping import Code, status
from .receipt import ReceiptCodec
from .service import MessagingService, guarded

if TYPE_CHECKING:
    from ..broker.broker import Broker

log = logging.getLogger("onceq.rocketmq")

SERVICE = "apache.rocketmq.v2.MessagingService"
HEADROOM = 1024 * 1024  # gRPC message bytes beyond the largest body (properties, framing)
UNBUILT = {
    "EndTransaction": (sv.EndTransactionRequest, sv.EndTransactionResponse,
                       "transactional messages"),
    "RecallMessage": (sv.RecallMessageRequest, sv.RecallMessageResponse,
                      "recalling delayed messages"),
    "UpdateOffset": (sv.UpdateOffsetRequest, sv.UpdateOffsetResponse,
                     "PullConsumer offsets (use onceq's own PullConsumer)"),
    "GetOffset": (sv.GetOffsetRequest, sv.GetOffsetResponse,
                  "PullConsumer offsets (use onceq's own PullConsumer)"),
    "QueryOffset": (sv.QueryOffsetRequest, sv.QueryOffsetResponse,
                    "PullConsumer offsets (use onceq's own PullConsumer)"),
    "SyncLiteSubscription": (sv.SyncLiteSubscriptionRequest,
                             sv.SyncLiteSubscriptionResponse, "lite topics"),
}


def _unary(fn: Callable[[Any, Any], Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
    async def handle(request: Any, context: Any) -> Any:
        return await guarded(resp, fn(request, context))

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=req.FromString,
                                               response_serializer=resp.SerializeToString)


def _unbuilt(svc: MessagingService, resp: Any, what: str) -> Callable[[Any, Any], Any]:
    async def handle(request: Any, context: Any) -> Any:
        if svc.auth is not None:  # signed all the same
            svc.auth.authenticate(dict(context.invocation_metadata() or ()),
                                  context.peer() or "")
        return resp(status=status(Code.UNSUPPORTED, f"{what}: not built yet on onceq's "
                                  "RocketMQ endpoint (docs/rocketmq.md)"))
    return handle


def handlers(svc: MessagingService) -> grpc.GenericRpcHandler:
    methods: dict[str, grpc.RpcMethodHandler] = {
        "QueryRoute": _unary(svc.query_route, sv.QueryRouteRequest, sv.QueryRouteResponse),
        "Heartbeat": _unary(svc.heartbeat, sv.HeartbeatRequest, sv.HeartbeatResponse),
        "SendMessage": _unary(svc.send_message, sv.SendMessageRequest,
                              sv.SendMessageResponse),
        "QueryAssignment": _unary(svc.query_assignment, sv.QueryAssignmentRequest,
                                  sv.QueryAssignmentResponse),
        "AckMessage": _unary(svc.ack_message, sv.AckMessageRequest, sv.AckMessageResponse),
        "ChangeInvisibleDuration": _unary(svc.change_invisible_duration,
                                          sv.ChangeInvisibleDurationRequest,
                                          sv.ChangeInvisibleDurationResponse),
        "ForwardMessageToDeadLetterQueue": _unary(
            svc.forward_message_to_dead_letter_queue,
            sv.ForwardMessageToDeadLetterQueueRequest,
            sv.ForwardMessageToDeadLetterQueueResponse),
        "NotifyClientTermination": _unary(svc.notify_client_termination,
                                          sv.NotifyClientTerminationRequest,
                                          sv.NotifyClientTerminationResponse),
        "ReceiveMessage": grpc.unary_stream_rpc_method_handler(
            svc.receive_message, request_deserializer=sv.ReceiveMessageRequest.FromString,
            response_serializer=sv.ReceiveMessageResponse.SerializeToString),
        "Telemetry": grpc.stream_stream_rpc_method_handler(
            svc.telemetry, request_deserializer=sv.TelemetryCommand.FromString,
            response_serializer=sv.TelemetryCommand.SerializeToString),
    }
    for name, (req, resp, what) in UNBUILT.items():
        methods[name] = _unary(_unbuilt(svc, resp, what), req, resp)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _credentials(broker: Broker) -> grpc.ServerCredentials | None:
    """TLS with the broker's certificate when its client port has one; client certificates
    signed by ``tls_client_ca`` required when ``tls_client_auth`` is ``required`` (the
    user is still the one the requests are signed for)."""
    cfg = broker.config
    if not cfg.tls_cert:
        return None
    with open(cfg.tls_cert, "rb") as f:
        cert = f.read()
    with open(cfg.tls_key or cfg.tls_cert, "rb") as f:
        key = f.read()
    if cfg.tls_client_auth == "required" and cfg.tls_client_ca:
        with open(cfg.tls_client_ca, "rb") as f:
            ca = f.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


class GrpcFrontEnd:
    """RocketMQ 5 clients' port of one broker (``Broker.front_ends``)."""

    name = "rocketmq"

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: grpc.aio.Server | None = None
        self.bridge: Bridge | None = None
        self.service: MessagingService | None = None
        self.journal: PopJournal | None = None
        self.groups: GroupSettingsFile | None = None

    async def start(self, broker: Broker) -> None:
        cfg = broker.config
        self.bridge = bridge = Bridge(broker)
        # receipt handles are signed with the data directory's key and acknowledgements
        # above the committed offsets are journaled: both survive a restart (journal.py)
        data_dir = cfg.store.data_dir
        store = broker.store
        self.journal = journal = PopJournal(data_dir, sync=cfg.store.flush == "sync")
        journal.open(lambda g, t, q: store.get_offset(g, t, q) if t in store.topics else -1)
        self.groups = groups = GroupSettingsFile(data_dir)  # FIFO groups, max attempts
        pop = PopService(bridge, ReceiptCodec(load_key(data_dir)),
                         store_host=f"{cfg.host}:{self.port}", journal=journal,
                         groups=groups.get)
        auth = None
        if cfg.acl:  # requests signed with the access keys of onceq's users (auth.py)
            try:
                auth = Authenticator(broker.security, AccessKeys(data_dir))
            except ValueError as exc:
                raise OSError(f"grpc_port: {exc}") from None
        self.service = MessagingService(cfg, bridge, pop, lambda: self.port, auth=auth)
        limit = cfg.store.max_body + HEADROOM
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not shared
        ])
        server.add_generic_rpc_handlers((handlers(self.service),))
        address = f"[{cfg.host}]:{self.port}" if ":" in cfg.host else f"{cfg.host}:{self.port}"
        creds = _credentials(broker)
        try:
            bound = (server.add_secure_port(address, creds) if creds is not None
                     else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"grpc_port: cannot listen on {address}: {exc}") from None
        if not bound:
            raise OSError(f"grpc_port: cannot listen on {address}")
        self.port = bound
        await server.start()
        self.server = server
        log.info("RocketMQ gRPC endpoint listening on %s:%d%s%s", cfg.host, self.port,
                 " (TLS)" if creds is not None else "",
                 ", requests signed with access keys (acl)" if auth is not None else "")

    async def stop(self) -> None:
        if self.bridge is not None:
            self.bridge.closing = True
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
        if self.journal is not None:
            self.journal.close()
            self.journal = None
