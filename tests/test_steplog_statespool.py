"""The replicas' states in each server's own state spool (issue 48 + 47: services/aggregator/steplog/statespool.py), in
real `cmemi up` runs: the step log's entries carry a reference to a record on the server's host instead of the
states, and a SIGKILLed server reads them back from there.

- the leader SIGKILLed mid-run, whole rounds and streaming: each replay reads the states from `states-0/`, no
  round twice in metrics.jsonl, nothing redone, `cmemi reference`'s params_sha256;
- K = 2 with the states spread (`train.inner_states: shards`): shard 1 SIGKILLed, its replay reads `states-1/`;
- a double fault: the leader killed and its state spool deleted: the replay stops at the checkpoint, says so
  (`state_spool_lost`, `steps_redone` naming the state spool), the steps since are computed again, and the run still
  ends at the reference.

The one-line change that fails all four (tried): `replicas.restore` skipping the items that reference the spool
(`continue`): the replays then keep no state, the first three end away from the reference, and the double fault
finds no `state_spool_lost`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.chaos import Cluster
from tests.test_steplog_local import FAULTS, ROUNDS, STREAM, lines, reference_of
from tests.test_steplog_local import killed_leader_runs_to_the_reference as killed_runs_to_the_reference

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(300)]


def spooled(run_dir: Path, shard: int) -> list[Path]:
    return sorted((run_dir / "steplog" / f"states-{shard}").glob("st-*.log"))


@pytest.mark.parametrize("sets", [ROUNDS, STREAM], ids=["rounds", "streaming"])
def test_a_killed_leader_reads_the_replicas_states_back_from_its_own_spool(tmp_path: Path, sets) -> None:
    spans = [(4, 12), (16, 24)] if sets is ROUNDS else [(10, 40), (60, 90)]
    replays = killed_runs_to_the_reference(tmp_path, sets, spans)
    assert all(e["checkpoint"] == 0 for e in replays), replays
    run = tmp_path / "run"
    assert len(spooled(run, 0)) == len(spans) + 1  # a segment per leader process (no checkpoint before the final)
    assert not [e for e in lines(run, "events.jsonl") if e["kind"] == "state_spool_lost"]


def test_a_killed_shard_with_the_states_spread_reads_them_back_from_its_own_spool(tmp_path: Path) -> None:
    sets = (*ROUNDS, "cluster.shards=2", "train.inner_states=shards")
    killed_runs_to_the_reference(tmp_path, sets, [(4, 12), (16, 24)], server="1")
    run = tmp_path / "run"
    assert len(spooled(run, 1)) >= 3 and spooled(run, 0)  # shard 1's three processes; the leader keeps its own
    assert not [e for e in lines(run, "events.jsonl") if e["kind"] == "state_spool_lost"]


def test_a_leader_killed_with_its_state_spool_lost_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """A double fault: the leader's host lost its state spool as it died (its files deleted, then SIGKILL). Its
    replay finds the first entry after the checkpoint unreadable, stops there, cuts the log and says so; the rounds
    since the checkpoint are computed again, and the result is still the reference."""
    checkpoint = 10
    sets = (*ROUNDS, f"checkpoint.every_steps={checkpoint}")
    want = reference_of(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, *FAULTS, "cluster.workers=2")
    try:
        at = c.wait_step(16, timeout=120)
        for p in spooled(c.run_dir, 0):
            p.unlink()
        inc = c.signal("aggregator", "0")
        c.replaced("aggregator", "0", inc, timeout=90)
    finally:
        rc = c.wait(timeout=200)
    assert rc == 0, f"killed at {at}\n{c.output()}"
    assert c.summary["params_sha256"] == want, at
    events = lines(c.run_dir, "events.jsonl")
    lost = [e for e in events if e["kind"] == "state_spool_lost"]
    assert len(lost) == 1 and lost[0]["step"] % checkpoint == 0 and "state spool" in lost[0]["reason"], lost
    redone = [e for e in events if e["kind"] == "steps_redone"]
    assert len(redone) == 1 and redone[0]["steps"] > 0 and "state spool" in redone[0]["reason"], redone
    steps = [e["step"] for e in lines(c.run_dir, "metrics.jsonl") if "loss" in e and "eval" not in e]
    twice = sorted(n for n, k in Counter(steps).items() if k > 1)
    assert twice and min(twice) == lost[0]["step"] + 1, (twice, lost)  # redone from the checkpoint on, honestly
