"""The step log at K = 2 (issue 47, docs/design/step-log.md): a restarted leader or shard replays the checkpointer's
log, so no committed step is trained twice at cluster.shards > 1 either.

Real `cmemi up` runs at `cluster.shards=2`, servers SIGKILLed at points of a run drawn from a seed, checkpoints far
apart from the kills (but in the shard-kill test, whose short replays let a re-lease beat the workers' reading).
metrics.jsonl is appended across restarts, one line per step (train.log_every 1): a step number in it twice is a
step trained twice. Each run proves several things (start-up is most of a test's time).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster, seeded_steps
from tests.test_steplog import events, step_lines

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(900)]

K2 = (*LONG, "cluster.shards=2", "cluster.workers=2", "train.log_every=1")


def twice(run_dir: Path) -> list[int]:
    return sorted(n for n, k in Counter(step_lines(run_dir)).items() if k > 1)


SERVER_EVENTS = ("fault_injected", "died", "aggregator_started", "step_log_replayed", "shard_restarted", "steps_redone")


def first_step_with_the_new_shard(run_dir: Path) -> list[tuple[float, float] | None]:
    """For each injected fault: (seconds from the kill, seconds from the restarted shard's being taken in the term,
    `shard_restarted` term_kept) to the first step line written after that: the first step it took part in (a line
    written sooner may be of a step its dead incarnation had done its share of). None for a kill whose restart
    started a new term instead."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [e["t"] for e in lines if "loss" in e and "eval" not in e]
    restarted = events(run_dir, "shard_restarted")
    out: list[tuple[float, float] | None] = []
    for fault in events(run_dir, "fault_injected"):
        taken = next(e for e in restarted if e["t"] > fault["t"])
        first = next((t for t in steps if t > taken["t"]), float("inf"))
        out.append((first - fault["t"], first - taken["t"]) if taken["term_kept"] else None)
    return out


def servers_timeline(run_dir: Path) -> str:
    """The servers' events of the run, one line each (named in a failure: which replay, of which incarnation, when)."""
    return "\n".join(json.dumps(e) for kind in SERVER_EVENTS for e in events(run_dir, kind))


def test_the_leader_a_shard_and_both_one_after_the_other_killed_replay_and_train_no_step_twice(
        tmp_path: Path, reference: str) -> None:
    """SIGKILL the leader, then shard 1, then the leader and shard 1 one right after the other (the shard while the
    new leader starts): each restarted server restores the checkpoint (here only the start: every_steps 0) and
    replays to the leader's log end, shard 1 its own slices with the leader's decisions. Shard 1's restart alone is
    taken within the term (issue 47: test_a_shard_killed_within_a_term_rejoins_it...); no step is computed again."""
    seed, targets = seeded_steps([(150, 350), (500, 700), (850, 1000)])
    c = Cluster(tmp_path / "run", *K2, "checkpoint.every_steps=0")
    killed_at = []
    try:
        killed_at.append(c.wait_step(targets[0]))
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
        killed_at.append(c.wait_step(targets[1]))
        c.replaced("aggregator", "1", c.signal("aggregator", "1"))
        killed_at.append(c.wait_step(targets[2]))
        leader = c.signal("aggregator", "0")
        c.replaced("aggregator", "0", leader)
        c.replaced("aggregator", "1", c.signal("aggregator", "1"))
    finally:
        rc = c.wait(timeout=400)
    note = f"seed {seed} (CMEMI_TEST_SEED={seed} draws the same kills), kills at steps {killed_at}"
    assert rc == 0, c.output()
    note += f"\n{servers_timeline(c.run_dir)}"
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference, note
    assert not twice(c.run_dir), f"steps trained twice: {twice(c.run_dir)[:20]} ({note})"
    # a step whose entries the checkpointer held but whose ack died with the leader commits without its line
    assert len(set(range(1, 1201)) - set(step_lines(c.run_dir))) <= 3, note
    replays = events(c.run_dir, "step_log_replayed")
    by_shard = Counter(e["shard"] for e in replays)
    # each new term (the two leader kills): the leader and shard 1 replay; shard 1's restart within the term: it alone
    assert by_shard[0] >= 2 and by_shard[1] >= 3, (replays, note)
    # a shard told `shard_behind` replays twice in one process, the second from where the first ended: both name
    # the checkpoint it restored (the once-seen failure here, seed 376012946: the second named its start)
    assert all(e["checkpoint"] == 0 for e in replays), (replays, note)
    assert max(e["replayed"] for e in replays if e["shard"] == 1) > killed_at[0], (replays, note)
    assert events(c.run_dir, "steps_redone") == [], note
    assert len(events(c.run_dir, "shard_restarted")) >= 1, note


