"""The report of a run that is not running (or whose Redis is gone), from RUN_DIR's files: summary.json,
metrics.jsonl and events.jsonl. The readers here also give a live report its rates (metrics.jsonl is local)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from cmemi.commands.status.target import read_json, schedule
from cmemi.commands.status.values import FINAL_STATES, natural_key, number

METRICS_WINDOW = 20  # logged steps averaged for samples/s and bytes/s


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
    """events.jsonl (copied from Redis by the coordinator), oldest first; lines that are not events skipped."""
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


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics lines that carry an evaluation (eval.every_steps)."""
    return [r for r in rows if isinstance(r.get("eval"), dict)]


def from_files(run_dir: Path, n_events: int = 8) -> dict[str, Any]:
    """The status report of a run that is not running (or whose Redis is gone), from its files."""
    summary = read_json(run_dir / "summary.json")
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
        "step": number(last.get("step"), int) or 0,
        "total": schedule(run_dir)[0],
        "local_steps": schedule(run_dir)[1],
        "loss": number(last.get("loss")), "lr": number(last.get("lr")),
        "samples_per_s": samples_s, "bytes_per_s": bytes_s,
        "live_workers": number(last.get("live_workers"), int),
        "progress_age_s": max(0.0, time.time() - float(last["t"])) if number(last.get("t")) is not None else None,
        "term": next((e.get("term") for e in reversed(events) if e["kind"] == "aggregator_started"), None),
    }
    if isinstance(summary, dict):
        wall = number(summary.get("wall_s"))
        nbytes = (number(summary.get("bytes_sent")) or 0) + (number(summary.get("bytes_received")) or 0)
        report.update({
            "step": number(summary.get("steps"), int) or report["step"], "loss": number(summary.get("final_loss")),
            "lr": number(summary.get("final_lr"), float) if "final_lr" in summary else report["lr"],
            "samples_per_s": number(summary.get("samples_per_s")),
            "bytes_per_s": nbytes / wall if wall else report["bytes_per_s"],
            "term": summary.get("term", report["term"]), "summary": summary,
        })
        if summary.get("eval"):
            report["eval"] = {"step": report["step"], **summary["eval"]}
    if "eval" not in report and eval_rows(rows):
        ev = eval_rows(rows)[-1]
        report["eval"] = {"step": ev.get("step"), **ev["eval"]}
    if report["total"] is None:
        report["total"] = report["step"] or None

    workers: dict[str, dict[str, Any]] = {}
    pids: dict[str | None, int] = {}  # worker id (as the event names it) -> pid of the process started (or spare handed) for it last
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
    report["workers"] = sorted(workers.values(), key=lambda w: natural_key(w["id"]))
    report["services"] = {}
    saved = [e for e in events if e["kind"] == "checkpoint_saved"]
    ckpt_step = number(saved[-1].get("step"), int) if saved else None
    report["checkpoint"] = {"step": ckpt_step, "path": saved[-1].get("path") if saved else None}
    report["events"] = events[-n_events:] if n_events else []
    report["gaps"] = ["heartbeats and pids: only in Redis while the run is running"]
    return report
