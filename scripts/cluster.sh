#!/usr/bin/env bash
# A broker group to try on one machine: a single-member etcd and three brokers of group
# g1 on loopback (docs/cluster.md). Data and logs under $ONCEQ_CLUSTER_DIR
# (default /tmp/onceq-cluster).
#
#   bash scripts/cluster.sh          start; prints the bootstrap list for clients
#   bash scripts/cluster.sh status   onceq cluster status
#   bash scripts/cluster.sh stop     stop the brokers and etcd it started (data kept)
#
# Ports: etcd $ONCEQ_ETCD_PORT (2379) and the next one for its peers; brokers
# $ONCEQ_PORT (9876) and the next two.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir="${ONCEQ_CLUSTER_DIR:-/tmp/onceq-cluster}"
etcd_port="${ONCEQ_ETCD_PORT:-2379}"
port="${ONCEQ_PORT:-9876}"
onceq="onceq"
if [ -x "$here/.venv/bin/onceq" ]; then onceq="$here/.venv/bin/onceq"; fi
endpoint="etcd://127.0.0.1:$etcd_port"

stop_pid() {  # stop the process whose id is in file $1, if it still runs
  local f="$1"
  [ -f "$f" ] || return 0
  local pid; pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$f"
}

case "${1:-start}" in
  start)
    bash "$here/scripts/etcd.sh"
    mkdir -p "$dir"
    if [ -f "$dir/etcd.pid" ] && kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
      echo "already running (bash scripts/cluster.sh stop first)" >&2
      exit 1
    fi
    if curl -fsS "http://127.0.0.1:$etcd_port/health" >/dev/null 2>&1; then
      # e.g. started by scripts/services.sh etcd: used, and left running by stop
      echo "using the etcd already running at 127.0.0.1:$etcd_port"
    else
    etcd --name onceq --data-dir "$dir/etcd" \
      --listen-client-urls "http://127.0.0.1:$etcd_port" \
      --advertise-client-urls "http://127.0.0.1:$etcd_port" \
      --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
      --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
      --initial-cluster "onceq=http://127.0.0.1:$((etcd_port + 1))" \
      --log-level warn >"$dir/etcd.log" 2>&1 &
    echo $! >"$dir/etcd.pid"
    for _ in $(seq 100); do
      curl -fsS "http://127.0.0.1:$etcd_port/health" >/dev/null 2>&1 && break
      sleep 0.1
    done
    fi
    bootstrap=""
    for i in 1 2 3; do
      p=$((port + i - 1))
      "$onceq" broker start --data-dir "$dir/b$i" --port "$p" --cluster "$endpoint" \
        --group g1 --broker-id "$i" --auto-create-topics >"$dir/b$i.log" 2>&1 &
      echo $! >"$dir/b$i.pid"
      bootstrap="${bootstrap:+$bootstrap,}127.0.0.1:$p"
    done
    echo "etcd at $endpoint; brokers of group g1 at $bootstrap (logs in $dir)"
    echo "try: $onceq cluster status --cluster $endpoint"
    echo "     Producer(\"$bootstrap\") / PushConsumer(\"$bootstrap\", ...)"
    ;;
  status)
    "$onceq" cluster status --cluster "$endpoint"
    ;;
  stop)
    for i in 1 2 3; do stop_pid "$dir/b$i.pid"; done
    stop_pid "$dir/etcd.pid"
    echo "stopped (data kept in $dir)"
    ;;
  *)
    echo "usage: bash scripts/cluster.sh [start|status|stop]" >&2
    exit 2
    ;;
esac
