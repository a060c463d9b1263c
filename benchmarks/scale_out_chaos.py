"""The chaos run over two broker groups of three replicas, longer than its test: a topic
spread over both groups, lost replies, consumers joining, a consumer SIGKILLed and one
group's leader SIGKILLed, with the idempotency layer and orderly consumers.

    python benchmarks/scale_out_chaos.py [--phase-s 5] [--rounds 200]

Needs ``etcd`` on the PATH (``bash scripts/etcd.sh``); starts its own etcd and six
brokers on loopback. Prints JSON and exits 1 on any loss, double store, effect not
exactly once or orderly key out of order. The checks are those of
tests/cluster/test_spread_chaos.py, which shares ``tests/cluster/spread_chaos.py``.
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

from tests.cluster import spread_chaos
from tests.cluster.group import make_group, start_etcd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=200,
                    help="keyed rounds (each sends one message of every key)")
    args = ap.parse_args()
    binary = shutil.which("etcd")
    if binary is None:
        print("etcd is not installed: bash scripts/etcd.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="onceq-spread-chaos-") as tmp:
        root = Path(tmp)
        (root / "etcd").mkdir()
        (root / "work").mkdir()
        with start_etcd(binary, root / "etcd") as etcd:
            cluster = f"c{uuid.uuid4().hex[:8]}"
            groups = {g: make_group(root / g, etcd, cluster, 3, group=g)
                      for g in ("g1", "g2")}
            t0 = time.monotonic()
            try:
                result = asyncio.run(spread_chaos.run(groups, root / "work",
                                                      phase_s=args.phase_s,
                                                      rounds=args.rounds, timeout_s=120))
            finally:
                for ns in groups.values():
                    for n in ns:
                        n.kill()
    result["seconds"] = round(time.monotonic() - t0, 1)
    for k in ("lost", "stored_twice", "effects_not_once", "effects_unacknowledged"):
        result[f"{k}_count"] = len(result[k])
        result[k] = result[k][:20]
    print(json.dumps(result, indent=2))
    ok = not (result["lost"] or result["stored_twice"] or result["effects_not_once"]
              or result["orderly"]["problem_count"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
