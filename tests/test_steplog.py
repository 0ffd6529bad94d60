"""The step log (issue 47): a restarted leader replays the checkpointer's log, so no committed step is trained twice.

Real `cmemi up` runs, the leader SIGKILLed at random points of a run whose only checkpoint is the final one: without
the log every kill would go back to step 0. The metrics log is appended across restarts, one line per step
(train.log_every 1): a step number in it twice is a step trained twice.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import DIGITS, LONG, ROOT, cmemi_cmd
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


def test_the_checkpointer_killed_alone_forces_a_checkpoint_and_a_later_leader_kill_still_replays(
        tmp_path: Path, reference: str) -> None:
    """With checkpoint.step_log_spool false, the checkpointer's restart loses the log it held (with the spool, only
    what the spool cannot cover: tests/test_steplog_spool.py): the leader's next entry is refused (`log_gap`) and the
    leader checkpoints at once before that step commits; killed later, it restores that checkpoint and replays the
    log since. No step is trained twice."""
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=0", "cluster.workers=2", "train.log_every=1",
                "checkpoint.step_log_spool=false")
    try:
        c.wait_step(200)
        c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
        c.wait_step(600)
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    assert c.summary["params_sha256"] == reference
    twice = [n for n, k in Counter(step_lines(c.run_dir)).items() if k > 1]
    assert not twice, twice[:20]
    forced = events(c.run_dir, "checkpoint_forced")
    assert len(forced) == 1 and 200 <= forced[0]["step"] < 600, forced
    replays = events(c.run_dir, "step_log_replayed")
    assert len(replays) == 1 and replays[0]["checkpoint"] == forced[0]["step"] and replays[0]["replayed"] > 0
    assert events(c.run_dir, "steps_redone") == []


def test_a_double_fault_goes_back_to_the_checkpoint_and_says_how_many_steps_are_redone(
        tmp_path: Path, reference: str) -> None:
    """The checkpointer and the leader killed together with the log held in memory only (checkpoint.step_log_spool
    false; with the spool the log outlives its holder's process): the log died with its holder, so the run goes back
    to the last checkpoint as without the log, says so in events.jsonl, and ends the same."""
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=100", "cluster.workers=2", "train.log_every=1",
                "checkpoint.step_log_spool=false")
    try:
        c.wait_step(350)
        c.double_fault("0")
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    assert c.summary["params_sha256"] == reference
    redone = events(c.run_dir, "steps_redone")
    assert len(redone) == 1 and redone[0]["step"] == 300 and redone[0]["steps"] >= 50, redone
    twice = [n for n, k in Counter(step_lines(c.run_dir)).items() if k > 1]
    assert len(twice) == redone[0]["steps"], (len(twice), redone)  # each step since the checkpoint, once again


def reference_of(tmp_path: Path, *sets: str) -> str:
    """`cmemi reference` of DIGITS with `sets`: the single-process result a run must equal."""
    out = tmp_path / "reference.json"
    proc = subprocess.run(cmemi_cmd("reference", DIGITS, *[a for s in sets for a in ("--set", s)], "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["params_sha256"]


@pytest.mark.parametrize("features", [
    ("compression.downlink=int8",),  # the workers' mirror and its codec's error feedback: server state, replayed
    ("precision=fp16", "train.clip_grad_norm=0.5", "model.kwargs.dropout=0.0"),  # loss-scale decisions, clipping
])
def test_replayed_server_state_of_each_feature_ends_bitwise_at_the_reference(tmp_path: Path,
                                                                            features: tuple[str, ...]) -> None:
    sets = (*LONG[:2], "checkpoint.every_steps=0", "cluster.spare_workers=0", *features)
    ref = reference_of(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, *LONG[3:], "cluster.workers=2", "train.log_every=1")
    try:
        for target in (250, 700):
            c.wait_step(target)
            c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    assert c.summary["params_sha256"] == ref
    twice = [n for n, k in Counter(step_lines(c.run_dir)).items() if k > 1]
    assert not twice, twice[:20]
    assert [e["replayed"] > 0 for e in events(c.run_dir, "step_log_replayed")] == [True, True]


def test_early_stopping_decides_the_same_across_replays(tmp_path: Path) -> None:
    """Evaluations run in the background and decide early stopping at the next boundary: their results travel in
    the log, so a replayed leader stops at the reference's step with the reference's history (kills between
    boundaries, with an evaluation in flight)."""
    sets = (*LONG[:2], "checkpoint.every_steps=0", "cluster.spare_workers=0", "eval.every_steps=50",
            "eval.early_stop_metric=accuracy", "eval.patience=2")
    out = tmp_path / "reference.json"
    proc = subprocess.run(cmemi_cmd("reference", DIGITS, *[a for s in sets for a in ("--set", s)], "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads(out.read_text())
    assert ref["stopped_early"] and 200 < ref["steps"] < 1200  # (the kills below come before the stop)
    c = Cluster(tmp_path / "run", *sets, *LONG[3:], "cluster.workers=2", "train.log_every=1")
    try:
        for target in (120, 230):
            c.wait_step(target)
            c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert (s["steps"], s["stopped_early"], s["params_sha256"]) == (ref["steps"], True, ref["params_sha256"])
    assert [h["step"] for h in s["eval_history"]] == [h["step"] for h in ref["eval_history"]]
    twice = [n for n, k in Counter(step_lines(c.run_dir)).items() if k > 1]
    assert not twice, twice[:20]
