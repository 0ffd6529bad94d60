"""A soak's result rebuilt from what its run left, when the soak died before writing it (issue 47).

    r = rescore(work, log_path, reference="d8e8...")     # bench/soak.py --rescore WORK --log LOG

The 1,000-fault soak at 738000b trained all 60,000 steps through its faults and then died in its last step
(`cmemi reference` timed out): its result was never written, but everything it is computed from was kept. The fault
rows come from the soak's stdout (one `[soak T s] fault N: KIND KEY SECONDS s at step S` line per fault, ` (missed:
...)` when it did not hit), the rest from the work folder (run/metrics.jsonl, run/events.jsonl, run/summary.json,
logs/), and the result is built by the same `outcome` as the live soak's (tests/helpers/soak_result.py).

What the log lacks is said, not guessed: a row's wall-clock `t` is None (the double-fault rule uses the log's T less
the fault's hold: T is printed once the fault is healed), and the seed is checked against the log's first faults
(each drawn from the seed alone before the first partition draws from it too). The soak kept restarts and exit
codes in memory; the run folder has only each process's `startup` event (distinct pids per role and id: a lower
bound on restarts, since a process killed before it reached Redis announced nothing) and, in logs/, libzmq's
assertion line before each abort: exit codes are None and the notes in `rescored` say why.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.netns_faults import role_of, schedule
from tests.helpers.netns_soak import PLACEMENT, WORKERS
from tests.helpers.soak_result import mark_double, outcome
from tests.test_netns import read_jsonl

LINE = re.compile(r"\[soak\s+(?P<T>[\d.]+)s\] fault (?P<n>\d+): (?P<kind>\w+) (?P<key>\w+) (?P<seconds>[\d.]+)s "
                  r"at step (?P<step>\d+)(?P<missed> \(missed: [^)]*\))?$")
TIMED_OUT = re.compile(r"TimeoutExpired: Command .*'-m', 'cmemi', '(?P<what>\w+)'.* timed out after (?P<s>[\d.]+) seconds")
ABORT = "Assertion failed:"  # what libzmq prints before it aborts (SIGABRT, exit -6: docs/concepts/faults.md)
HOLD = (0.3, 1.5)  # the soak's default hold: the seed check draws the same seconds


class RescoreError(ValueError):
    """A log or work folder that cannot be rescored; the message names what is missing and the fix."""


def parse_log(text: str) -> list[dict[str, Any]]:
    """The schedule's rows from the soak's fault lines, in order; `log_s` is the line's T (seconds since the soak
    began, printed once the fault was healed), `t` is None (the wall-clock start is not in the log)."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = LINE.match(line.rstrip())
        if not m:
            continue
        if int(m["n"]) != len(rows) + 1:
            raise RescoreError(f"fault line {m['n']} follows fault {len(rows)}: give the soak's whole stdout as --log")
        rows.append({"kind": m["kind"], "key": m["key"], "seconds": float(m["seconds"]), "t": None, "other": None,
                     "hit": m["missed"] is None, "role": role_of(m["key"]), "step": int(m["step"]),
                     "log_s": float(m["T"])})
    if not rows:
        raise RescoreError("the log has no `[soak T s] fault N: ...` line: give the soak's stdout as --log")
    return rows


def seed_matches(rows: list[dict[str, Any]], seed: int) -> bool:
    """Whether the log's first faults (up to the first partition, whose other side is the first draw the faults
    themselves make) are the ones `seed` schedules: kind, key and seconds as the log prints them."""
    drawn = schedule(random.Random(seed), list(PLACEMENT), 7, HOLD)
    return all((r["kind"], r["key"], f"{r['seconds']:.2f}") == (k, key, f"{s:.2f}")
               for r, (k, key, s) in zip(rows, drawn, strict=False))


def key_of(role: str, ident: str) -> str:
    """The soak's placement key for a `startup` event's role and id (the inverse of netns_faults.role_of)."""
    if role == "aggregator":
        return "agg" if ident == "0" else f"agg{ident}"
    return {"coordinator": "coord", "checkpointer": "ckpt"}.get(role, ident)


