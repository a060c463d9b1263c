"""Bad input over raw sockets: the broker answers with stable error codes, closes only
connections whose byte stream cannot be framed, keeps serving others and loses no data."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import zlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq import Admin, ErrorCode, Message, OnceqError, Producer, PullConsumer, PullStatus
from onceq.log.batch import encode_batch
from onceq.log.record import encode_part
from onceq.log.sequence import SEQUENCED
from onceq.protocol.codes import RequestCode
from onceq.protocol.frame import (
    PREFIX,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    PUSH,
    REQUEST,
    RESPONSE,
    FrameDecoder,
    decode_header,
    encode_frame,
)
from tests.helpers import running_broker, wait_until

_U32 = struct.Struct("<I")
KEEP = "keep"  # topic with data that must survive every bad input


# ================================================================ raw client
class Raw:
    """A bare asyncio stream speaking frames by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(1 << 30)
        self.frames: list[tuple[int, int, int, int, bytes, bytes]] = []
        self.pushes: list[tuple[int, int, int, int, bytes, bytes]] = []

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_frame(self, timeout: float = 2.0) -> tuple[int, int, dict[str, Any], bytes]:
        """Next frame as (kind, code, corr_id, header, payload); EOFError when closed."""
        while not self.frames:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                raise EOFError
            self.decoder.feed(data)
            self.frames.extend(self.decoder.frames())
            self.pushes += [f for f in self.frames if f[1] == PUSH]
            self.frames = [f for f in self.frames if f[1] != PUSH]
        _v, kind, code, corr, header, payload = self.frames.pop(0)
        assert kind == RESPONSE
        return code, corr, decode_header(header), payload

    async def request(self, code: int, header: dict[str, Any] | None = None,
                      payload: bytes = b"", corr: int = 1) -> tuple[int, dict[str, Any], bytes]:
        await self.write(encode_frame(REQUEST, code, corr, header, payload))
        rcode, rcorr, hdr, body = await self.read_frame()
        assert rcorr == corr
        return rcode, hdr, body

    async def expect_closed(self, timeout: float = 2.0) -> list[int]:
        """Read until the broker closes the connection; return the codes answered meanwhile."""
        codes = []
        while True:
            try:
                code, _corr, _hdr, _p = await self.read_frame(timeout)
            except (EOFError, ConnectionResetError):
                return codes
            codes.append(code)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def raw_frame(length: int, version: int = PROTOCOL_VERSION, kind: int = REQUEST,
              code: int = RequestCode.PING, corr: int = 1, hlen: int = 0, rest: bytes = b""
              ) -> bytes:
    return PREFIX.pack(length, version, kind, code, corr, hlen) + rest


def frame_with_raw_header(code: int, header: bytes, payload: bytes = b"", corr: int = 1
                          ) -> bytes:
    length = PREFIX_SIZE - 4 + len(header) + len(payload)
    return raw_frame(length, code=code, corr=corr, hlen=len(header), rest=header + payload)


def batch(*parts: bytes) -> bytes:
    return b"".join(_U32.pack(len(p)) + p for p in parts)


def part(body: bytes = b"x", uk: str = "K", **kw: Any) -> bytes:
    return encode_part(body, uk, 1_700_000_000_000, **kw)


# ================================================================ fixtures / checks
@pytest.fixture
async def seeded(broker, addr):
    """Topic KEEP with a few messages; returns what must be read back unchanged."""
    async with Admin(addr) as admin:
        await admin.create_topic(KEEP, 2)
    async with Producer(addr) as p:
        sent = await p.send_batch(KEEP, [Message(f"keep-{i}".encode(), tags="k",
                                                 properties={"i": str(i)}) for i in range(5)],
                                  queue=0)
        sent.append(await p.send(KEEP, b"keep-q1", queue=1))
    return [(r.queue_id, r.offset, r.unique_key) for r in sent]


async def assert_healthy(addr: str, seeded: list[tuple[int, int, str]]) -> None:
    """Another connection is served and the stored data is intact (and nothing was added)."""
    async with Admin(addr) as admin:
        await admin.ping()
        assert await admin.topic_offsets(KEEP) == [(0, 5), (0, 1)]
    async with PullConsumer(addr, "checker") as c:
        got = []
        for q in (0, 1):
            r = await c.pull(KEEP, q, 0, 100)
            assert r.status == PullStatus.FOUND
            got += [(m.queue_id, m.queue_offset, m.unique_key) for m in r.messages]
            if q == 0:
                assert [m.body for m in r.messages] == [f"keep-{i}".encode() for i in range(5)]
                assert [m.properties for m in r.messages] == [{"i": str(i)} for i in range(5)]
    assert got == seeded


