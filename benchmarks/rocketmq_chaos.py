"""The official RocketMQ 5 clients while the broker is SIGKILLed and restarted, the long
form of ``tests/rocketmq/test_chaos.py`` (which kills it twice).

Official producers (sync sends, each answered send recorded with its message id),
SimpleConsumers of one group (acknowledging by receipt handle, each acknowledgement
answered OK recorded) and a PushConsumer of another group run against one broker
(``--grpc-port``, async flush); before each of ``--kills`` SIGKILLs the answered sends,
the acknowledgements and the consumptions have each grown by ``--progress``; the broker is
started again on the same data directory and ports. Reported (``run_chaos`` in the test):

* ``lost``: answered sends not stored (read back with onceq's pull consumer);
  ``stored_twice``: answered sends stored more than once;
* ``simple_not_received`` / ``push_not_consumed``: answered sends the SimpleConsumers'
  group never received / the PushConsumer never consumed;
* ``redelivered_after_ack``: messages a SimpleConsumer acknowledged (answered OK) and a
  receive asked afterwards delivered again; ``push_redelivered_after_ack``: messages the
  PushConsumer consumed again without a refused (stale) acknowledgement of the earlier
  delivery;
* at least once, not errors: ``simple_deliveries_beyond_first`` and
  ``push_consumed_beyond_first`` (deliveries in flight at a kill come again; the
  PushConsumer also consumes what it had cached, its stale acknowledgements refused).

Lists are cut to their first 20 items (their full length under ``*_count``). Exit code 1
when anything was lost, stored twice or delivered again after an acknowledgement.

Usage: python benchmarks/rocketmq_chaos.py [--kills 10] [--progress 500] [--rate 400]
           [--producers 2] [--simple-consumers 2]
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _progress import note

from tests.rocketmq.test_chaos import run_chaos

BAD = ("lost", "stored_twice", "simple_not_received", "push_not_consumed",
       "redelivered_after_ack", "push_redelivered_after_ack")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--progress", type=int, default=500)
    ap.add_argument("--rate", type=float, default=400, help="sends a second, in all")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--simple-consumers", type=int, default=2)
    ap.add_argument("--keep", help="keep the data and the clients' event files here")
    a = ap.parse_args()
    note(f"{a.kills} kills, {a.progress} more sends, acks and consumptions before each")
    with tempfile.TemporaryDirectory(prefix="onceq-rmq-chaos-") as tmp:
        root = Path(a.keep) if a.keep else Path(tmp)
        result = run_chaos(root, kills=a.kills, progress=a.progress, rate=a.rate,
                           producers=a.producers, simples=a.simple_consumers)
    result.pop("killed_at", None)
    for k, v in list(result.items()):
        if isinstance(v, list) and v and isinstance(v[0], str):
            result[f"{k}_count"] = len(v)
            result[k] = v[:20]
        elif isinstance(v, list) and not v:
            result[f"{k}_count"] = 0
    print(json.dumps(result, indent=2))
    return 1 if any(result[k] for k in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