def restarts_from(events: list[dict[str, Any]]) -> dict[str, int]:
    """Processes that announced a start (distinct pids of `startup` events) less the first, per key."""
    pids: dict[str, set[int]] = defaultdict(set)
    for e in events:
        if e.get("kind") == "startup":
            pids[key_of(str(e.get("role")), str(e.get("id")))].add(e.get("pid", 0))
    return {k: len(p) - 1 for k, p in sorted(pids.items()) if len(p) > 1}


def aborts_logged(logs: Path) -> dict[str, int]:
    """libzmq assertion lines per service log (logs/KEY.log): each is one abort, restarted like a crash."""
    out = {f.stem: f.read_text(errors="replace").count(ABORT) for f in sorted(logs.glob("*.log"))}
    return {k: n for k, n in out.items() if n}


def why_from(text: str) -> str:
    """Why the soak wrote no result, from its log's last line (a traceback's exception, usually)."""
    tail = [line for line in text.splitlines() if line.strip()]
    last = tail[-1].strip() if tail else ""
    if LINE.match(last) or not last:
        return "the soak's log ends after its last fault, with no result and no error"
    timeout = TIMED_OUT.search(last)
    if timeout:  # a subprocess's argv names this machine's paths: its command is enough
        return (f"the soak died before writing its result: `cmemi {timeout['what']}` timed out after "
                f"{timeout['s']} seconds (the last line of its log)")
    return f"the soak died before writing its result; its log ends: {last[:400]}"


def run_seconds(events: list[dict[str, Any]]) -> float | None:
    """From the first process's spawn (its `startup` phases) to `run_completed`: the run's own wall time."""
    starts = [min(e["phases"].values()) for e in events if e.get("kind") == "startup" and e.get("phases")]
    done = [e["t"] for e in events if e.get("kind") == "run_completed"]
    return round(done[-1] - min(starts), 1) if starts and done else None


def rescore(work: Path, log_path: Path, *, reference: str | None, faults: int = 1000, seed: int = 47) -> dict[str, Any]:
    """The soak's result for the run in `work` from its stdout `log_path` (see the module docstring); `reference`:
    the reference's params_sha256. `faults` and `seed` as the soak was given them (the log does not print them; the
    seed is checked). `rescored` says where it came from, why, and what could not be recovered."""
    cfg_path, run_dir = work / "cluster.yaml", work / "run"
    if not cfg_path.is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise RescoreError(f"{work} lacks cluster.yaml or run/metrics.jsonl: give the soak's --work folder")
    log = log_path.read_text(errors="replace")
    rows = parse_log(log)
    if not seed_matches(rows, seed):
        raise RescoreError(f"the log's first faults are not those seed {seed} schedules: give the soak's --seed")
    steps = int(yaml.safe_load(cfg_path.read_text())["train"]["steps"])
    events = read_jsonl(run_dir / "events.jsonl")
    completed = any(e.get("kind") == "run_completed" for e in events)
    aborts = aborts_logged(work / "logs")
    r = outcome(rows, run_dir, faults=faults, seed=seed, steps=steps, hosts=len(set(PLACEMENT.values())),
                workers=len(WORKERS), restarts=restarts_from(events) or None, exit_codes=None,
                double=mark_double(rows, lambda row: row["log_s"] - row["seconds"]), reference=reference,
                error=None if completed else "the run did not finish: no run_completed in run/events.jsonl",
                faults_s=rows[-1]["log_s"], wall_s=None)
    near = [row for row in rows if row.get("double")]
    notes = [
        "fault rows from the log: `t` unknown (None); double faults timed by the log's T less the fault's hold "
        f"(T is printed once the fault is healed, to 0.1 s): {len(near)} server kills within DOUBLE_S",
        "restarts: processes that announced a start (run/events.jsonl `startup`, distinct pids) less the first, a "
        "lower bound (a process killed before it reached Redis announced nothing)" if r["restarts"] else
        "restarts: not recorded (no `startup` events in run/events.jsonl)",
        "exit codes: not recorded (the soak kept them in memory); logs/ shows "
        f"{sum(aborts.values())} libzmq aborts (SIGABRT) {aborts}",
        f"faults_s: the last fault's T in the log; wall_s: unknown (the soak died), the run itself took "
        f"{run_seconds(events)} s from its first process's start to run_completed",
    ]
    return {**r, "aborts_logged": aborts, "run_s": run_seconds(events),
            "rescored": {"from": str(work), "log": str(log_path), "why": why_from(log), "notes": notes}}
