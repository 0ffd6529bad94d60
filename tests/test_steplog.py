"""The step log (issue 47): a restarted leader replays the checkpointer's log, so no committed step is trained twice.

Real `cmemi up` runs, the leader SIGKILLed at random points of a run whose only checkpoint is the final one: without
the log every kill would go back to step 0. The metrics log is appended across restarts, one line per step
(train.log_every 1): a step number in it twice is a step trained twice.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(600)]


def step_lines(run_dir: Path) -> list[int]:
    """The step numbers of metrics.jsonl's step lines (evaluations left out), in the order written."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [e["step"] for e in lines if "loss" in e and "eval" not in e]


def events(run_dir: Path, kind: str) -> list[dict]:
    """The run's events of `kind`, from events.jsonl (Redis is gone once the run ended)."""
    found = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in found if e["kind"] == kind]


def kill_points(seed: int) -> list[int]:
    """Three kill steps, one in each third of the 1,200-step run, drawn from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(100, 350), rng.randrange(450, 700), rng.randrange(800, 1050)]


def test_leader_killed_three_times_replays_the_log_and_trains_no_step_twice(tmp_path: Path, reference: str) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    targets = kill_points(seed)
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=0", "cluster.workers=2", "train.log_every=1")
    killed_at = []
    try:
        for target in targets:
            killed_at.append(c.wait_step(target))
            c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait()
    note = f"seed {seed}, kills at steps {killed_at}"
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference, note
    steps = step_lines(c.run_dir)
    twice = sorted(n for n, k in Counter(steps).items() if k > 1)
    assert not twice, f"steps trained twice: {twice[:20]} ({note})"
    # a step whose entry the checkpointer held but whose ack died with the leader commits without its line
    assert len(set(range(1, 1201)) - set(steps)) <= len(targets), note
    replays = events(c.run_dir, "step_log_replayed")
    assert len(replays) == 3 and all(e["checkpoint"] == 0 and e["replayed"] > 0 for e in replays), (replays, note)
    assert events(c.run_dir, "steps_redone") == [], note
    assert s["term"] == 4


def test_a_run_without_the_log_trains_steps_again_after_a_kill(tmp_path: Path, reference: str) -> None:
    """checkpoint.step_log: false is today's behaviour: the restarted leader goes back to its last checkpoint (here
    the start), and the workers train the steps since again (the metrics log says so), to the same result."""
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=0", "cluster.workers=2", "train.log_every=1",
                "checkpoint.step_log=false")
    try:
        killed = c.wait_step(300)
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    assert c.summary["params_sha256"] == reference
    twice = [n for n, k in Counter(step_lines(c.run_dir)).items() if k > 1]
    assert len(twice) >= killed - 10 and events(c.run_dir, "step_log_replayed") == []
