"""Delayed messages: the wire marks and the timer's levels (pure functions, standard
library only).

A producer asks for a delivery time by setting the ``DELAYED`` flag in the message part's
u16 flags (``part.py``) and the delivery time, milliseconds since the epoch as a decimal
string, in the ``TIMER_DELIVER_MS`` property (RocketMQ 5's name for it). The broker reads
the flag from the fixed header (one byte per send, no properties decoded) and the property
only of flagged parts. A part with the property but not the flag is an ordinary message:
the property of a delivered message (which keeps it, as the record of its delivery time)
does nothing when that message is sent again.

The timer (``broker/retry.py``) keeps a delayed message in the ``%TIMER%`` topic, whose
queue ``k`` holds messages for ``TIMER_BASE_MS * 2**k`` ms (125 ms, 250 ms, ... 18.2 h).
A message is stored in the queue of the longest level not longer than the time it has
left; when that level has passed, it is delivered if its time has come (or comes within
the shortest level), else moved on to the queue for the time it has left. Every queue
holds messages stored one after the other with one delay, so it is in due-time order
(within the shortest level) and the service only watches its head, as it does for the
retries' delay levels. A message is moved at most about ``log2(delay / 125 ms)`` times
(twenty for 18 hours, one more per 18 hours beyond), each a copy in the commit log, so
that no waiting message is older than the longest level: retention (72 h by default)
never deletes one that is still to be delivered.
"""

from __future__ import annotations

import struct

DELAYED = 0x4000  # part flag: this message carries TIMER_DELIVER_MS (a delayed send)
PROP_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
TIMER_TOPIC = "%TIMER%"
TIMER_BASE_MS = 125
TIMER_LEVELS = 20  # 125 ms * 2**19 = 65,536 s = 18.2 h for the longest
MAX_TIMER_MS = TIMER_BASE_MS << (TIMER_LEVELS - 1)
DEFAULT_MAX_DELAY_S = 3 * 86400.0  # RocketMQ 5's timerMaxDelaySec
MAX_DELAY_SETTING_S = 365 * 86400.0
_MAX_DIGITS = 18  # a time in ms: an i64 holds 18 decimal digits whatever they are

# the flag in a part's header: byte 9 of the u16 flags at bytes 8-9, little endian
_FLAG_BYTE = 9
_FLAG_BIT = DELAYED >> 8
assert DELAYED == _FLAG_BIT << 8
_FLAGS = struct.Struct("<H")


class DelayError(ValueError):
    """A delivery time the broker does not accept (INVALID_ARGUMENT)."""


def is_delayed(part: bytes | memoryview) -> bool:
    """Whether a message part carries the DELAYED flag (one byte read)."""
    return len(part) > _FLAG_BYTE and bool(part[_FLAG_BYTE] & _FLAG_BIT)


def level_ms(level: int) -> int:
    """The delay of timer queue ``level``."""
    return TIMER_BASE_MS << level


def timer_level(remaining_ms: int) -> int:
    """The queue of a message with ``remaining_ms`` to wait: the longest level not longer
    than that (the shortest when it is shorter than every level)."""
    if remaining_ms < 2 * TIMER_BASE_MS:
        return 0
    return min((remaining_ms // TIMER_BASE_MS).bit_length() - 1, TIMER_LEVELS - 1)


def decimal_ms(value: object) -> int | None:
    """A time in ms written as a property: a decimal integer string (None: not one)."""
    if (not isinstance(value, str) or not value.isascii() or not value.isdigit()
            or len(value) > _MAX_DIGITS):
        return None
    return int(value)


def parse_deliver_ms(value: object) -> int:
    """The delivery time of ``TIMER_DELIVER_MS``: a decimal integer string, ms since the
    epoch; raises DelayError (its message is what the producer reads)."""
    ms = decimal_ms(value)
    if ms is None:
        raise DelayError(f"delayed message: property {PROP_TIMER_DELIVER_MS} must be the "
                         "delivery time in ms since the epoch, a decimal integer, got "
                         f"{str(value)[:40]!r}")
    return ms


def check_delay(deliver_ms: int, now_ms: int, max_delay_s: float) -> None:
    """Refuse a delivery time further ahead than ``max_delay_s`` (the broker's
    ``timer_max_delay_s``); a time in the past is accepted (delivered at once)."""
    if deliver_ms - now_ms > max_delay_s * 1000:
        raise DelayError(f"delayed message: delivery time {deliver_ms} is "
                         f"{(deliver_ms - now_ms) / 1000:.0f} s ahead, more than the "
                         f"broker's timer_max_delay_s ({max_delay_s:g} s)")


def timer_due(store_ms: int, level: int, deliver_ms: int) -> tuple[int, bool]:
    """(when, deliver) for a message stored at ``store_ms`` in timer queue ``level`` for
    delivery at ``deliver_ms``: at ``when`` it is delivered to its topic (``deliver``), or
    moved on to the queue for the time it has left.

    Its level has passed at ``store_ms + level_ms(level)``. It is delivered then when its
    time has come by then, or at its time when that comes within the shortest level after
    (no queue is shorter); else it moves on then. ``when`` lies in
    ``[store_ms, store_ms + level_ms(level) + TIMER_BASE_MS)``, and is never before the
    delivery time of a message delivered."""
    hop = store_ms + level_ms(level)
    if deliver_ms <= hop:
        return max(deliver_ms, store_ms), True
    if deliver_ms < hop + TIMER_BASE_MS:
        return deliver_ms, True
    return hop, False


def deliver_ms_of(deliver_at: float | None, delay_s: float | None, now: float) -> int:
    """The delivery time in ms of a send's ``deliver_at`` (seconds since the epoch) or
    ``delay_s`` (seconds from ``now``); exactly one of them is given."""
    if (deliver_at is None) == (delay_s is None):
        raise ValueError("give either deliver_at or delay_s")
    at = deliver_at if deliver_at is not None else now + float(delay_s)  # type: ignore[arg-type]
    if at != at or at in (float("inf"), float("-inf")):
        raise ValueError(f"delivery time must be finite, got {at!r}")
    return max(round(at * 1000), 0)


def set_flag(part: bytes) -> bytes:
    """``part`` with the DELAYED flag set (it carries TIMER_DELIVER_MS)."""
    flags = _FLAGS.unpack_from(part, 8)[0] | DELAYED
    return part[:8] + _FLAGS.pack(flags) + part[10:]