# ================================================================ error codes
def test_error_codes_are_stable():
    assert {e.name: int(e) for e in ErrorCode} == {
        "OK": 0, "SYSTEM_ERROR": 1, "BAD_REQUEST": 2, "UNKNOWN_REQUEST": 3,
        "FRAME_TOO_LARGE": 4, "UNSUPPORTED_VERSION": 5, "TOPIC_NOT_EXIST": 10,
        "TOPIC_EXISTS": 11, "INVALID_NAME": 12, "INVALID_QUEUE": 13, "MESSAGE_TOO_LARGE": 14,
        "INVALID_ARGUMENT": 15, "GROUP_NOT_EXIST": 16, "NOT_HOLDER": 17, "GROUP_ACTIVE": 18,
        "OFFSET_BEHIND": 19, "MESSAGE_NOT_FOUND": 49,
        "SERVICE_UNAVAILABLE": 30, "SYSTEM_BUSY": 31, "FLUSH_TIMEOUT": 32, "SHUTTING_DOWN": 33,
        "DISK_FULL": 34, "STORAGE_ERROR": 35, "TOO_MANY_CONNECTIONS": 36,
        "NOT_LEADER": 37, "NOT_ENOUGH_REPLICAS": 38, "STALE_EPOCH": 39,
        "OUT_OF_ORDER_SEQUENCE": 40, "INVALID_SEQUENCE": 41,
        "NOT_MEMBER": 43, "TOO_MANY_GROUPS": 44, "CLIENT_ID_IN_USE": 45, "WRITER_IN_USE": 46,
        "UNAUTHENTICATED": 50, "AUTH_FAILED": 51, "ACCESS_DENIED": 52, "USER_NOT_EXIST": 53,
        "USER_EXISTS": 54, "REQUEST_TIMEOUT": 55, "QUEUE_FULL": 56, "WRONG_GROUP": 57,
        "QUEUE_MOVING": 58,
    }


# ================================================================ broken streams
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=300))
async def test_random_garbage(broker, addr, seeded, garbage):
    raw = await Raw.open(broker.port)
    try:
        await raw.write(garbage)
        raw.writer.write_eof()  # no more bytes: the broker must close its side
        codes = await raw.expect_closed()
    finally:
        await raw.close()
    # whatever it answered carries a known code
    for code in codes:
        ErrorCode(code)
    if len(garbage) >= PREFIX_SIZE and garbage[4] != PROTOCOL_VERSION:
        assert codes[:1] == [ErrorCode.UNSUPPORTED_VERSION]
    await assert_healthy(addr, seeded)


