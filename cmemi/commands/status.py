"""`cmemi status RUN_DIR`: what a run is doing now, read from its Redis (or from its files once it ended).

The Redis URL and run name come from RUN_DIR/cluster.json (written by `cmemi up`), or from
`--redis URL --run NAME` for a cluster started another way. When Redis cannot be reached but the run
directory holds the run's files (summary.json, metrics.jsonl, events.jsonl), the report is built from
those and says so. `--json` prints the same report as one JSON object (one per line with `--watch`).

Everything here is read-only: status never writes to Redis or to the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from cmemi.shared.coordination.keys import Keys
from cmemi.shared.errors import UserError
from cmemi.shared.runtime.exits import Exit

ROLES = ("coordinator", "aggregator", "checkpointer")
FINAL_STATES = ("completed", "failed")
METRICS_WINDOW = 20  # logged steps averaged for samples/s and bytes/s


class StatusError(UserError):
    """A one-line, user-facing reason why no status can be shown."""


# ---------------------------------------------------------------------------------------------- target
class Target:
    """Where to look: a Redis URL and run name, and/or a run directory."""

    def __init__(self, run_dir: str | Path | None = None, redis_url: str | None = None, run: str | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.redis_url, self.run = redis_url, run
        self.from_cluster_json = False
        if self.run_dir is not None:
            info = _read_json(self.run_dir / "cluster.json") or {}
            self.from_cluster_json = bool(info.get("redis")) and redis_url is None
            self.redis_url = self.redis_url or info.get("redis")
            self.run = self.run or info.get("run") or _config_value(self.run_dir, "run", "name")
        if self.redis_url is None and (self.run_dir is None or not _has_files(self.run_dir)):
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _config_value(run_dir: Path, section: str, key: str) -> Any:
    """One field of RUN_DIR/config.yaml (plain YAML read: no validation, no plugin imports)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return (cfg.get(section) or {}).get(key)
    except Exception:  # missing or broken config.yaml (OSError, yaml.YAMLError, ...): status goes on without it
        return None


