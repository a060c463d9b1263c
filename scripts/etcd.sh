#!/usr/bin/env bash
# Make sure the etcd binary is installed (the cluster tests start their own private etcd
# from it): Debian's `etcd-server`, installed with apt-get when missing. Starts no service.
# Fails loudly.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "etcd is missing and installing it needs root (apt-get install etcd-server)" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "etcd is missing and apt-get is not available: install etcd 3.4+ by hand" >&2
  exit 1
fi
echo "installing etcd (apt-get install etcd-server) for the cluster tests" >&2
$sudo apt-get update -qq
if ! DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq etcd-server >/dev/null; then
  echo "apt-get install etcd-server failed" >&2
  exit 1
fi
command -v etcd >/dev/null 2>&1 || { echo "etcd still not found after install" >&2; exit 1; }
