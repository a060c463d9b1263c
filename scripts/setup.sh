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
case ",$extras," in
  *,spark,*)
    # Spark runs on a JVM: Java 17 or newer must be on PATH (or in JAVA_HOME)
    java="java"
    if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then java="$JAVA_HOME/bin/java"; fi
    if ! command -v "$java" >/dev/null 2>&1; then
      echo "the spark extra needs Java 17 or newer: 'java' was not found (install a JDK or JRE 17+, e.g. apt-get install openjdk-17-jre-headless, or set JAVA_HOME)" >&2
      exit 1
    fi
    jver=$("$java" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')
    jmajor=${jver%%.*}
    if [ "$jmajor" = "1" ]; then jmajor=$(echo "$jver" | cut -d. -f2); fi  # 1.8 -> 8
    if ! [ "$jmajor" -ge 17 ] 2>/dev/null; then
      echo "the spark extra needs Java 17 or newer; $java -version says ${jver:-nothing}" >&2
      exit 1
    fi
    ;;
esac
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.onceq-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
  touch "$stamp"
fi
