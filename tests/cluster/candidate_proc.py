"""A broker-group candidate in a process of its own (the tests SIGKILL it).

``python -m tests.cluster.candidate_proc ENDPOINT CLUSTER GROUP BROKER_ID TTL`` prints
``leader EPOCH`` when elected, then runs until killed.
"""

from __future__ import annotations

import asyncio
import sys

from onceq.cluster import Election, EtcdClient, Session, register


async def main(endpoint: str, cluster: str, group: str, broker_id: str, ttl: float) -> None:
    session = await Session(EtcdClient(endpoint), ttl=ttl).start()
    await register(session, cluster, group, broker_id, f"proc-{broker_id}")
    election = Election(session, cluster, group, broker_id, f"proc-{broker_id}",
                        on_elected=lambda t: print(f"leader {t.epoch}", flush=True))
    election.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    endpoint, cluster, group, broker_id, ttl = sys.argv[1:6]
    asyncio.run(main(endpoint, cluster, group, broker_id, float(ttl)))
