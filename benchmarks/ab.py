"""Run one benchmark against several source trees, alternating them, and compare.

Each round runs the benchmark once per tree (the order reversed every other round, so a
drift of the machine weighs on every tree alike), with ``PYTHONPATH`` set to the tree's
``src`` for the benchmark and every process it starts. Every number in the benchmark's JSON
is collected per tree; the report gives each figure's median per tree and its ratio to the
first tree (above 1: the later tree has the larger figure).

Usage: python benchmarks/ab.py --src OLD/src NEW/src [--rounds 3] -- throughput.py --n 50000
    --no-peers --repeats 1
Prints one JSON document: {"benchmark", "src", "rounds", "figures": {path: {"median":
{src: value}, "ratio": {src: ratio}}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _progress import Steps  # noqa: E402


def numbers(doc: object, path: str = "") -> dict[str, float]:
    """Every number in a JSON document, by its path (``onceq.async.produce.100``)."""
    out: dict[str, float] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.update(numbers(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.update(numbers(v, f"{path}.{i}" if path else str(i)))
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        out[path] = float(doc)
    return out


def run(src: str, argv: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p))
    script = argv[0] if os.path.isabs(argv[0]) else os.path.join(HERE, argv[0])
    out = subprocess.run([sys.executable, script, *argv[1:]], env=env, stdout=subprocess.PIPE,
                         text=True, check=True)
    return numbers(json.loads(out.stdout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="+", required=True, help="source trees (their src folder)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("benchmark", nargs=argparse.REMAINDER,
                    help="-- SCRIPT [ARGS]: a benchmark of this folder and its arguments")
    a = ap.parse_args()
    argv = a.benchmark[1:] if a.benchmark[:1] == ["--"] else a.benchmark
    if not argv:
        ap.error("name the benchmark after --")
    srcs = [os.path.abspath(s) for s in a.src]
    seen: dict[str, dict[str, list[float]]] = {s: {} for s in srcs}
    steps = Steps(a.rounds * len(srcs))
    for r in range(a.rounds):
        for src in srcs if r % 2 == 0 else srcs[::-1]:
            steps.next(f"round {r + 1}/{a.rounds}: {argv[0]} on {src}")
            for key, value in run(src, argv).items():
                seen[src].setdefault(key, []).append(value)
    base = srcs[0]
    figures: dict[str, dict] = {}
    for key in seen[base]:
        med = {s: statistics.median(seen[s][key]) for s in srcs if key in seen[s]}
        figures[key] = {"median": med, "ratio": {
            s: round(v / med[base], 3) if med[base] else None
            for s, v in med.items() if s != base}}
    print(json.dumps({"benchmark": argv, "src": srcs, "rounds": a.rounds,
                      "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
