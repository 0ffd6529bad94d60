"""The soak (issue 47): one training run across emulated hosts under a seeded schedule of faults of every kind.

    result = soak(lab, work_dir, faults=1000, seed=47)    # bench/soak.py (`make soak`) and tests/test_soak.py

Hosts: `ctl` (Redis and the coordinator), `agg` (the leader), `shard` (shard 1 of cluster.shards = 2), `ckpt` (the
checkpointer), `h0`..`h2` (a worker each). Faults come one after another (tests/helpers/netns_faults.py: each held
for a seeded 0.3-1.5 s, the next `gap` s after it is healed) and anything that exits early is restarted on its host
with the same arguments, as an orchestrator would. The run is long enough not to end before the last fault
(`steps`); once the faults are done it is left to finish. The result: faults by kind and by role, restarts, steps
redone (tests/helpers/netns_checks.py), double faults (a server killed within `DOUBLE_S` of another server's kill:
their recovery may overlap, so a fallback to a checkpoint is allowed there; and a server's death after the
checkpointer restarted having lost some of its log — its spool's read-back says so — and before a checkpoint covered
it, `log_lost_redone`) and the final params_sha256 against
`cmemi reference` of the same config, built by tests/helpers/soak_result.py's `outcome` (which `bench/soak.py
--rescore` shares: tests/helpers/soak_rescore.py).
"""

from __future__ import annotations

import random
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.helpers import netns
from tests.helpers.netns_cluster import HostsRun
from tests.helpers.netns_faults import Faults, role_of, schedule
from tests.helpers.soak_result import mark_double, outcome, reference_timeout, sha_in

PLACEMENT = {"redis": "ctl", "coord": "ctl", "agg": "agg", "agg1": "shard", "ckpt": "ckpt",
             "w0": "h0", "w1": "h1", "w2": "h2"}
WORKERS = ("w0", "w1", "w2")


def argv() -> dict[str, tuple[str, ...]]:
    """How each key is (re)started."""
    return {"coord": ("coordinator", "--supervise", "none"), "ckpt": ("checkpointer",), "agg": ("aggregator",),
            "agg1": ("aggregator", "--shard", "1"), **{w: ("worker", "--worker-id", w) for w in WORKERS}}


def sets(steps: int) -> tuple[str, ...]:
    return (f"train.steps={steps}", f"scheduler.kwargs.T_max={steps}", "cluster.shards=2",
            f"cluster.workers={len(WORKERS)}", "checkpoint.every_steps=200")


def soak(lab: netns.NetLab, work: Path, faults: int, seed: int, steps: int, gap: float = 0.5,
         hold: tuple[float, float] = (0.3, 1.5), deadline_s: float = 2400) -> dict[str, Any]:
    """Run it; the result (see the module docstring). Past `deadline_s` the faults stop (TimeoutError) or, once
    they are done, the result says why the run did not finish (`error`, with the services' logs)."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    run = HostsRun(lab, work, sets(steps), PLACEMENT)
    f = Faults(run, rng, argv())
    for key, args in argv().items():
        run.start(key, *args)
    run.wait_step(20, timeout=300)
    done: list[dict[str, Any]] = []
    for kind, key, seconds in schedule(rng, list(PLACEMENT), 2 * faults, hold):
        if sum(r["hit"] for r in done) >= faults:
            break
        if run.procs["agg"].poll() == 0:
            break  # the run ended before the schedule: reported as fewer faults than asked
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"the soak ran past {deadline_s:g}s after {len(done)} faults at step {run.step()}")
        fault = f.inject(kind, key, seconds)
        row = {**fault.row(), "role": role_of(key), "step": run.step()}
        done.append(row)
        print(f"[soak {time.monotonic() - t0:7.1f}s] fault {len(done)}: {kind} {key} {seconds:.2f}s at step {row['step']}"
              f"{'' if fault.hit else ' (missed: no such process or port)'}", flush=True)
        f.hold(gap)
    t_faults = time.monotonic() - t0
    error = None
    try:
        while run.procs["agg"].poll() != 0:  # the run finishes; a crash meanwhile is restarted
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(f"the run did not finish within {deadline_s:g}s (step {run.step()})")
            f.hold(0.5)
        netns.wait_all(run.procs, ["coord", *WORKERS], 120, run.diagnostics)
    except (TimeoutError, AssertionError) as exc:
        error = f"{exc}{run.diagnostics()}"
    for proc in lab.procs:
        lab.stop(proc)
    try:
        reference = sha_in(run.reference(timeout=reference_timeout(steps)))
    except subprocess.TimeoutExpired as exc:  # the run's own figures are still worth keeping: said in `error`
        reference, error = None, f"{error or ''}\ncmemi reference did not finish within {exc.timeout:g} s"
    return outcome(done, run.run_dir, faults=faults, seed=seed, steps=steps, hosts=len(run.hosts),
                   workers=len(WORKERS), restarts=f.restarts,
                   exit_codes=dict(Counter(f"{k}={rc}" for k, rc in f.exit_codes)),
                   double=mark_double(done, lambda r: r["t"]), reference=reference, error=error,
                   faults_s=round(t_faults, 1), wall_s=round(time.monotonic() - t0, 1))
