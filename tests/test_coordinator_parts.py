"""The coordinator's parts, in process, on a real redis-server: the events log, fencing (with Redis down),
liveness (a silent member, a hung child, a child that never registers), the run state, how an exit is read,
and the slots (scaling, giving up). Each test names the fault it injects; none starts a cluster."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog
from cmemi.services.coordinator.child_exit import ExitKind, exit_kind
from cmemi.services.coordinator.events_log import START, EventsLog, last_copied
from cmemi.services.coordinator.fencing import Fencer
from cmemi.services.coordinator.liveness import Liveness
from cmemi.services.coordinator.run_state import RunPhase, RunState, phase_of
from cmemi.services.coordinator.slots import Slots
from cmemi.services.coordinator.supervisor import Child, SlotState
from cmemi.services.coordinator.witnesses import Witnesses
from cmemi.shared.config.loading import load_config
from cmemi.shared.coordination.heard import HeardWriter, read_heard
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect, read_events
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire.security import Curve

from tests.conftest import DIGITS


def sleeper(*tag: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(120)", *tag]


@pytest.fixture
def ctx(redis_server, tmp_path: Path) -> ServiceContext:
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "run.name=parts", "cluster.max_restarts=1",
                               "cluster.spare_workers=0", "cluster.start_timeout=0.5"])
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    return ServiceContext(cfg, connect(redis_server.url), Keys("parts"), "parts", structlog.get_logger(),
                          argparse.Namespace(), threading.Event(), {}, Curve(enabled=False))


def kinds(ctx: ServiceContext) -> list[str]:
    return [e["kind"] for _id, e in read_events(ctx.redis, ctx.keys)]


def register(ctx: ServiceContext, role: str, ident: str, inc: int, pid: int, *, heartbeat: bool,
             started_ago: float = 60.0, state: str = "running") -> None:
    ctx.redis.hset(ctx.keys.member(role, ident), mapping={"role": role, "id": ident, "incarnation": inc, "pid": pid,
                                                          "state": state, "started_at": time.time() - started_ago})
    if heartbeat:
        ctx.redis.set(ctx.keys.heartbeat(role, ident), f"{inc}:{time.time():.3f}", px=60_000)


# ------------------------------------------------------------------------------------------ events log
def test_events_log_copies_the_stream_and_starts_over_when_redis_loses_it(ctx: ServiceContext) -> None:
    path = ctx.run_dir / "events.jsonl"
    log = EventsLog(ctx.redis, ctx.keys, path)
    ctx.emit("a")
    ctx.emit("b")
    log.tail()
    log.tail()  # nothing new: nothing written twice
    ctx.redis.delete(ctx.keys.events)  # injected: Redis lost its data (restarted empty)
    log.tail()
    # the new stream's first id is below the old cursor (a stream's ids start over with its data)
    ctx.redis.xadd(ctx.keys.events, {"json": json.dumps({"t": 0.0, "kind": "c"})}, id="1-1")
    log.close()  # closing copies what is left
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def copied(path: Path) -> list[str]:
    return [json.loads(line)["kind"] for line in path.read_text().splitlines()]


def test_events_log_copies_each_event_once_across_coordinator_restarts(ctx: ServiceContext) -> None:
    """A restarted coordinator resumes after the file's last stream id (before: from 0-0, appending it all again)."""
    path = ctx.run_dir / "events.jsonl"
    for kind in ("a", "b", "c"):
        ctx.emit(kind)
    EventsLog(ctx.redis, ctx.keys, path).close()
    log = EventsLog(ctx.redis, ctx.keys, path)  # restarted: nothing new yet
    log.tail()
    ctx.emit("d")
    log.tail()
    log.file.close()  # SIGKILLed: no close(), and a line torn in the middle of its write
    with open(path, "a") as f:
        f.write('{"t": 1.0, "kind": "e", "si')
    ctx.emit("e")
    for _ in range(3):  # restarted three more times
        EventsLog(ctx.redis, ctx.keys, path).close()
    assert copied(path) == ["a", "b", "c", "d", "e"]
    ids = [json.loads(line)["sid"] for line in path.read_text().splitlines()]
    assert ids == [entry_id for entry_id, _e in read_events(ctx.redis, ctx.keys)]


