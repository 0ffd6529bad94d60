"""Slot accounting and adoption, on real processes: a spare that took a slot restarts as that worker, and a
restarted coordinator adopts exactly the processes an earlier one started (not a reused pid)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cmemi.services.coordinator.run_state import RunState
from cmemi.services.coordinator.slots import Slots
from cmemi.services.coordinator.supervisor import Child, load_children, save_children
from cmemi.shared.config.loading import load_config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.runtime.exits import Exit

from tests.conftest import DIGITS
from tests.helpers.chaos import poll


def sleeper(*tag: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(120)", *tag]


def test_adoption_follows_the_command_line_and_reads_exits(tmp_path: Path) -> None:
    a, b = Child("worker", "w0", sleeper("w0")), Child("worker", "spare1", sleeper("spare1"), spare=True)
    a.start()
    b.start()
    path = tmp_path / "children.json"
    try:
        save_children(path, [a, b])
        b.argv = sleeper("changed")  # the recorded command line no longer matches the process: not adopted
        rows = path.read_text().replace("spare1", "other")
        path.write_text(rows)
        adopted = load_children(path)
        assert [(c.name, c.pid, c.spare) for c in adopted] == [("worker:w0", a.pid, False)]
        child = adopted[0]
        assert child.alive and child.popen is None
        a.popen.send_signal(signal.SIGKILL)  # our own child: we reap it, the adopter only sees it gone
        a.popen.wait()
        poll(lambda: child.poll() is not None, 10, "the adopted process seen to exit")
        assert child.poll() == Exit.UNKNOWN and not child.alive
    finally:
        for c in (a, b):
            c.kill()


def test_a_spare_that_took_a_slot_restarts_as_that_worker(redis_server, tmp_path: Path) -> None:
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "run.name=slots"])
    events: list[tuple[str, dict]] = []
    ctx = SimpleNamespace(cfg=cfg, redis=connect(redis_server.url), keys=Keys("slots"), run_dir=tmp_path,
                          log=SimpleNamespace(error=print, warning=print, info=print),
                          emit=lambda kind, **f: events.append((kind, f)))
    slots = Slots(ctx, "unused.yaml", RunState(ctx))  # the slot logic only, without starting a cluster
    slots.add_spare = lambda: None  # no new spare: the next death must start a new process
    worker = Child("worker", "w0", sleeper("--worker-id", "w0"))
    spare = Child("worker", "spare1", sleeper("--spare", "spare1"), spare=True)
    slots.children[worker.name] = worker
    slots.spares.append(spare)
    for c in (worker, spare):
        c.start()
    try:
        worker.kill()
        slots.replace(worker)
        took = slots.children["worker:w0"]
        assert took is spare and not took.spare and took.argv == worker.argv
        assert ctx.redis.lpop(Keys("slots").spare("spare1")) == "w0"
        rows = json.loads((tmp_path / "children.json").read_text())  # a coordinator dying now adopts it as w0
        assert [(r["ident"], r["spare"], r["pid"]) for r in rows] == [("w0", False, spare.pid)]
        took.kill()
        slots.replace(took)  # no spare left: a new process, with the worker's command line
        assert not took.running and took.next_start <= time.monotonic() + 0.5
        poll(lambda: slots.restart_if_due(took, time.monotonic()) or took.alive, 10,
             "the slot restarted (after its backoff)")
        assert took.alive and took.launched == worker.argv and "--spare" not in took.launched
    finally:
        for c in (worker, spare, slots.children["worker:w0"]):
            c.kill()


@pytest.mark.parametrize("ident", ["0", "1"])
def test_a_leader_that_trained_since_its_restart_is_restarted_without_backoff(redis_server, tmp_path: Path,
                                                                             ident: str) -> None:
    """A crash loop's backoff is for a process that dies before doing its job; a leader killed again after it moved
    the run's progress on (a second fault within a minute) is restarted at once. One that did not is backed off.
    A shard k > 0 (ident 1) likewise: no step commits without it (issue 47's repeated shard kills)."""
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "run.name=slots"])
    keys = Keys("slots")
    ctx = SimpleNamespace(cfg=cfg, redis=connect(redis_server.url), keys=keys, run_dir=tmp_path,
                          log=SimpleNamespace(error=print, warning=print, info=print), emit=lambda kind, **f: None)
    slots = Slots(ctx, "unused.yaml", RunState(ctx))
    leader = Child("aggregator", ident, sleeper("--leader", ident))
    slots.children[leader.name] = leader
    ctx.redis.hset(keys.progress, "step", 10)
    try:
        for trained, backed_off in ((True, False), (False, True)):
            leader.start()
            leader.kill()
            slots.replace(leader)  # the first death: restarted at once either way
            slots.restart_if_due(leader, time.monotonic())
            assert leader.alive and leader.progress_at_start == int(ctx.redis.hget(keys.progress, "step"))
            if trained:
                ctx.redis.hincrby(keys.progress, "step", 5)
            leader.kill()
            slots.replace(leader)  # the second death within HEALTHY_AFTER_S
            assert (leader.next_start > time.monotonic() + 0.2) == backed_off, (trained, leader.restarts)
            leader.restarts = 0
    finally:
        leader.kill()


