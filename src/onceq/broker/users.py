"""The broker's users: names, SCRAM-SHA-256 credentials and the super-user flag.

``UserStore`` keeps them in ``users.json`` in the data directory, rewritten atomically on
every change (temp file, fsync, rename, fsync of the directory) with mode 0600. The file
holds each user's salt, iteration count, StoredKey and ServerKey (``Credentials``), never
the password; ``list`` shows no secret at all. Format::

    {"version": 1,
     "users": {"alice": {"super": false, "created": 1718000000.0, "updated": 1718000000.0,
                         "scram": {"mechanism": "SCRAM-SHA-256", "salt": "<base64>",
                                   "iterations": 8192, "stored_key": "<base64>",
                                   "server_key": "<base64>"}}}}

A damaged or unreadable file is refused at start with ``UserError(kind="damaged")`` naming
the file; a temp file left by a crash before the rename is ignored (the previous content
stands). Errors are ``UserError`` with a stable ``kind``: ``"invalid"`` (bad name or
password), ``"exists"``, ``"unknown"``, ``"damaged"``; the broker maps them to wire codes.
Not thread-safe: the broker calls it from its event loop.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

from ..protocol.scram import (
    DEFAULT_ITERATIONS,
    MIN_ITERATIONS,
    Credentials,
    make_credentials,
)
from ..storage.files import OS_FILES, FileOps
from ..storage.metadata import RenameNotDurable, write_atomic

FILE = "users.json"
VERSION = 1
MECHANISM = "SCRAM-SHA-256"
MAX_PASSWORD = 1024
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}", re.ASCII)


class UserError(Exception):
    """A user operation failed; ``kind`` is one of "invalid", "exists", "unknown",
    "damaged" (stable, for mapping to error codes)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def check_name(name: object) -> str:
    """``name`` when it is a valid user name (1-64 of letters, digits, ``._-@``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserError("invalid", f"invalid user name {name!r}: 1-64 characters among "
                                   "letters, digits and . _ - @")
    return name


class _PrivateFiles(FileOps):
    """``files`` whose new files are created with mode 0600 (the user file is secret)."""

    def __init__(self, files: FileOps) -> None:
        self.files = files

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = self.files.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a temp file left by a crash keeps its old mode
        except OSError:
            self.files.close(fd)
            raise
        return fd

    def close(self, fd: int) -> None:
        self.files.close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return self.files.pwrite(fd, data, offset)

    def write_all(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        self.files.write_all(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self.files.fsync(fd)

    def replace(self, src: str, dst: str) -> None:
        self.files.replace(src, dst)

    def unlink(self, path: str) -> None:
        self.files.unlink(path)

    def fsync_dir(self, path: str) -> None:
        self.files.fsync_dir(path)

    def read_file(self, path: str) -> bytes:
        return self.files.read_file(path)


class UserStore:
    """The users of one broker, in ``<data_dir>/users.json``.

    Every change is on disk when the method returns. When the write fails before the
    rename (``OSError``), the store is left as it was, in memory and on disk; when only
    the final directory fsync fails (``RenameNotDurable``), the change is kept.
    ``clock`` gives the wall-clock times recorded as ``created``/``updated``.
    """

    def __init__(self, data_dir: str, clock: Callable[[], float] = time.time, *,
                 iterations: int = DEFAULT_ITERATIONS, files: FileOps = OS_FILES) -> None:
        self.path = os.path.join(data_dir, FILE)
        self.clock = clock
        self.iterations = iterations
        self.files = _PrivateFiles(files)
        self._users: dict[str, dict[str, Any]] = {}
        self._creds: dict[str, Credentials] = {}
        self._load()

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, name: object) -> bool:
        return name in self._users

    def credentials(self, name: str) -> Credentials | None:
        """The SCRAM credentials of ``name``, None for an unknown user (the lookup that
        ``ScramServer`` takes)."""
        return self._creds.get(name)

    def is_super(self, name: str) -> bool:
        """True for an existing super user, False otherwise."""
        entry = self._users.get(name)
        return bool(entry and entry["super"])

    def get(self, name: str) -> dict[str, Any]:
        """The public view of ``name`` (no secret); ``UserError("unknown")`` if absent."""
        if name not in self._users:
            raise UserError("unknown", f"no user {name!r}")
        return self._public(name, self._users[name])

    def list(self) -> list[dict[str, Any]]:
        """Every user's public view, by name: name, super, created, updated, mechanism."""
        return [self._public(n, e) for n, e in sorted(self._users.items())]

    # ------------------------------------------------------------------ changes
    def create(self, name: str, password: str | Credentials, *, super: bool = False
               ) -> dict[str, Any]:
        """Add a user with a password, or with SCRAM credentials derived from it by the
        client (the password never reaches the broker); ``UserError`` "invalid" or
        "exists". Returns its public view."""
        check_name(name)
        if name in self._users:
            raise UserError("exists", f"user {name!r} already exists")
        creds = self._make(password)
        now = self.clock()
        entry = {"super": bool(super), "created": now, "updated": now,
                 "scram": {"mechanism": MECHANISM, **creds.to_dict()}}
        self._commit({**self._users, name: entry})
        return self.get(name)

    def update(self, name: str, *, password: str | Credentials | None = None,
               super: bool | None = None) -> dict[str, Any]:
        """Change a user's password and/or super flag; ``UserError`` "unknown" or
        "invalid". Returns its public view."""
        if name not in self._users:
            raise UserError("unknown", f"no user {name!r}")
        entry = dict(self._users[name])
        if password is not None:
            entry["scram"] = {"mechanism": MECHANISM, **self._make(password).to_dict()}
        if super is not None:
            entry["super"] = bool(super)
        entry["updated"] = self.clock()
        self._commit({**self._users, name: entry})
        return self.get(name)

    def delete(self, name: str) -> None:
        """Remove a user; ``UserError("unknown")`` if absent."""
        if name not in self._users:
            raise UserError("unknown", f"no user {name!r}")
        self._commit({n: e for n, e in self._users.items() if n != name})

    # ------------------------------------------------------------------ a group's users
    def export(self) -> dict[str, Any]:
        """The whole user file's document (secrets included: SCRAM keys, no password), as
        a broker group shares it through etcd (``shared_security.py``)."""
        return {"version": VERSION, "users": self._users}

    def replace(self, doc: dict[str, Any]) -> bool:
        """Take every user of ``doc`` (an ``export``) in place of this store's; written to
        disk first. ValueError for a document that is not a user file; False when it holds
        what the store holds already."""
        users = _parse(json.dumps(doc).encode())
        if users == self._users:
            return False
        self._commit(users)
        return True

    # ------------------------------------------------------------------ internals
    def _make(self, password: object) -> Credentials:
        if isinstance(password, Credentials):
            if password.iterations < MIN_ITERATIONS:
                raise UserError("invalid", f"SCRAM credentials need at least "
                                f"{MIN_ITERATIONS} iterations")
            return password
        if not isinstance(password, str) or not password or len(password) > MAX_PASSWORD:
            raise UserError("invalid", f"a password is 1-{MAX_PASSWORD} characters")
        try:
            return make_credentials(password, iterations=self.iterations)
        except ValueError as exc:
            raise UserError("invalid", f"invalid password: {exc}") from None

    @staticmethod
    def _public(name: str, entry: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "super": entry["super"], "created": entry["created"],
                "updated": entry["updated"], "mechanism": entry["scram"]["mechanism"]}

    def _commit(self, users: dict[str, dict[str, Any]]) -> None:
        doc = {"version": VERSION, "users": users}
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        try:
            write_atomic(self.path, data, self.files)
        except RenameNotDurable:
            self._set(users)  # the new file is in place, only its durability is in doubt
            raise
        self._set(users)

    def _set(self, users: dict[str, dict[str, Any]]) -> None:
        self._users = users
        self._creds = {n: Credentials.from_dict(e["scram"]) for n, e in users.items()}

    def _load(self) -> None:
        try:
            raw = self.files.read_file(self.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UserError("damaged", f"{self.path}: cannot read the user file: "
                                       f"{exc.strerror or exc}") from None
        try:
            users = _parse(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise UserError("damaged", f"{self.path}: damaged user file ({exc}); restore "
                                       "it from a backup or remove it") from None
        self._set(users)


def _parse(raw: bytes) -> dict[str, dict[str, Any]]:
    """The users of a user file; ValueError saying what is wrong."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a user file of version {VERSION}")
    users = doc.get("users")
    if not isinstance(users, dict):
        raise ValueError("no 'users' object")
    out = {}
    for name, entry in users.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"invalid user name {name!r}")
        if not isinstance(entry, dict) or not isinstance(entry.get("super"), bool):
            raise ValueError(f"user {name!r}: bad entry")
        for key in ("created", "updated"):
            if type(entry.get(key)) not in (int, float):
                raise ValueError(f"user {name!r}: bad {key!r} time")
        scram = entry.get("scram")
        if not isinstance(scram, dict) or scram.get("mechanism") != MECHANISM:
            raise ValueError(f"user {name!r}: no {MECHANISM} credentials")
        try:
            Credentials.from_dict(scram)
        except ValueError as exc:
            raise ValueError(f"user {name!r}: {exc}") from None
        out[name] = entry
    return out
