"""`cmemi events RUN_DIR`: each fault's recovery timeline, read back from events.jsonl.

For every death of a worker: injected (if a chaos tool recorded the kill) -> detected -> leases
freed -> replacement started -> replacement admitted -> replacement's first accepted gradient.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_events(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the run directory of a `cmemi up` run")
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def _first(events: list[dict[str, Any]], after: float, pred) -> dict[str, Any] | None:
    return next((e for e in events if e["t"] >= after and pred(e)), None)


def timelines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per detected death: times relative to the kill (or to detection when the kill is unknown)."""
    rows = []
    for died in (e for e in events if e["kind"] == "died"):
        role, ident, inc = died["role"], died["id"], died.get("incarnation")
        injected = [e for e in events if e["kind"] == "fault_injected" and e.get("id") == ident
                    and e.get("role", role) == role and e["t"] <= died["t"]]
        t0 = injected[-1]["t"] if injected else died["t"]
        row: dict[str, Any] = {"role": role, "id": ident, "incarnation": inc, "how": died.get("how"),
                               "killed_at": t0, "detect_s": died["t"] - t0 if injected else None}
        if role == "worker":
            freed = _first(events, died["t"], lambda e, w=ident: e["kind"] == "leases_freed" and e.get("worker") == w)
            admitted = _first(events, died["t"], lambda e, w=ident, i=inc: e["kind"] == "worker_admitted"
                              and e.get("worker") == w and (i is None or e.get("incarnation", 0) > i))
            first = admitted and _first(events, admitted["t"], lambda e, w=ident, a=admitted: (
                e["kind"] == "first_grad_accepted" and e.get("worker") == w and e.get("incarnation") == a["incarnation"]))
            row["reassign_s"] = freed["t"] - t0 if freed else None
            row["joined_s"] = admitted["t"] - t0 if admitted else None
            row["first_grad_s"] = first["t"] - t0 if first else None
        else:
            back = _first(events, died["t"], lambda e, r=role: e["kind"] == f"{r}_started")
            row["restarted_s"] = back["t"] - t0 if back else None
        rows.append(row)
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no faults recorded"
    cols = ["role", "id", "incarnation", "how", "detect_s", "reassign_s", "joined_s", "first_grad_s", "restarted_s"]
    cols = [c for c in cols if any(c in r for r in rows)]
    table = [cols] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
