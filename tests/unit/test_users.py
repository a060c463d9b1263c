"""The user store: validation, atomic writes, reload, no secret shown, damaged files."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from onceq.broker.users import FILE, UserError, UserStore
from onceq.protocol.scram import MIN_ITERATIONS, ScramClient, ScramError, ScramServer
from onceq.storage.metadata import RenameNotDurable
from tests.clock import FakeClock
from tests.faultfiles import FaultFiles


@pytest.fixture
def clock():
    return FakeClock(1_700_000_000.0)


def store(tmp_path, clock, **kw) -> UserStore:
    return UserStore(str(tmp_path), clock, iterations=MIN_ITERATIONS, **kw)


def login(users: UserStore, name: str, password: str) -> str:
    client, server = ScramClient(name, password), ScramServer(users.credentials)
    user, final = server.final(client.final(server.first(client.first())))
    client.verify(final)
    return user


def test_create_login_and_reload_round_trip(tmp_path, clock):
    users = store(tmp_path, clock)
    assert len(users) == 0 and users.list() == []
    users.create("alice", "pw-a")
    clock.advance(5)
    users.create("root@ops", "pw-r", super=True)
    again = store(tmp_path, clock)
    assert again.list() == users.list()
    assert [u["name"] for u in again.list()] == ["alice", "root@ops"]
    assert again.is_super("root@ops") and not again.is_super("alice")
    assert not again.is_super("nobody") and again.credentials("nobody") is None
    assert again.credentials("alice") == users.credentials("alice")
    assert login(again, "alice", "pw-a") == "alice"
    with pytest.raises(ScramError):
        login(again, "alice", "pw-r")


def test_file_holds_no_password_and_is_private(tmp_path, clock):
    users = store(tmp_path, clock)
    users.create("alice", "correct-horse")
    path = tmp_path / FILE
    raw = path.read_text()
    assert "correct-horse" not in raw
    doc = json.loads(raw)
    assert doc["version"] == 1
    entry = doc["users"]["alice"]
    assert set(entry) == {"super", "created", "updated", "scram"}
    assert set(entry["scram"]) == {"mechanism", "salt", "iterations", "stored_key",
                                   "server_key"}
    assert entry["scram"]["mechanism"] == "SCRAM-SHA-256"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_list_and_get_show_no_secret(tmp_path, clock):
    users = store(tmp_path, clock)
    users.create("alice", "pw", super=True)
    view = users.list()[0]
    assert view == {"name": "alice", "super": True, "created": clock.t, "updated": clock.t,
                    "mechanism": "SCRAM-SHA-256"}
    assert users.get("alice") == view
    secret = users.credentials("alice")
    text = repr(users.list())
    for field in ("salt", "stored_key", "server_key", "iterations", "scram"):
        assert field not in text
    assert secret is not None and secret.salt.hex() not in text


def test_update_password_and_super_flag(tmp_path, clock):
    users = store(tmp_path, clock)
    created = users.create("alice", "old")["created"]
    clock.advance(60)
    view = users.update("alice", password="new", super=True)
    assert view["super"] and view["created"] == created and view["updated"] == created + 60
    again = store(tmp_path, clock)
    assert login(again, "alice", "new") == "alice"
    with pytest.raises(ScramError):
        login(again, "alice", "old")
    assert again.update("alice", super=False)["super"] is False
    assert login(again, "alice", "new") == "alice"  # the password stays


def test_delete(tmp_path, clock):
    users = store(tmp_path, clock)
    users.create("alice", "pw")
    users.create("bob", "pw")
    users.delete("alice")
    assert "alice" not in users and "bob" in users
    assert [u["name"] for u in store(tmp_path, clock).list()] == ["bob"]


@pytest.mark.parametrize("name", ["", "a" * 65, "al ice", "al/ice", "ålice", "a,b", "x\n",
                                  None, 7])
def test_invalid_names_are_refused(tmp_path, clock, name):
    users = store(tmp_path, clock)
    with pytest.raises(UserError) as err:
        users.create(name, "pw")
    assert err.value.kind == "invalid"
    assert not (tmp_path / FILE).exists()


def test_valid_names(tmp_path, clock):
    users = store(tmp_path, clock)
    for name in ("a", "a" * 64, "svc.orders-1_x@prod"):
        users.create(name, "pw")
    assert len(users) == 3


@pytest.mark.parametrize("password", ["", "x" * 1025, "nul\x00", None])
def test_invalid_passwords_are_refused(tmp_path, clock, password):
    users = store(tmp_path, clock)
    with pytest.raises(UserError) as err:
        users.create("alice", password)
    assert err.value.kind == "invalid"


def test_stable_error_kinds(tmp_path, clock):
    users = store(tmp_path, clock)
    users.create("alice", "pw")
    with pytest.raises(UserError) as err:
        users.create("alice", "pw2")
    assert err.value.kind == "exists"
    for op in (lambda: users.update("bob", super=True), lambda: users.delete("bob"),
               lambda: users.get("bob")):
        with pytest.raises(UserError) as err:
            op()
        assert err.value.kind == "unknown"


def test_crash_between_temp_write_and_rename_keeps_the_old_file(tmp_path, clock):
    users = store(tmp_path, clock)
    users.create("alice", "pw")
    before = (tmp_path / FILE).read_bytes()
    # the crash: a new content was written to the temp file, the rename never happened
    (tmp_path / f"{FILE}.tmp").write_text('{"version": 1, "users": {"half')
    again = store(tmp_path, clock)
    assert [u["name"] for u in again.list()] == ["alice"]
    assert (tmp_path / FILE).read_bytes() == before
    again.create("bob", "pw")  # the next write replaces the stale temp file
    assert not (tmp_path / f"{FILE}.tmp").exists()
    assert stat.S_IMODE(os.stat(tmp_path / FILE).st_mode) == 0o600
    assert [u["name"] for u in store(tmp_path, clock).list()] == ["alice", "bob"]


def test_failed_write_leaves_memory_and_disk_unchanged(tmp_path, clock):
    files = FaultFiles()
    users = store(tmp_path, clock, files=files)
    users.create("alice", "pw")
    files.arm("replace", err=errno.ENOSPC)
    with pytest.raises(OSError):
        users.create("bob", "pw")
    assert "bob" not in users and users.credentials("bob") is None
    assert [u["name"] for u in store(tmp_path, clock).list()] == ["alice"]
    files.arm("fsync")
    with pytest.raises(OSError):
        users.delete("alice")
    assert "alice" in users
    users.create("bob", "pw")  # works again once the fault is gone
    assert len(store(tmp_path, clock)) == 2


def test_directory_fsync_failure_keeps_the_change(tmp_path, clock):
    files = FaultFiles()
    users = store(tmp_path, clock, files=files)
    files.arm("fsync_dir")
    with pytest.raises(RenameNotDurable):
        users.create("alice", "pw")
    assert "alice" in users and "alice" in store(tmp_path, clock)


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe", b"[]", b'{"version": 2, "users": {}}', b'{"version": 1}',
    b'{"version": 1, "users": {"bad name": {}}}',
    b'{"version": 1, "users": {"alice": {"super": "yes"}}}',
    b'{"version": 1, "users": {"alice": {"super": false, "created": 1, "updated": 1}}}',
    b'{"version": 1, "users": {"alice": {"super": false, "created": 1, "updated": 1,'
    b' "scram": {"mechanism": "SCRAM-SHA-256", "salt": "!", "iterations": 4096,'
    b' "stored_key": "", "server_key": ""}}}}',
])
def test_damaged_file_is_a_clear_error(tmp_path, clock, content):
    (tmp_path / FILE).write_bytes(content)
    with pytest.raises(UserError) as err:
        store(tmp_path, clock)
    assert err.value.kind == "damaged"
    assert str(tmp_path / FILE) in str(err.value) and "damaged user file" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_unreadable_file_is_a_clear_error(tmp_path, clock):
    (tmp_path / FILE).mkdir()  # reading a directory fails with an OSError
    with pytest.raises(UserError) as err:
        store(tmp_path, clock)
    assert err.value.kind == "damaged" and "cannot read" in str(err.value)
