"""bench/round_timeline.py: a step's timeline from the debug lines a CMEMI run logs (`lease_timing` on the workers,
`grad_timing` and `step_timing` on the leader), as bench/cluster.py --timeline records it."""

from __future__ import annotations

import json
from pathlib import Path

from bench.round_timeline import summary


def write(path: Path, *events: dict) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + "not json\n")


def lease(step: int, lo: int, got: float, ready: float, computed: float, sent: float, state: bool = False) -> dict:
    return {"event": "lease_timing", "step": step, "lo": lo, "got": got, "ready": ready, "computed": computed,
            "sent": sent, "state": state}


def test_a_step_is_timed_from_the_leases_served_before_it(tmp_path: Path) -> None:
    """Round 1 is served at t = 100 (step 1's leases); its two leases land, compute and go up; step 2 is served at
    t = 106. Round 0 (no step before it timed) and a round with a missing gradient are left out."""
    write(tmp_path / "aggregator.log",
          {"event": "step_timing", "step": 1, "collected": 99.0, "applied": 99.9, "served": 100.0},
          {"event": "grad_timing", "wid": "w0", "step": 1, "lo": 0, "arrived": 104.7, "taken": 104.8},
          {"event": "grad_timing", "wid": "w1", "step": 1, "lo": 1, "arrived": 105.6, "taken": 105.7},
          {"event": "step_timing", "step": 2, "collected": 105.7, "applied": 105.9, "served": 106.0},
          {"event": "grad_timing", "wid": "w0", "step": 2, "lo": 0, "arrived": 110.0, "taken": 110.1},
          {"event": "step_timing", "step": 3, "collected": 111.0, "applied": 111.1, "served": 111.2})
    write(tmp_path / "w0.log", lease(1, 0, 100.2, 100.3, 104.3, 104.4), lease(2, 0, 106.1, 106.2, 109.0, 109.1))
    write(tmp_path / "w1.log", lease(1, 1, 100.5, 100.7, 105.2, 105.3, state=True), lease(2, 1, 106.1, 106.2, 109, 109.1))
    t = summary(tmp_path, 2)
    assert t["steps"] == 1 and t["steps_with_a_state"] == 1
    expected = {"step_s": 6.0, "params_out_first_s": 0.2, "params_out_last_s": 0.5, "intake_s": 0.2,
                "compute_min_s": 4.0, "compute_max_s": 4.5, "barrier_s": 0.9, "encode_s": 0.1, "last_up_s": 0.3,
                "leader_s": 0.4, "not_computing_s": 1.5, "last_up_with_a_state_s": 0.3, "last_up_without_s": None}
    assert {k: t[k] for k in expected} == expected


def test_no_timed_step_says_so(tmp_path: Path) -> None:
    write(tmp_path / "aggregator.log", {"event": "worker admitted"})
    assert summary(tmp_path, 8) == {"steps": 0}
