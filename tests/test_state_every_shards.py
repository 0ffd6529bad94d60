"""`train.state_every` (D > 1) at `cluster.shards` K = 2 (issue 48; docs/design/local-steps.md, "Snapshotted every D
rounds"): each shard k > 0 keeps its own pieces of the versions a moved replica's replay starts from (its
`Trainer.history`) and answers a worker's pull of an older version from them (services/aggregator/shard/inner.py
`past`); the worker pulls every shard's pieces of each version s … t − 1 and assembles them with the leader's, which
come with the `inner` message (or alone, `only_past`, when shard 1 keeps the replica's state).

Units: shard 1's answer to a pull of an older version (the kept bits; outside the window, the reason and no tensors,
as the leader refuses), and a checkpoint of K = 2 restored at K = 1 (the history's pieces of both shards in one). Real `cmemi up` runs of digits, 4 replicas of 5 inner steps, D = 4, checked bitwise against `cmemi reference`: W = 1, 2
and 3 workers, a worker SIGKILLed (its replicas move, so a replay from a snapshot up to D − 1 rounds old happens, at K
= 2), and shard 1 SIGKILLed (its history comes back from its checkpoint and its step log) and then both workers, so
that replays after it read shard 1's rebuilt history.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard.inner import ShardStates
from cmemi.services.aggregator.snapshots.contents import collect, restore
from cmemi.services.checkpointer.merge import Pending, merged
from cmemi.shared.config.loading import load_config
from cmemi.shared.wire import protocol

from tests.conftest import DIGITS, run_up
from tests.helpers import references
from tests.helpers.chaos import Cluster
from tests.test_state_every import INT4, PACED, a_worker_killed_replays_bitwise, events
from tests.test_state_every import LOCAL as ROUNDS

LOCAL = (*ROUNDS, "train.state_every=4")


def _replays_counted(summary: dict, replays: list[dict]) -> None:
    """Every replay event is a replica's snapshot handed out (by the leader, or by shard 1 for the replicas it keeps),
    at most D − 1 rounds old, and summary.json counts their rounds over both servers."""
    assert all(1 <= e["rounds"] <= 3 for e in replays), replays
    assert summary["inner_rounds_replayed"] == sum(e["rounds"] for e in replays), (summary, replays)


def test_a_shard_answers_an_older_version_of_its_pieces_and_refuses_one_outside_its_window() -> None:
    """Shard 1 of 2 after 6 rounds at D = 4 keeps its pieces of versions 3 … 6 (the oldest current snapshot starts
    round 3); a `pull` marked `past` of version 4 is answered with version 4's bits (not the current ones), one of
    version 1 with the reason and no tensors. Each answer decoded through the wire schema (`slice`, `past`)."""
    cfg = load_config(DIGITS, ["train.local_steps=5", "train.replicas=4", "train.steps=60", "train.state_every=4",
                               "cluster.shards=2"])
    t, got = Trainer(cfg, shard=1), []
    kept = {0: {n: p.detach().clone() for n, p in t.pieces.items()}}
    for _ in range(6):
        with torch.no_grad():
            for p in t.pieces.values():
                p.add_(1.0)
        t.end_step()
        kept[t.step] = {n: p.detach().clone() for n, p in t.pieces.items()}

    def send(identity: bytes, mtype: str, encoded: tuple, **fields: object) -> int:
        got.append(protocol.decode(protocol.encode(mtype, "r", fields, encoded=encoded[0]), "r"))
        return 0
    states = ShardStates(t, send, RunTotals(), True)
    assert sorted(t.history.kept) == [3, 4, 5, 6] and t.pieces
    for version in (4, 1):
        states.pull(b"w", {"replica": None, "past": True, "version": version})
    old, outside = got
    assert old.type == "slice" and old.header["past"] and old.header["asked"] == 4 and old.header["refused"] is None
    assert old.tensors.keys() == kept[4].keys() and all(torch.equal(old.tensors[n], kept[4][n]) for n in kept[4])
    assert not all(torch.equal(old.tensors[n], t.pieces[n]) for n in kept[4])  # not the current version's
    assert outside.header["past"] and not outside.tensors
    assert "version 1 is not in this server's history (versions held: 3..6" in outside.header["refused"]


def test_a_checkpoint_of_two_shards_restores_the_whole_history_into_one_server() -> None:
    """K = 2, D = 4, 6 rounds, each shard's snapshot merged as the checkpointer merges them, restored at K = 1: the one
    server's history holds every version 3 … 6 of both shards' pieces, bit for bit (a checkpoint of another K is cut
    again; before, shard 1's pieces were lost and a replay of its rounds could not start)."""
    sets = ["train.local_steps=5", "train.replicas=4", "train.steps=60", "train.state_every=4"]
    two = [Trainer(load_config(DIGITS, [*sets, "cluster.shards=2"]), shard=k) for k in range(2)]
    for t in two:
        t.keep_own_rows()
        for _ in range(6):
            with torch.no_grad():
                for p in t.pieces.values():
                    p.add_(1.0)
            t.end_step()
    pending = Pending(1, 2, two[0].partition.describe())
    for k, t in enumerate(two):
        pending.slices[k] = collect(t, RunTotals(), 1, {"sha256": "x"}, None)[1:]
    meta, tensors = merged(pending)
    one = Trainer(load_config(DIGITS, sets))
    restore(one, RunTotals(), None, None, meta, tensors)
    assert sorted(one.history.kept) == [3, 4, 5, 6] and one.history.kept[6].keys() == one.pieces.keys()
    for v in (3, 4, 5, 6):
        for t in two:
            assert all(torch.equal(one.history.kept[v][n], x) for n, x in t.history.kept[v].items()), (v, t.shard)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_shards_give_the_reference_at_one_two_and_three_workers(tmp_path: Path) -> None:
    """D = 4, K = 2, W = 1, 2, 3 (3 workers for 4 replicas: replicas move, so new holders replay from snapshots with
    the versions pulled from both servers): the reference's params_sha256 at every W."""
    want = references.reference(tmp_path, *LOCAL)["params_sha256"]
    replayed = 0
    for w in (1, 2, 3):
        r = run_up(tmp_path / f"w{w}", *LOCAL, "cluster.shards=2", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["steps"] == 12 and r.summary["params_sha256"] == want, (w, r.summary)
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        replays = events(tmp_path / f"w{w}", "replay")
        _replays_counted(r.summary, replays)
        replayed += len(replays)
    assert replayed, "no replica moved: the replay was not exercised"


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
@pytest.mark.parametrize("downlink", ["none", "int4"])
def test_a_worker_killed_at_two_shards_replays_from_both_servers_history(tmp_path: Path, downlink: str) -> None:
    """D = 4, K = 2, W = 2 and a spare, paced: SIGKILL a worker mid-run; its replicas go to the others with their
    snapshots and are replayed from versions assembled from both servers' pieces (int4 up and down: from the int4
    mirrors m_u each server keeps): bitwise the reference (params_sha256 and mirror_sha256)."""
    sets = (*[s for s in LOCAL if not s.startswith(("cluster.spare", "eval", "checkpoint"))], "checkpoint.every_steps=4",
            *PACED, *(INT4 if downlink == "int4" else ()))
    a_worker_killed_replays_bitwise(tmp_path, (*sets, "cluster.shards=2"), at=5, timeout=300)


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_shard_one_killed_rebuilds_its_history_and_answers_the_replays_after_it(tmp_path: Path) -> None:
    """D = 4, K = 2, the step log on, a checkpoint every 4 rounds: SIGKILL shard 1 mid-run (its history comes back from
    its checkpoint's `history` section and the log's replayed rounds, each keeping its version again), then both
    workers, so that every replica is replayed from its snapshot with shard 1's pieces of the versions since from
    that rebuilt history: bitwise the reference, and no round trained twice."""
    sets = (*[s for s in LOCAL if not s.startswith(("cluster.spare", "eval", "checkpoint", "train.steps", "scheduler"))],
            "train.steps=80", "scheduler.kwargs.T_max=80", "checkpoint.every_steps=4", "train.log_every=1", *PACED)
    want = references.reference(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, "cluster.shards=2", "cluster.workers=2", "cluster.spare_workers=1")
    try:
        for at, role, ident in ((6, "aggregator", "1"), (9, "worker", "w0"), (12, "worker", "w1")):
            killed = c.wait_step(at, timeout=300)
            c.replaced(role, ident, c.signal(role, ident), timeout=120)
    finally:
        rc = c.wait(timeout=300)
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == want["steps"] and s["params_sha256"] == want["params_sha256"], (s, want["params_sha256"])
    restarts = [e for e in events(c.run_dir, "step_log_replayed") if e["shard"] == 1]
    assert any(e["checkpoint"] >= 4 for e in restarts), restarts  # its checkpoint's history, then the log's rounds
    steps = [json.loads(x)["step"] for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()
             if x.strip() and "loss" in json.loads(x) and "eval" not in json.loads(x)]
    assert len(steps) == len(set(steps)), sorted(steps)  # no round trained twice
    replays = events(c.run_dir, "replay")
    assert any(e["round"] >= killed for e in replays), replays  # after the last kill: from shard 1's rebuilt history
    _replays_counted(s, replays)
