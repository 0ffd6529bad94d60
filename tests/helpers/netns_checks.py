"""What a faulted run's metrics.jsonl says about fencing and redone work (issue 47: partitions, not only deaths).

The leader writes one line per step with its term (services/aggregator/leader/reporting.py), appended across
restarts. From those lines alone:
- **fenced by term**: in file order a term never goes back (a line of term t after one of term t' > t), and no line
  of term t is written after a newer term's leader started (its `aggregator_started` event in events.jsonl, when
  given): either is a deposed leader committing after its successor took over, two live servers for one run.
- **no split result**: a step logged under two terms has the same loss in both (bitwise: the JSON float is the
  float's shortest repr); a differing loss is two histories.
- **steps redone**: every step number logged more than once counts once per extra line.
- **nothing lost**: every step 1..N is logged.

And from events.jsonl, which steps redone were a double fault of the kind a kill schedule cannot see
(`log_lost_redone`): the checkpointer, which holds the step log, restarted and lost some of it, and a server died
before a checkpoint was written after that restart, so its successor found no log past the checkpoint and went back to
it (`steps_redone`, "not in the step log"). What holds the recovery and the server died together. Since the step log
is written through to disk (services/checkpointer/logfiles.py) a restart loses the log only where its read-back says
so — `step_log_recovered` with `lost` > 0 (a corrupt entry, or one after a gap) or `read_back` false (Redis had lost
the run's keys) — or without the spool (no `step_log_recovered` after the checkpointer's `startup`: a run from before
it, or checkpoint.step_log_spool false). A torn tail is not a loss: that entry was never acknowledged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines (evaluation lines carry `eval` and no loss of their own)."""
    return [r for r in rows if "loss" in r and "eval" not in r]


def fencing(rows: list[dict[str, Any]], steps: int, events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The checks above over metrics.jsonl's lines (and events.jsonl's `aggregator_started` events, when given);
    `violations` lists each broken rule in words (empty: none)."""
    rows = step_rows(rows)
    violations: list[str] = []
    started = {e["term"]: e["t"] for e in events or [] if e.get("kind") == "aggregator_started"}
    for term in sorted({r["term"] for r in rows if "term" in r}):
        newer = [t for k, t in started.items() if k > term]
        late = [r for r in rows if r.get("term") == term and newer and r["t"] > min(newer)]
        if late:
            violations.append(f"{len(late)} steps committed under term {term} after a newer term's leader started "
                              f"(steps {late[0]['step']}..{late[-1]['step']})")
    newest = 0
    seen: dict[int, dict[int, float]] = defaultdict(dict)  # step -> term -> loss
    for i, r in enumerate(rows):
        term = r.get("term")
        if term is None:
            violations.append(f"line {i + 1} (step {r['step']}) has no term")
            continue
        if term < newest:
            violations.append(f"step {r['step']} committed under term {term} after term {newest} took over")
        newest = max(newest, term)
        previous = seen[r["step"]].get(term)
        if previous is not None and previous != r["loss"]:
            violations.append(f"step {r['step']} committed twice under term {term} with losses {previous} and {r['loss']}")
        seen[r["step"]][term] = r["loss"]
    for step, by_term in seen.items():
        if len(set(by_term.values())) > 1:
            violations.append(f"step {step} has different losses under terms {sorted(by_term)}: {by_term}")
    counts: dict[int, int] = defaultdict(int)
    for r in rows:
        counts[r["step"]] += 1
    missing = [s for s in range(1, steps + 1) if s not in counts]
    if missing:
        violations.append(f"{len(missing)} steps never logged (first {missing[:5]})")
    return {"violations": violations, "steps_redone": sum(c - 1 for c in counts.values()),
            "steps_logged_twice": sum(1 for c in counts.values() if c > 1),
            "terms": sorted({r["term"] for r in rows if "term" in r})}


def log_lost_redone(events: list[dict[str, Any]]) -> dict[str, int]:
    """The `steps_redone` events (and their steps) that came after a checkpointer's restart that lost log (see the
    module's docstring) with no checkpoint saved since (a `checkpoint_forced` is only asked for): {"events": n,
    "steps": total, "all_events": every steps_redone event}."""
    log_lost, restart, out = False, False, {"events": 0, "steps": 0, "all_events": 0}
    for e in events:
        kind = e.get("kind")
        if kind == "startup" and e.get("role") == "checkpointer":
            log_lost = restart  # the run's first checkpointer has nothing to lose; a restart, until its read-back
            restart = True  # says otherwise (no read-back: the log was in memory only)
        elif kind == "step_log_recovered" and log_lost:
            log_lost = bool(e.get("lost", 0)) or not e.get("read_back", True)
        elif kind == "checkpoint_saved":
            log_lost = False
        elif kind == "steps_redone":
            out["all_events"] += 1
            if log_lost:
                out["events"] += 1
                out["steps"] += int(e.get("steps", 0))
    return out
