#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install onceq with the given extras (default: dev).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
py=""
for cand in python3.11 python3.12 python3.13 python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    py="$cand"; break
  fi
done
if [ -z "$py" ]; then
  echo "onceq needs Python 3.11 or newer (python3.11 not found)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.onceq-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
  touch "$stamp"
fi
