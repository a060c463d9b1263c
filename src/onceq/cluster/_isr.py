"""The in-sync replicas of a group as its leader publishes them in etcd (Kafka's ISR in
the controller): the election lets only these brokers run (``_role.may_campaign``).

The leader writes the key with one transaction guarded by its term::

    if   create_revision(groups/<group>/leader) == the revision of its term
    then put groups/<group>/isr = {epoch, leader, members}
    else range groups/<group>/leader

so a deposed leader (its leader key gone or created anew by another term) can never
overwrite what its successor published. The key has no lease: it outlives every leader,
and the next election reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._etcd import Compare, EtcdClient, put_op, range_op
from ._keys import IsrRecord, isr_key, leader_key
from ._role import Leadership


async def read_isr(client: EtcdClient, cluster: str, group: str) -> IsrRecord | None:
    """The ISR last published in ``group`` (None: never published)."""
    kv, _ = await client.get(isr_key(cluster, group))
    return IsrRecord.from_kv(kv)


async def publish_isr(client: EtcdClient, cluster: str, group: str, term: Leadership,
                      members: Sequence[str]) -> bool:
    """Publish ``members`` (the leader first) as the ISR of ``term``; False when the term
    is over (the leader key is not the one of ``term`` any more): nothing was written."""
    record = IsrRecord(term.epoch, term.broker_id, tuple(members))
    lkey = leader_key(cluster, group)
    result = await client.txn([Compare(lkey, "CREATE", "EQUAL", term.revision)],
                              [put_op(isr_key(cluster, group), record.encode())],
                              [range_op(lkey)])
    return result.succeeded
