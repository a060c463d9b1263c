"""``onceq dedup show|stats|purge`` on a SQLite dedup store."""

from __future__ import annotations

import asyncio
import json
import time

from click.testing import CliRunner

from onceq.cli.main import main
from onceq.idempotency import Claim, Ticket, open_store


def _prepare(url: str) -> None:
    async def go() -> None:
        s = open_store(url)
        now = time.time()
        await s.claim_many([Claim("billing", "orders", "A-1", "host:1:ab:1", "h1"),
                            Claim("billing", "orders", "A-2", "host:1:ab:2", "h2"),
                            Claim("billing", "orders", "OLD", "host:1:ab:3", "h3",
                                  lease_s=0.01, retention_s=0.01)])
        assert await s.complete_many([Ticket("billing", "orders", "A-1", "host:1:ab:1")],
                                     3600) == [True]
        await s.close()
        while time.time() < now + 0.05:
            await asyncio.sleep(0.01)

    asyncio.run(go())


def test_dedup_show_stats_purge(tmp_path):
    url = f"sqlite:///{tmp_path}/dedup.db"
    run = CliRunner().invoke
    r = run(main, ["dedup", "init", "--store", url])
    assert r.exit_code == 0 and "ready: 0 CONSUMING, 0 CONSUMED" in r.output, r.output
    _prepare(url)
    r = run(main, ["dedup", "show", "--store", url, "-g", "billing", "-t", "orders", "A-1",
                   "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    assert (rec["status"], rec["owner"], rec["attempt"]) == ("CONSUMED", "host:1:ab:1", 1)
    r = run(main, ["dedup", "show", "--store", url, "-g", "billing", "-t", "orders", "A-2"])
    assert r.exit_code == 0 and "CONSUMING" in r.output and "attempt       1" in r.output
    r = run(main, ["dedup", "show", "--store", url, "-g", "billing", "-t", "orders", "NOPE"])
    assert r.exit_code == 2 and "no record" in r.output
    assert [(h["event"], h["attempt"], h["owner"]) for h in rec["history"]] == [
        ("claimed", 1, "host:1:ab:1"), ("completed", 1, "host:1:ab:1")]
    r = run(main, ["dedup", "show", "--store", url, "-g", "billing", "-t", "orders", "A-1"])
    lines = r.output.splitlines()
    hist = lines[lines.index("history") + 1:]
    assert len(hist) == 2 and "claimed" in hist[0] and "completed" in hist[1], r.output
    assert hist[1].split()[1:] == ["completed", "attempt", "1", "host:1:ab:1"]
    r = run(main, ["dedup", "stats", "--store", url])
    assert json.loads(r.output) == {"consuming": 1, "consumed": 1, "released": 0}
    r = run(main, ["dedup", "purge", "--store", url, "--batch", "1"])
    assert r.exit_code == 0 and "purged 1 expired record(s)" in r.output, r.output
    r = run(main, ["dedup", "purge", "--store", url, "--older-than", "1h"])
    assert r.exit_code == 0 and "purged 0 expired or older than 1h" in r.output, r.output
    r = run(main, ["dedup", "purge", "--store", url, "--older-than", "soon"])
    assert r.exit_code == 2 and "invalid duration 'soon'" in r.output, r.output
    time.sleep(0.05)
    r = run(main, ["dedup", "purge", "--store", url, "--older-than", "0.01s", "--batch", "1"])
    assert r.exit_code == 0 and "purged 2 expired or older than" in r.output, r.output
    r = run(main, ["dedup", "stats", "--store", url])
    assert json.loads(r.output) == {"consuming": 0, "consumed": 0, "released": 0}
    r = run(main, ["dedup", "stats", "--store", "redis://127.0.0.1:1/0"])
    assert r.exit_code == 2 and "dedup store" in r.output