def test_a_checkpointer_restart_forces_a_checkpoint_on_every_shard_and_a_double_fault_goes_back_to_it(
        tmp_path: Path, reference: str) -> None:
    """The log held in memory only (checkpoint.step_log_spool false; with the spool a checkpointer's restart loses
    nothing: tests/test_steplog_spool.py). The checkpointer killed alone: the leader's next entry is refused
    (`log_gap`), every shard checkpoints that step, and it commits once the checkpoint is written; a later leader kill
    replays from there. Then the checkpointer and shard 1 killed together (a double fault): the log died with its
    holder, the run goes back to the last checkpoint, says how many steps it redoes (`steps_redone`), and ends
    bitwise the same."""
    c = Cluster(tmp_path / "run", *K2, "checkpoint.every_steps=500", "checkpoint.step_log_spool=false")
    try:
        c.wait_step(150)
        c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
        c.wait_step(350)
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))
        c.wait_step(650)
        c.double_fault("1")
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    assert c.summary["params_sha256"] == reference
    forced = events(c.run_dir, "checkpoint_forced")
    assert len(forced) == 1 and 150 <= forced[0]["step"] < 350, forced
    replays = [e for e in events(c.run_dir, "step_log_replayed") if e["shard"] == 0]
    assert replays[0]["checkpoint"] == forced[0]["step"] and replays[0]["replayed"] > 0, replays
    redone = events(c.run_dir, "steps_redone")
    assert len(redone) == 1 and redone[0]["step"] == 500 and redone[0]["steps"] >= 100, redone
    assert len(twice(c.run_dir)) == redone[0]["steps"], (len(twice(c.run_dir)), redone)  # each step since, once


def test_a_shard_killed_within_a_term_rejoins_it_no_new_term_no_step_twice(tmp_path: Path, reference: str) -> None:
    """Issue 47: SIGKILL shard 1 at three points drawn from a seed, a checkpoint every 20 steps (short replays: the
    long ones are test_the_leader_a_shard_and_both_..., every_steps 0). Each restarted shard restores the newest,
    replays its own entries to the leader's step (told it, if its first replay fell short: `shard_behind`) and takes
    its dead incarnation's place in the same term: the leader never restores nor replays, no new term starts, no
    step is trained twice, and the result is bitwise the fault-free one. The workers follow its new address from the
    first lease the leader hands them after taking it in (`shards`), or its Redis record if read first. The one-line change that fails this: `Restarts.decide` returning ROLL_BACK for a new incarnation
    at the leader's step (then every kill starts a new term, as before issue 47). A kill that loses the entry of the
    leader's last step falls back to a new term (below): allowed, counted, and never all three. Each restarted shard
    taken in the term takes part in a step within 2 s of that, at cluster.dead_after 2 s: before the leases said
    where a restarted shard is (leader/roster.py `news`; a repeat at each of its reports bounded it meanwhile), the
    slices of the first re-lease could go to its dead address, and the next re-lease came 2 x dead_after later (4.2 s to the next new
    step in 2 of 3 kills of bench/recovery_log.py --kill shard). That loss needs a short replay, so that the
    re-lease comes before the workers read the new address: with every_steps 1000 this test's kills never drew it
    (the unfixed code passed); with 20, 2 of 3 kills took 4.35 s."""
    seed, targets = seeded_steps([(120, 350), (500, 700), (850, 980)])
    c = Cluster(tmp_path / "run", *K2, "checkpoint.every_steps=20", "cluster.dead_after=2.0")
    try:
        killed_at = c.kill_at("aggregator", "1", targets)
    finally:
        rc = c.wait(timeout=400)
    note = f"seed {seed}, kills at steps {killed_at}"
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference, note
    assert not twice(c.run_dir), f"steps trained twice: {twice(c.run_dir)[:20]} ({note})"
    assert events(c.run_dir, "steps_redone") == [], note
    restarted = events(c.run_dir, "shard_restarted")
    kept = [e for e in restarted if e["term_kept"]]
    # A kill between the shard's sends of its entry and its shard_ready loses the entry of the leader's last step
    # with the process, and the log cannot bring the new shard to the leader's step: the documented fallback to a new
    # term (docs/design/step-log.md; seen in about one run of three, one of its three kills). Every other kill is
    # taken in the term, and each fallback starts exactly one term.
    fallbacks = [e for e in restarted if not e["term_kept"]]
    assert len(kept) + len(fallbacks) == 3 and kept and all(e["shard"] == 1 for e in kept), (restarted, note)
    terms = {e["term"] for e in events(c.run_dir, "aggregator_started")}
    assert len(terms) == 1 + len(fallbacks), (terms, note)  # no new term but a fallback's
    waits = first_step_with_the_new_shard(c.run_dir)  # (None: a fallback's new term, not bound here)
    in_term = [w[1] for w in waits if w is not None]  # (from its being taken in: the replay's length left out)
    assert len(in_term) == len(kept) and max(in_term) < 2.0, (waits, note, servers_timeline(c.run_dir))
    replays = events(c.run_dir, "step_log_replayed")
    if not fallbacks:
        assert {e["shard"] for e in replays} == {1}, (replays, note)  # only the restarted shard replays
    # each restart replayed from a checkpoint to where it was killed at least (the leader's entry of its last step
    # may come a moment after: a second replay, `shard_behind`'s, goes on from where that one ended), or restored a
    # checkpoint of that step (nothing to replay)
    back = replays + events(c.run_dir, "checkpoint_restored")
    assert all(any(e["step"] >= at - 1 for e in back) for at in killed_at), (back, note)