def test_a_resumed_events_log_starts_over_when_the_stream_did(ctx: ServiceContext) -> None:
    """Redis lost its data while no coordinator ran: the new stream's ids lie below the file's last one."""
    path = ctx.run_dir / "events.jsonl"
    ctx.redis.xadd(ctx.keys.events, {"json": json.dumps({"t": 0.0, "kind": "old"})}, id="9000-1")
    EventsLog(ctx.redis, ctx.keys, path).close()
    ctx.redis.delete(ctx.keys.events)  # injected: Redis restarted empty
    ctx.redis.xadd(ctx.keys.events, {"json": json.dumps({"t": 0.0, "kind": "new"})}, id="5-1")
    EventsLog(ctx.redis, ctx.keys, path).close()
    EventsLog(ctx.redis, ctx.keys, path).close()
    assert copied(path) == ["old", "new"]


def test_the_last_copied_id_is_read_from_the_tail_of_a_long_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"t": 0.0, "kind": "x", "pad": "p" * 300, "sid": f"{i}-0"}) for i in range(1, 1001)]
    path.write_text("\n".join(lines) + "\n" + json.dumps({"kind": "no id"}) + "\n" + '{"torn')
    assert last_copied(path) == "1000-0"
    assert path.read_text().endswith('{"kind": "no id"}\n')  # the torn line was cut, the rest kept
    path.write_text('{"kind": "a line from before ids"}\n')
    assert last_copied(path) == START and last_copied(tmp_path / "missing.jsonl") == START


# ------------------------------------------------------------------------------------------ fencing
def test_a_death_is_fenced_once_and_a_fence_waits_for_redis(ctx: ServiceContext, redis_server) -> None:
    fencer = Fencer(ctx)
    try:
        register(ctx, "worker", "w0", 7, 4242, heartbeat=False)
        fencer.declare_dead("worker", "w0", how="exit code 1", pid=4242)  # the incarnation is read from its record
        assert ctx.redis.get(ctx.keys.fence("worker", "w0")) == "7" and not fencer.pending
        assert fencer.known_dead("worker", "w0", 7) and not fencer.known_dead("worker", "w0", 8)
        fencer.declare_dead("worker", "w1", how="exit code 1", pid=1)  # died before registering: nothing to fence
        assert ctx.redis.get(ctx.keys.fence("worker", "w1")) is None
        assert kinds(ctx) == ["died", "fenced", "died"]

        ctx.redis.set(ctx.keys.fence("worker", "w3"), 5)  # declared by an earlier coordinator
        assert fencer.known_dead("worker", "w3", 5) and fencer.declared[("worker", "w3")] == 5

        redis_server.stop()  # injected: Redis down while a death is declared
        fencer.declare_dead("worker", "w2", how="heartbeat missing", pid=9, inc=3)
        assert fencer.pending == {("worker", "w2"): 3}
        redis_server.start(port=redis_server.port)
        fencer.retry()
        assert ctx.redis.get(ctx.keys.fence("worker", "w2")) == "3" and not fencer.pending
    finally:
        fencer.close()


# ------------------------------------------------------------------------------------------ liveness
def test_liveness_yields_only_silent_members_that_nobody_declared(ctx: ServiceContext) -> None:
    fencer = Fencer(ctx)
    liveness = Liveness(ctx, fencer)
    try:
        register(ctx, "worker", "beating", 1, 11, heartbeat=True)
        register(ctx, "worker", "silent", 2, 12, heartbeat=False)
        register(ctx, "worker", "young", 3, 13, heartbeat=False, started_ago=0.0)  # within cluster.dead_after
        register(ctx, "worker", "left", 4, 14, heartbeat=False, state="stopped")
        register(ctx, "worker", "fenced", 5, 15, heartbeat=False)
        ctx.redis.set(ctx.keys.fence("worker", "fenced"), 5)
        register(ctx, "coordinator", "0", 6, 16, heartbeat=False)
        deaths = list(liveness.scan({}, local=False))
        assert [(d.ident, d.inc, d.pid, d.child, d.how) for d in deaths] == [
            ("silent", 2, 12, None, "heartbeat missing")]
    finally:
        fencer.close()


def test_liveness_kills_a_hung_child_and_one_that_never_registers(ctx: ServiceContext) -> None:
    fencer = Fencer(ctx)
    liveness = Liveness(ctx, fencer)
    hung, late = Child("worker", "w0", sleeper("w0")), Child("worker", "w1", sleeper("w1"))
    children = {hung.name: hung, late.name: late}
    try:
        for c in children.values():
            c.start()
        register(ctx, "worker", "w0", 1, hung.pid, heartbeat=False)  # registered, then silent: hung
        late.started_at -= ctx.cfg.cluster.start_timeout + 1  # injected: its start deadline has passed
        deaths = list(liveness.scan(children, local=True))
        assert {(d.ident, d.child is not None) for d in deaths} == {("w0", True), ("w1", True)}
        assert not hung.alive and not late.alive  # killed before their slots are refilled
        assert hung.registered and not late.registered
        assert any("start_timeout" in d.how for d in deaths if d.ident == "w1")
    finally:
        for c in children.values():
            c.kill()
        fencer.close()


