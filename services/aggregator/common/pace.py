"""Local steps: how many of a step's replicas each worker may hold, from how late its replicas land (issue 48, "a slow
host costs its share, not everyone's time"; docs/design/local-steps.md, "Slow host").

A step of local steps waits for its last replica. With one host slower than the others (a link at a quarter of their
rate, half their compute), the replicas it holds land last and every other worker waits. The leader measures, per
worker, when its last replica of a step lands after the step began (`finish`, an exponential average over steps) and
what a replica that is not computed ahead costs it, lease to gradient (`turn`, likewise). At each new step it compares
the worker that finishes last with the one that would finish one more replica soonest: after its own last one, or, if
it is then busy all step and computes nothing ahead, after all of them computed in turn (its count + 1 times its turn;
a turn includes the state sent down and, streaming, the replay a moved replica needs: a move is paid once, then the
replica stays with its new holder). Measured on the emulated cluster, the optimistic estimate alone (finish + turn) moved
a replica off a host whose link was a quarter of the others' and halved the step rate: the fast worker lost its compute
ahead. When the slow one finishes later than that by more than `MARGIN` (on average and in each of its last two steps),
its share (`cap`) drops
by one: it is leased at most that many replicas a step, and the replicas it holds beyond it (its highest) are no longer
kept for it (`movable`), so a faster worker takes one with its state. A share rises again by one when the worker's
measured time per replica, one more of them, would still land `MARGIN` before the others' last, and every `PROBE`
steps anyway (conditions change: a link recovers; a cut that was wrong costs at most that long). One change per
`COOLDOWN` steps (a change's own effect is measured before the next), so two equal workers on a loaded machine do not
trade replicas back and forth.

The decision uses only timings: which worker computes a replica changes, never what it computes (a replica's round is
a pure function of its state and the step's parameters), so the result stays bitwise `cmemi reference`. A share is not
a promise to the step: past `PATIENCE` times the slowest expected finish the caps are off (a fast worker that hangs
while it heartbeats does not leave a capped one idle beside pending work), and a worker that joins or leaves resets
them. `cluster.pace_replicas: false` turns it off (a replica then stays with whoever holds it, whatever its pace).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def _ewma(old: float | None, new: float, weight: float = 0.5) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class Pace:
    MARGIN = 1.25  # a move must shorten the step by a quarter, and a share comes back only with the same margin
    MIN_STEPS = 2  # steps a worker's finish is measured before a decision uses it
    COOLDOWN = 3  # steps between two changes of any share
    PROBE = 30  # steps a cut share holds before the worker gets one replica back to be measured again
    PATIENCE = 2.0  # the caps are off once a step has run this many times its slowest expected finish

    def __init__(self, replicas: int, enabled: bool = True, emit: Callable[..., None] = lambda *_a, **_k: None) -> None:
        self.R, self.enabled, self.emit = replicas, enabled, emit
        self.step = -1
        self.started = 0.0  # when the current step began (monotonic)
        self.finish: dict[str, float] = {}  # worker -> seconds from a step's start to its last replica landed
        self.steps: dict[str, int] = {}  # worker -> steps its finish was measured over
        self.per: dict[str, float] = {}  # worker -> finish / replicas of its last measured step
        self.count: dict[str, int] = {}  # worker -> replicas it computed in its last measured step
        self.latest: dict[str, tuple[float, float]] = {}  # worker -> its finish in the last two steps it computed in
        self.fresh: frozenset[str] = frozenset()  # the workers whose replicas landed in the last step
        self.cut_at: dict[str, int] = {}  # worker -> the step its share was last cut
        self.turn: dict[str, float] = {}  # worker -> lease to gradient of a replica not computed ahead
        self.cap: dict[str, int] = {}  # worker -> the most replicas it is leased a step (absent: no limit)
        self.moves = 0  # share changes that took a replica from a worker
        self.landed: dict[str, tuple[int, float]] = {}  # this step: worker -> (replicas landed, when the last did)
        self.since: dict[str, float] = {}  # worker -> when its current lease went out
        self.by_worker: dict[str, int] = {}  # replicas each worker computed over the run
        self.quiet = 0  # steps until the next change may come
        self.workers: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ measuring
    def leased(self, wid: str, now: float) -> None:
        self.since[wid] = now

    def accepted(self, wid: str, ahead: bool, now: float) -> None:
        """One of `wid`'s replicas landed (`ahead`: computed before its lease, so its lease time says nothing of a
        replica's cost)."""
        n, _ = self.landed.get(wid, (0, 0.0))
        self.landed[wid] = (n + 1, now - self.started)
        self.by_worker[wid] = self.by_worker.get(wid, 0) + 1
        if not ahead and (since := self.since.get(wid)) is not None:
            self.turn[wid] = _ewma(self.turn.get(wid), now - since)

    def new_step(self, step: int, now: float, live: Iterable[str]) -> None:
        """Step `step` begins: the last step's finishes are folded in and the shares decided (a step collected again
        keeps its start and its shares)."""
        if step == self.step:
            return
        workers = frozenset(live)
        if workers != self.workers:  # a worker came or went: its replicas were handed out again, shares start over
            self.workers, self.cap, self.quiet = workers, {}, self.COOLDOWN
        for wid, (n, t) in self.landed.items():
            self.finish[wid] = _ewma(self.finish.get(wid), t)
            self.steps[wid] = self.steps.get(wid, 0) + 1
            self.per[wid], self.count[wid], self.latest[wid] = t / n, n, (self.latest.get(wid, (t, t))[1], t)
        self.fresh = frozenset(self.landed)
        self.step, self.started, self.landed = step, now, {}
        if self.enabled and self.R > 1:
            self.quiet = max(0, self.quiet - 1)
            if not self.quiet:
                self._decide()

    # ------------------------------------------------------------------ deciding
    def _decide(self) -> None:
        # a worker that computed nothing last step (its share is none) has no finish to compare: only fresh ones
        known = {w: f for w, f in self.finish.items()
                 if w in self.workers and w in self.fresh and self.steps.get(w, 0) >= self.MIN_STEPS}
        if len(known) < 2 and not self.cap:
            return
        last = max(sorted(known), key=lambda w: known[w], default=None)
        # when another would land one more: after its own, or, busy all step, with none computed ahead
        others = {w: max(known[w], self.count.get(w, 1) * self._turn(w)) + self._turn(w)
                  for w in known if w != last and self.cap.get(w, self.R) > 0}
        if last is not None and others:
            soonest = min(sorted(others), key=lambda w: others[w])
            # on average and in each of its last two steps: one pause on a loaded machine does not move a replica
            beaten = min(known[last], *self.latest[last]) > self.MARGIN * others[soonest]
            if beaten and self._holding(last) > 0:
                self._set(last, self._holding(last) - 1, f"finishes {known[last]:.2f} s into a step; {soonest} "
                          f"would finish one more replica at {others[soonest]:.2f} s")
                return
        for w in sorted(self.cap):  # a capped worker gets one back when one more would not hold the step up
            if self.step - self.cut_at.get(w, self.step) >= self.PROBE:  # or, now and then, to be measured again
                self.steps[w] = 0  # (a new cut needs new measurements)
                self.finish.pop(w, None)
                self.latest.pop(w, None)
                self._set(w, self.cap[w] + 1, f"measured again after {self.PROBE} steps at a share of {self.cap[w]}")
                return
            rest = max((known[o] for o in known if o != w), default=0.0)
            if w in self.per and (self.cap[w] + 1) * self.per[w] * self.MARGIN < rest:
                self._set(w, self.cap[w] + 1, f"{self.cap[w] + 1} replicas would land at "
                          f"{(self.cap[w] + 1) * self.per[w]:.2f} s, before the others' {rest:.2f} s")
                return

    def _turn(self, wid: str) -> float:
        """What one more replica costs `wid`: its lease-to-gradient time, else the slowest any worker measured."""
        return self.turn.get(wid, max(self.turn.values(), default=self.per.get(wid, 0.0)))

    def _holding(self, wid: str) -> int:
        """Replicas `wid` computed in its last measured step, within its share (a share comes down from there)."""
        return min(self.cap.get(wid, self.R), self.count.get(wid, 1))

    def _set(self, wid: str, share: int, why: str) -> None:
        share, cut = max(0, share), share < self.cap.get(wid, self.R)
        self.moves += cut
        if cut:
            self.cut_at[wid] = self.step
        self.cap[wid] = share
        if not cut and share >= -(-self.R // max(1, len(self.workers))):  # back to its fair share: no limit
            del self.cap[wid]
        self.quiet = self.COOLDOWN
        self.emit("replica_share", worker=wid, share=share, step=self.step, why=why)

    # ------------------------------------------------------------------ applying
    def _patient(self, now: float) -> bool:
        expected = max(self.finish.values(), default=0.0)
        return expected > 0 and now - self.started < self.PATIENCE * expected

    def allows(self, wid: str, leased: int, now: float) -> bool:
        """May `wid`, leased `leased` replicas in this step already, be leased another?"""
        return not self.enabled or wid not in self.cap or leased < self.cap[wid] or not self._patient(now)

    def movable(self, held: dict[str, list[int]], now: float) -> set[int]:
        """Of the replicas each worker holds for this step (`held`: worker -> replicas), those a capped worker holds
        beyond its share: its highest (it computes its lowest first), which another worker may take with its state."""
        if not self.enabled or not self.cap:
            return set()
        if not self._patient(now):  # the caps are off: each holder keeps its own again
            return set()
        return {r for w, rs in held.items() if w in self.cap for r in sorted(rs)[self.cap[w]:]}

    def fair(self, live: int) -> int:
        """A worker's fair share of the replicas (`Holdings.elsewhere`: one holding fewer may take another's extras
        beyond it): the replicas left by the capped workers over the others, so the fast workers given a slow one's
        replicas keep them, rather than a fast one that has sent its own this step taking them, with their states."""
        capped = {w: c for w, c in self.cap.items() if w in self.workers}
        rest = max(1, live - len(capped))
        return -(-max(0, self.R - sum(capped.values())) // rest)

    def summary(self) -> dict[str, Any]:
        """For summary.json: replicas computed by each worker, the shares in force, how many were lowered."""
        return {"replicas_by_worker": dict(sorted(self.by_worker.items())), "replica_shares": dict(sorted(self.cap.items())),
                "replica_share_cuts": self.moves}