def test_a_child_that_died_between_two_coordinators_is_one_death(redis_server, tmp_path: Path) -> None:
    """w0 SIGKILLed after its coordinator died and before the next one adopted the children (the test_events_once.py
    flake): the new coordinator reads its exit as if it had seen it, so its death is declared once (`died`, its
    incarnation fenced) before its slot is refilled. Before, it was left out of the adopted children and its slot
    refilled at once: no `died` event, and its replacement's record hid it from liveness for good."""
    from cmemi.services.coordinator.coordinator import Coordinator
    from cmemi.services.coordinator.fencing import Fencer

    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "run.name=slots", "cluster.workers=1", "cluster.shards=1",
                               "cluster.spare_workers=0"])
    keys = Keys("slots")
    events: list[tuple[str, dict]] = []

    def say(*args: object, **fields: object) -> None:
        print(*args, fields)

    ctx = SimpleNamespace(cfg=cfg, redis=connect(redis_server.url), keys=keys, run_dir=tmp_path, run="slots",
                          log=SimpleNamespace(error=say, warning=say, info=say),
                          emit=lambda kind, **f: events.append((kind, f)))
    coordinator = Coordinator.__new__(Coordinator)  # its loop's parts only, without starting a cluster
    coordinator.ctx, coordinator.log, coordinator.local = ctx, ctx.log, True
    coordinator.run_state, coordinator.fencer = RunState(ctx), Fencer(ctx)
    coordinator.slots = Slots(ctx, "unused.yaml", coordinator.run_state)
    first = [Child(role, ident, sleeper(role, ident)) for role, ident in
             (("checkpointer", "0"), ("aggregator", "0"), ("worker", "w0"))]
    for c in first:
        c.start()
    worker = first[-1]
    try:
        save_children(tmp_path / "children.json", first)  # what the dead coordinator left
        ctx.redis.hset(keys.member("worker", "w0"), mapping={"role": "worker", "id": "w0", "pid": worker.pid,
                                                             "incarnation": 3})
        worker.popen.send_signal(signal.SIGKILL)  # no coordinator watches
        worker.popen.wait()
        coordinator.slots.adopt_or_start()
        adopted = [f["id"] for kind, f in events if kind == "process_adopted"]
        assert sorted(adopted) == ["0", "0"], events
        coordinator._check_children()
        died = [f for kind, f in events if kind == "died"]
        assert [(f["role"], f["id"], f["incarnation"], f["pid"]) for f in died] == [("worker", "w0", 3, worker.pid)]
        assert int(ctx.redis.get(keys.fence("worker", "w0"))) == 3
        coordinator._check_children()  # read once: the slot restarts when due, no second death
        assert len([kind for kind, _f in events if kind == "died"]) == 1, events
    finally:
        coordinator.fencer.close()
        for c in first + coordinator.slots.everyone():
            c.kill()