# ------------------------------------------------------------------------------------------ run state, exits
def test_run_state_never_reopens_a_completed_run_and_survives_an_empty_redis(ctx: ServiceContext) -> None:
    run = RunState(ctx)
    assert run.open() and ctx.redis.get(ctx.keys.state) == "running"
    ctx.redis.delete(ctx.keys.state)  # Redis restarted empty: still running, written back
    assert run.control().phase is None and ctx.redis.get(ctx.keys.state) == "running"
    ctx.redis.set(ctx.keys.scale, 3)
    assert run.control().scale == "3"
    ctx.redis.set(ctx.keys.state, "completed")
    assert not run.open() and run.completed() and ctx.redis.get(ctx.keys.state) == "completed"
    assert phase_of("completed") is RunPhase.COMPLETED and phase_of("something new") is RunPhase.RUNNING
    run.fail("worker:w0 died 2 times")
    assert run.exit_code == 1 and ctx.redis.get(ctx.keys.state) == "failed"
    assert ctx.redis.get(ctx.keys.error) == "worker:w0 died 2 times" and kinds(ctx) == ["run_failed"]


def test_exit_kind(ctx: ServiceContext) -> None:
    child = Child("worker", "w0", [])
    child.adopted = 777  # an adopted process: its exit code reads as Exit.UNKNOWN
    r, k = ctx.redis, ctx.keys
    assert exit_kind(child, Exit.FATAL, r, k) is ExitKind.FATAL
    assert exit_kind(child, 0, r, k) is exit_kind(child, Exit.REJOIN, r, k) is ExitKind.NORMAL
    assert exit_kind(child, Exit.CRASH, r, k) is exit_kind(child, Exit.UNKNOWN, r, k) is ExitKind.DIED
    register(ctx, "worker", "w0", 1, 777, heartbeat=False, state="stopped")
    assert exit_kind(child, Exit.UNKNOWN, r, k) is ExitKind.NORMAL
    register(ctx, "worker", "w0", 2, 778, heartbeat=False, state="stopped")  # another process's record
    assert exit_kind(child, Exit.UNKNOWN, r, k) is ExitKind.DIED
    r.set(k.error, "bad config")
    assert exit_kind(child, Exit.UNKNOWN, r, k) is ExitKind.FATAL


# ------------------------------------------------------------------------------------------ slots
def test_scaling_keeps_the_lowest_ids_and_fills_the_first_free_ones(ctx: ServiceContext) -> None:
    slots = Slots(ctx, "unused.yaml", RunState(ctx))
    slots.argv = lambda role, ident: sleeper(role, ident)  # sleepers in place of services
    try:
        for i in range(3):
            slots.add("worker", f"w{i}")
        slots.target_workers = 3
        slots.scale(2)
        assert [(c.ident, c.slot) for c in slots.children.values()] == [
            ("w0", SlotState.ACTIVE), ("w1", SlotState.ACTIVE), ("w2", SlotState.RETIRED)]
        slots.scale(4)  # w2 is still leaving: new slots take w3 and w4
        active = sorted(n for n, c in slots.children.items() if c.slot is SlotState.ACTIVE)
        assert active == ["worker:w0", "worker:w1", "worker:w3", "worker:w4"]
        assert kinds(ctx).count("scaled") == 2
    finally:
        for c in slots.children.values():
            c.kill()


def test_a_crash_loop_fails_the_run_unless_another_worker_lives(ctx: ServiceContext) -> None:
    run = RunState(ctx)
    slots = Slots(ctx, "unused.yaml", run)
    slots.argv = lambda role, ident: sleeper(role, ident)
    try:
        w0, w1 = slots.add("worker", "w0"), slots.add("worker", "w1")
        ckpt = slots.add("checkpointer", "0")
        for _ in range(2):  # cluster.max_restarts=1: the second death in a row is one too many
            w0.kill()
            slots.replace(w0)
        assert w0.slot is SlotState.GIVEN_UP and run.exit_code is None  # w1 still trains
        for _ in range(2):
            ckpt.kill()
            slots.replace(ckpt)
        assert ckpt.slot is SlotState.GIVEN_UP and run.exit_code == 1 and ctx.redis.get(ctx.keys.state) == "failed"
        assert slots.next_restart(1e9) == 1e9  # nothing given up on is waited for
        assert w1.alive
    finally:
        for c in slots.children.values():
            c.kill()


