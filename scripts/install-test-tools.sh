#!/usr/bin/env bash
# Debian packages the observability tests run for real: `prometheus` (with promtool) for
# tests/test_dashboards_prometheus.py and `chromium` for tests/test_web_ui.py. Idempotent: installs only what is
# missing, so a machine that has them (or a CI image that cached them) does nothing. Nothing is downloaded but
# Debian packages: the browser test drives this chromium, never a downloaded one.
set -euo pipefail

missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if ((${#missing[@]} == 0)); then
    echo "[install-test-tools] prometheus and chromium already installed"
    exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "[install-test-tools] need root or sudo for apt-get" >&2; exit 1; }
    sudo=(sudo)
fi
echo "[install-test-tools] installing ${missing[*]}"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v chromium >/dev/null