async def test_wrong_version(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    await raw.write(raw_frame(12, version=PROTOCOL_VERSION + 1, corr=77))
    code, corr, hdr, _ = await raw.read_frame()
    assert (code, corr) == (ErrorCode.UNSUPPORTED_VERSION, 77)
    assert "version" in hdr["message"]
    assert await raw.expect_closed() == []
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_oversized_length_prefix(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    await raw.write(raw_frame(0x7FFFFFFF, code=RequestCode.SEND, corr=5))
    code, corr, hdr, _ = await raw.read_frame()
    assert (code, corr) == (ErrorCode.FRAME_TOO_LARGE, 5)
    assert "exceeds" in hdr["message"]
    assert await raw.expect_closed() == []
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_malformed_prefix(broker, addr, seeded):
    for bad in (raw_frame(12, kind=9),  # unknown frame kind
                raw_frame(20, hlen=100, rest=b"\x00" * 8),  # header longer than the frame
                raw_frame(3)):  # length shorter than the prefix
        raw = await Raw.open(broker.port)
        await raw.write(bad)
        code, _corr, _hdr, _ = await raw.read_frame()
        assert code == ErrorCode.BAD_REQUEST
        assert await raw.expect_closed() == []
        await raw.close()
    await assert_healthy(addr, seeded)


async def test_truncated_frame_then_close(broker, addr, seeded):
    good = encode_frame(REQUEST, RequestCode.SEND, 1, {"topic": KEEP, "queue": 0},
                        batch(part(b"never stored")))
    for cut in (3, PREFIX_SIZE - 1, PREFIX_SIZE + 4, len(good) - 1):
        raw = await Raw.open(broker.port)
        await raw.write(good[:cut])
        await raw.close()
    # a frame announcing more than arrives, then EOF from the client
    raw = await Raw.open(broker.port)
    await raw.write(raw_frame(1000, code=RequestCode.SEND, rest=b"\x00" * 50))
    raw.writer.write_eof()
    assert await raw.expect_closed() == []
    await raw.close()
    await asyncio.sleep(0.05)
    await assert_healthy(addr, seeded)


async def test_frames_split_byte_by_byte_and_pipelined(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    data = b"".join(encode_frame(REQUEST, RequestCode.PING, i) for i in range(1, 4))
    for i in range(len(data)):
        raw.writer.write(data[i:i + 1])
    await raw.writer.drain()
    for i in range(1, 4):
        code, corr, hdr, _ = await raw.read_frame()
        assert (code, corr) == (0, i) and "time" in hdr
    await raw.close()
    await assert_healthy(addr, seeded)


# ================================================================ bad requests, connection kept
async def test_junk_header_gets_bad_request_and_connection_stays_usable(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    for junk in (b"\xc1\xc1\xc1",  # never-used msgpack byte
                 b"\x93\x01\x02\x03",  # a list, not a map
                 b"\x81\xa1",  # truncated map
                 msgpack.packb({"topic": KEEP}) + b"\xff"):  # trailing bytes
        await raw.write(frame_with_raw_header(RequestCode.SEND, junk, batch(part()), corr=9))
        code, corr, hdr, _ = await raw.read_frame()
        assert (code, corr) == (ErrorCode.BAD_REQUEST, 9), junk
        assert hdr["message"]
    code, hdr, _ = await raw.request(RequestCode.PING, corr=10)
    assert code == 0
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_a_reply_that_cannot_be_encoded_is_an_error_answer(broker, addr, seeded):
    """A reply is encoded inside the request's error handling: one that cannot be (a value
    past msgpack's 64 bits) is answered SYSTEM_ERROR, and the connection goes on."""
    from onceq.protocol.replies import Pong
    from onceq.protocol.requests import Ping

    handlers = broker.handlers
    saved = handlers[RequestCode.PING]
    handlers[RequestCode.PING] = (Ping, lambda call, req: Pong(2 ** 70))
    raw = await Raw.open(broker.port)
    try:
        code, hdr, _ = await raw.request(RequestCode.PING, corr=3)
        assert code == ErrorCode.SYSTEM_ERROR and hdr["message"]
    finally:
        handlers[RequestCode.PING] = saved
    code, _, _ = await raw.request(RequestCode.PING, corr=4)
    assert code == 0
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_unknown_request_code(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    for unknown in (0, 2, 999, 0xFFFF):
        code, hdr, _ = await raw.request(unknown, {"topic": KEEP}, corr=unknown + 1)
        assert code == ErrorCode.UNKNOWN_REQUEST
        assert str(unknown) in hdr["message"]
    # a frame of kind RESPONSE or PUSH from a client is ignored, the connection goes on
    await raw.write(encode_frame(RESPONSE, 0, 123, {"x": 1}))
    code, _, _ = await raw.request(RequestCode.PING, corr=500)
    assert code == 0
    await raw.close()
    await assert_healthy(addr, seeded)


BAD_FIELDS: list[tuple[int, dict[str, Any], ErrorCode]] = [
    (RequestCode.SEND, {"queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": KEEP}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": KEEP, "queue": "0"}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": KEEP, "queue": True}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": KEEP, "queue": 0.0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": 5, "queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": KEEP.encode(), "queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND, {"topic": None, "queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND_SEQUENCED, {"queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEND_SEQUENCED, {"topic": KEEP, "queue": 0}, ErrorCode.INVALID_SEQUENCE),
    (RequestCode.SEND_SEQUENCED, {"topic": KEEP, "queue": 0, "writer": "w", "epoch": "0",
                                  "seq": 0}, ErrorCode.INVALID_SEQUENCE),
    (RequestCode.SEND_SEQUENCED, {"topic": KEEP, "queue": 0, "writer": "w", "epoch": 0,
                                  "seq": -1}, ErrorCode.INVALID_SEQUENCE),
    (RequestCode.SEND_SEQUENCED, {"topic": KEEP, "queue": 0, "writer": "w", "epoch": 0,
                                  "seq": 0}, ErrorCode.INVALID_SEQUENCE),  # no marker
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": "0"}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "max": None},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "suspend_ms": "1"},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "tags": "A"},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "tags": [1]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "group": "g", "commit": "1"},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "group": 7, "commit": 1},
     ErrorCode.INVALID_ARGUMENT),  # a group must be a string
    (RequestCode.QUERY_OFFSETS, {"topic": KEEP}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.SEARCH_OFFSET, {"topic": KEEP, "queue": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.COMMIT_OFFSET, {"topic": KEEP, "queue": 0, "offset": 1},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.COMMIT_OFFSET, {"group": "g", "topic": KEEP, "queue": 0, "offset": -2},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.COMMIT_OFFSET, {"group": "bad group", "topic": KEEP, "queue": 0, "offset": 1},
     ErrorCode.INVALID_NAME),
    (RequestCode.GET_OFFSET, {"group": "g", "topic": KEEP}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.GET_OFFSET, {"group": "", "topic": KEEP, "queue": 0}, ErrorCode.INVALID_NAME),
    (RequestCode.CREATE_TOPIC, {}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.CREATE_TOPIC, {"topic": "new", "queues": 0}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.CREATE_TOPIC, {"topic": "new", "queues": 5000}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.CREATE_TOPIC, {"topic": "new", "queues": "8"}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.CREATE_TOPIC, {"topic": KEEP, "queues": 1}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.DELETE_TOPIC, {}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.GET_TOPIC, {"topic": ["x"]}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": "G"}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": ["G"]}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"subs": {}}]}, ErrorCode.INVALID_NAME),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"group": "G", "subs": []}]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"group": "G", "model": "NOPE"}]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"group": "G", "subs": {"T": 1}}]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"group": "G", "meta": [1]}]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "", "groups": [{"group": "G"}]},
     ErrorCode.INVALID_ARGUMENT),
    (RequestCode.HEARTBEAT, {"client": "c", "groups": [{"group": "G"}, {"group": "bad name"}]},
     ErrorCode.INVALID_NAME),  # all or nothing: G must not be joined either
    (RequestCode.UNREGISTER, {"group": "G"}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.LIST_GROUP_MEMBERS, {}, ErrorCode.INVALID_ARGUMENT),
    (RequestCode.LIST_GROUP_MEMBERS, {"group": "nobody"}, ErrorCode.GROUP_NOT_EXIST),
]


