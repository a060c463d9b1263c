#!/usr/bin/env bash
# Make sure headless Chromium is installed (the demo report's rendering test needs it):
# Debian's `chromium` package, installed with apt-get when missing. Fails loudly.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "chromium is missing and installing it needs root (apt-get install chromium)" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is missing and apt-get is not available: install Chromium by hand" >&2
  exit 1
fi
echo "installing chromium (apt-get) for the HTML report test" >&2
$sudo apt-get update -qq
if ! DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null; then
  echo "apt-get install chromium failed" >&2
  exit 1
fi
command -v chromium >/dev/null 2>&1 || { echo "chromium still not found after install" >&2; exit 1; }
