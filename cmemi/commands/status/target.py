"""Where `cmemi status` looks: the run's Redis (URL and run name) and/or its run directory.

The Redis URL and run name come from RUN_DIR/cluster.json (written by `cmemi up`), or from `--redis URL --run NAME`
for a cluster started another way; RUN_DIR/config.yaml gives the schedule (read as plain YAML: no validation, no
plugin imports, so status works on a run whose user code is not importable here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cmemi.commands.status.values import number
from cmemi.shared.errors import UserError


class StatusError(UserError):
    """A one-line, user-facing reason why no status can be shown."""


class Target:
    """Where to look: a Redis URL and run name, and/or a run directory."""

    def __init__(self, run_dir: str | Path | None = None, redis_url: str | None = None, run: str | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.redis_url, self.run = redis_url, run
        self.from_cluster_json = False
        if self.run_dir is not None:
            info = read_json(self.run_dir / "cluster.json") or {}
            self.from_cluster_json = bool(info.get("redis")) and redis_url is None
            self.redis_url = self.redis_url or info.get("redis")
            self.run = self.run or info.get("run") or config_value(self.run_dir, "run", "name")
        if self.redis_url is None and (self.run_dir is None or not has_files(self.run_dir)):
            where = f"{self.run_dir}/cluster.json not found" if self.run_dir is not None else "no RUN_DIR"
            raise StatusError(f"{where}; pass the run directory of a `cmemi up` run, or --redis URL --run NAME")
        if self.redis_url is not None and self.run is None:
            raise StatusError("the run name is unknown; pass --run NAME (the config's run.name)")

    @property
    def redis_label(self) -> str | None:
        return redis_label(self.redis_url) if self.redis_url else None


def redis_label(url: str) -> str:
    """host:port/db of a Redis URL, never its password."""
    try:
        u = urlsplit(url)
        db = u.path.strip("/") or "0"
        return f"{u.hostname}:{u.port or 6379}/{db}"
    except ValueError:
        return "<unparsable redis url>"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def config_value(run_dir: Path, section: str, key: str) -> Any:
    """One field of RUN_DIR/config.yaml (plain YAML read: no validation, no plugin imports)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return (cfg.get(section) or {}).get(key)
    except Exception:  # missing or broken config.yaml (OSError, yaml.YAMLError, ...): status goes on without it
        return None


def schedule(run_dir: Path | None) -> tuple[int | None, int]:
    """(the servers' steps, train.local_steps) from RUN_DIR/config.yaml: with local steps a step is a round."""
    if run_dir is None:
        return None, 0
    steps = number(config_value(run_dir, "train", "steps"), int)
    local = number(config_value(run_dir, "train", "local_steps"), int) or 0
    local //= max(1, number(config_value(run_dir, "train", "fragments"), int) or 1)  # streaming: a step is a segment
    return (steps // local if steps is not None and local else steps), local


def has_files(run_dir: Path) -> bool:
    """The run directory holds a run's files: a report can be built from them."""
    return any((run_dir / n).is_file() for n in ("summary.json", "metrics.jsonl", "events.jsonl"))
