#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/java.sh  # before setup.sh, which checks it for the spark extra
bash scripts/setup.sh dev,spark
bash scripts/chromium.sh
bash scripts/etcd.sh  # the cluster tests start their own etcd from it
bash scripts/services.sh redis mariadb postgresql
.venv/bin/ruff check src tests benchmarks
# two workers: much of the suite waits on brokers, etcd and Spark rather than computing
# (ONCEQ_TEST_WORKERS=0 runs it in this process)
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 \
  -n "${ONCEQ_TEST_WORKERS:-2}" "$@"
