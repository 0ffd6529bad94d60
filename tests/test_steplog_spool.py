"""The step log outlives the checkpointer's process (issue 47: services/checkpointer/logfiles.py): a restarted
checkpointer reads back what it acknowledged, so a server that dies after that restart and before the next checkpoint
still replays every committed step (before the spool this was the soak's double fault: bench/results/soak.json's 7).

Real `cmemi up` runs of LONG: the checkpointer SIGKILLed mid-run and restarted, then the leader (and, at K = 2, shard
1) SIGKILLed before any checkpoint (every_steps 1000 of 1,200 steps: the first one comes after the kills). Counted as
tests/test_steplog_*.py count: a replay per server death and no fallback (no `steps_redone`, no `checkpoint_forced`:
the restarted checkpointer's log had no gap), no step number twice in metrics.jsonl, and `params_sha256` equal to
`cmemi reference`'s. The one-line change that fails both: `opened` in logfiles.py not reading back (`read_back`
false): the log is lost, the leader's next entry is answered `log_gap` and a checkpoint is forced.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster
from tests.test_steplog import events, reference_of, step_lines

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(900)]

SETS = (*LONG, "checkpoint.every_steps=1000", "cluster.workers=2", "train.log_every=1")


def twice(run_dir: Path) -> list[int]:
    return sorted(n for n, k in Counter(step_lines(run_dir)).items() if k > 1)


def read_back(run_dir: Path) -> dict:
    """The restarted checkpointer's `step_log_recovered` (the first checkpointer's start reads nothing back)."""
    got = [e for e in events(run_dir, "step_log_recovered") if e["read_back"]]
    assert len(got) == 1, got
    return got[0]


@pytest.mark.parametrize("transport", ["auto", "tcp"])  # same host: entries landed from a slot; tcp://: off the wire
def test_a_checkpointer_restart_then_a_leader_kill_replays_every_step_from_the_spool(tmp_path: Path,
                                                                                     transport: str) -> None:
    c = Cluster(tmp_path / "run", *SETS, f"cluster.transport={transport}")
    try:
        c.wait_step(250)
        c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
        killed = c.wait_step(500)
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    assert c.summary["steps"] == 1200 and c.summary["params_sha256"] == reference_of(tmp_path, *LONG)
    assert not twice(c.run_dir), twice(c.run_dir)[:20]
    back = read_back(c.run_dir)
    assert back["entries"] >= 250 and back["lost"] == 0 and back["base"] == 0, back
    assert events(c.run_dir, "checkpoint_forced") == [] and events(c.run_dir, "step_log_rebased") == []
    assert events(c.run_dir, "steps_redone") == []
    replays = events(c.run_dir, "step_log_replayed")
    assert len(replays) == 1 and replays[0]["checkpoint"] == 0 and replays[0]["step"] >= killed - 1, replays


def test_at_two_shards_a_checkpointer_restart_then_the_leader_and_a_shard_killed_redo_no_step(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "run", *SETS, "cluster.shards=2")
    try:
        c.wait_step(200)
        c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
        leader_at = c.wait_step(400)
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
        shard_at = c.wait_step(600)
        c.replaced("aggregator", "1", c.signal("aggregator", "1"))
    finally:
        rc = c.wait(timeout=400)
    note = f"leader killed at {leader_at}, shard 1 at {shard_at}"
    assert rc == 0, c.output()
    assert c.summary["steps"] == 1200 and c.summary["params_sha256"] == reference_of(tmp_path, *LONG), note
    assert not twice(c.run_dir), (twice(c.run_dir)[:20], note)
    back = read_back(c.run_dir)
    assert back["entries"] >= 2 * 200 and back["lost"] == 0, back  # both shards' entries, each step
    assert events(c.run_dir, "checkpoint_forced") == [] and events(c.run_dir, "step_log_rebased") == [], note
    assert events(c.run_dir, "steps_redone") == [], note
    replays = events(c.run_dir, "step_log_replayed")
    assert all(e["checkpoint"] == 0 for e in replays), (replays, note)
    # the leader's death: the leader and shard 1 replay from the start to where it died, through the read-back log
    assert any(e["shard"] == 0 and e["step"] >= leader_at - 1 for e in replays), (replays, note)
    assert any(e["shard"] == 1 and e["step"] >= shard_at - 1 for e in replays), (replays, note)
