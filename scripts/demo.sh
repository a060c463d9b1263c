#!/usr/bin/env bash
# Set up the environment (with the spark extra and Java 17+) and run the main job:
# `onceq demo` on embedded defaults. Extra arguments go to `onceq demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/java.sh  # before setup.sh, which checks it for the spark extra
bash scripts/setup.sh dev,spark
exec .venv/bin/onceq demo "$@"
