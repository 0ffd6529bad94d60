"""A shard that outlives its leader joins the new term in place (issue 47, services/aggregator/shard/newterm.py): a
real `cmemi up` at `cluster.shards=2`, the leader SIGKILLed at points drawn from a seed, the checkpoint far from
the kills (every_steps 1000 of 1,200 steps: the leader's replays are long). Shard 1 keeps its process (its pid in
its Redis record is the same before the kill and once the new term trained), no step is trained twice
(metrics.jsonl is appended across restarts, one line per step), none is redone, and the result is bitwise the
fault-free one (`cmemi reference`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.chaos import Cluster, seeded_steps
from tests.test_steplog import events
from tests.test_steplog_sharded import K2, servers_timeline, twice

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(900)]


def test_the_leader_killed_at_k2_shard_1_joins_each_new_term_in_place_same_bits(tmp_path: Path,
                                                                                  reference: str) -> None:
    """The one-line change that fails this: `newterm.restarts_instead` returning a reason always (then shard 1
    leaves every term by a restart, as before: a new pid each time, no `shard_term_joined`). A kill just after the
    dead leader committed a step on shard 1 and before the log held the leader's own entry of it leaves shard 1 a
    step past the new leader's: it restarts then (`shard_left_term`, the documented exception), never silently."""
    seed, targets = seeded_steps([(150, 350), (500, 700), (850, 1000)])
    c = Cluster(tmp_path / "run", *K2, "checkpoint.every_steps=1000")
    killed_at: list[int] = []
    pids: list[tuple[int, int]] = []  # shard 1's pid before each kill, and once the new term trained
    try:
        for target in targets:
            killed_at.append(c.wait_step(target))
            before = int(c.redis.hget(c.keys.member("aggregator", "1"), "pid") or 0)
            c.replaced("aggregator", "0", c.signal("aggregator", "0"))
            c.wait_step(killed_at[-1] + 20)  # (the run's progress: only the new term moves it past the kill)
            pids.append((before, int(c.redis.hget(c.keys.member("aggregator", "1"), "pid") or 0)))
    finally:
        rc = c.wait(timeout=400)
    note = f"seed {seed} (CMEMI_TEST_SEED={seed} draws the same kills), kills at steps {killed_at}, pids {pids}"
    assert rc == 0, c.output()
    note += "\n" + servers_timeline(c.run_dir)
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference, note
    assert not twice(c.run_dir), f"steps trained twice: {twice(c.run_dir)[:20]} ({note})"
    assert events(c.run_dir, "steps_redone") == [], note
    joined = [e for e in events(c.run_dir, "shard_term_joined") if e["shard"] == 1]
    left = [e for e in events(c.run_dir, "shard_left_term") if e["shard"] == 1]
    kept = [i for i, (before, after) in enumerate(pids) if before == after]
    assert joined and len(joined) == len(kept) and len(joined) + len(left) == 3, (joined, left, note)
    assert all("past the step" in e["why"] for e in left), (left, note)  # the only case that restarts here
    assert len({e["term"] for e in joined}) == len(joined), note  # one join per new term
    in_place = [e for e in events(c.run_dir, "step_log_replayed") if e.get("in_place")]
    assert all(e["shard"] == 1 and e["replayed"] == 0 for e in in_place), (in_place, note)