async def test_missing_and_ill_typed_fields(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    for i, (req, header, expected) in enumerate(BAD_FIELDS, 1):
        payload = batch(part(b"must not be stored", uk=f"BAD{i}"))
        code, hdr, _ = await raw.request(req, header, payload, corr=i)
        assert code == expected, (req, header, hdr)
        assert isinstance(hdr["message"], str) and hdr["message"]
    # an empty header on every request the broker handles is answered, never a crash
    for i, req in enumerate(sorted(broker.handlers), 100):
        code, hdr, _ = await raw.request(req, None, corr=i)
        assert code in (0, ErrorCode.INVALID_ARGUMENT, ErrorCode.INVALID_NAME), (req, hdr)
    code, _, _ = await raw.request(RequestCode.PING, corr=999)
    assert code == 0
    assert raw.pushes == []  # no heartbeat was half applied
    await raw.close()
    assert "new" not in broker.store.topics
    assert not broker.groups.members("G")
    await assert_healthy(addr, seeded)


async def test_extreme_integers(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    big = 2**64 - 1  # msgpack carries it; nothing in onceq is wider than a signed 64 bits
    top = 2**63 - 1
    wide = ErrorCode.INVALID_ARGUMENT
    cases = [
        (RequestCode.SEND, {"topic": KEEP, "queue": big}, wide),
        (RequestCode.SEND, {"topic": KEEP, "queue": top}, ErrorCode.INVALID_QUEUE),
        (RequestCode.SEND, {"topic": KEEP, "queue": -(2**63)}, ErrorCode.INVALID_QUEUE),
        (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": big}, wide),
        (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": top, "max": top,
                            "max_bytes": -1, "suspend_ms": -5}, 0),
        (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": -(2**63)}, 0),
        (RequestCode.SEARCH_OFFSET, {"topic": KEEP, "queue": 0, "ts": big}, wide),
        (RequestCode.SEARCH_OFFSET, {"topic": KEEP, "queue": 0, "ts": top}, 0),
        (RequestCode.SEARCH_OFFSET, {"topic": KEEP, "queue": 0, "ts": -(2**63)}, 0),
        (RequestCode.QUERY_OFFSETS, {"topic": KEEP, "queue": big}, wide),
        # a commit of 2**63 was answered SYSTEM_ERROR yet changed the offset
        (RequestCode.COMMIT_OFFSET, {"group": "G", "topic": KEEP, "queue": 0,
                                     "offset": 2**63}, wide),
        (RequestCode.PULL, {"topic": KEEP, "queue": 0, "offset": 0, "group": "G",
                            "commit": 2**63}, wide),
        (RequestCode.HEARTBEAT, {"client": "x", "groups": [
            {"group": "G", "subs": {KEEP: "*"}, "held": [[KEEP, 0, 2**63]]}]}, wide),
        (RequestCode.HEARTBEAT, {"client": "x", "groups": [
            {"group": "G", "subs": {KEEP: "*"}, "reset_gen": big}]}, 0),
    ]
    for i, (req, header, expected) in enumerate(cases, 1):
        code, hdr, _ = await raw.request(req, header, batch(part(uk=f"X{i}")), corr=i)
        assert code == expected, (header, hdr)
    await raw.close()
    assert broker.store.get_offset("G", KEEP, 0) == -1  # nothing out of range was stored
    await assert_healthy(addr, seeded)


@pytest.mark.parametrize("name", ["", "has space", "x" * 128, "tópico", "a/b", "a\x00b",
                                  "..\x2f..", "new\nline"])
async def test_invalid_topic_names(broker, addr, seeded, name):
    raw = await Raw.open(broker.port)
    requests = [
        (RequestCode.CREATE_TOPIC, {"topic": name, "queues": 1}),
        (RequestCode.SEND, {"topic": name, "queue": 0}),
        (RequestCode.PULL, {"topic": name, "queue": 0, "offset": 0}),
        (RequestCode.GET_TOPIC, {"topic": name}),
        (RequestCode.DELETE_TOPIC, {"topic": name}),
        (RequestCode.QUERY_OFFSETS, {"topic": name, "queue": 0}),
    ]
    for i, (req, header) in enumerate(requests, 1):
        code, hdr, _ = await raw.request(req, header, batch(part()), corr=i)
        assert code == ErrorCode.INVALID_NAME, (req, hdr)
    await raw.close()
    assert list(broker.store.topics) == [KEEP]
    await assert_healthy(addr, seeded)


async def test_longest_valid_topic_name(broker, addr):
    name = "N" * 127
    async with Admin(addr) as admin:
        assert (await admin.create_topic(name, 1))["topic"] == name
    async with Producer(addr) as p:
        r = await p.send(name, b"ok")
    async with PullConsumer(addr, "g") as c:
        (m,) = (await c.pull(name, 0, r.offset)).messages
        assert (m.topic, m.body) == (name, b"ok")


async def test_body_above_max_body(broker, addr, seeded):
    max_body = broker.config.store.max_body
    raw = await Raw.open(broker.port)
    code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": KEEP, "queue": 0},
                                     batch(part(b"b" * (max_body + 1))))
    assert code == ErrorCode.MESSAGE_TOO_LARGE
    assert str(max_body) in hdr["message"]
    # in a batch: the whole batch is refused
    code, _, _ = await raw.request(RequestCode.SEND_BATCH, {"topic": KEEP, "queue": 0},
                                   batch(part(b"ok", uk="A1"), part(b"b" * (max_body + 1),
                                                                    uk="A2")), corr=2)
    assert code == ErrorCode.MESSAGE_TOO_LARGE
    # exactly max_body is fine, on the same connection
    code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": "edge", "queue": 0},
                                     batch(part(b"e" * max_body)), corr=3)
    assert code == ErrorCode.TOPIC_NOT_EXIST
    await raw.close()
    await assert_healthy(addr, seeded)
    async with Admin(addr) as admin:
        await admin.create_topic("edge", 1)
    async with Producer(addr) as p:
        r = await p.send("edge", b"e" * max_body)
    async with PullConsumer(addr, "g") as c:
        (m,) = (await c.pull("edge", 0, r.offset)).messages
        assert len(m.body) == max_body


async def test_malformed_batch_stores_nothing(broker, addr, seeded):
    good = part(b"good", uk="G1")
    broken = bytearray(part(b"broken", uk="G2"))
    broken[-7] ^= 0xFF  # body length no longer matches the part's size
    bad_payloads = [
        batch(good, bytes(broken), part(b"after", uk="G3")),  # malformed part in the middle
        batch(good, part(uk="G4")[:10]),  # part shorter than the minimum
        batch(good) + b"\x01\x02",  # truncated length prefix at the end
        batch(good) + _U32.pack(1000) + b"short",  # part length past the payload
        b"",  # empty batch
        batch(b""),  # zero-length part
        batch(good, part(uk="G5")[:20] + b"\x00"),  # truncated part, junk byte
        batch(good, part(tags="x")[:-1]),  # one byte short
    ]
    raw = await Raw.open(broker.port)
    for i, payload in enumerate(bad_payloads, 1):
        for req in (RequestCode.SEND, RequestCode.SEND_BATCH):
            code, hdr, _ = await raw.request(req, {"topic": KEEP, "queue": 0}, payload, corr=i)
            assert code == ErrorCode.BAD_REQUEST, (i, hdr)
    await raw.close()
    await assert_healthy(addr, seeded)  # queue 0 still ends at offset 5
    # the good part alone is stored fine afterwards (its key was not put in the dedup window)
    async with Producer(addr) as p:
        r = await p.send(KEEP, Message(b"good", unique_key="G1"), queue=0)
    assert not r.duplicate and r.offset == 5


def _poison_parts() -> list[bytes]:
    base = bytearray(part(b"body", uk="PK", tags="tg", keys="kk"))
    bad_uk = bytearray(base)
    bad_uk[13] = 0xFF  # non-ascii unique key
    bad_tags = bytearray(base)
    bad_tags[13 + 2 + 2] = 0xFF  # tags not utf-8
    props_junk = msgpack.packb([1, 2])  # properties not a map
    p = bytearray(part(b"body", uk="PJ"))
    # rebuild the part with a list where the properties map goes
    fixed = bytes(p[:13 + 2])
    junk = (fixed + struct.pack("<H", 0) + struct.pack("<H", 0)
            + _U32.pack(len(props_junk)) + props_junk + _U32.pack(4) + b"body")
    undecodable = (fixed + struct.pack("<H", 0) + struct.pack("<H", 0)
                   + _U32.pack(2) + b"\xc1\xc1" + _U32.pack(4) + b"body")
    return [bytes(bad_uk), bytes(bad_tags), junk, undecodable]


async def test_parts_that_would_poison_consumers_are_refused(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    for i, bad in enumerate(_poison_parts(), 1):
        code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": KEEP, "queue": 1},
                                         batch(bad), corr=i)
        assert code == ErrorCode.BAD_REQUEST, (i, hdr)
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_invalid_queue(broker, addr, seeded):
    raw = await Raw.open(broker.port)
    for i, q in enumerate((2, 99, -1, 1024), 1):
        code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": KEEP, "queue": q},
                                         batch(part(uk=f"Q{i}")), corr=i)
        assert code == ErrorCode.INVALID_QUEUE, hdr
        for req, extra in ((RequestCode.PULL, {"offset": 0}), (RequestCode.QUERY_OFFSETS, {}),
                           (RequestCode.SEARCH_OFFSET, {"ts": 0}),
                           (RequestCode.GET_OFFSET, {"group": "g"}),
                           (RequestCode.COMMIT_OFFSET, {"group": "g", "offset": 0})):
            code, hdr, _ = await raw.request(req, {"topic": KEEP, "queue": q, **extra},
                                             corr=i)
            assert code == ErrorCode.INVALID_QUEUE, (req, hdr)
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_bad_connection_does_not_disturb_a_concurrent_one(broker, addr, seeded):
    """A client in the middle of a long poll is not affected by another connection's
    garbage."""
    async with PullConsumer(addr, "g") as c, Producer(addr) as p:
        pull = asyncio.create_task(c.pull(KEEP, 1, 1, suspend=5))
        await asyncio.sleep(0.05)
        raw = await Raw.open(broker.port)
        await raw.write(b"\xff" * 64)
        assert await raw.expect_closed() == [ErrorCode.UNSUPPORTED_VERSION]
        await raw.close()
        r = await p.send(KEEP, b"late", queue=1)
        res = await asyncio.wait_for(pull, 2)
        assert [m.body for m in res.messages] == [b"late"]
        assert r.offset == 1


