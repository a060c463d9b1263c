"""A small asyncio client for etcd v3 over its JSON gateway (``/v3/...``).

Only what the coordination layer needs: range (one key or a prefix), put (under a lease),
delete, compare-and-swap transactions, lease grant / keep-alive / revoke, and a watch of a
key or a prefix. Keys and values are bytes (base64 on the wire); revisions and lease ids
are ints. Each call tries the endpoints in turn, starting with the last one that answered,
and raises :class:`EtcdUnavailable` (naming every endpoint tried) when none answers.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import _http

DEFAULT_PORT = 2379


class EtcdError(Exception):
    """Any failure of a call to etcd."""

    retriable = False


class EtcdUnavailable(EtcdError):
    """No endpoint answered the call (refused, timed out, cut, or etcd has no leader)."""

    retriable = True

    def __init__(self, path: str, failures: Sequence[tuple[str, str]]) -> None:
        self.path = path
        self.failures = list(failures)
        tried = "; ".join(f"{ep}: {why}" for ep, why in self.failures)
        super().__init__(f"etcd unavailable for {path} ({tried})")


class EtcdRequestError(EtcdError):
    """etcd answered the call with an error (e.g. an unknown lease)."""

    def __init__(self, endpoint: str, path: str, code: int, message: str) -> None:
        self.endpoint, self.path, self.code, self.message = endpoint, path, code, message
        super().__init__(f"etcd at {endpoint} refused {path}: {message} (code {code})")


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"etcd://h1:2379,h2:2379"``, ``"h1,h2:2380"`` or a list of ``host:port``."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        text = item.strip()
        for scheme in ("etcd://", "http://"):
            text = text.removeprefix(scheme)
        text = text.rstrip("/")
        if not text:
            continue
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            host, port = text, str(DEFAULT_PORT)
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError(f"no etcd endpoint in {spec!r}")
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(_unb64(kv.get("key")), _unb64(kv.get("value")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("version", 0)), int(kv.get("lease", 0)))


@dataclass(frozen=True)
class WatchEvent:
    type: Literal["PUT", "DELETE"]
    kv: KeyValue  # for a DELETE: the key and the deletion's revision (mod_revision)


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` ``op`` ``value``."""

    key: bytes
    target: Literal["CREATE", "MOD", "VERSION", "VALUE", "LEASE"]
    op: Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]
    value: int | bytes

    def to_json(self) -> dict[str, Any]:
        field_name = {"CREATE": "create_revision", "MOD": "mod_revision",
                      "VERSION": "version", "VALUE": "value", "LEASE": "lease"}[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.op,
                field_name: value}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def range_op(key: bytes, prefix: bool = False) -> dict[str, Any]:
    req = {"key": _b64(key)}
    if prefix:
        req["range_end"] = _b64(prefix_end(key))
    return {"request_range": req}


