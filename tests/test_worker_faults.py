"""Workers die at any moment: the run goes on by itself, no step is redone, the result is unchanged."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmemi.commands.events import load_events, timelines
from tests.conftest import LONG, ROOT, run_up
from tests.helpers.chaos import Cluster, poll

pytestmark = [pytest.mark.integration, pytest.mark.fault]

def assert_clean_finish(c: Cluster, rc: int, reference: str, total: int = 1200) -> None:
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == total
    steps = [m["step"] for m in c_metrics(c)]
    assert steps == list(range(1, total + 1)), "a step was lost or redone"
    assert s["params_sha256"] == reference


def c_metrics(c: Cluster) -> list[dict]:
    import json

    return [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]


KILLS = 6


def test_random_worker_kills_change_nothing(tmp_path: Path, reference: str) -> None:
    """Six kills, each of a live worker, at steps drawn up front: the last comes by step 20 + 6 * 140 = 860 of
    1200, so a run that completes has had all six (no timeout swallowed, no lower bar)."""
    rng = random.Random(1234)
    at, plan = 20, []
    for _ in range(KILLS):
        at += rng.randint(80, 140)
        plan.append(at)
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=3")
    killed: list[tuple[str, int]] = []
    try:
        for step in plan:
            c.wait_step(step)
            time.sleep(rng.uniform(0, 0.01))  # land anywhere in a step: computing, sending, fetching parameters
            # a slot killed a moment ago is refilled by the spare or a new process: kill only with two live
            live = poll(lambda: (m := c.members("worker")) and len(m) >= 2 and m, 60, "two live workers")
            wid = rng.choice(sorted(live))
            killed.append((wid, c.signal("worker", wid)))
    finally:
        rc = c.wait()
    assert len(killed) == KILLS  # every kill landed before the end (assert_clean_finish: the run then completed)
    assert_clean_finish(c, rc, reference)
    died = {(e["id"], e["incarnation"]) for e in load_events(c.run_dir) if e["kind"] == "died"}
    assert set(killed) <= died, set(killed) - died  # each kill hit that live incarnation and was detected
    rows = [r for r in timelines(load_events(c.run_dir)) if r["role"] == "worker"]
    assert len(rows) >= KILLS and all(r["detect_s"] is not None for r in rows[:KILLS])


def test_all_workers_but_one_killed_at_once(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=3", "cluster.spare_workers=0")
    try:
        c.wait_step(300)
        live = sorted(c.members("worker"))
        assert len(live) == 3
        for wid in live[:2]:
            c.signal("worker", wid)
    finally:
        rc = c.wait()
    assert_clean_finish(c, rc, reference)
    died = {e["id"] for e in load_events(c.run_dir) if e["kind"] == "died"}
    assert set(live[:2]) <= died


def test_stopped_worker_is_fenced_and_its_late_gradients_rejected(tmp_path: Path) -> None:
    slow = ("model.factory=tests.helpers.fixtures:slow_mlp", "model.kwargs={delay: 0.3}", "train.steps=1500",
            "scheduler.kwargs.T_max=1500", "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1",
            "checkpoint.every_steps=0", "cluster.spare_workers=0")
    ref = run_up(tmp_path / "ref", *slow, "cluster.workers=1")
    assert ref.rc == 0, ref.stderr[-3000:]
    c = Cluster(tmp_path / "run", *slow, "cluster.workers=2")
    extra = None
    try:
        c.wait_step(5)
        # a worker on "another host": not the coordinator's child, so it is fenced, not killed
        in_forward = tmp_path / "straggler-in-forward"
        env = {**os.environ, "CMEMI_TEST_SLOW_WORKER": "1", "CMEMI_TEST_IN_FORWARD": str(in_forward)}
        extra = subprocess.Popen([sys.executable, "-m", "cmemi", "worker", "--config", str(c.run_dir / "config.yaml"),
                                  "--redis", c.redis_url, "--worker-id", "straggler"], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Its gradients are late by design (re-issue hands its microbatches to idle fast workers and the first
        # complete copy wins), so "contributing" is not the signal: being admitted and holding a lease is.
        poll(lambda: any(e.get("worker") == "straggler" for e in c.events("worker_admitted")), 60, "admitted")
        poll(in_forward.exists, 60, "the straggler computing a microbatch", interval=0.005)  # it holds a lease
        c.signal("worker", "straggler", signal.SIGSTOP)  # within its 0.3 s forward: its gradient comes late
        poll(lambda: any(e.get("id") == "straggler" for e in c.events("fenced")), 30, "straggler fenced")
        poll(lambda: any(e.get("worker") == "straggler" for e in c.events("leases_freed")), 10, "leases freed")
        os.kill(extra.pid, signal.SIGCONT)
        assert extra.wait(timeout=60) == 3  # it learns it was fenced and exits for good
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
            extra.wait()
        rc = c.wait()
    assert rc == 0, c.output()
    s = c.summary
    assert s["dropped_messages"].get("fenced", 0) >= 1, s["dropped_messages"]
    assert s["params_sha256"] == ref.summary["params_sha256"]


def test_scale_up_and_down_while_running(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0")
    try:
        c.wait_step(100)
        assert subprocess.run([sys.executable, "-m", "cmemi", "scale", str(c.run_dir), "3"], cwd=ROOT).returncode == 0
        poll(lambda: len(c.members("worker")) == 3, 60, "3 workers")
        assert subprocess.run([sys.executable, "-m", "cmemi", "scale", str(c.run_dir), "1"], cwd=ROOT).returncode == 0
        poll(lambda: len(c.members("worker")) == 1, 60, "1 worker")
    finally:
        rc = c.wait()
    assert_clean_finish(c, rc, reference)
    kinds = [e["kind"] for e in load_events(c.run_dir)]
    assert "worker_left" in kinds and "died" not in kinds
