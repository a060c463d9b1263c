"""The users and grants of a cluster with acl on: one document in etcd, mirrored by every
broker into its own files.

The key ``/onceq/<cluster>/security`` holds ``{"users": <users.json>, "grants":
<acls.json>}`` (JSON; the users' SCRAM keys, never a password). It is the cluster's truth:

* every broker reads it every ``poll_s`` and, when it changed, takes it into its
  ``users.json`` and ``acls.json`` (so a broker restarted while etcd is down still knows
  the users it knew; its followers' replication logins and its clients' work on it);
* a change made on a broker (user create/update/delete, acl grant/revoke: requests only
  the leader serves) is written to etcd before it is answered: an answer means every
  broker of the cluster takes it within ``poll_s``. When etcd cannot be written the
  request fails (``SERVICE_UNAVAILABLE``, retriable) and the next read of etcd puts the
  broker back to the document: a change not answered is not the cluster's;
* a login of a user the broker does not know reads the document first (at most every
  ``REFRESH_S``), so a user made on the leader logs in on a follower at once;
* until etcd was read and holds users, a login is answered ``SERVICE_UNAVAILABLE``
  (retriable; not a failed login);
* the first document comes from a broker that finds the key absent while it has users of
  its own (``onceq user create --data-dir`` before the first start): written only if the
  key is still absent, so one broker's users win and the others take them.

Pure but for ``SharedSecurity.sync_once`` and ``publish``, which talk to etcd.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ..cluster import EtcdClient, EtcdError, security_key
from .acl import Grant

if TYPE_CHECKING:
    from .security import Security

log = logging.getLogger("onceq.broker")
REFRESH_S = 0.2  # the least time between two reads for a login of an unknown user


def encode_document(security: Security) -> bytes:
    return json.dumps({"users": security.users.export(), "grants": security.acls.export()},
                      sort_keys=True).encode()


def apply_document(security: Security, raw: bytes) -> bool:
    """Take the users and grants of ``raw`` into ``security``'s stores (their files
    first); whether anything changed. ValueError for a document that is not one."""
    try:
        doc = json.loads(raw)
        users, grants = doc["users"], doc["grants"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a security document: {exc}") from None
    try:  # both checked before either is taken: never half a document
        [Grant.from_json(d) for d in grants["grants"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a grants document: {exc}") from None
    changed = security.users.replace(users)
    return security.acls.replace(grants) or changed


class SharedSecurity:
    def __init__(self, client: EtcdClient, cluster: str, security: Security,
                 poll_s: float = 1.0) -> None:
        self.client = client
        self.key = security_key(cluster)
        self.security = security
        self.poll_s = poll_s
        self.revision = 0  # mod revision of the document this broker holds
        self.problem = ""  # why the last read or write failed ("" when it did not)
        self._publishing = 0
        self._read = False  # etcd was read once (the document, or that there is none)
        self.clock = time.monotonic
        self._refreshed = float("-inf")

    async def run(self) -> None:
        """Read the document every ``poll_s`` until cancelled."""
        while True:
            try:
                await self.sync_once()
                self._read = True
                self.problem = ""
            except (EtcdError, OSError) as exc:
                if not self.problem:
                    log.warning("security: cannot read the cluster's users from etcd: %s "
                                "(those of this broker's files stand)", exc)
                self.problem = str(exc)
            await asyncio.sleep(self.poll_s)

    async def sync_once(self) -> None:
        kv, _ = await self.client.get(self.key)
        if kv is None:
            if len(self.security.users):  # the first document: this broker's users
                revision = await self.client.create(self.key,
                                                    encode_document(self.security))
                if revision is not None:
                    self.revision = revision
                    log.warning("security: the cluster's users and grants are this "
                                "broker's (%d users)", len(self.security.users))
            return
        if kv.mod_revision <= self.revision or self._publishing:
            return  # held already, or a change of this broker is being written
        try:
            changed = apply_document(self.security, kv.value)
        except ValueError as exc:
            log.error("security: the document in etcd is damaged (%s); keeping this "
                      "broker's users and grants", exc)
            return
        self.revision = kv.mod_revision
        if changed:
            log.info("security: users and grants taken from etcd (revision %d, %d users)",
                     kv.mod_revision, len(self.security.users))

    async def refresh(self) -> None:
        """Read the document now (a login of a user this broker does not know: made on
        another broker a moment ago), at most once per ``REFRESH_S``; errors are kept in
        ``problem``."""
        now = self.clock()
        if now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        try:
            await self.sync_once()
        except (EtcdError, OSError) as exc:
            self.problem = str(exc)

    async def publish(self) -> None:
        """Write this broker's users and grants as the cluster's (after a change made
        here); EtcdError or OSError when etcd cannot be written."""
        self._publishing += 1
        try:
            self.revision = await self.client.put(self.key, encode_document(self.security))
        except (EtcdError, OSError):
            self.revision = 0  # the next read puts this broker back to the document
            raise
        finally:
            self._publishing -= 1

    @property
    def ready(self) -> bool:
        """Whether logins can be answered: etcd was read and there are users (before, a
        login is answered ``SERVICE_UNAVAILABLE``, retriable and not counted as a failed
        login: a broker just started must not lock its clients out)."""
        return self._read and len(self.security.users) > 0

    def status(self) -> dict[str, Any]:
        return {"revision": self.revision, "problem": self.problem}
