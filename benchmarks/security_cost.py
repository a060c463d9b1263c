"""What the protections cost: produce and consume throughput and connection setup with TLS
and ACLs off and on, in the same run.

Modes: ``off``, ``tls`` (TLS on the client port, clients verify the broker), ``acl`` (users
authenticate with SCRAM-SHA-256 and every request is checked against the grants of a
normal user, not a super user), ``tls+acl``. Each round runs every mode once (the order
reversed every other round) on a fresh broker process and data directory: one producer
process sends ``--n`` messages of 100 bytes in batches of ``--batch``, one consumer process
reads them with pulls that carry their commits (``throughput.py``'s workload), and this
process opens and closes ``--conns`` connections one after another (TCP, TLS handshake,
SCRAM exchange) and takes the median time. Rates are medians over rounds; ratios are to
``off``.

Usage: python benchmarks/security_cost.py [--n 200000] [--batch 100] [--rounds 3]
Prints one JSON document. Needs the ``cryptography`` package (the ``tls`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Steps  # noqa: E402
from throughput import TOPIC, start_broker  # noqa: E402

from onceq import ClientSecurity  # noqa: E402
from onceq.broker.acl import AclStore, make_grant  # noqa: E402
from onceq.broker.users import UserStore  # noqa: E402
from onceq.cli.tls_dev_cert import make_dev_certs  # noqa: E402
from onceq.client.connection import BrokerConnection  # noqa: E402

MODES = ("off", "tls", "acl", "tls+acl")
USER, PASSWORD = "bench", "bench-password"


def prepare(data: str, mode: str, certs: dict) -> tuple[list[str], dict[str, str]]:
    """Broker flags and the clients' environment of ``mode``; users and grants written
    into ``data`` before the broker starts."""
    flags: list[str] = []
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ONCEQ_USER", "ONCEQ_PASSWORD", "ONCEQ_TLS"))}
    if "tls" in mode:
        flags += ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"])]
        env.update(ONCEQ_TLS="1", ONCEQ_TLS_CA=str(certs["ca"]))
    if "acl" in mode:
        os.makedirs(data, exist_ok=True)
        UserStore(data).create(USER, PASSWORD)
        acls = AclStore(data)
        acls.grant(make_grant(USER, "Topic", TOPIC, ["Pub", "Sub", "Create"]))
        acls.grant(make_grant(USER, "Group", "bench-group", ["Sub"]))
        acls.save()
        flags.append("--acl")
        env.update(ONCEQ_USER=USER, ONCEQ_PASSWORD=PASSWORD)
    return flags, env


def child(role: str, addr: str, n: int, batch: int, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, os.path.join(HERE, "throughput.py"), "--child", role,
                          addr, str(n), str(batch)], env=env, stdout=subprocess.PIPE,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


async def setup_ms(addr: str, security: ClientSecurity, conns: int) -> float:
    times = []
    for _ in range(conns):
        t0 = time.perf_counter()
        conn = await BrokerConnection.open(addr, security=security)
        times.append(time.perf_counter() - t0)
        conn.close()
    return 1000 * statistics.median(times)


def run_mode(mode: str, certs: dict, n: int, batch: int, conns: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="onceq-sec-") as d:
        data = os.path.join(d, "data")
        flags, env = prepare(data, mode, certs)
        proc, addr = start_broker(data, "async", flags)
        try:
            produce = child("produce", addr, n, batch, env)
            consume = child("consume", addr, n, batch, env)
            security = ClientSecurity(USER if "acl" in mode else None,
                                      PASSWORD if "acl" in mode else None,
                                      tls="tls" in mode, ca_file=str(certs["ca"]))
            setup = asyncio.run(setup_ms(addr, security, conns))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return {"produce": produce, "consume": consume, "setup_ms": setup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=30)
    a = ap.parse_args()
    seen: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    steps = Steps(a.rounds * len(MODES))
    with tempfile.TemporaryDirectory(prefix="onceq-certs-") as cd:
        certs = make_dev_certs(cd)
        for r in range(a.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                steps.next(f"round {r + 1}/{a.rounds}: {mode}")
                for key, value in run_mode(mode, certs, a.n, a.batch, a.conns).items():
                    seen[mode].setdefault(key, []).append(value)
    med = {m: {k: round(statistics.median(v), 2) for k, v in figs.items()}
           for m, figs in seen.items()}
    ratios = {m: {k: round(med[m][k] / med["off"][k], 3) for k in med[m]}
              for m in MODES if m != "off"}
    print(json.dumps({"workload": {"n": a.n, "batch": a.batch, "rounds": a.rounds,
                                   "body_bytes": 100, "conns": a.conns},
                      "median": med, "vs_off": ratios,
                      "goal_within_20pct": {m: ratios[m]["produce"] >= 0.8
                                            and ratios[m]["consume"] >= 0.8
                                            for m in ratios}}, indent=1))


if __name__ == "__main__":
    main()