def _schedule(run_dir: Path | None) -> tuple[int | None, int]:
    """(the servers' steps, train.local_steps) from RUN_DIR/config.yaml: with local steps a step is a round."""
    if run_dir is None:
        return None, 0
    steps, local = _num(_config_value(run_dir, "train", "steps"), int), _num(_config_value(run_dir, "train",
                                                                                          "local_steps"), int) or 0
    local //= max(1, _num(_config_value(run_dir, "train", "fragments"), int) or 1)  # streaming: a step is a segment
    return (steps // local if steps is not None and local else steps), local


def _has_files(run_dir: Path) -> bool:
    return any((run_dir / n).is_file() for n in ("summary.json", "metrics.jsonl", "events.jsonl"))


# ---------------------------------------------------------------------------------------------- helpers
def _num(value: Any, kind: type = float) -> Any:
    if value is None or value == "":
        return None
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        return None


def read_metrics(run_dir: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl lines (only the last `tail_bytes` of the file when given); bad or partial lines skipped."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            if tail_bytes is not None:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - tail_bytes))
                data = f.read()
                if size > tail_bytes:
                    data = data[data.find(b"\n") + 1:]  # drop the cut first line
            else:
                data = f.read()
    except OSError:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written right now
        if isinstance(row, dict):
            out.append(row)
    return out


def read_events_file(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = (run_dir / "events.jsonl").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and "kind" in ev:
            out.append(ev)
    return sorted(out, key=lambda e: e.get("t", 0))


def rates(rows: list[dict[str, Any]], window: int = METRICS_WINDOW) -> tuple[float | None, float | None]:
    """(samples/s, bytes/s) over the last `window` logged steps: total work / total step time."""
    steps = [r for r in rows if "loss" in r and r.get("step_time_s")][-window:]
    dt = sum(float(r["step_time_s"]) for r in steps)
    if not steps or dt <= 0:
        return None, None
    samples = sum(float(r["samples_per_s"]) * float(r["step_time_s"]) for r in steps if r.get("samples_per_s"))
    nbytes = sum(float(r.get("bytes_in") or 0) + float(r.get("bytes_out") or 0) for r in steps)
    has_bytes = any("bytes_in" in r or "bytes_out" in r for r in steps)
    return samples / dt, (nbytes / dt if has_bytes else None)


def _natural(ident: str) -> tuple:
    head = ident.rstrip("0123456789")
    tail = ident[len(head):]
    return head, int(tail) if tail else -1


def _checkpoint_path(run_dir: Path | None, step: int | None) -> str | None:
    if run_dir is None or step is None:
        return None
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    return str(path) if path.is_dir() else None


def _eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if isinstance(r.get("eval"), dict)]


# ---------------------------------------------------------------------------------------------- redis
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
        m = _member(role, ident, *res[3 * i: 3 * i + 3], now=now)
        if m is not None:
            out.append(m)
    return out


def _member(role: str, ident: str, rec: dict[str, str], hb: str | None, fence_value: str | None,
            now: float) -> dict[str, Any] | None:
    if not rec:
        return None
    inc = _num(rec.get("incarnation"), int)
    fence = _num(fence_value, int)
    hb_age = None
    if hb is not None:
        _inc, _, ts = hb.partition(":")
        hb_age = max(0.0, now - float(ts)) if _num(ts) is not None else None
    if fence is not None and inc is not None and fence >= inc:
        state = "fenced"
    elif rec.get("state") == "stopped":
        state = "stopped"
    elif hb is not None:
        state = "running"
    else:
        state = "no heartbeat"  # dead or hung: the coordinator fences and replaces it after cluster.dead_after
    out: dict[str, Any] = {
        "id": ident, "role": role, "incarnation": inc, "host": rec.get("host"), "pid": _num(rec.get("pid"), int),
        "state": state, "heartbeat_age_s": hb_age, "started_at": _num(rec.get("started_at")),
    }
    for extra in ("addr", "term", "metrics_url", "transport"):
        if extra in rec:
            out[extra] = _num(rec[extra], int) if extra == "term" else rec[extra]
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
        "step": _num(progress.get("step"), int) or 0,
        "total": _num(progress.get("total"), int) or _schedule(run_dir)[0],
        "local_steps": _num(progress.get("local_steps"), int) or _schedule(run_dir)[1],
        "loss": _num(progress.get("loss")), "lr": _num(progress.get("lr")),
        "samples_per_s": _num(progress.get("samples_s")), "bytes_per_s": _num(progress.get("bytes_s")),
        "live_workers": _num(progress.get("live_workers"), int),
        "progress_age_s": max(0.0, now - float(progress["t"])) if _num(progress.get("t")) is not None else None,
        "term": _num(agg.get("term"), int) or _num(progress.get("term"), int),
    }
    rows = read_metrics(run_dir, tail_bytes=64 * 1024) if run_dir is not None else []
    if rows:
        samples_s, bytes_s = rates(rows)
        report["samples_per_s"] = samples_s if samples_s is not None else report["samples_per_s"]
        if report["bytes_per_s"] is None:
            report["bytes_per_s"] = bytes_s
        evals = _eval_rows(rows)
        if evals:
            report["eval"] = {"step": evals[-1].get("step"), **evals[-1]["eval"]}
    if report["bytes_per_s"] is None:
        gaps.append("bytes_per_s: not in Redis progress (needs RUN_DIR/metrics.jsonl on this host)")

    services = {m["role"]: m for m in _members(client, keys, [(role, "0") for role in ROLES], now)}
    if agg:
        services.setdefault("aggregator", {"id": "0", "role": "aggregator"}).update(
            {"addr": agg.get("addr"), "term": _num(agg.get("term"), int)})
    report["services"] = services

    prefix = keys.member("worker", "")
    ids = [key[len(prefix):] for key in client.scan_iter(match=prefix + "*", count=500)]
    workers = _members(client, keys, [("worker", ident) for ident in ids], now)
    for m in workers:
        ident = m["id"]
        done = mb_done.get(f"{ident}:{m['incarnation']}", mb_done.get(ident)) if mb_done else None
        m["microbatches_done"] = _num(done, int)
    workers.sort(key=lambda w: _natural(w["id"]))
    report["workers"] = workers
    if not mb_done:
        gaps.append("microbatches_done: per-worker microbatch counts are not in Redis")

    ckpt_step = _num(ckpt, int)
    report["checkpoint"] = {"step": ckpt_step, "path": _checkpoint_path(run_dir, ckpt_step)}
    events = []
    for entry_id, fields in reversed(client.xrevrange(keys.events, count=n_events)):
        try:
            events.append({"id": entry_id, **json.loads(fields["json"])})
        except (KeyError, ValueError):
            continue
    report["events"] = events
    report["gaps"] = gaps
    return report


# ---------------------------------------------------------------------------------------------- files
def from_files(run_dir: Path, n_events: int = 8) -> dict[str, Any]:
    """The status report of a run that is not running (or whose Redis is gone), from its files."""
    summary = _read_json(run_dir / "summary.json")
    rows = read_metrics(run_dir)
    events = read_events_file(run_dir)
    steps = [r for r in rows if "loss" in r]
    last = steps[-1] if steps else {}
    kinds = {e["kind"] for e in events}
    if isinstance(summary, dict):
        state = "completed"
    elif "run_failed" in kinds:
        state = "failed"
    else:
        state = "stopped"  # ended (Ctrl-C, crash) or its Redis is unreachable mid-run
    samples_s, bytes_s = rates(steps)
    report: dict[str, Any] = {
        "source": "files", "time": time.time(), "state": state,
        "error": next((e.get("error") for e in reversed(events) if e["kind"] == "run_failed"), None),
        "step": _num(last.get("step"), int) or 0,
        "total": _schedule(run_dir)[0],
        "local_steps": _schedule(run_dir)[1],
        "loss": _num(last.get("loss")), "lr": _num(last.get("lr")),
        "samples_per_s": samples_s, "bytes_per_s": bytes_s,
        "live_workers": _num(last.get("live_workers"), int),
        "progress_age_s": max(0.0, time.time() - float(last["t"])) if _num(last.get("t")) is not None else None,
        "term": next((e.get("term") for e in reversed(events) if e["kind"] == "aggregator_started"), None),
    }
    if isinstance(summary, dict):
        wall = _num(summary.get("wall_s"))
        nbytes = (_num(summary.get("bytes_sent")) or 0) + (_num(summary.get("bytes_received")) or 0)
        report.update({
            "step": _num(summary.get("steps"), int) or report["step"], "loss": _num(summary.get("final_loss")),
            "lr": _num(summary.get("final_lr"), float) if "final_lr" in summary else report["lr"],
            "samples_per_s": _num(summary.get("samples_per_s")),
            "bytes_per_s": nbytes / wall if wall else report["bytes_per_s"],
            "term": summary.get("term", report["term"]), "summary": summary,
        })
        if summary.get("eval"):
            report["eval"] = {"step": report["step"], **summary["eval"]}
    if "eval" not in report and _eval_rows(rows):
        ev = _eval_rows(rows)[-1]
        report["eval"] = {"step": ev.get("step"), **ev["eval"]}
    if report["total"] is None:
        report["total"] = report["step"] or None

    workers: dict[str, dict[str, Any]] = {}
    pids: dict[str, int] = {}  # worker id -> pid of the process started (or spare handed) for it last
    for e in events:
        if e["kind"] in ("process_started", "restarted") and e.get("role") == "worker" and e.get("pid"):
            pids[e.get("id")] = e["pid"]
        wid = e.get("worker") if e["kind"] in ("worker_started", "worker_admitted", "worker_left") else (
            e.get("id") if e.get("role") == "worker" and e["kind"] in ("died", "fenced") else None)
        if wid is None:
            continue
        w = workers.setdefault(wid, {"id": wid, "role": "worker", "incarnation": None, "host": None, "pid": None,
                                     "state": None, "heartbeat_age_s": None, "microbatches_done": None})
        if e["kind"] in ("worker_started", "worker_admitted") and e.get("incarnation") != w["incarnation"]:
            w["incarnation"], w["state"], w["host"] = e.get("incarnation"), "running", e.get("host", w["host"])
            w["pid"] = pids.get(wid, w["pid"])
        elif e["kind"] == "worker_left" and e.get("incarnation") == w["incarnation"]:
            w["state"] = "left"
        elif e["kind"] in ("died", "fenced") and e.get("incarnation") in (None, w["incarnation"]):
            w["state"] = e["kind"]
    for w in workers.values():
        if w["state"] == "running":  # the files cannot tell more: the run ended (its workers exited) or Redis is gone
            w["state"] = "exited" if state in FINAL_STATES else "unknown"
    report["workers"] = sorted(workers.values(), key=lambda w: _natural(w["id"]))
    report["services"] = {}
    saved = [e for e in events if e["kind"] == "checkpoint_saved"]
    ckpt_step = _num(saved[-1].get("step"), int) if saved else None
    report["checkpoint"] = {"step": ckpt_step, "path": saved[-1].get("path") if saved else None}
    report["events"] = events[-n_events:] if n_events else []
    report["gaps"] = ["heartbeats and pids: only in Redis while the run is running"]
    return report


# ---------------------------------------------------------------------------------------------- collect
def collect(target: Target, n_events: int = 8, timeout: float = 2.0) -> dict[str, Any]:
    """The report from Redis; from the run directory's files (with a `note` saying why) when Redis is gone."""
    reason = None
    if target.redis_url is not None:
        try:
            client = redis.Redis.from_url(target.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                          decode_responses=True)
            # cluster.json is written by a live `cmemi up` right after it clears the run's keys: no key yet is "starting"
            starting = target.from_cluster_json and not (target.run_dir / "summary.json").is_file()
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
                reason = f"cannot reach redis at {target.redis_label} ({_one_line(exc)})"
            # else: the run completed and its Redis went with it (embedded): the files are the whole story
    if target.run_dir is not None and _has_files(target.run_dir):
        report = from_files(target.run_dir, n_events)
        report.update(run=target.run, redis=target.redis_label, run_dir=str(target.run_dir),
                      note=(f"{reason}; " if reason else "") + f"showing the files in {target.run_dir}")
        return report
    hint = "is the run still running? check --redis/--run" if reason and "reach" in reason else "check --run"
    raise StatusError(f"{reason}; {hint}" if reason else "nothing to show")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# ---------------------------------------------------------------------------------------------- render
def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def human_bytes(n: float | None, suffix: str = "/s") -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}{suffix}" if unit == "B" else f"{n:.1f} {unit}{suffix}"
        n /= 1000
    return f"{n:.1f} GB{suffix}"


