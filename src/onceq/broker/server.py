"""Run a broker until SIGTERM/SIGINT; flush everything on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from .broker import Broker
from .config import BrokerConfig
from .front_end import FrontEnd


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def serve(config: BrokerConfig, on_ready: Callable[[Broker], None] | None = None,
                front_ends: list[FrontEnd] | None = None) -> None:
    broker = Broker(config)
    broker.front_ends.extend(front_ends or ())
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(broker)
    try:
        await stop.wait()
    finally:
        logging.getLogger("onceq.broker").info("shutting down: flushing")
        await broker.stop()


def run(config: BrokerConfig, on_ready: Callable[[Broker], None] | None = None,
        front_ends: list[FrontEnd] | None = None) -> None:
    install_uvloop()
    asyncio.run(serve(config, on_ready, front_ends))
