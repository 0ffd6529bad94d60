#!/usr/bin/env bash
# The Debian packages the tests start as real servers, installed when absent (`make test` runs this first):
#   prometheus — tests/test_prometheus.py scrapes a real run through RUN_DIR/prometheus/targets.json.
# Installing needs root; without it a missing package is named and the script fails (the tests would fail anyway,
# loudly, not skip).
set -euo pipefail
missing=()
command -v prometheus >/dev/null || [[ -x /usr/bin/prometheus ]] || missing+=(prometheus)
(( ${#missing[@]} )) || exit 0
if [[ $(id -u) != 0 ]]; then
    echo "scripts/system_packages.sh: missing ${missing[*]}; install as root: apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "scripts/system_packages.sh: installing ${missing[*]}"
log=$(mktemp)
timeout 900 apt-get update -qq >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
    || { tail -20 "$log" >&2; exit 1; }
rm -f "$log"
