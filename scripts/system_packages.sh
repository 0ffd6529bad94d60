#!/usr/bin/env bash
# Install the Debian packages some tests drive for real, if they are missing:
#
#   bash scripts/system_packages.sh chromium [prometheus ...]
#
# A package counts as present when dpkg has it installed or a command of its name is on PATH (a Chromium or a
# Prometheus installed another way is used as it is). Missing ones are installed with apt-get (as root, or through
# sudo), after one `apt-get update`. `make test` runs it with $(SYSTEM_PACKAGES) (Makefile). Exit 0 when every
# package is present at the end; else 1, with one line saying which package and how to install it.
#
# Which tests need which package: chromium, tests/test_dashboard_browser.py (`cmemi dashboard` in a real browser);
# prometheus, tests/test_prometheus.py (a real Prometheus scrapes a run through RUN_DIR/prometheus/targets.json);
# iptables, the emulated hosts' blocked ports and cuts (tests/helpers/netns_cluster.py: test_netns*, test_partitions*,
# test_soak; a fresh Debian has none, and those tests failed at their first `iptables`).

set -Eeuo pipefail

(( $# )) || { echo "usage: $0 PACKAGE [PACKAGE ...]" >&2; exit 2; }

present() { command -v "$1" >/dev/null 2>&1 || dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }

missing=()
for pkg in "$@"; do
    present "$pkg" || missing+=("$pkg")
done
(( ${#missing[@]} )) || exit 0

if ! command -v apt-get >/dev/null; then
    echo "system_packages: ${missing[*]} missing and no apt-get here: install them with this system's package manager" >&2
    exit 1
fi
as_root=()
if (( $(id -u) != 0 )); then
    command -v sudo >/dev/null || { echo "system_packages: ${missing[*]} missing: run as root (or install sudo)" >&2; exit 1; }
    as_root=(sudo)
fi
echo "system_packages: installing ${missing[*]}" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { timeout 900 "${as_root[@]}" apt-get update -qq \
       && DEBIAN_FRONTEND=noninteractive timeout 900 "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
              "${missing[@]}"; } >"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "system_packages: apt-get install ${missing[*]} failed (output above)" >&2
    exit 1
fi
for pkg in "${missing[@]}"; do
    present "$pkg" || { echo "system_packages: $pkg still missing after apt-get install" >&2; exit 1; }
done