async def test_producer_frame_above_the_limit(broker, addr, seeded):
    """A body far above max_body does not even fit a frame: the broker answers the request
    with FRAME_TOO_LARGE and closes that connection; the producer reports it and can go on
    with a new connection."""
    async with Producer(addr, retries=0) as p:
        with pytest.raises(OnceqError) as ei:
            await p.send(KEEP, b"z" * (broker.config.store.max_body * 3), queue=1)
        assert ei.value.code in (ErrorCode.FRAME_TOO_LARGE, ErrorCode.SERVICE_UNAVAILABLE)
        r = await p.send(KEEP, b"fits", queue=1)  # reconnects
        assert r.offset == 1
    async with PullConsumer(addr, "g") as c:
        assert [m.body for m in (await c.pull(KEEP, 1, 1)).messages] == [b"fits"]


async def test_client_that_does_not_read_its_answers(broker, addr, seeded):
    """Pipelined pulls whose answers are not read: the broker stops dispatching and reading
    that connection near its write high-water mark instead of buffering every answer."""
    big = b"B" * 60_000
    async with Admin(addr) as admin:
        await admin.create_topic("bulk", 1)
    async with Producer(addr) as p:
        for _ in range(20):
            await p.send("bulk", big)
    n = 100  # each answer carries ~1.2 MB: ~120 MB if all were buffered
    raw = await Raw.open(broker.port)
    host, port = raw.writer.get_extra_info("sockname")[:2]
    local = f"{host}:{port}"
    await raw.write(b"".join(
        encode_frame(REQUEST, RequestCode.PULL, i, {"topic": "bulk", "queue": 0, "offset": 0})
        for i in range(1, n + 1)))
    await wait_until(lambda: any(c.peer == local and c.write_paused
                                 for c in broker.connections), 5, "the answers to back up")
    (conn,) = [c for c in broker.connections if c.peer == local]
    assert conn.transport.get_write_buffer_size() < 16 * 1024 * 1024
    assert len(conn._backlog) > n // 2  # waiting for the client to read
    async with Admin(addr) as admin:  # other connections are served meanwhile
        await admin.ping()
    for i in range(1, n + 1):  # reading lets everything through, in order
        code, corr, hdr, payload = await raw.read_frame(5)
        assert (code, corr, hdr["n"]) == (0, i, 20)
        assert len(payload) > 20 * 60_000
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_system_topics_are_written_by_the_broker_only(broker, addr, seeded):
    """No plain send (SEND, SEND_BATCH, SEND_SEQUENCED) writes a system topic: the schedule
    service trusts the due time and target of every ``%SCHEDULE%`` record, the audit
    every ``%TRACE%`` record, a group consumes its ``%RETRY%`` topic. Clients neither
    create nor delete them; pulls stay allowed; nothing is stored."""
    raw = await Raw.open(broker.port)
    broker.retry.ensure_topics()  # %SCHEDULE%
    async with Admin(addr) as admin:
        await admin.group_trace("g", True)  # %TRACE%
    code, hdr, _ = await raw.request(RequestCode.CONSUMER_SEND_BACK, {  # %DLQ%g, %RETRY%g
        "group": "g", "topic": KEEP, "queue": 0, "offset": 0, "delay_level": -1})
    assert code == 0, hdr
    broker.retry.ensure_group_topics("g")
    system = ["%SCHEDULE%", "%TRACE%", "%RETRY%g", "%DLQ%g", "%OFFSETS%"]
    assert all(t in broker.store.topics for t in system[:4])
    before = {t: broker.store.min_max(t, 0) for t in system[:4]}
    corr = 0
    for topic in [*system, "%RETRY%new", "%other"]:
        body = part(properties={"REAL_TOPIC": "%RETRY%g", "REAL_QID": "0",
                                "DELIVER_AT_MS": "not a time"})
        for req, header in (
                (RequestCode.SEND, {"topic": topic, "queue": 0}),
                (RequestCode.SEND_BATCH, {"topic": topic, "queue": 0}),
                (RequestCode.SEND_SEQUENCED, {"topic": topic, "queue": 0, "writer": "w",
                                              "epoch": 0, "seq": 0}),
                (RequestCode.CREATE_TOPIC, {"topic": topic, "queues": 4}),
                (RequestCode.DELETE_TOPIC, {"topic": topic})):
            corr += 1
            code, hdr, _ = await raw.request(req, header, batch(body, body), corr=corr)
            assert code == ErrorCode.INVALID_ARGUMENT, (req, topic, hdr)
            assert topic in hdr["message"], hdr
    assert {t: broker.store.min_max(t, 0) for t in system[:4]} == before
    assert broker.store.topics["%SCHEDULE%"].queues == len(broker.retry.levels)
    assert "%RETRY%new" not in broker.store.topics and "%other" not in broker.store.topics
    # reading them stays allowed; a GET_TOPIC creates no retry topic (the first send-back
    # of the group does)
    code, hdr, _ = await raw.request(RequestCode.PULL, {"topic": "%DLQ%g", "queue": 0,
                                                        "offset": 0}, corr=corr + 1)
    assert (code, hdr["st"]) == (0, PullStatus.FOUND)
    code, hdr, _ = await raw.request(RequestCode.GET_TOPIC, {"topic": "%RETRY%new"},
                                     corr=corr + 2)
    assert code == ErrorCode.TOPIC_NOT_EXIST, hdr
    assert "%RETRY%new" not in broker.store.topics
    await raw.close()
    await assert_healthy(addr, seeded)


