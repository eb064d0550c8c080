#!/usr/bin/env bash
# A real Prometheus scrapes a real tensorserve under load, and every PromQL
# query of docs/observability.md and docs/grafana-dashboard.json must answer
# sane values through Prometheus's HTTP API (scripts/check_prometheus.py).
# Installs Debian's prometheus package first unless one is on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi
prometheus --version 2>&1 | head -n 1
exec python scripts/check_prometheus.py "$@"
