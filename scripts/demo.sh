#!/usr/bin/env bash
# Set up the environment and run the main job: `onceq demo` on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/onceq demo "$@"
