"""The slow-host policy of local steps (services/aggregator/common/pace.py) with made-up timings, no sockets: a worker
whose replicas land late loses one replica a step at a time while another would finish one more sooner, down to none;
equal workers never trade; a share comes back when the worker is fast again; the caps yield to a step that overruns,
to a worker coming or going, and to `cluster.pace_replicas: false`. The cluster test is tests/test_pace_cluster.py."""

from __future__ import annotations

import pytest
from cmemi.services.aggregator.common.pace import Pace
from cmemi.services.aggregator.leader.leasing import Leasing

pytestmark = pytest.mark.timeout(60)


class Clock:
    """Steps of made-up time: each worker's replicas land at the given seconds into the step."""

    def __init__(self, pace: Pace, workers: list[str]) -> None:
        self.pace, self.workers, self.now, self.step, self.events = pace, workers, 1000.0, 0, []
        pace.emit = lambda kind, **kw: self.events.append((kind, kw))
        pace.new_step(0, self.now, workers)

    def run(self, lands: dict[str, list[float]], turn: dict[str, float] | None = None) -> None:
        """One step: worker w's replicas land at `lands[w]` seconds after the step began (its turn: lease to
        gradient, default the time of its first replica); then the next step begins."""
        start = self.now
        for w, times in lands.items():
            for t in times:
                lease_at = start + t - (turn or {}).get(w, times[0])
                self.pace.leased(w, lease_at)
                self.pace.accepted(w, False, start + t)
        self.now = start + max(t for times in lands.values() for t in times) + 0.01
        self.step += 1
        self.pace.new_step(self.step, self.now, self.workers)


def fast_and_slow(slow_at: float, steps: int, shares: dict[str, int] | None = None) -> Clock:
    """Three workers, 3 replicas, w2's replica landing `slow_at` s into each step, the others' at 1 s; a worker with a
    share gets that many replicas at 1 s each (w2 at `slow_at` each), the rest go to w0."""
    c = Clock(Pace(3), ["w0", "w1", "w2"])
    for _ in range(steps):
        cap = c.pace.cap.get("w2", 1)
        lands = {"w0": [1.0 * (i + 1) for i in range(1 + (1 - cap))], "w1": [1.0]}
        if cap:
            lands["w2"] = [slow_at]
        c.run(lands, turn={"w0": 1.0, "w1": 1.0, "w2": slow_at})
    return c


def test_equal_workers_never_trade_replicas() -> None:
    c = Clock(Pace(4), ["w0", "w1"])
    for i in range(40):  # a loaded machine: who lands last changes from step to step, by up to 20 %
        c.run({"w0": [1.0, 2.0 + 0.4 * (i % 2)], "w1": [1.1, 2.2 - 0.3 * (i % 3 == 0)]})
    assert c.pace.cap == {} and c.pace.moves == 0 and c.events == []
    assert c.pace.allows("w0", 7, c.now)


def test_a_slow_worker_loses_its_replica_to_a_faster_one() -> None:
    """w2 lands at 4 s, w0 would land one more at 1 + 1 = 2 s: after MIN_STEPS measured steps w2's share drops to 0,
    its replica is movable, and it is parked while its share is leased."""
    c = fast_and_slow(4.0, Pace.MIN_STEPS + 1)
    assert c.pace.cap == {"w2": 0}, c.events
    assert c.pace.moves == 1
    kind, fields = c.events[-1]
    assert kind == "replica_share" and fields["worker"] == "w2" and fields["share"] == 0
    assert not c.pace.allows("w2", 0, c.now + 0.1)
    assert c.pace.allows("w0", 5, c.now + 0.1) and c.pace.allows("w1", 1, c.now + 0.1)
    assert c.pace.movable({"w0": [0], "w1": [1], "w2": [2]}, c.now + 0.1) == {2}
    for _ in range(12):  # w0 now lands 2 replicas at 2 s: w2 (4 s a replica) does not get its back
        c.run({"w0": [1.0, 2.0], "w1": [1.0]})
    assert c.pace.cap == {"w2": 0} and c.pace.moves == 1


