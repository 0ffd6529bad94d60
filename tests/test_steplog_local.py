"""The step log with local steps (issue 47, "every server role"): a restarted leader replays the checkpointer's log —
each round's reduced outer change and the replicas' states it made current — so no committed round is trained twice,
and the result is bitwise `cmemi reference`'s.

Real `cmemi up` runs (digits, a paced MLP so the kills land mid-run), the leader SIGKILLed at points drawn from a
seed, in runs whose only checkpoints are far apart from the kills (none but the final one, or one before them):
without the log every kill would go back to that checkpoint and every replica would compute its rounds since again.
Whole rounds, streaming (fragments), and SparseLoCo's error feedback (`sparse2`, the residual kept in each replica's
state, which the log carries). The metrics log is appended across restarts, one line per round (train.log_every 1): a
round in it twice is a round trained twice.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import DIGITS, ROOT, cmemi_cmd
from tests.helpers.chaos import Cluster, seeded_steps

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(300)]

ROUNDS = ("train.local_steps=5", "train.replicas=4", "train.steps=200", "scheduler.kwargs.T_max=200",
          "cluster.spare_workers=0")  # 40 rounds of 5 inner steps
STREAM = ("train.local_steps=6", "train.replicas=4", "train.fragments=3", "train.steps=240",
          "scheduler.kwargs.T_max=240", "cluster.spare_workers=0")  # 120 segments of 2 inner steps
FAULTS = ("cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1", "train.log_every=1",
          "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.005}")


def reference_of(tmp_path: Path, *sets: str) -> str:
    out = tmp_path / "reference.json"
    proc = subprocess.run(cmemi_cmd("reference", DIGITS, *[a for s in sets for a in ("--set", s)], "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["params_sha256"]


def lines(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]


def killed_leader_runs_to_the_reference(tmp_path: Path, sets: tuple[str, ...], spans: list[tuple[int, int]],
                                        checkpoint: int = 0, server: str = "0") -> list[dict]:
    """Kill the leader (or shard `server`) once in each span of server steps (drawn from a fresh seed, named in every
    failure), with checkpoint.every_steps `checkpoint`; check what every such run must show, and return the
    leader's replays."""
    seed, targets = seeded_steps(spans)
    want = reference_of(tmp_path, *sets, f"checkpoint.every_steps={checkpoint}")
    c = Cluster(tmp_path / "run", *sets, *FAULTS, f"checkpoint.every_steps={checkpoint}", "cluster.workers=2")
    try:
        killed_at = c.kill_at("aggregator", server, targets, replace_timeout=90)
    finally:
        rc = c.wait(timeout=200)
    note = f"seed {seed}, kills at steps {killed_at}"
    assert rc == 0, f"{note}\n{c.output()}"
    s = c.summary
    assert s["params_sha256"] == want, note
    steps = [e["step"] for e in lines(c.run_dir, "metrics.jsonl") if "loss" in e and "eval" not in e]
    twice = sorted(n for n, k in Counter(steps).items() if k > 1)
    assert not twice, f"steps trained twice: {twice[:20]} ({note})"
    # a step whose entry the checkpointer held but whose ack died with the leader commits without its line
    assert len(set(range(1, s["steps"] + 1)) - set(steps)) <= len(targets), note
    events = lines(c.run_dir, "events.jsonl")
    replays = [e for e in events if e["kind"] == "step_log_replayed" and e["shard"] == 0]
    assert len(replays) == len(targets) and all(e["replayed"] > 0 for e in replays), (replays, note)
    # K > 1: every kill's new term replays each shard to the leader's step (a restarted shard may replay twice: once
    # in the term it restarted in, again in the new term its join starts)
    shards = {e["step"] for e in events if e["kind"] == "step_log_replayed" and e["shard"] > 0}
    assert shards == ({e["step"] for e in replays} if "cluster.shards=2" in sets else set()), note
    assert [e for e in events if e["kind"] == "steps_redone"] == [], note
    assert s["term"] == len(targets) + 1, note
    return replays


def test_whole_rounds_leader_killed_replays_rounds_and_trains_none_twice(tmp_path: Path) -> None:
    """40 rounds, 4 replicas of SGD-Nesterov inside, the default outer step, no checkpoint but the final one: three
    kills, each replays every round since the start (its inner states included) and none is computed again."""
    replays = killed_leader_runs_to_the_reference(tmp_path, ROUNDS, [(4, 12), (16, 24), (28, 34)])
    assert all(e["checkpoint"] == 0 for e in replays), replays


def test_streaming_leader_killed_replays_segments_and_trains_none_twice(tmp_path: Path) -> None:
    """Streaming: 3 fragments of a 6-step round, 120 segments; an entry carries the snapshots of the replicas that
    shipped one with that segment (their own parameters and inner optimizer). Three kills, no checkpoint between."""
    replays = killed_leader_runs_to_the_reference(tmp_path, STREAM, [(10, 40), (50, 80), (90, 110)])
    assert all(e["checkpoint"] == 0 for e in replays), replays


def test_error_feedback_residuals_in_the_replicas_states_replay_exactly(tmp_path: Path) -> None:
    """sparse2 (SparseLoCo, error feedback per replica: the residual lives in the replica's state, so in the entry),
    whole rounds, a checkpoint at round 12 and the kills after it: the replay restores that checkpoint's states and
    applies the logged ones."""
    sets = (*ROUNDS, "compression.codec=sparse2")
    replays = killed_leader_runs_to_the_reference(tmp_path, sets, [(14, 20), (26, 32)], checkpoint=12)
    assert all(e["checkpoint"] in (12, 24, 36) and e["checkpoint"] < e["step"] for e in replays), replays


def test_sharded_streaming_leader_killed_replays_every_shard_and_trains_none_twice(tmp_path: Path) -> None:
    """K = 2, streaming: the leader's entry carries its slice, the decision and the replicas' states, each shard its
    slice (the sharded log, unchanged); three leader kills, every shard replays to the leader's step each time."""
    killed_leader_runs_to_the_reference(tmp_path, (*STREAM, "cluster.shards=2"), [(10, 40), (50, 80), (90, 110)])


def test_sharded_whole_rounds_shard_killed_replays_and_trains_none_twice(tmp_path: Path) -> None:
    """K = 2, whole rounds: shard 1 SIGKILLed twice; each restart starts a new term in which the leader and both
    shards replay to the leader's log end (its replicas' states included) and no round is computed again."""
    killed_leader_runs_to_the_reference(tmp_path, (*ROUNDS, "cluster.shards=2"), [(4, 12), (16, 24)], server="1")


def test_a_synchronous_run_with_the_powersgd_downlink_replays_its_mirror_and_warm_start(tmp_path: Path) -> None:
    """Synchronous, K = 1, the compressed downlink's server state: the workers' mirror (its error feedback: what the
    mirror lacks is sent later) and PowerSGD's warm-started Q, both moved by each step from the new parameters, so
    a replay moves them again bitwise; int8 up."""
    sets = ("train.steps=300", "scheduler.kwargs.T_max=300", "cluster.spare_workers=0", "compression.codec=int8",
            "compression.downlink=powersgd", "compression.powersgd_rank=2")
    replays = killed_leader_runs_to_the_reference(tmp_path, sets, [(40, 120), (160, 240)])
    assert all(e["checkpoint"] == 0 for e in replays), replays
