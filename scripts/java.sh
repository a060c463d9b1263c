#!/usr/bin/env bash
# Make sure Java 17+ is there for pyspark (the demo's Spark step and the Spark tests):
# Debian's `openjdk-17-jre-headless`, installed with apt-get when missing. Fails loudly.
set -euo pipefail
java_ok() {
  command -v java >/dev/null 2>&1 || return 1
  local v
  v=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  [ -n "$v" ] && [ "$v" -ge 17 ]
}
java_ok && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v apt-get >/dev/null 2>&1 || { [ -n "$sudo" ] && ! command -v sudo >/dev/null; }; then
  echo "pyspark needs Java 17 or newer: install a JRE (e.g. openjdk-17-jre-headless)" >&2
  exit 1
fi
echo "installing Java 17 (apt-get) for pyspark" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openjdk-17-jre-headless >/dev/null
java_ok || { echo "Java 17+ still not found after install" >&2; exit 1; }
