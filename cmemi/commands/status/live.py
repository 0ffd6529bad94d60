"""The report of a running run, from its Redis keys (plus RUN_DIR/metrics.jsonl for rates when local).

A worker's state is read from three keys in one round trip: its member record, its heartbeat (a TTL key) and its
fence. Everything here is read-only: status never writes to Redis.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import redis

from cmemi.commands.status.files import eval_rows, rates, read_metrics
from cmemi.commands.status.target import schedule
from cmemi.commands.status.values import natural_key, number
from cmemi.shared.coordination.keys import Keys

ROLES = ("coordinator", "aggregator", "checkpointer")


def _checkpoint_path(run_dir: Path | None, step: int | None) -> str | None:
    if run_dir is None or step is None:
        return None
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    return str(path) if path.is_dir() else None


def _members(client: redis.Redis, keys: Keys, who: list[tuple[str, str]], now: float) -> list[dict[str, Any]]:
    """The member records of (role, id)s that have one, with heartbeat age and fencing: one round trip."""
    pipe = client.pipeline(transaction=False)
    for role, ident in who:
        pipe.hgetall(keys.member(role, ident))
        pipe.get(keys.heartbeat(role, ident))
        pipe.get(keys.fence(role, ident))
    res = pipe.execute()
    out = []
    for i, (role, ident) in enumerate(who):
        rec, hb, fence_value = res[3 * i: 3 * i + 3]
        m = _member(role, ident, rec, hb, fence_value, now=now)
        if m is not None:
            out.append(m)
    return out


def _member(role: str, ident: str, rec: dict[str, str], hb: str | None, fence_value: str | None,
            now: float) -> dict[str, Any] | None:
    if not rec:
        return None
    inc = number(rec.get("incarnation"), int)
    fence = number(fence_value, int)
    hb_age = None
    if hb is not None:
        _inc, _, ts = hb.partition(":")
        hb_age = max(0.0, now - float(ts)) if number(ts) is not None else None
    if fence is not None and inc is not None and fence >= inc:
        state = "fenced"
    elif rec.get("state") == "stopped":
        state = "stopped"
    elif hb is not None:
        state = "running"
    else:
        state = "no heartbeat"  # dead or hung: the coordinator fences and replaces it after cluster.dead_after
    out: dict[str, Any] = {
        "id": ident, "role": role, "incarnation": inc, "host": rec.get("host"), "pid": number(rec.get("pid"), int),
        "state": state, "heartbeat_age_s": hb_age, "started_at": number(rec.get("started_at")),
    }
    for extra in ("addr", "term", "metrics_url", "transport"):
        if extra in rec:
            out[extra] = number(rec[extra], int) if extra == "term" else rec[extra]
    return out


def from_redis(client: redis.Redis, keys: Keys, run_dir: Path | None = None, n_events: int = 8,
               now: float | None = None, starting: bool = False) -> dict[str, Any]:
    """The status report, from the run's Redis keys (plus RUN_DIR/metrics.jsonl for rates when local).

    A run without any key yet is "starting" when `starting` (`cmemi up` clears the keys and writes
    cluster.json before the coordinator is up), and a LookupError otherwise (a wrong --run).
    """
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.state)
    pipe.get(keys.error)
    pipe.hgetall(keys.progress)
    pipe.hgetall(keys.aggregator)
    pipe.get(keys.ckpt_latest)
    pipe.exists(keys.events)
    pipe.hgetall(keys.prefix + "microbatches")
    state, error, progress, agg, ckpt, has_events, mb_done = pipe.execute()
    if state is None and not progress and not agg and not has_events and not starting:
        raise LookupError(f"no run named {keys.prefix[len('cmemi:'):-1]!r} in this Redis")
    gaps: list[str] = []
    report: dict[str, Any] = {
        "source": "redis", "time": now, "state": state or "starting", "error": error,
        "step": number(progress.get("step"), int) or 0,
        "total": number(progress.get("total"), int) or schedule(run_dir)[0],
        "local_steps": number(progress.get("local_steps"), int) or schedule(run_dir)[1],
        "loss": number(progress.get("loss")), "lr": number(progress.get("lr")),
        "samples_per_s": number(progress.get("samples_s")), "bytes_per_s": number(progress.get("bytes_s")),
        "live_workers": number(progress.get("live_workers"), int),
        "progress_age_s": max(0.0, now - float(progress["t"])) if number(progress.get("t")) is not None else None,
        "term": number(agg.get("term"), int) or number(progress.get("term"), int),
    }
    rows = read_metrics(run_dir, tail_bytes=64 * 1024) if run_dir is not None else []
    if rows:
        samples_s, bytes_s = rates(rows)
        report["samples_per_s"] = samples_s if samples_s is not None else report["samples_per_s"]
        if report["bytes_per_s"] is None:
            report["bytes_per_s"] = bytes_s
        evals = eval_rows(rows)
        if evals:
            report["eval"] = {"step": evals[-1].get("step"), **evals[-1]["eval"]}
    if report["bytes_per_s"] is None:
        gaps.append("bytes_per_s: not in Redis progress (needs RUN_DIR/metrics.jsonl on this host)")

    services = {m["role"]: m for m in _members(client, keys, [(role, "0") for role in ROLES], now)}
    if agg:
        services.setdefault("aggregator", {"id": "0", "role": "aggregator"}).update(
            {"addr": agg.get("addr"), "term": number(agg.get("term"), int)})
    report["services"] = services

    prefix = keys.member("worker", "")
    ids = [key[len(prefix):] for key in client.scan_iter(match=prefix + "*", count=500)]
    workers = _members(client, keys, [("worker", ident) for ident in ids], now)
    for m in workers:
        ident = m["id"]
        done = mb_done.get(f"{ident}:{m['incarnation']}", mb_done.get(ident)) if mb_done else None
        m["microbatches_done"] = number(done, int)
    workers.sort(key=lambda w: natural_key(w["id"]))
    report["workers"] = workers
    if not mb_done:
        gaps.append("microbatches_done: per-worker microbatch counts are not in Redis")

    ckpt_step = number(ckpt, int)
    report["checkpoint"] = {"step": ckpt_step, "path": _checkpoint_path(run_dir, ckpt_step)}
    events = []
    # [(entry id, fields)], decoded (shared/coordination/membership.py, `text`)
    newest = cast("list[tuple[str, dict[str, str]]]", client.xrevrange(keys.events, count=n_events))
    for entry_id, fields in reversed(newest):
        try:
            events.append({"id": entry_id, **json.loads(fields["json"])})
        except (KeyError, ValueError):
            continue
    report["events"] = events
    report["gaps"] = gaps
    return report
