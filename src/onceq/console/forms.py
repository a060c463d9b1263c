"""What an operator types into the console's forms, checked before anything reaches the
broker: a malformed offset or time is a message on the page, never a request."""

from __future__ import annotations

from datetime import UTC, datetime

WIRE_MAX = (1 << 63) - 1  # integers travel to the broker as signed 64 bits


class InputError(ValueError):
    """A form field the console cannot use; its text names the field and why."""


def text(value: str | None, field: str, *, required: bool = True) -> str:
    """The field stripped; ``InputError`` when it is required and empty."""
    out = (value or "").strip()
    if required and not out:
        raise InputError(f"{field}: required")
    return out


def integer(value: str | None, field: str, *, low: int = 0, high: int = WIRE_MAX) -> int:
    """A whole number in [low, high]."""
    raw = text(value, field)
    try:
        n = int(raw, 10)
    except ValueError:
        raise InputError(f"{field}: {raw!r} is not a whole number") from None
    if not low <= n <= high:
        raise InputError(f"{field}: {n} is outside {low}..{high}")
    return n


def optional_integer(value: str | None, field: str, *, low: int = 0,
                     high: int = WIRE_MAX) -> int | None:
    """``integer``, or None for an empty field."""
    if not (value or "").strip():
        return None
    return integer(value, field, low=low, high=high)


def time_ms(value: str | None, field: str) -> int:
    """Epoch milliseconds, or an ISO 8601 time (UTC when it names no zone; what a
    ``datetime-local`` input sends), as epoch milliseconds."""
    raw = text(value, field)
    if raw.isdigit():
        return integer(raw, field)
    try:
        t = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise InputError(f"{field}: {raw!r} is neither an ISO 8601 time "
                         "(2026-01-31T12:00:00) nor epoch milliseconds") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    ms = int(t.timestamp() * 1000)
    if ms < 0:
        raise InputError(f"{field}: {raw!r} is before 1970")
    return ms


def optional_time_ms(value: str | None, field: str) -> int | None:
    if not (value or "").strip():
        return None
    return time_ms(value, field)


def iso_ms(ms: int | None) -> str:
    """Epoch milliseconds as ``YYYY-MM-DD HH:MM:SS.mmm`` UTC ("-" for None)."""
    if ms is None:
        return "-"
    t = datetime.fromtimestamp(ms / 1000, UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def choice(value: str | None, field: str, options: tuple[str, ...]) -> str:
    raw = text(value, field)
    if raw not in options:
        raise InputError(f"{field}: {raw!r} is not one of {', '.join(options)}")
    return raw