def test_a_worker_slower_by_less_than_a_move_costs_keeps_its_replica() -> None:
    """w2 lands at 2.2 s; moving its replica would make w0 land at 2 s: not a quarter better, so no move."""
    c = fast_and_slow(2.2, 20)
    assert c.pace.cap == {} and c.pace.moves == 0


def test_a_share_is_cut_one_replica_at_a_time_with_a_cooldown() -> None:
    """w1 holds 3 of 4 replicas and lands them at 3, 6, 9 s; w0 lands its one at 1 s: w1 loses one per COOLDOWN steps."""
    c = Clock(Pace(4), ["w0", "w1"])
    steps = 0
    while not c.pace.cap:
        c.run({"w0": [1.0], "w1": [3.0, 6.0, 9.0]}, turn={"w0": 1.0, "w1": 3.0})
        steps += 1
        assert steps <= Pace.MIN_STEPS + Pace.COOLDOWN
    assert c.pace.cap == {"w1": 2}
    for _ in range(Pace.COOLDOWN - 1):
        c.run({"w0": [1.0, 2.0], "w1": [3.0, 6.0]}, turn={"w0": 1.0, "w1": 3.0})
        assert c.pace.cap == {"w1": 2}
    c.run({"w0": [1.0, 2.0], "w1": [3.0, 6.0]}, turn={"w0": 1.0, "w1": 3.0})
    assert c.pace.cap == {"w1": 1} and c.pace.moves == 2
    assert c.pace.movable({"w0": [0], "w1": [1, 2, 3]}, c.now + 0.1) == {2, 3}


def test_a_share_comes_back_when_the_worker_is_fast_again() -> None:
    c = fast_and_slow(4.0, Pace.MIN_STEPS + 1)
    assert c.pace.cap == {"w2": 0}
    c.pace.per["w2"] = 0.5  # (its link recovered: the last replica it computed took half a second)
    for _ in range(Pace.COOLDOWN + 1):
        c.run({"w0": [1.0, 2.0], "w1": [1.0]})
    assert c.pace.cap == {} and c.events[-1][1]["share"] == 1, c.events


def test_the_caps_yield_to_a_step_that_overruns() -> None:
    """A fast worker that hangs while it heartbeats must not leave the capped one idle beside pending work."""
    c = fast_and_slow(4.0, Pace.MIN_STEPS + 1)
    expected = max(c.pace.finish.values())
    late = c.now + Pace.PATIENCE * expected + 0.1
    assert c.pace.allows("w2", 0, late)
    assert c.pace.movable({"w0": [0], "w2": [2]}, late) == set()


def test_a_worker_coming_or_going_resets_the_shares() -> None:
    c = fast_and_slow(4.0, Pace.MIN_STEPS + 1)
    assert c.pace.cap
    c.workers = ["w0", "w2"]
    c.run({"w0": [1.0, 2.0]})
    assert c.pace.cap == {}


def test_the_policy_off_caps_nobody() -> None:
    c = Clock(Pace(3, enabled=False), ["w0", "w1", "w2"])
    for _ in range(10):
        c.run({"w0": [1.0], "w1": [1.0], "w2": [9.0]})
    assert c.pace.cap == {} and c.pace.allows("w2", 3, c.now)
    assert c.pace.movable({"w2": [2]}, c.now) == set()


def test_a_step_collected_again_keeps_its_start() -> None:
    c = fast_and_slow(4.0, 1)
    started = c.pace.started
    c.pace.new_step(c.step, c.now + 5, c.workers)
    assert c.pace.started == started


