"""RocketMQ access keys of onceq's users: the accessKey/secretKey pairs the official RocketMQ
clients sign their requests with (``Credentials(access_key, secret_key)``) when the broker
runs with ``acl`` on (``auth.py``; docs/rocketmq.md).

onceq keeps only SCRAM keys for a user's password, which cannot check an HMAC signature, so
an access key is a pair of its own, made for a user by ``onceq user access-key create USER
--data-dir DIR``. A user may have several (a rotation: make a new one, move the clients,
delete the old one). The pairs are kept in ``rocketmq_access_keys.json`` in the data
directory, mode 0600, written atomically; the secret keys are stored as they are (an HMAC
is checked with the secret itself). Format::

    {"version": 1,
     "keys": {"oq3f9c...": {"user": "alice", "secret": "<secret key>",
                            "created": 1718000000.0, "user_created": 1717990000.0}}}

A key names its user as the user was when the key was made (``user_created``): a user
deleted and made again under the same name does not get the old user's keys back.

The broker reads the file at start and again when it changes (``refresh``), so keys made
or deleted while it runs count within a second. No grpc import: the command line uses it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..broker.front_end import file_stamp, write_file_atomic

FILE = "rocketmq_access_keys.json"
VERSION = 1
ACCESS_KEY = re.compile(r"[A-Za-z0-9_.@-]{1,128}", re.ASCII)
_PREFIX = "oq"  # onceq's access keys: "oq" and 20 hex digits


@dataclass(frozen=True, slots=True)
class AccessKey:
    access_key: str
    user: str
    secret: str
    created: float
    user_created: float

    def public(self) -> dict[str, Any]:
        """What may be shown: everything but the secret key."""
        return {"access_key": self.access_key, "user": self.user, "created": self.created}


def new_pair() -> tuple[str, str]:
    """A fresh (access key, secret key): 80 random bits and 240 random bits."""
    return _PREFIX + secrets.token_hex(10), secrets.token_urlsafe(30)


def parse(raw: bytes) -> dict[str, AccessKey]:
    """The keys of an access-key file; ValueError saying what is wrong."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not an access-key file of version {VERSION}")
    keys = doc.get("keys")
    if not isinstance(keys, dict):
        raise ValueError("no 'keys' object")
    out = {}
    for ak, e in keys.items():
        if not isinstance(ak, str) or not ACCESS_KEY.fullmatch(ak):
            raise ValueError(f"invalid access key {ak!r}")
        if not (isinstance(e, dict) and isinstance(e.get("user"), str)
                and isinstance(e.get("secret"), str) and e["secret"]
                and all(type(e.get(t)) in (int, float) for t in ("created", "user_created"))):
            raise ValueError(f"access key {ak!r}: bad entry")
        out[ak] = AccessKey(ak, e["user"], e["secret"], float(e["created"]),
                            float(e["user_created"]))
    return out


class AccessKeys:
    """The access keys of one data directory (``rocketmq_access_keys.json``).

    A damaged file is refused when read at start (``ValueError`` naming it); a change that
    cannot be read later (``refresh``) leaves the keys read before in place."""

    def __init__(self, data_dir: str, clock: Callable[[], float] = time.time) -> None:
        self.path = os.path.join(data_dir, FILE)
        self.clock = clock
        self.keys: dict[str, AccessKey] = {}
        self._stamp: tuple[int, int, int] | None = None
        self.problem = ""  # why the last refresh did not take the file ("": it did)
        self.keys = self._read()

    def _read(self) -> dict[str, AccessKey]:
        stamp = file_stamp(self.path)
        if stamp is None:
            self._stamp = None
            return {}
        try:
            with open(self.path, "rb") as f:
                keys = parse(f.read())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: cannot read the RocketMQ access keys ({exc}); "
                             "restore it from a backup or remove it") from None
        self._stamp = stamp
        return keys

    def refresh(self) -> bool:
        """Read the file again when it changed since it was read; whether it did."""
        if file_stamp(self.path) == self._stamp:
            return False
        try:
            self.keys = self._read()
        except ValueError as exc:
            self.problem = str(exc)
            return False
        self.problem = ""
        return True

    def get(self, access_key: str) -> AccessKey | None:
        return self.keys.get(access_key)

    def list(self, user: str | None = None) -> list[AccessKey]:
        return sorted((k for k in self.keys.values() if user is None or k.user == user),
                      key=lambda k: (k.user, k.created, k.access_key))

    def create(self, user: str, user_created: float) -> AccessKey:
        """A new pair for ``user`` (whose ``created`` time is ``user_created``), saved."""
        self.refresh()
        ak, sk = new_pair()
        key = AccessKey(ak, user, sk, self.clock(), user_created)
        self._save({**self.keys, ak: key})
        return key

    def delete(self, access_key: str) -> bool:
        """Remove a pair; whether there was one."""
        self.refresh()
        if access_key not in self.keys:
            return False
        self._save({k: v for k, v in self.keys.items() if k != access_key})
        return True

    def _save(self, keys: dict[str, AccessKey]) -> None:
        doc = {"version": VERSION, "keys": {
            k.access_key: {"user": k.user, "secret": k.secret, "created": k.created,
                           "user_created": k.user_created} for k in keys.values()}}
        write_file_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True).encode(),
                          private=True)
        self.keys = keys
        self._stamp = file_stamp(self.path)
