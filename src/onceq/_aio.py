"""Small asyncio helpers shared by the broker and the clients."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Return when ``event`` is set or after ``timeout`` seconds, whichever comes first.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11 a wake-up racing a
    cancellation of the caller can make it swallow that cancellation, and a loop that stops
    by being cancelled then never ends.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