async def test_system_topics_are_not_created_on_first_use(tmp_path):
    """With topics created on first use, a send to a missing system topic is refused and a
    GET_TOPIC of one creates nothing."""
    async with running_broker(str(tmp_path / "d"), auto_create_topics=True) as b:
        raw = await Raw.open(b.port)
        code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": "%DLQ%x", "queue": 0},
                                         batch(part()))
        assert code == ErrorCode.INVALID_ARGUMENT, hdr
        code, hdr, _ = await raw.request(RequestCode.GET_TOPIC, {"topic": "%DLQ%x"}, corr=2)
        assert code == ErrorCode.TOPIC_NOT_EXIST, hdr
        code, hdr, _ = await raw.request(RequestCode.SEND, {"topic": "auto", "queue": 0},
                                         batch(part()), corr=3)
        assert code == 0, hdr
        await raw.close()
        assert "%DLQ%x" not in b.store.topics and "auto" in b.store.topics


def _raw_batch(body: bytes, count: int) -> bytes:
    """A record batch header, with a good checksum, before any bytes."""
    tail = bytes([0xB1, 0]) + struct.pack("<H", count) + body
    return _U32.pack(len(tail) + 8) + _U32.pack(zlib.crc32(tail)) + tail


async def test_malformed_record_batches_store_nothing(broker, addr, seeded):
    """SEND_RECORDS: a batch whose checksum, header or any part does not check is refused
    whole, with the code a single message would get."""
    good = part(b"good", uk="R1")
    broken = bytearray(part(b"broken", uk="R2"))
    broken[-7] ^= 0xFF
    ok = encode_batch([good, part(b"two", uk="R3")])
    flipped = bytearray(ok)
    flipped[-1] ^= 1  # the checksum no longer matches
    recount = bytearray(ok)
    recount[10] = 3  # claims 3 messages, with a fresh checksum
    recount[4:8] = _U32.pack(zlib.crc32(bytes(recount[8:])))
    attrs = bytearray(ok)
    attrs[9] = 0x80  # unknown attribute bit, with a fresh checksum
    attrs[4:8] = _U32.pack(zlib.crc32(bytes(attrs[8:])))
    junk_zstd = bytearray(ok)
    junk_zstd[9] = 1  # says zstd, holds plain parts
    junk_zstd[4:8] = _U32.pack(zlib.crc32(bytes(junk_zstd[8:])))
    bad_payloads = [
        b"", b"\x00" * 11, bytes(flipped), bytes(recount), bytes(attrs), bytes(junk_zstd),
        ok + b"\x00", ok[:-1], encode_batch([good, bytes(broken)]),
        _raw_batch(good + part(uk="R4")[:10], 2),  # a part shorter than a fixed header
        *(encode_batch([good, bad]) for bad in _poison_parts()),
    ]
    raw = await Raw.open(broker.port)
    for i, payload in enumerate(bad_payloads, 1):
        code, hdr, _ = await raw.request(RequestCode.SEND_RECORDS, {"topic": KEEP, "queue": 0},
                                         payload, corr=i)
        assert code == ErrorCode.BAD_REQUEST, (i, hdr)
        assert "record batch" in hdr["message"], hdr
    max_body = broker.config.store.max_body
    code, hdr, _ = await raw.request(
        RequestCode.SEND_RECORDS, {"topic": KEEP, "queue": 0},
        encode_batch([good, part(b"b" * (max_body + 1), uk="R5")]), corr=100)
    assert code == ErrorCode.MESSAGE_TOO_LARGE and str(max_body) in hdr["message"]
    code, hdr, _ = await raw.request(
        RequestCode.SEND_RECORDS, {"topic": KEEP, "queue": 0},
        encode_batch([good, part(b"s", uk="R6", flags=SEQUENCED)]), corr=101)
    assert code == ErrorCode.INVALID_SEQUENCE, hdr
    await raw.close()
    await assert_healthy(addr, seeded)
    async with Producer(addr) as p:  # nothing of the refused batches reached the window
        r = await p.send(KEEP, Message(b"good", unique_key="R1"), queue=0)
    assert not r.duplicate and r.offset == 5
