"""The follower's side of log replication: fetch the leader's commit log from this
replica's log end, check and append it verbatim (``storage/replica.py``), keep the
leader's epochs; after a change of leader, first cut the divergent tail.

The steps against one leader (its term's epoch ``E``):

1. ask where this replica's last epoch ends in the leader's log (``REPLICA_EPOCH_END``)
   and cut this log there when it is longer (what is past that point was never
   acknowledged: an acknowledged write is on every in-sync replica, the new leader
   included);
2. fetch from the log end, under epoch ``E``, until the leader changes or the broker stops;
   each fetch acknowledges everything before its position (under ``flush = "sync"`` the
   fetched records are fsynced before the next fetch says so).

A leader with no epoch as old as this replica's log (``-1``) is not followed: the broker
logs why and tries again later (an operator moves the data directory aside).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._credentials import CredentialsError, read_credentials_file
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.frame import REQUEST, RESPONSE, FrameDecoder, decode_header, encode_frame
from ..protocol.replies import REPLY_OF, EpochEnd, ReplicaData
from ..protocol.requests import Authenticate, ReplicaEpochEnd, ReplicaFetch
from ..protocol.schema import Message
from ..protocol.scram import ScramClient, ScramError
from ..storage.errors import StorageError
from ..storage.leader_epochs import LeaderEpochs, epoch_end, merge_from_leader, truncate
from ..storage.replica import ReplicaLog

if TYPE_CHECKING:
    from ..cluster import LeaderRecord
    from ..storage.store import MessageStore
    from .config import BrokerConfig
    from .flush import Flusher

log = logging.getLogger("onceq.broker")


# what the leader answers a follower it does not let in (acl on): said in its status
_REFUSED = (ErrorCode.AUTH_FAILED, ErrorCode.UNAUTHENTICATED, ErrorCode.ACCESS_DENIED)


def replication_login(config: BrokerConfig) -> tuple[str, str] | None:
    """With acl on: the user and password a follower logs in to its leader with
    (``replication_credentials_file``); CredentialsError naming the file."""
    if not config.acl:
        return None
    return read_credentials_file(config.replication_credentials_file)


def replication_tls(config: BrokerConfig) -> ssl.SSLContext | None:
    """When the brokers speak TLS (``tls_cert``): the context a follower connects to its
    leader with, verifying the leader's certificate (``replication_tls_ca``)."""
    if not config.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                     cafile=config.replication_tls_ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class LeaderChannel:
    """One connection to the leader, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame: int) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(max_frame)
        self.corr = 0

    @classmethod
    async def open(cls, address: str, max_frame: int, timeout: float, *,
                   tls: ssl.SSLContext | None = None,
                   login: tuple[str, str] | None = None) -> LeaderChannel:
        """Connect (with ``tls``) and, with ``login`` (user, password), authenticate
        (SCRAM-SHA-256, the server's proof checked) before the channel is handed out."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, int(port), ssl=tls, server_hostname=host if tls else None), timeout)
        channel = cls(reader, writer, max_frame)
        if login is not None:
            try:
                scram = ScramClient(*login)
                first = await channel.call(Authenticate(scram.first()), timeout)
                final = await channel.call(Authenticate(scram.final(first.message)), timeout)
                scram.verify(final.message)
            except ScramError as exc:
                channel.close()
                raise OnceqError(ErrorCode.AUTH_FAILED, f"the leader's answer does not "
                                 f"prove it knows the user: {exc}") from None
            except BaseException:
                channel.close()
                raise
        return channel

    async def call(self, request: Message, timeout: float) -> Any:
        self.corr += 1
        corr = self.corr
        self.writer.write(encode_frame(REQUEST, request.CODE, corr, request.encode(),
                                       getattr(request, "payload", b"")))
        await self.writer.drain()
        return await asyncio.wait_for(self._reply(request.CODE, corr), timeout)

    async def _reply(self, code: int, corr: int) -> Any:
        while True:
            for _v, kind, rcode, rcorr, header, payload in self.decoder.frames():
                if kind != RESPONSE or rcorr != corr:
                    continue
                hdr = decode_header(header)
                if rcode:
                    details = {k: v for k, v in hdr.items() if k != "message"}
                    raise OnceqError(rcode, hdr.get("message"), details)
                return REPLY_OF[code].decode(hdr, payload)
            data = await self.reader.read(1 << 20)
            if not data:
                raise ConnectionError("the leader closed the connection")
            self.decoder.feed(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Follower:
    """Replicates the leader's log into ``store`` while ``run`` runs. ``hw`` is the
    leader's high watermark as last heard (a new leader starts from it)."""

    def __init__(self, config: BrokerConfig, store: MessageStore, replica_log: ReplicaLog,
                 epochs: LeaderEpochs, flusher: Callable[[], Flusher | None],
                 on_append: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.replica_log = replica_log
        self.epochs = epochs
        self.flusher = flusher
        self.on_append = on_append
        self.hw = 0
        self.leader: LeaderRecord | None = None
        self.problem = ""  # why it does not follow now (empty: it does)
        self._sig = ""

    async def run(self, leader: LeaderRecord) -> None:
        """Follow ``leader`` until cancelled (reconnecting after errors)."""
        self.leader = leader
        backoff = 0.1
        while True:
            channel = None
            try:
                channel = await LeaderChannel.open(leader.address, 64 * 1024 * 1024, 5.0,
                                                   tls=replication_tls(self.config),
                                                   login=replication_login(self.config))
                if await self._cut_divergent_tail(channel, leader):
                    self.problem = ""
                    backoff = 0.1
                    await self._fetch_loop(channel, leader)
            except asyncio.CancelledError:
                raise
            except OnceqError as exc:
                level = logging.INFO if exc.code in (ErrorCode.NOT_LEADER,
                                                     ErrorCode.STALE_EPOCH) else logging.WARNING
                if exc.code in _REFUSED:  # the leader will not have this broker replicate
                    self.problem = f"{ErrorCode(exc.code).name}: {exc.message}"
                    backoff = 2.0
                log.log(level, "follower: leader %s at %s: %s", leader.broker_id,
                        leader.address, exc)
            except (OSError, ConnectionError, TimeoutError, ValueError) as exc:
                log.info("follower: leader %s at %s: %s", leader.broker_id, leader.address,
                         exc)
            except CredentialsError as exc:
                self.problem = str(exc)
                log.error("follower: cannot log in to the leader: %s", exc)
                backoff = 2.0
            except StorageError as exc:
                self.problem = exc.message
                log.error("follower: cannot apply the leader's log: %s", exc.message)
                backoff = 2.0
            finally:
                if channel is not None:
                    channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _cut_divergent_tail(self, channel: LeaderChannel, leader: LeaderRecord) -> bool:
        """Step 1; False when this replica must not follow (``problem`` says why)."""
        log_ = self.store.log
        entries = self.epochs.entries
        if not entries:
            if log_.end > log_.start:
                self.problem = ("this replica's log has records but no leader epochs (a "
                                "standalone broker's data directory): it is not followed "
                                "over; move it aside to replicate the group")
                log.error("follower: %s", self.problem)
                await asyncio.sleep(5)
                return False
            return True
        mine = entries[-1][0]
        answer: EpochEnd = await channel.call(
            ReplicaEpochEnd(self.config.group, self.config.broker_id, mine), 5.0)
        if answer.epoch < 0:
            self.problem = (f"the leader {leader.broker_id} has no epoch at or below {mine}, "
                            "this replica's last: not followed")
            log.error("follower: %s", self.problem)
            await asyncio.sleep(5)
            return False
        own_end = epoch_end(entries, answer.epoch, log_.end)[1]
        cut = min(answer.end, own_end) if own_end >= 0 else answer.end
        if cut < log_.end:
            log.warning("follower: epoch %d ends at %d on leader %s; this log ends at %d: "
                        "cutting the divergent tail", answer.epoch, answer.end,
                        leader.broker_id, log_.end)
            self.replica_log.truncate(cut)
            self.epochs.set(truncate(self.epochs.entries, cut))
        return True

    async def _fetch_loop(self, channel: LeaderChannel, leader: LeaderRecord) -> None:
        cfg = self.config
        wait_ms = cfg.replica_fetch_wait_ms
        while True:
            position = self.store.log.end
            req = ReplicaFetch(cfg.group, cfg.broker_id, leader.epoch, position,
                               cfg.replica_fetch_bytes, wait_ms, self._sig)
            data: ReplicaData = await channel.call(req, wait_ms / 1000 + 10)
            if data.topics is not None:
                self.replica_log.sync_topics(data.topics)
                self._sig = data.sig
            if data.payload:
                self.replica_log.append(position, data.payload)
                end = self.store.log.end
                leader_epochs = [(int(e), int(p)) for e, p in data.epochs]
                self.epochs.set(merge_from_leader(self.epochs.entries, leader_epochs, end))
                self.on_append()
                flusher = self.flusher()
                if flusher is not None and flusher.sync_policy:
                    await flusher.flush_now()  # the next fetch acknowledges them
            self.hw = max(self.hw, min(data.hw, self.store.log.end))
