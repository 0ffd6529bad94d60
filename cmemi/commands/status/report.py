"""One status report, from the run's Redis when it answers, else from the run's files (with a note saying why)."""

from __future__ import annotations

from typing import Any

import redis

from cmemi.commands.status.files import from_files
from cmemi.commands.status.live import from_redis
from cmemi.commands.status.target import StatusError, Target, has_files
from cmemi.shared.coordination.keys import Keys


def collect(target: Target, n_events: int = 8, timeout: float = 2.0) -> dict[str, Any]:
    """The report from Redis; from the run directory's files (with a `note` saying why) when Redis is gone."""
    reason = None
    if target.redis_url is not None and target.run is not None:  # (Target names the run wherever Redis is known)
        try:
            client = redis.Redis.from_url(target.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                          decode_responses=True)
            # cluster.json is written by a live `cmemi up` right after it clears the run's keys: no key yet is "starting"
            starting = (target.from_cluster_json and target.run_dir is not None
                        and not (target.run_dir / "summary.json").is_file())
            try:
                report = from_redis(client, Keys(target.run), target.run_dir, n_events, starting=starting)
            finally:
                client.close()
            report.update(run=target.run, redis=target.redis_label,
                          run_dir=str(target.run_dir) if target.run_dir is not None else None)
            return report
        except LookupError as exc:
            reason = f"{exc} (redis {target.redis_label})"
        except (redis.RedisError, OSError) as exc:
            if target.run_dir is None or not (target.run_dir / "summary.json").is_file():
                reason = f"cannot reach redis at {target.redis_label} ({one_line(exc)})"
            # else: the run completed and its Redis went with it (embedded): the files are the whole story
    if target.run_dir is not None and has_files(target.run_dir):
        report = from_files(target.run_dir, n_events)
        report.update(run=target.run, redis=target.redis_label, run_dir=str(target.run_dir),
                      note=(f"{reason}; " if reason else "") + f"showing the files in {target.run_dir}")
        return report
    hint = "is the run still running? check --redis/--run" if reason and "reach" in reason else "check --run"
    raise StatusError(f"{reason}; {hint}" if reason else "nothing to show")


def one_line(exc: BaseException) -> str:
    """The first line of an error, for a report's note (redis-py's messages can run over several lines)."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
