"""The soak's result from what a run left (issue 47): one function for the live soak and for a rescoring.

    r = outcome(rows, run_dir, faults=1000, seed=47, steps=60000, restarts=..., exit_codes=..., reference=sha, ...)

`soak()` (tests/helpers/netns_soak.py) builds its result here as it ends, and `rescore()` (tests/helpers/
soak_rescore.py) rebuilds the same result from a run's folder and the soak's log when the soak itself died before
writing it (the 1,000-fault soak at 738000b trained all 60,000 steps, then its `cmemi reference` timed out): the
same counts, the same fencing checks over metrics.jsonl and events.jsonl (tests/helpers/netns_checks.py), the same
double-fault rule. Only how a fault's time is known differs (`when`): the live soak has each fault's wall-clock
start, a log only the seconds since the soak began.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.netns_checks import fencing, log_lost_redone
from tests.test_netns import read_jsonl

SERVER_KILLS = ("agg", "agg1", "ckpt")
DOUBLE_S = 5.0
SHA = re.compile(r"\b[0-9a-f]{64}\b")


def reference_timeout(steps: int) -> float:
    """Seconds `cmemi reference` may take: it trains every step again, fault-free, and 60,000 steps took over
    300 s on a loaded 2-core machine (the 1,000-fault soak at 738000b died of that timeout; alone it took 584 s)."""
    return max(300.0, steps / 40)


def sha_in(text: str) -> str | None:
    """The first params_sha256 in `cmemi reference`'s output (its JSON summary holds one), or None."""
    found = SHA.search(text)
    return found.group(0) if found else None


def mark_double(rows: list[dict[str, Any]], when: Callable[[dict[str, Any]], float]) -> int:
    """Mark (`double`: True) and count each server kill that hit within DOUBLE_S of another server's kill (their
    recoveries may overlap, so a fallback to a checkpoint is allowed there); `when` gives a row's start in seconds."""
    last: tuple[str, float] | None = None
    double = 0
    for row in rows:
        if row["kind"] != "kill" or row["key"] not in SERVER_KILLS or not row["hit"]:
            continue
        t = when(row)
        if last and last[0] != row["key"] and t - last[1] < DOUBLE_S:
            row["double"] = True
            double += 1
        last = (row["key"], t)
    return double


def summary_sha(run_dir: Path) -> str | None:
    """The run's own params_sha256 (run/summary.json, written when the run completed), or None without one."""
    path = run_dir / "summary.json"
    return json.loads(path.read_text())["params_sha256"] if path.is_file() else None


def outcome(rows: list[dict[str, Any]], run_dir: Path, *, faults: int, seed: int, steps: int, hosts: int,
            workers: int, restarts: dict[str, int] | None, exit_codes: dict[str, int] | None, double: int,
            reference: str | None, error: str | None, faults_s: float | None,
            wall_s: float | None) -> dict[str, Any]:
    """The soak's result (bench/results/soak.json's fields) from its fault rows and its run folder."""
    sha = summary_sha(run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    checks = fencing(read_jsonl(run_dir / "metrics.jsonl"), steps, events)
    lost = log_lost_redone(events)
    hits = [r for r in rows if r["hit"]]
    return {
        "faults_asked": faults, "faults": len(hits), "faults_missed": len(rows) - len(hits), "seed": seed,
        "steps": steps, "hosts": hosts, "shards": 2, "workers": workers,
        "by_kind": dict(Counter(r["kind"] for r in hits)),
        "by_role": dict(Counter(r["role"] for r in hits)),
        "by_kind_role": dict(Counter(f"{r['kind']}:{r['role']}" for r in hits)),
        "restarts": restarts, "exit_codes": exit_codes,
        "double_faults": double + lost["events"], "steps_redone": checks["steps_redone"],
        "double_faults_log_lost": lost["events"], "steps_redone_double": lost["steps"],
        "redone_events": lost["all_events"],
        "steps_logged_twice": checks["steps_logged_twice"], "terms": len(checks["terms"]),
        "violations": checks["violations"][:20],
        "params_sha256": sha, "reference_params_sha256": reference, "bitwise_equal": sha is not None and sha == reference,
        "error": error[-6000:] if error else None,
        "faults_s": faults_s, "wall_s": wall_s, "schedule": rows,
    }
