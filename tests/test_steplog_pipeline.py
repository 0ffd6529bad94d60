"""The pipelined step log in process (services/aggregator/leader/stepping.py): the leader, its loop on a thread of the
test, a worker played by the test and a checkpointer that holds each entry's acknowledgement back until the test
lets it go (tests/helpers/rig.py). A step's parameters go out before its ack; its metrics line only after; the next
entry is shipped only once the previous one is acknowledged (at most one step unacknowledged)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.helpers.rig import until
from tests.test_leader_units import LeaderRig

pytestmark = pytest.mark.timeout(120)


def lines(rig: LeaderRig) -> list[int]:
    """The steps metrics.jsonl holds a line of (line-buffered: a written line is in the file)."""
    path = rig.ctx.run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [e["step"] for e in map(json.loads, path.read_text().splitlines()) if "loss" in e]


@pytest.fixture
def rig(tmp_path: Path, redis_server):
    r = LeaderRig(tmp_path, redis_server.url, "train.steps=3", "scheduler.kwargs.T_max=3", "train.log_every=1",
                  "checkpoint.step_log=true")
    try:
        yield r
    finally:
        r.close()


def test_a_step_is_published_before_its_ack_committed_after_it_and_never_two_are_unacknowledged(
        rig: LeaderRig) -> None:
    released: set[int] = set()
    early: list[int] = []  # steps whose metrics line was written before their ack
    unacked: list[int] = []  # entries shipped and not acknowledged, seen at each check (one right after each entry)
    lock = threading.Lock()
    ckpt = rig.checkpointer

    def acks_when(step: int) -> bool:  # (on the checkpointer's thread, before each ack and each receive)
        with lock:
            unacked.append(len(ckpt.logged) - len(ckpt.acked))
            if step in lines(rig):
                early.append(step)
            return step in released

    ckpt.acks_when = acks_when
    w = rig.admitted()
    work = rig.want(w)
    assert work.header["step"] == 0
    rig.grad(w, work.header)  # completes step 1: applied, shipped, and its parameters go out at once
    work = w.expect("work", timeout=30)
    assert work.header["step"] == 1
    until(lambda: ckpt.logged == [1], 30, "step 1's entry")  # (shipped right after its parameters went out)
    assert ckpt.acked == []
    assert lines(rig) == []  # published, not committed: no metrics line before the ack

    rig.grad(w, work.header)  # step 2 is complete, but step 1 is not acknowledged: the leader waits
    assert w.quiet(0.5)  # (no parameters of step 2 while step 1's ack is held)
    assert ckpt.logged == [1] and lines(rig) == []  # nor is step 2's entry shipped
    with lock:
        released.add(1)
    until(lambda: lines(rig) == [1], 30, "step 1's metrics line after its ack")
    work = w.expect("work", timeout=30)
    assert work.header["step"] == 2
    until(lambda: ckpt.logged == [1, 2], 30, "step 2's entry")
    assert ckpt.acked == [1]
    assert lines(rig) == [1]  # step 2 published, its ack held

    with lock:
        released.update({2, 3})
    rig.grad(w, work.header)  # the last step: its ack is waited for before the run ends
    msg = w.expect("work", "stop", timeout=30)
    assert msg.type == "stop"
    rig.thread.join(timeout=30)
    summary = json.loads((rig.ctx.run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and lines(rig) == [1, 2, 3]
    assert ckpt.logged == ckpt.acked == [1, 2, 3] and early == []
    assert unacked and max(unacked) == 1  # never a second entry while one is unacknowledged
