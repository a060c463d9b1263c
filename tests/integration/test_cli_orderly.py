"""``onceq consume --orderly`` and the orderly locks in ``onceq group status``."""

from __future__ import annotations

import signal
import time

from tests.integration.test_cli import ok, run, table_rows
from tests.integration.test_cli_consumer import LINE, Consumer, baddr, send, wait_members

__all__ = ["baddr"]  # the module's broker fixture


def test_orderly_consume_and_group_status_shows_the_orderly_locks(baddr):
    ok(run("topic", "create", "ord", "-q", "2", "-b", baddr))
    for q in range(2):
        send(baddr, "ord", [f"q{q}-{i}" for i in range(5)], send={"queue": q})
    c = Consumer("ord", "-g", "ord-g", "--orderly", "--from", "first", "-b", baddr)
    try:
        members = wait_members(baddr, "ord-g", 1)
        lines = c.wait_lines(10)
        per_queue: dict[int, list[int]] = {0: [], 1: []}
        for line in lines:
            m = LINE.match(line)
            assert m, line
            per_queue[int(m[2])].append(int(m[3]))
        assert per_queue == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
        deadline = time.monotonic() + 10
        while True:
            out = ok(run("group", "status", "ord-g", "-b", baddr))
            rows = {int(r[1]): r for r in table_rows(out) if r[0] == "ord"}
            if all("orderly" in r[6] for r in rows.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        cid = members[0]["client"]
        for r in rows.values():  # holder (orderly, age)
            assert r[6].startswith(f"{cid} (orderly, ") and r[6].endswith("s)"), r
    finally:
        rc, err = c.stop(signal.SIGTERM)
    assert rc == 0 and "Traceback" not in err, err
    # the shutdown committed, then unlocked: offsets at the end, no lock left
    rows = [r for r in table_rows(ok(run("group", "status", "ord-g", "-b", baddr)))
            if r[0] == "ord"]
    assert [(r[4], r[6]) for r in rows] == [("5", "-"), ("5", "-")]