def delete_op(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


@dataclass
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the transaction
    ranges: list[list[KeyValue]] = field(default_factory=list)  # one per range op, in order


class EtcdClient:
    """Calls to an etcd cluster through any of its ``endpoints``."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._preferred = 0

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._preferred + i) % n for i in range(n)]

    async def call(self, path: str, body: dict[str, Any], timeout: float | None = None
                   ) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers."""
        url = f"/v3/{path}"
        failures = []
        for i in self._order():
            host, port = self.endpoints[i]
            name = f"{host}:{port}"
            try:
                async with asyncio.timeout(self.timeout if timeout is None else timeout):
                    answer = await _http.post(host, port, url, body)
            except TimeoutError:
                failures.append((name, "timed out"))
            except _http.TransportError as e:
                failures.append((name, str(e)))
            except _http.HttpStatusError as e:
                message = str(e.body.get("message") or e.body.get("error") or e)
                if e.status == 503 or e.body.get("code") == 14:  # gRPC UNAVAILABLE
                    failures.append((name, message))
                    continue
                raise EtcdRequestError(name, url, int(e.body.get("code", 0)), message) from e
            else:
                self._preferred = i
                return answer
        raise EtcdUnavailable(url, failures)

    # ------------------------------------------------------------------ kv
    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store's revision at the read."""
        kvs, revision = await self.range(key)
        return (kvs[0] if kvs else None), revision

    async def range(self, key: bytes, *, prefix: bool = False) -> tuple[list[KeyValue], int]:
        answer = await self.call("kv/range", range_op(key, prefix)["request_range"])
        return ([KeyValue.from_json(kv) for kv in answer.get("kvs", [])],
                int(answer["header"]["revision"]))

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        answer = await self.call("kv/put", put_op(key, value, lease)["request_put"])
        return int(answer["header"]["revision"])

    async def create(self, key: bytes, value: bytes) -> int | None:
        """Put the key only if it does not exist: the revision, None when it existed."""
        result = await self.txn([Compare(key, "VERSION", "EQUAL", 0)], [put_op(key, value)])
        return result.revision if result.succeeded else None

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete the key (or every key under the prefix); the number deleted."""
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        return int((await self.call("kv/deleterange", body)).get("deleted", 0))

    async def txn(self, compare: Sequence[Compare], success: Sequence[dict[str, Any]],
                  failure: Sequence[dict[str, Any]] = ()) -> TxnResult:
        """If every compare holds, run ``success`` (else ``failure``), atomically."""
        answer = await self.call("kv/txn", {"compare": [c.to_json() for c in compare],
                                            "success": list(success),
                                            "failure": list(failure)})
        ranges = [[KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", [])]
                  for r in answer.get("responses", []) if "response_range" in r]
        return TxnResult(bool(answer.get("succeeded", False)),
                         int(answer["header"]["revision"]), ranges)

    # ------------------------------------------------------------------ leases
    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: ``(id, ttl granted in seconds)``."""
        answer = await self.call("lease/grant", {"TTL": str(int(ttl))})
        return int(answer["ID"]), int(answer["TTL"])

    async def lease_keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renew the lease once; the TTL it now has (0: the lease is gone)."""
        answer = await self.call("lease/keepalive", {"ID": str(lease)}, timeout)
        return int(answer.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease: int, timeout: float | None = None) -> None:
        """Revoke the lease (its keys are deleted); an unknown lease is no error."""
        try:
            await self.call("lease/revoke", {"ID": str(lease)}, timeout)
        except EtcdRequestError as e:
            if "not found" not in e.message:
                raise

    # ------------------------------------------------------------------ watch
    async def watch(self, key: bytes, *, prefix: bool = False, start_revision: int = 0
                    ) -> AsyncIterator[list[WatchEvent]]:
        """The changes of the key (or prefix) from ``start_revision`` on, batch by batch.

        Raises :class:`EtcdUnavailable` when the stream cannot be opened or breaks, and
        :class:`EtcdRequestError` when etcd cancels the watch (e.g. the start revision was
        compacted): the caller re-reads and watches again.
        """
        create: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            create["range_end"] = _b64(prefix_end(key))
        if start_revision:
            create["start_revision"] = str(start_revision)
        url = "/v3/watch"
        failures = []
        stream = None
        for i in self._order():
            host, port = self.endpoints[i]
            name = f"{host}:{port}"
            try:
                async with asyncio.timeout(self.timeout):
                    stream = await _http.open_stream(host, port, url,
                                                     {"create_request": create})
                    await stream.next_object()  # the "created" answer
                break
            except (TimeoutError, _http.TransportError, _http.HttpStatusError) as e:
                if stream is not None:
                    stream.close()
                    stream = None
                failures.append((name, "timed out" if isinstance(e, TimeoutError) else str(e)))
        if stream is None:
            raise EtcdUnavailable(url, failures)
        try:
            while True:
                try:
                    item = await stream.next_object()
                except _http.TransportError as e:
                    raise EtcdUnavailable(url, [(name, str(e))]) from e
                result = item.get("result", {})
                if "error" in item or result.get("canceled"):
                    why = (item.get("error", {}).get("message") or result.get("cancel_reason")
                           or f"compacted at {result.get('compact_revision')}")
                    raise EtcdRequestError(name, url, 0, f"watch canceled: {why}")
                events = [WatchEvent("DELETE" if ev.get("type") == "DELETE" else "PUT",
                                     KeyValue.from_json(ev.get("kv", {})))
                          for ev in result.get("events", [])]
                if events:
                    yield events
        finally:
            stream.close()
