"""The leader of a 3-broker group SIGKILLed N times under load (acks=all, a producer
with retries, a push consumer with the idempotency layer on SQLite): the time until sends
succeed again after each kill, and what was lost, stored twice or applied twice.

    python benchmarks/cluster_failover.py --kills 20 [--session-ttl 2]

Needs ``etcd`` on the PATH (``bash scripts/etcd.sh``); starts its own etcd and brokers on
loopback. Prints JSON. The checks are the ones of tests/cluster/test_failover_chaos.py
(3 kills there), which share ``tests/cluster/chaos.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster import chaos
from tests.cluster.group import make_group, start_etcd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--session-ttl", type=float, default=2.0)
    args = ap.parse_args()
    binary = shutil.which("etcd")
    if binary is None:
        print("etcd is not installed: bash scripts/etcd.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="onceq-failover-") as tmp:
        root = Path(tmp)
        (root / "etcd").mkdir()
        with start_etcd(binary, root / "etcd") as etcd:
            nodes = make_group(root, etcd, f"b{uuid.uuid4().hex[:8]}", 3,
                               "--session-ttl", str(args.session_ttl))
            t0 = time.monotonic()
            try:
                result = asyncio.run(chaos.run(nodes, args.kills, root, timeout_s=60))
            finally:
                for n in nodes:
                    n.kill()
    result["session_ttl_s"] = args.session_ttl
    result["seconds"] = round(time.monotonic() - t0, 1)
    for k in ("lost", "stored_twice", "effects_not_once", "effects_unacknowledged"):
        result[f"{k}_count"] = len(result[k])
        result[k] = result[k][:20]
    print(json.dumps(result, indent=2))
    ok = not (result["lost"] or result["stored_twice"] or result["effects_not_once"]) \
        and result["replicas_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