def test_leasing_parks_a_worker_at_its_share() -> None:
    """Leasing.lease asks the pace first: a worker at its share of the step is parked, the others are leased."""
    from types import SimpleNamespace

    from cmemi.services.aggregator.common.admission import LeaseSeal
    from cmemi.shared.config.loading import load_config

    from tests.conftest import DIGITS

    cfg = load_config(DIGITS, ["train.local_steps=2", "train.replicas=4", "train.steps=20", "cluster.workers=3"])
    leasing = Leasing(cfg, True, False, LeaseSeal(b"k" * 32), 1, lambda: 3, live_ids=lambda: ["w0", "w1", "w2"])
    leasing.pace.cap["w2"] = 0
    leasing.pace.finish["w0"] = 1e6  # (the step has a long way to run before the caps are off)
    slow, fast = SimpleNamespace(wid="w2", inc=1), SimpleNamespace(wid="w0", inc=1)
    assert leasing.lease(b"slow", slow, 0) is None and b"slow" in leasing.parked  # type: ignore[arg-type]
    assert leasing.lease(b"fast", fast, 0) is not None  # type: ignore[arg-type]
    assert leasing.leased_to("w0") == 1 and leasing.leased_to("w2") == 0


def test_a_worker_given_every_replica_keeps_every_state() -> None:
    """The worker's side (services/worker/compute/replicas.py): one given all 4 replicas (its share is 2, it keeps 3)
    keeps each state it computed in the last two rounds, so none is sent again next step; older ones still go."""
    from types import SimpleNamespace

    from cmemi.services.worker.compute.replicas import Replicas
    from cmemi.shared.config.loading import load_config

    from tests.conftest import DIGITS

    cfg = load_config(DIGITS, ["train.microbatches=4", "cluster.workers=2"])
    replicas = Replicas(cfg, SimpleNamespace(window=2, ahead=False), None, print)  # type: ignore[arg-type]
    assert replicas.hold_at_most == 3
    for r in range(4):
        replicas.keep(r, 7, None)
    for r in range(4):  # step 7 computed replica by replica: the ones not yet computed are still wanted
        replicas.keep(r, 8, None)
        assert sorted(replicas.held) == [0, 1, 2, 3]
    replicas.keep(0, 10, None)  # two rounds on, the oldest go down to 3 again
    assert sorted(replicas.held) == [0, 2, 3]


def test_a_worker_at_no_share_is_measured_again_now_and_then() -> None:
    """A cut share is not for ever (a link recovers; a cut on a bad moment was wrong): after PROBE steps the worker
    gets one replica back, its old timings dropped, and it is cut again only on new ones."""
    c = fast_and_slow(4.0, Pace.MIN_STEPS + 1)
    assert c.pace.cap == {"w2": 0}
    for _ in range(Pace.PROBE):
        c.run({"w0": [1.0, 2.0], "w1": [1.0]})
    assert c.pace.cap == {} and "measured again" in c.events[-1][1]["why"], c.events
    assert "w2" not in c.pace.finish
    c.run({"w0": [1.0], "w1": [1.0], "w2": [1.2]}, turn={"w0": 1.0, "w1": 1.0, "w2": 1.2})  # fast again: kept
    for _ in range(10):
        c.run({"w0": [1.0], "w1": [1.0], "w2": [1.2]}, turn={"w0": 1.0, "w1": 1.0, "w2": 1.2})
    assert c.pace.cap == {} and c.pace.moves == 1


def test_one_slow_step_does_not_cut_a_share() -> None:
    """A cut needs the average and the last step both slow: a worker stalled for one step (a pause on a loaded
    machine) keeps its replica."""
    c = Clock(Pace(3), ["w0", "w1", "w2"])
    for i in range(30):
        c.run({"w0": [1.0], "w1": [1.0], "w2": [8.0 if i % 5 == 4 else 1.0]}, turn={"w0": 1.0, "w1": 1.0, "w2": 1.0})
    assert c.pace.cap == {} and c.pace.moves == 0


def test_the_fair_share_counts_the_replicas_a_capped_worker_gave_up() -> None:
    """Three fast workers share the four replicas of four when the fourth is at none: two each at most, so the fast one
    holding two keeps both (`Holdings.elsewhere` protects a holder's replicas up to the fair share)."""
    c = Clock(Pace(4), ["w0", "w1", "w2", "w3"])
    assert c.pace.fair(4) == 1
    c.pace.cap["w3"] = 0
    assert c.pace.fair(4) == 2
    c.pace.cap["w3"] = 1
    assert c.pace.fair(4) == 1
