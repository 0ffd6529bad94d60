"""Where a step's time goes: a timeline of a CMEMI run's steps from its debug log lines (bench/cluster.py --timeline).

At CMEMI_LOG_LEVEL=DEBUG each worker logs `lease_timing` per lease (wall-clock times its work was in hand, its
parameters in, its gradient or change computed, sent; whether a replica's state went with it), and the leader
`grad_timing` per gradient (arrived, taken) and `step_timing` per step (collected, stepped, its leases served). All
processes of the emulated cluster share one clock, so the times compare. Per step, from the moment the step before
it served its leases: when the first and the last worker had their parameters (`params_out_*`), their intake, the
compute (shortest, longest) and the spread of its ends (the barrier), the encoding, the last gradient's trip up (with
a replica's state beside it, separately), the leader from the last arrival to the next step's leases, and how long
the slowest worker was not computing (`not_computing_s`: the step's time minus its longest compute). Medians.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def _lines(path: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if event not in line:
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == event:
            out.append(e)
    return out


def summary(logs: Path, n: int) -> dict[str, Any]:
    """The medians over the steps where every one of the n workers' leases and gradients were logged."""
    steps = {e["step"]: e for e in _lines(logs / "aggregator.log", "step_timing")}
    grads: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in _lines(logs / "aggregator.log", "grad_timing"):
        grads[e["step"]].append(e)
    leases: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for f in sorted(logs.glob("w*.log")):
        for e in _lines(f, "lease_timing"):
            leases[e["step"]].append(e)
    rows = []
    for s, done in sorted(steps.items()):  # step s is applied once the leases of collector step s - 1 are in
        before, L, G = steps.get(s - 1), leases.get(s - 1, []), grads.get(s - 1, [])
        if before is None or len(L) < n or len(G) < n:
            continue
        t0 = before["served"]
        ends = [x["computed"] - t0 for x in L]
        sent = max(x["sent"] for x in L) - t0
        last_in = max(x["arrived"] for x in G) - t0
        compute = [x["computed"] - x["ready"] for x in L]
        rows.append({"step_s": done["served"] - t0, "params_out_first_s": min(x["got"] for x in L) - t0,
                     "params_out_last_s": max(x["got"] for x in L) - t0,
                     "intake_s": max(x["ready"] - x["got"] for x in L), "compute_min_s": min(compute),
                     "compute_max_s": max(compute), "barrier_s": max(ends) - min(ends), "encode_s": sent - max(ends),
                     "last_up_s": last_in - sent, "state": any(x.get("state") for x in L),
                     "leader_s": done["served"] - t0 - last_in, "not_computing_s": done["served"] - t0 - max(compute)})
    if not rows:
        return {"steps": 0}

    def med(rs: list[dict[str, Any]], k: str) -> float | None:
        return round(statistics.median(r[k] for r in rs), 3) if rs else None

    keys = [k for k in rows[0] if k != "state"]
    with_state = [r for r in rows if r["state"]]
    return {"steps": len(rows), "steps_with_a_state": len(with_state), **{k: med(rows, k) for k in keys},
            "last_up_with_a_state_s": med(with_state, "last_up_s"),
            "last_up_without_s": med([r for r in rows if not r["state"]], "last_up_s")}