# ------------------------------------------------------------------------------------------ witnesses
def test_witnesses_hold_judgement_while_everyone_is_silent_and_until_the_path_has_settled(ctx: ServiceContext) -> None:
    w = Witnesses(ctx.cfg.cluster)  # dead_after 2, heartbeat 0.2: stale after 1 s, settle 7 s after a break
    w.observe({"worker:w0": "1:a", "aggregator:0": "2:a"}, {}, now=0.0)
    assert w.path_works(now=0.0)  # a coordinator that starts judges at once, as before
    w.observe({"worker:w0": None, "aggregator:0": "2:b"}, {}, now=0.5)
    assert w.may_judge("worker", "w0", 1)  # one member silent, the others beating: its silence is its own
    w.observe({"worker:w0": None, "aggregator:0": "2:b"}, {}, now=1.6)  # nobody beat for 1.1 s: the path is gone
    assert not w.path_works(now=1.6)
    w.observe({"worker:w0": None, "aggregator:0": "2:c"}, {}, now=3.0)  # healed: beats again
    assert not w.path_works(now=3.0 + w.settle_s - 0.1) and w.path_works(now=3.0 + w.settle_s)


def test_a_worker_the_leader_still_hears_is_not_judged_on_its_heartbeat(ctx: ServiceContext) -> None:
    w = Witnesses(ctx.cfg.cluster)
    w.observe({"aggregator:0": "2:a"}, {"w0": "5:10"}, now=0.0)
    assert w.leader_hears("w0", 5, now=1.9) and not w.leader_hears("w0", 4, now=1.9)
    assert not w.leader_hears("w0", 5, now=2.0)  # its count has not moved for dead_after
    w.observe({"aggregator:0": "2:b"}, {"w0": "5:11"}, now=2.5)
    assert w.leader_hears("w0", 5, now=2.6) and not w.leader_hears("w1", 1, now=2.6)


def test_liveness_fences_no_one_while_every_heartbeat_lapsed_at_once(ctx: ServiceContext) -> None:
    """The Redis host cut off from everyone: every member's heartbeat expires; nobody is declared dead until
    heartbeats come back and the path has worked for a while; then only the one still silent is."""
    fencer = Fencer(ctx)
    liveness = Liveness(ctx, fencer)
    try:
        register(ctx, "worker", "w0", 1, 11, heartbeat=True)
        register(ctx, "worker", "w1", 2, 12, heartbeat=True)
        register(ctx, "aggregator", "0", 3, 13, heartbeat=True)
        assert list(liveness.scan({}, local=False)) == []
        for who in (("worker", "w0"), ("worker", "w1"), ("aggregator", "0")):
            ctx.redis.delete(ctx.keys.heartbeat(*who))  # injected: every heartbeat expired at once
        liveness.witnesses.beats = {n: (v, t - 5.0) for n, (v, t) in liveness.witnesses.beats.items()}  # ... 5 s ago
        assert list(liveness.scan({}, local=False)) == [], "judged while everyone was silent"
        ctx.redis.set(ctx.keys.heartbeat("worker", "w1"), "2:later", px=60_000)  # healed: two beat again, w0 not
        ctx.redis.set(ctx.keys.heartbeat("aggregator", "0"), "3:later", px=60_000)
        assert list(liveness.scan({}, local=False)) == [], "judged before the others had time to beat again"
        assert liveness.witnesses.fresh_since is not None
        liveness.witnesses.fresh_since -= liveness.witnesses.settle_s  # injected: the path has worked since
        ctx.redis.set(ctx.keys.heartbeat("worker", "w1"), "2:later still", px=60_000)
        assert [(d.ident, d.how) for d in liveness.scan({}, local=False)] == [("w0", "heartbeat missing")]
    finally:
        fencer.close()


def test_liveness_spares_a_worker_whose_heartbeat_lapsed_while_the_leader_hears_it(ctx: ServiceContext) -> None:
    fencer = Fencer(ctx)
    liveness = Liveness(ctx, fencer)
    heard = HeardWriter(ctx.redis, ctx.keys, interval=3600)  # written by hand below
    try:
        register(ctx, "worker", "w0", 4, 14, heartbeat=False)  # its link to Redis cut
        register(ctx, "aggregator", "0", 3, 13, heartbeat=True)
        heard.note("w0", 4)
        heard.write()
        assert read_heard(ctx.redis, ctx.keys) == {"w0": "4:1"}
        assert list(liveness.scan({}, local=False)) == []  # the leader heard it: alive
        liveness.witnesses.heard["w0"] = ("4:1", time.monotonic() - ctx.cfg.cluster.dead_after)  # not since
        assert [d.ident for d in liveness.scan({}, local=False)] == ["w0"]
    finally:
        heard.close()
        fencer.close()
