"""cmemi-healthcheck (docker/healthcheck.py, the containers' healthcheck and liveness probe) finds Redis as the
services do, CMEMI_REDIS_URL first (how the swarm stack and the Kubernetes manifests pass it), against a real
redis-server: unhealthy until this host's process is registered and heartbeating, healthy then."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect

from tests.conftest import ROOT

HEALTHCHECK = ROOT / "docker" / "healthcheck.py"


def check(role: str, **env: str) -> tuple[int, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CMEMI")}
    r = subprocess.run([sys.executable, str(HEALTHCHECK), role], env={**base, **env}, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout.strip()


def test_healthcheck_reads_the_redis_url_from_cmemi_redis_url(redis_server) -> None:
    config = str(ROOT / "examples" / "digits.yaml")  # cluster.redis is not set there
    rc, out = check("worker", CMEMI_CONFIG=config)
    assert rc == 1 and out.startswith("unhealthy: no Redis URL"), out

    env = {"CMEMI_CONFIG": config, "CMEMI_REDIS_URL": redis_server.url}
    rc, out = check("worker", **env)
    assert rc == 1 and out.startswith("unhealthy: no live heartbeat of a worker"), out

    client, keys = connect(redis_server.url), Keys("digits")
    client.hset(keys.member("worker", "w0"), mapping={"id": "w0", "host": socket.gethostname(),
                                                      "incarnation": "7", "state": "running"})
    client.set(keys.heartbeat("worker", "w0"), "7:0")
    rc, out = check("worker", **env)
    assert rc == 0 and out == "healthy: worker w0 incarnation 7 heartbeating", out
    rc, out = check("aggregator", **env)  # another role on this host is not registered
    assert rc == 1, out
