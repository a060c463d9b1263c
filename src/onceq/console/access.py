"""How the console reaches the broker: the client API's ``Admin`` with the two reads a
page needs beyond it, and one place that turns every failure into words for the page."""

from __future__ import annotations

from dataclasses import dataclass

from ..client.admin import Admin
from ..client.connection import ConnectionLost
from ..client.security import CredentialsError
from ..log.record import MessageExt, RecordError, decode_records
from ..protocol.codes import PullStatus
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import OffsetReply, PullReply
from ..protocol.requests import Pull, SearchOffset
from .forms import InputError
from .metrics import MetricsError


@dataclass(slots=True)
class QueueRead:
    status: PullStatus
    messages: list[MessageExt]
    next_offset: int
    min_offset: int
    max_offset: int


class ConsoleAdmin(Admin):
    """``Admin`` plus reading a queue outside any group (no offset, lock or trace of a
    group is touched) and finding the offset of a time."""

    async def read_queue(self, topic: str, queue: int, offset: int, max_msgs: int
                         ) -> QueueRead:
        reply: PullReply = await self._call(Pull(topic, queue, offset, max_msgs))
        msgs: list[MessageExt] = []
        if reply.status == PullStatus.FOUND and reply.payload:
            msgs = list(decode_records(reply.payload, True, offset, reply.next))
        return QueueRead(reply.status, msgs, reply.next, reply.min, reply.max)

    async def search_offset(self, topic: str, queue: int, ts_ms: int) -> int:
        """The offset of the first message of the queue stored at or after ``ts_ms``."""
        reply: OffsetReply = await self._call(SearchOffset(topic, queue, ts_ms))
        return int(reply.offset)


# what a page shows instead of its data when one of these is raised
PAGE_ERRORS = (OnceqError, InputError, CredentialsError, MetricsError, RecordError)

_STATUS = {ErrorCode.TOPIC_NOT_EXIST: 404, ErrorCode.GROUP_NOT_EXIST: 404,
           ErrorCode.MESSAGE_NOT_FOUND: 404, ErrorCode.USER_NOT_EXIST: 404,
           ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.INVALID_NAME: 400,
           ErrorCode.INVALID_QUEUE: 400, ErrorCode.BAD_REQUEST: 400,
           ErrorCode.UNAUTHENTICATED: 403, ErrorCode.AUTH_FAILED: 403,
           ErrorCode.ACCESS_DENIED: 403, ErrorCode.GROUP_ACTIVE: 409,
           ErrorCode.TOPIC_EXISTS: 409}


@dataclass(frozen=True, slots=True)
class Problem:
    """A failure as the page tells it: a headline, the detail, an HTTP status."""

    title: str
    detail: str
    status: int
    code: str = ""  # the broker's error code name, when it answered with one


def describe(exc: BaseException, broker: str) -> Problem:
    if isinstance(exc, InputError):
        return Problem("Bad input", str(exc), 400)
    if isinstance(exc, CredentialsError):
        return Problem("Credentials", str(exc), 500)
    if isinstance(exc, MetricsError):
        return Problem("Metrics endpoint", str(exc), 502)
    if isinstance(exc, RecordError):
        return Problem("Unreadable record", f"a stored record does not decode: {exc}", 502)
    if isinstance(exc, ConnectionLost):
        return Problem("Broker unreachable",
                       f"the broker at {broker} cannot be reached: {exc.message}", 502,
                       exc.code.name)
    if isinstance(exc, OnceqError):
        code = exc.code
        detail = f"{code.name}: {exc.message}"
        if code == ErrorCode.UNAUTHENTICATED:
            detail += (" (the broker has ACLs on: start the console with ONCEQ_USER and "
                       "ONCEQ_PASSWORD, or ONCEQ_CREDENTIALS_FILE)")
        elif code == ErrorCode.ACCESS_DENIED:
            detail += " (the console's user has no grant for this: see docs/security.md)"
        elif code == ErrorCode.GROUP_ACTIVE:
            detail += (" (the group has live members: tick 'force' to reset anyway; the "
                       "members drop those queues and read again from the new offsets)")
        title = {404: "Not found", 400: "Refused", 403: "Not allowed",
                 409: "Refused"}.get(_STATUS.get(code, 502), "Broker error")
        return Problem(title, detail, _STATUS.get(code, 502), code.name)
    return Problem("Error", f"{type(exc).__name__}: {exc}", 500)
