#!/usr/bin/env python3
"""Container healthcheck: is this container's CMEMI process registered in Redis and heartbeating?

Usage (compose `healthcheck.test`): cmemi-healthcheck ROLE   (coordinator, aggregator, checkpointer, worker)

Reads the same config as the service (CMEMI_CONFIG, default /app/examples/digits.yaml, plus the
CMEMI__SECTION__FIELD environment overrides) to find the run name, and the Redis URL as the services do:
CMEMI_REDIS_URL, else cluster.redis. Healthy when a
member record of ROLE whose host is this container's hostname is running and its heartbeat key (which
expires `cluster.dead_after` after the last beat) still holds that record's incarnation. Exit 0
healthy, 1 unhealthy. A process that finished cleanly (record state `stopped`) counts as healthy.
"""

from __future__ import annotations

import os
import socket
import sys


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in ("coordinator", "aggregator", "checkpointer", "worker"):
        print("usage: cmemi-healthcheck {coordinator,aggregator,checkpointer,worker}", file=sys.stderr)
        return 2
    role = sys.argv[1]
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.coordination.keys import Keys
    from cmemi.shared.coordination.membership import connect

    cfg = load_config(os.environ.get("CMEMI_CONFIG", "/app/examples/digits.yaml"))
    url = os.environ.get("CMEMI_REDIS_URL") or cfg.cluster.redis  # shared.service.redis_url's order, without --redis
    if not url:
        print("unhealthy: no Redis URL (set CMEMI_REDIS_URL or CMEMI__CLUSTER__REDIS)")
        return 1
    keys = Keys(cfg.run.name)
    client = connect(url)
    host = socket.gethostname()
    for key in client.scan_iter(match=keys.member(role, "*"), count=500):
        record = client.hgetall(key)
        if record.get("host") != host:
            continue
        if record.get("state") == "stopped":
            print(f"healthy: {role} {record.get('id')} stopped cleanly")
            return 0
        beat = client.get(keys.heartbeat(role, record.get("id", "")))
        if beat is not None and beat.split(":", 1)[0] == record.get("incarnation"):
            print(f"healthy: {role} {record.get('id')} incarnation {record.get('incarnation')} heartbeating")
            return 0
    print(f"unhealthy: no live heartbeat of a {role} on host {host} in run {cfg.run.name!r}")
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # Redis down, bad config...: unhealthy, with the reason in `docker inspect`
        print(f"unhealthy: {type(exc).__name__}: {exc}")
        sys.exit(1)
