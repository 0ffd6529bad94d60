"""RUN_DIR/prometheus/targets.json: the run's /metrics endpoints in Prometheus's file-based service discovery
format (`file_sd_configs`), kept current by `cmemi up` while the run goes (metrics.enabled).

Each service advertises its endpoint in its Redis member record (`metrics_url`, shared/runtime/metrics.py); a
port is free-picked per process, so only this file can tell Prometheus where to scrape. A killed process's record
stays until its replacement registers under the same id: its target stays in the file meanwhile (Prometheus shows
it down, which is what an operator should see), then the replacement's takes its place. A process that stopped
cleanly (`state: stopped`) leaves the file. The file is rewritten whole (atomic rename) only when it changes:
Prometheus never reads half of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import table
from cmemi.shared.runtime import atomic


def targets(client: redis.Redis, keys: Keys, run: str) -> list[dict[str, Any]]:
    """One file_sd group per advertised endpoint, labelled job/run/role/id/incarnation (and worker, for workers)."""
    out = []
    for key in sorted(client.scan_iter(match=keys.member("*", "*"), count=500)):
        rec = table(client.hgetall(key))
        url = rec.get("metrics_url")
        if not url or rec.get("state") == "stopped" or "role" not in rec:
            continue
        labels = {"job": "cmemi", "run": run, "role": rec["role"], "id": rec.get("id", ""),
                  "incarnation": rec.get("incarnation", "")}
        if rec["role"] == "worker":
            labels["worker"] = rec.get("id", "")
        out.append({"targets": [urlsplit(url).netloc], "labels": labels})
    return out


class TargetsFile:
    def __init__(self, run_dir: Path, client: redis.Redis, keys: Keys, run: str) -> None:
        self.path = run_dir / "prometheus" / "targets.json"
        self.client, self.keys, self.run = client, keys, run
        self.written: str | None = None

    def refresh(self) -> None:
        """Rewrite the file if the endpoints changed. Redis down or restarting: the file stays as it is."""
        try:
            text = json.dumps(targets(self.client, self.keys, self.run), indent=1) + "\n"
        except redis.RedisError:
            return
        if text != self.written:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(self.path, text)
            self.written = text
