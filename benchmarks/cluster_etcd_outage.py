"""etcd down (SIGSTOP) for a long time under load, against a 3-broker group: what keeps
working is what docs/cluster.md promises (the leader serves until its lease could have
expired, then sends fail NOT_LEADER, retriable, until etcd is back), and nothing
acknowledged is lost or stored twice.

    python benchmarks/cluster_etcd_outage.py [--seconds 30] [--session-ttl 2]

Needs ``etcd`` on the PATH (``bash scripts/etcd.sh``); starts its own etcd and brokers on
loopback. Prints JSON. The checks are those of tests/cluster/test_failures.py::
test_etcd_down (3 TTLs there), which share ``tests/cluster/failures.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.failures import etcd_outage
from tests.cluster.group import Etcd, make_group


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--session-ttl", type=float, default=2.0)
    args = ap.parse_args()
    binary = shutil.which("etcd")
    if binary is None:
        print("etcd is not installed: bash scripts/etcd.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="onceq-etcd-outage-") as tmp:
        root = Path(tmp)
        (root / "etcd").mkdir()
        etcd = Etcd(binary, root / "etcd")
        etcd.start()
        nodes = make_group(root, etcd.endpoint, f"b{uuid.uuid4().hex[:8]}", 3,
                           "--session-ttl", str(args.session_ttl))
        try:
            figures = asyncio.run(etcd_outage(etcd, nodes, args.seconds, args.session_ttl))
        finally:
            for n in nodes:
                n.kill()
            etcd.stop()
    print(json.dumps({"benchmark": "cluster_etcd_outage", "session_ttl_s": args.session_ttl,
                      **figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