def _age(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    return fmt


def _event_details(ev: dict[str, Any]) -> str:
    parts = []
    who: tuple[str, ...] = ()
    if ev.get("role") and ev.get("id") is not None:
        parts.append(f"{ev['role']} {ev['id']}")  # who, first
        who = ("role", "id")
    elif isinstance(ev.get("worker"), str):
        parts.append(f"worker {ev['worker']}")
        who = ("worker",)
    for k, v in ev.items():
        if k in ("t", "kind") or k in who:
            continue
        if k == "id" and not ev.get("role"):
            continue  # the stream entry id
        if k == "params_sha256" and isinstance(v, str):
            v = v[:12]
        elif k == "path" and isinstance(v, str):
            v = Path(v).name
        elif isinstance(v, float):
            v = f"{v:.4g}"
        parts.append(f"{k}={v}")
    text = " ".join(parts)
    return text if len(text) <= 90 else text[:87] + "..."


def render(report: dict[str, Any], width: int = 24) -> str:
    """The human-readable table of a report."""
    lines = []
    where = f"redis {report['redis']}" if report["source"] == "redis" else "from files"
    stamp = time.strftime("%H:%M:%S", time.localtime(report["time"]))
    lines.append(f"run {report.get('run') or '-'}   state {report['state']}   ({where}, {stamp})")
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    if report.get("error"):
        lines.append(f"error: {report['error']}")
    step, total = report.get("step") or 0, report.get("total")
    filled = int(width * step / total) if total else 0
    pct = f"{100 * step / total:3.0f}%" if total else ""
    H = report.get("local_steps") or 0  # train.local_steps: a step of the servers is a round of H inner steps
    where = (f"round {step}/{_fmt(total)} (inner step {step * H}/{_fmt(total * H if total else None)})" if H
             else f"step {step}/{_fmt(total)}")
    lines.append(f"{where} [{'#' * filled}{'.' * (width - filled)}] {pct}".rstrip())
    lines.append(f"loss {_fmt(report.get('loss'), '.4g')}   lr {_fmt(report.get('lr'), '.4g')}   "
                 f"samples/s {_fmt(report.get('samples_per_s'), '.0f')}   "
                 f"bytes/s {human_bytes(report.get('bytes_per_s'))}   "
                 f"live workers {_fmt(report.get('live_workers'))}"
                 + (f"   last step {_age(report['progress_age_s'])} ago"
                    if report["source"] == "redis" and report.get("progress_age_s") is not None else ""))
    ev = report.get("eval")
    if ev:
        lines.append("eval " + "   ".join(f"{k} {_fmt(v, '.4g')}" for k, v in ev.items() if k != "step")
                     + f"   (step {_fmt(ev.get('step'))})")
    ckpt = report.get("checkpoint") or {}
    lines.append(f"aggregator term {_fmt(report.get('term'))}   latest checkpoint "
                 f"{'step ' + str(ckpt['step']) if ckpt.get('step') is not None else '-'}"
                 + (f" ({ckpt['path']})" if ckpt.get("path") else ""))
    lines.append("")
    services = report.get("services") or {}
    if services:
        lines.append("services")
        rows = [[s.get("role", r), _fmt(s.get("incarnation")), _fmt(s.get("host")), _fmt(s.get("pid")),
                 _fmt(s.get("state")), _age(s.get("heartbeat_age_s")), _fmt(s.get("addr"))]
                for r, s in services.items()]
        lines += _table(["role", "incarnation", "host", "pid", "state", "heartbeat", "address"], rows)
        lines.append("")
    workers = report.get("workers") or []
    lines.append(f"workers ({sum(1 for w in workers if w.get('state') == 'running')} running)")
    if workers:
        rows = [[w["id"], _fmt(w.get("incarnation")), _fmt(w.get("host")), _fmt(w.get("pid")), _fmt(w.get("state")),
                 _age(w.get("heartbeat_age_s")), _fmt(w.get("microbatches_done")), _fmt(w.get("transport"))]
                for w in workers]
        lines += _table(["id", "incarnation", "host", "pid", "state", "heartbeat", "microbatches", "transport"], rows)
    else:
        lines.append("  (none registered yet)")
    lines.append("")
    events = report.get("events") or []
    lines.append("recent events")
    for e in events:
        t = time.strftime("%H:%M:%S", time.localtime(e["t"])) if isinstance(e.get("t"), (int, float)) else "--:--:--"
        lines.append(f"  {t}  {e.get('kind', '?'):<20} {_event_details(e)}".rstrip())
    if not events:
        lines.append("  (none)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- cli
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi status", description="What a run is doing now (read from its Redis).")
    p.add_argument("run_dir", nargs="?", help="the run directory (its cluster.json names the Redis)")
    p.add_argument("--redis", default=None, metavar="URL", help="Redis URL of a cluster started another way")
    p.add_argument("--run", default=None, metavar="NAME", help="the run name (run.name) with --redis")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds until the run ends")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--events", type=int, default=8, metavar="N", help="how many recent events to show")
    p.add_argument("--json", action="store_true", help="print the report as JSON (one object per line with --watch)")
    args = p.parse_args(argv)
    if args.run_dir is None and args.redis is None:
        p.error("pass RUN_DIR, or --redis URL --run NAME")
    try:
        target = Target(args.run_dir, args.redis, args.run)
        if not args.watch:
            _show(collect(target, args.events), args.json, clear=False)
            return 0
        clear = sys.stdout.isatty() and not args.json
        while True:
            report = collect(target, args.events)
            _show(report, args.json, clear)
            if report["source"] != "redis" or report["state"] in FINAL_STATES:
                return 0
            time.sleep(max(0.1, args.interval))
    except StatusError as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cmemi status --watch | head`: the reader is gone
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0


def _show(report: dict[str, Any], as_json: bool, clear: bool) -> None:
    if as_json:
        print(json.dumps(report, default=str), flush=True)
        return
    text = render(report)
    if clear:
        sys.stdout.write("\x1b[H\x1b[2J")
    print(text + ("" if clear else "\n"), flush=True)
