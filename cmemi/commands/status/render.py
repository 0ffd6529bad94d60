"""The human-readable table of a status report (`cmemi status`; `--json` prints the report itself)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


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
