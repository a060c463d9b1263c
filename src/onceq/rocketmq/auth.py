"""Who sends a RocketMQ request, and what they may do, when the broker runs with ``acl`` on.

The official RocketMQ 5 clients sign every request (and each Telemetry stream when it
opens) with their ``Credentials(access_key, secret_key)``, in two metadata entries::

    x-mq-date-time: 20260101T120000Z
    authorization:  MQv2-HMAC-SHA1 Credential=<access key>, SignedHeaders=x-mq-date-time,
                    Signature=<hex HMAC-SHA1(secret key, the x-mq-date-time value)>

The pure part (``parse_authorization``, ``parse_date_time``, ``sign``, ``signature_ok``,
``date_time_problem``, ``peer_address``) reads and checks the header; ``Authenticator``
maps the access key to an onceq user (``access_keys.py``) and the request to onceq's own
checks:

* **authentication**: a missing or garbled header, an unknown access key (or one whose
  user is gone), a signature that does not match, a date-time out of the window below, or
  a source or user locked out after failed logins, are refused with ``UNAUTHORIZED``
  (40100). An unknown access key and a wrong signature count as failed logins, as onceq's
  own (``broker/auth_limits.py``: per source, and per user for a wrong signature); the same
  header failing again (a client repeats its signed header for every request of the same
  second) counts once;
* **the date-time window**: the clients write their local wall-clock time with a ``Z``
  (Python's ``datetime.now()``), so the broker cannot tell a client's time zone from a
  skewed clock. It accepts a date-time at most 12 h 15 min before and 14 h 15 min after
  its own UTC clock: the world's time-zone offsets (UTC-12 to UTC+14) and 15 min of clock
  skew. A captured header stops working after that; the signature covers the date-time
  only, as RocketMQ's protocol defines it, so TLS is what keeps a header from being
  captured at all;
* **authorization**: each RPC stands for the onceq requests whose checks it needs
  (``SendMessage``: a ``SEND`` to the topic; ``ReceiveMessage``, ``QueryAssignment``: a
  member's ``PULL``, Sub on topic and group; ``AckMessage``, ``ChangeInvisibleDuration``: a
  ``COMMIT_OFFSET``; ``QueryRoute``: ``GET_TOPIC``; a consumer's ``Heartbeat`` and
  settings: a ``HEARTBEAT`` of its group; ``NotifyClientTermination``: ``UNREGISTER``),
  checked by the broker's own ``Security.authorize`` with the table of ``broker/acl.py``
  (audited as onceq's own requests). A refusal is ``FORBIDDEN`` (40300).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from hashlib import sha1
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

from ..protocol.errors import OnceqError
from ..protocol.schema import Message
from .access_keys import AccessKey, AccessKeys
from .mapping import Code, RmqError

if TYPE_CHECKING:
    from ..broker.security import Security

log = logging.getLogger("onceq.rocketmq")

SCHEME = "MQv2-HMAC-SHA1"
DATE_TIME = "x-mq-date-time"
AUTHORIZATION = "authorization"
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
SKEW_S = 15 * 60  # clock skew allowed beyond the time-zone offsets
ZONE_WEST_S = 12 * 3600  # UTC-12
ZONE_EAST_S = 14 * 3600  # UTC+14
REFRESH_S = 1.0  # the access-key file is looked at again at most this often
MAX_HEADER = 1024
_HEX = re.compile(r"[0-9A-Fa-f]{40}", re.ASCII)
_MAX_RECENT = 4096
HOW = ("sign requests with a RocketMQ access key of an onceq user: Credentials(access_key, "
       "secret_key), made by `onceq user access-key create USER`")


class AuthError(ValueError):
    """A header that cannot be read, and why."""


@dataclass(frozen=True, slots=True)
class Authorization:
    access_key: str
    signed_headers: tuple[str, ...]
    signature: str


def parse_authorization(value: str) -> Authorization:
    """The fields of an ``authorization`` value; ``AuthError`` saying what is wrong."""
    if len(value) > MAX_HEADER:
        raise AuthError(f"longer than {MAX_HEADER} characters")
    scheme, _, rest = value.strip().partition(" ")
    if scheme != SCHEME:
        raise AuthError(f"the scheme is {scheme[:40]!r}, not {SCHEME}")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        name, eq, v = item.strip().partition("=")
        if not eq or not name:
            raise AuthError(f"{item.strip()[:40]!r} is not name=value")
        if name in fields:
            raise AuthError(f"{name} given twice")
        fields[name] = v.strip()
    missing = [n for n in ("Credential", "SignedHeaders", "Signature") if not fields.get(n)]
    if missing:
        raise AuthError(f"no {', '.join(missing)}")
    signed = tuple(h.strip().lower() for h in fields["SignedHeaders"].split(";"))
    if signed != (DATE_TIME,):
        raise AuthError(f"SignedHeaders is {fields['SignedHeaders'][:60]!r}: onceq checks "
                        f"signatures of {DATE_TIME} (what the RocketMQ clients sign)")
    if not _HEX.fullmatch(fields["Signature"]):
        raise AuthError("the Signature is not 40 hex digits (HMAC-SHA1)")
    return Authorization(fields["Credential"], signed, fields["Signature"].lower())


def parse_date_time(value: str) -> float:
    """The ``x-mq-date-time`` value (``20260101T120000Z``) as seconds since the epoch, read
    as UTC; ``AuthError`` for another format."""
    if len(value) != 16:
        raise AuthError(f"{DATE_TIME} {value[:40]!r} is not like 20260101T120000Z")
    try:
        return datetime.strptime(value, DATE_FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise AuthError(f"{DATE_TIME} {value!r} is not like 20260101T120000Z") from None


def sign(secret: str, date_time: str) -> str:
    """The signature the RocketMQ clients send: hex HMAC-SHA1(secret key, date-time)."""
    return hmac.new(secret.encode(), date_time.encode(), sha1).hexdigest()


def signature_ok(secret: str, date_time: str, signature: str) -> bool:
    """Whether ``signature`` (hex, any case) signs ``date_time`` with ``secret``
    (compared in constant time)."""
    return hmac.compare_digest(sign(secret, date_time), signature.lower())


def date_time_problem(signed_at: float, now: float, skew_s: float = SKEW_S) -> str | None:
    """Why a request signed at ``signed_at`` (the client's wall clock read as UTC) is too
    far from ``now`` (the broker's UTC clock), or None when it is inside the window."""
    if signed_at < now - ZONE_WEST_S - skew_s:
        return (f"it is {(now - signed_at) / 3600:.1f} h behind this onceq broker's UTC "
                "clock (at most 12 h 15 min: time zones to UTC-12, 15 min of skew)")
    if signed_at > now + ZONE_EAST_S + skew_s:
        return (f"it is {(signed_at - now) / 3600:.1f} h ahead of this onceq broker's UTC "
                "clock (at most 14 h 15 min: time zones to UTC+14, 15 min of skew)")
    return None


def peer_address(peer: str) -> str | None:
    """The address of a gRPC peer (``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:41234``, also
    percent-encoded), as ACL source conditions and login limits take it; None for
    another kind (a Unix socket)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
        return host or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]") or None
    return None


@dataclass(frozen=True, slots=True)
class Identity:
    """The user a request is signed for; ``user`` and ``source`` as the broker's
    ``Security.authorize`` reads a connection's."""

    user: str
    source: str | None
    access_key: str


class Authenticator:
    """Authentication and authorization of RocketMQ requests on a broker with acl on."""

    def __init__(self, security: Security, keys: AccessKeys,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.security = security
        self.keys = keys
        self.clock = clock
        self.monotonic = monotonic
        self._looked = monotonic()
        self._recent: OrderedDict[tuple[str, str], float] = OrderedDict()  # failed headers
        self._corr = itertools.count(1)

    # ---------------------------------------------------------------- authentication
    def authenticate(self, metadata: Mapping[str, str], peer: str) -> Identity:
        """The user ``metadata`` is signed for; ``RmqError(UNAUTHORIZED)`` otherwise."""
        source = peer_address(peer)
        where = source or peer or "grpc"
        value = metadata.get(AUTHORIZATION)
        if not value:
            self._refused(where, None, "no authorization header")
            raise RmqError(Code.UNAUTHORIZED, "this onceq broker has acl on and the request "
                           f"is not signed: {HOW}")
        try:
            auth = parse_authorization(value)
            date_time = metadata.get(DATE_TIME, "")
            signed_at = parse_date_time(date_time)
        except AuthError as exc:
            self._refused(where, None, f"garbled authorization: {exc}")
            raise RmqError(Code.UNAUTHORIZED, f"the request's signature cannot be read "
                           f"({exc}): {HOW}") from None
        key = self._key(auth.access_key)
        user = key.user if key is not None and self._user_of(key) else None
        wait = self.security.failed.check(where, user)
        if wait is not None:
            self._refused(where, user, "locked out")
            raise RmqError(Code.UNAUTHORIZED, f"too many failed logins: try again in "
                           f"{wait:.0f}s")
        if key is None or user is None:
            self._failed(where, None, value, f"unknown access key {auth.access_key!r}")
            gone = f" (its user {key.user!r} no longer exists)" if key is not None else ""
            raise RmqError(Code.UNAUTHORIZED, f"access key {auth.access_key!r} is not known "
                           f"to this onceq broker{gone}: {HOW}")
        if not signature_ok(key.secret, date_time, auth.signature):
            self._failed(where, user, value, f"bad signature for access key {key.access_key}")
            raise RmqError(Code.UNAUTHORIZED, f"the signature does not match access key "
                           f"{auth.access_key!r}: wrong secret key")
        problem = date_time_problem(signed_at, self.clock())
        if problem is not None:
            self._refused(where, user, f"{DATE_TIME} {date_time}: {problem}")
            raise RmqError(Code.UNAUTHORIZED, f"the request was signed at {date_time}: "
                           f"{problem}; check the client's clock")
        self.security.failed.succeeded(where, user)
        return Identity(user, source, key.access_key)

    def _key(self, access_key: str) -> AccessKey | None:
        """The pair of ``access_key``, the file read again when it changed (at most once a
        second, and for an access key not known yet)."""
        now = self.monotonic()
        key = self.keys.get(access_key)
        if key is None or now - self._looked >= REFRESH_S:
            self._looked = now
            if self.keys.refresh():
                key = self.keys.get(access_key)
            elif self.keys.problem:
                log.error("%s", self.keys.problem)
        return key

    def _user_of(self, key: AccessKey) -> bool:
        """Whether the user the key was made for still exists (not one made again since
        under the same name)."""
        users = self.security.users
        if key.user not in users:
            return False
        return float(users.get(key.user)["created"]) == key.user_created

    def _refused(self, source: str, user: str | None, why: str) -> None:
        self.security.audit.record("login-failed", user=user, source=source,
                                   reason=f"rocketmq: {why}")

    def _failed(self, source: str, user: str | None, header: str, why: str) -> None:
        """A failed login: counted (once per source and header) and audited."""
        now = self.monotonic()
        recent = self._recent
        while recent and next(iter(recent.values())) < now - self.security.failed.window_s:
            recent.popitem(last=False)
        if (source, header) not in recent:
            recent[(source, header)] = now
            while len(recent) > _MAX_RECENT:
                recent.popitem(last=False)
            self.security.failed.failed(source, user)
        self._refused(source, user, why)

    # ---------------------------------------------------------------- authorization
    def authorize(self, who: Identity, rpc: str, requests: tuple[Message, ...]) -> None:
        """``RmqError(FORBIDDEN)`` unless ``who`` may make each of ``requests`` (the onceq
        requests standing for ``rpc``), by the broker's own checks."""
        for request in requests:
            try:
                self.security.authorize(cast(Any, who), request.CODE, next(self._corr),
                                        request)
            except OnceqError as exc:
                raise RmqError(Code.FORBIDDEN, f"{rpc} refused by onceq's ACL: "
                               f"{exc.message}") from None
