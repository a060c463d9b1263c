"""A member of the demo's consumer group: push consumer -> recording -> (idempotency
layer) -> the shop.

Protected: the broker's access lock is used and the listener is
``idempotent(handler, store="sqlite:///...", key="keys")`` (business key = order id), with
the shop as reconciler for a crashed attempt. Unprotected (the contrast run): no access
lock, no idempotency layer. ``python -m onceq.cli.demo.member`` runs one member in a
child process (the one the demo SIGKILLs).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from dataclasses import dataclass

from ...client.push import ConsumeContext, PushConsumer
from ...idempotency import idempotent
from ...log.record import MessageExt
from .recording import DeliveryLog, RecordingListener
from .shop import Order, Shop

GROUP = "shop"
TOPIC = "orders"
LEASE_S = 3.0  # a crashed member's claims expire this soon (extended every second)


@dataclass(frozen=True, slots=True)
class MemberSpec:
    broker: str
    workdir: str  # holds shop.db, dedup.db and deliveries/
    name: str
    protected: bool
    work_ms: float = 2.0  # time the business "takes" per order


def build(spec: MemberSpec) -> tuple[PushConsumer, RecordingListener]:
    shop = Shop(f"{spec.workdir}/shop.db", spec.name)
    recorder: RecordingListener

    def handle(msgs: list[MessageExt], ctx: ConsumeContext) -> None:
        if spec.work_ms:
            time.sleep(spec.work_ms / 1000 * len(msgs))
        shop.apply([(Order.parse(m.body), m.unique_key, recorder.delivery_ids[id(m)])
                    for m in msgs])

    inner = handle
    if spec.protected:
        inner = idempotent(handle, store=f"sqlite:///{spec.workdir}/dedup.db", key="keys",
                           lease_s=LEASE_S, reconcile=lambda key, m: shop.applied(key))
    recorder = RecordingListener(inner, DeliveryLog(f"{spec.workdir}/deliveries", spec.name))
    consumer = PushConsumer(spec.broker, GROUP, recorder, consume_from="FIRST",
                            instance_name=spec.name, access_lock=spec.protected,
                            client_id=f"demo-{spec.name}")
    consumer.subscribe(TOPIC)
    return consumer, recorder


async def _child(spec: MemberSpec) -> None:
    consumer, _ = build(spec)
    await consumer.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await consumer.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description="one member of the onceq demo's consumer group")
    p.add_argument("--broker", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--unprotected", action="store_true")
    p.add_argument("--work-ms", type=float, default=2.0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_child(MemberSpec(a.broker, a.workdir, a.name, not a.unprotected, a.work_ms)))


if __name__ == "__main__":
    main()
