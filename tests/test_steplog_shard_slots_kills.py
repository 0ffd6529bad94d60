"""The step log at K = 2 on one host with the shards' entries through their shared-memory slots (issue 47: the log's
step-time cost at a shard; tests/test_steplog_shard_slots.py has the link's units): the leader SIGKILLed, then
shard 1, each replays from the log, no step is trained twice, nothing is redone and the result is `cmemi
reference`'s bits. Every shard entry of the run went through a slot (the shard's log says so, and never that one
went as frames) and the checkpointer dropped none (a slot read while written again is dropped: `shm_overwritten`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster, seeded_steps
from tests.test_steplog import events
from tests.test_steplog_sharded import servers_timeline, twice

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(900)]

K2 = (*LONG, "cluster.shards=2", "cluster.workers=2", "train.log_every=1", "cluster.transport=auto")


def test_the_leader_then_a_shard_killed_with_the_shards_entries_in_slots_redo_nothing_and_end_bitwise(
        tmp_path: Path, reference: str) -> None:
    seed, targets = seeded_steps([(200, 450), (650, 900)])
    c = Cluster(tmp_path / "run", *K2)
    killed_at = []
    try:
        killed_at.append(c.wait_step(targets[0]))
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
        killed_at.append(c.wait_step(targets[1]))
        c.replaced("aggregator", "1", c.signal("aggregator", "1"))
    finally:
        rc = c.wait(timeout=400)
    note = f"seed {seed} (CMEMI_TEST_SEED={seed} draws the same kills), kills at steps {killed_at}"
    assert rc == 0, c.output()
    note += f"\n{servers_timeline(c.run_dir)}"
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference, note
    assert not twice(c.run_dir), f"steps trained twice: {twice(c.run_dir)[:20]} ({note})"
    assert events(c.run_dir, "steps_redone") == [], note
    assert {e["shard"] for e in events(c.run_dir, "step_log_replayed")} == {0, 1}, note
    logs = "\n".join(p.read_text(errors="replace") for p in (c.run_dir / "logs").glob("*.log"))
    assert logs.count("this shard's entries go through its shared-memory slots") >= 2, note  # each incarnation
    assert "goes as frames" not in logs, note
    dropped = s.get("checkpointer_dropped_messages") or {}
    assert not any(reason.startswith("shm") for reason in dropped), (dropped, note)
