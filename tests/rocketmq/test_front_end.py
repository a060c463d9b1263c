"""The gRPC front end in the broker's lifecycle (in process, with onceq's own generated
messages: the official client is not loaded here), and the ``grpc_port`` setting."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("grpc")

import grpc

from onceq.broker.config import BrokerConfig
from onceq.broker.settings import ConfigError, load
from onceq.rocketmq._pb import definition_pb2 as pb
from onceq.rocketmq._pb import service_pb2 as sv
from onceq.rocketmq.server import SERVICE, GrpcFrontEnd
from tests.helpers import free_port, running_broker, small_store


def _stub(port: int, method: str, req_cls, resp_cls):
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return ch, ch.unary_unary(f"/{SERVICE}/{method}",
                              request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)


async def test_front_end_starts_and_stops_with_the_broker(tmp_path):
    port = free_port()
    async with running_broker(str(tmp_path / "d")) as b:
        front = GrpcFrontEnd(port)
        b.front_ends.append(front)
        await front.start(b)
        try:
            ch, route = _stub(port, "QueryRoute", sv.QueryRouteRequest, sv.QueryRouteResponse)
            async with ch:
                md = (("x-mq-client-id", "t1"),)
                res = await route(sv.QueryRouteRequest(topic=pb.Resource(name="none")),
                                  metadata=md, timeout=5)
                assert res.status.code == pb.Code.TOPIC_NOT_FOUND
                assert "onceq topic create none" in res.status.message
                res = await route(sv.QueryRouteRequest(topic=pb.Resource(name="none")),
                                  timeout=5)
                assert res.status.code == pb.Code.CLIENT_ID_REQUIRED
        finally:
            await front.stop()
            b.front_ends.clear()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


async def test_a_port_in_use_fails_the_start_and_leaves_nothing_open(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        from onceq.broker.broker import Broker

        b = Broker(BrokerConfig(small_store(str(tmp_path / "d")), port=0))
        b.front_ends.append(GrpcFrontEnd(port))
        with pytest.raises(OSError, match="grpc_port"):
            await b.start()
        assert b._closing  # stopped: store closed, tasks ended


def test_grpc_port_setting(tmp_path):
    env = {"ONCEQ_DATA_DIR": str(tmp_path)}
    assert load(environ=env).broker.grpc_port == 0  # off by default
    assert load(environ={**env, "ONCEQ_GRPC_PORT": "8081"}).broker.grpc_port == 8081
    # with acl on the requests are signed with access keys (test_auth.py)
    assert load(environ={**env, "ONCEQ_GRPC_PORT": "8081", "ONCEQ_ACL": "true"}).broker.acl
    for bad, why in (({"ONCEQ_GRPC_PORT": "70000"}, "<= 65535"),
                     ({"ONCEQ_GRPC_PORT": "9876"}, "also the broker's port")):
        with pytest.raises(ConfigError, match=why):
            load(environ={**env, **bad})
