"""The leader's lease protocol (docs/design.md §2): which worker computes which node of the step's reduction tree.

Workers pull: `want` (or a `grad`, which implies the next `want`) is answered with `work` — carrying the
parameters when the worker's version is stale — or the worker is parked until work exists. A lease goes back
to the queue when its holder dies, is fenced, leaves, asks again (its lease was lost on the way) or times out;
an outstanding lease is handed to an idle worker too once it is overdue (`ReissuePolicy`). Every lease is
sealed (`admission.LeaseSeal`) so the shards can tell it from a forgery.

A transfer still arriving is not a lost one. A worker that hears nothing for a while re-asks (`want` with
`reask: n`); while the work last sent to it is unanswered (`in_flight`), the leader does not release its lease
or send its parameters again: it answers `pending {reask: n}`, which travels behind that work on the same
connection. If the work arrived first, the worker ignores the answer; if it never came (or the worker's
gradient never reached us), the worker knows it and asks plainly, and only then does the lease go back
(docs/design.md §2). So the leader holds at most one unanswered work message per worker: a slow link gets
one parameter set per lease, never a queue of copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from cmemi.services.aggregator.common.admission import LeaseSeal, WorkerInfo
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.pace import Pace
from cmemi.shared.config.schema import Config
from cmemi.shared.core import reduction


class ReissuePolicy:
    """How long a lease may be outstanding, while the queue is empty and workers idle, before the next idle worker
    gets it too: twice the recent lease-to-gradient time per microbatch (an exponential average; a lease of n
    microbatches waits n times as long), so a withheld lease costs about one recomputation, not `lease_timeout`,
    and an honest step's tail is not duplicated. `enabled` False: never before the lease expires."""
    FACTOR = 2.0
    MIN_S = 0.05
    MIN_SAMPLES = 3

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.avg: float | None = None
        self.samples = 0
        self._since: dict[tuple[str, int], float] = {}

    def leased(self, info: Any, now: float) -> None:
        self._since[(info.wid, info.inc)] = now

    def accepted(self, info: Any, now: float, microbatches: int = 1) -> None:
        since = self._since.get((info.wid, info.inc))
        if since is None:
            return
        dt = (now - since) / microbatches
        self.avg = dt if self.avg is None else 0.8 * self.avg + 0.2 * dt
        self.samples += 1

    @property
    def after(self) -> float | None:
        """Seconds per microbatch a lease is outstanding before an idle worker gets it too (None: not measured yet)."""
        if not self.enabled or self.avg is None or self.samples < self.MIN_SAMPLES:
            return None
        return max(self.MIN_S, self.FACTOR * self.avg)


class Leasing:
    def __init__(self, cfg: Config, per_microbatch: bool, always_strict: bool, seal: LeaseSeal, term: int,
                 live_workers: Callable[[], int], reclaim: Callable[[], None] = lambda: None,
                 live_ids: Callable[[], Iterable[str]] = tuple, emit: Callable[..., None] = lambda *_a, **_k: None,
                 ) -> None:
        self.cfg, self.M, self.seal, self.term = cfg, cfg.train.microbatches, seal, term
        # A stateless lossy codec (fp16/bf16/int8) rounds each microbatch's gradient, as the reference does, so it
        # leases microbatch by microbatch; the lossless and the error-feedback codecs encode a block's sum.
        self.per_microbatch = per_microbatch
        self.always_strict = always_strict  # sharded: every gradient is checked on arrival
        self.live_workers = live_workers
        self.parked: dict[bytes, tuple[WorkerInfo, int]] = {}  # identity -> (worker, parameter version it holds)
        self.in_flight: set[bytes] = set()  # identities sent work that have not answered it yet (grad or want)
        self.params_sent: dict[bytes, int] = {}  # identity -> the last parameter version sent to it
        # streaming local steps hand no lease to a second worker early: it would need the replica's state sent and
        # its segments replayed, more than the holder needs (it may have computed the lease ahead); a lease of a dead
        # worker goes back when it is fenced, or after its timeout
        self.reissue = ReissuePolicy(enabled=cfg.train.fragments <= 1)
        self.reclaim = reclaim  # a step's gradient buffers are free again (Intake.reclaim)
        # local steps: how many replicas a step each worker may hold, from how late its replicas land (pace.py)
        self.live_ids = live_ids
        self.pace = Pace(cfg.train.microbatches, cfg.train.local_steps > 0 and cfg.cluster.pace_replicas, emit)
        self.collector = self.new_step(0)

    def new_step(self, step: int, strict: bool = False) -> StepCollector:
        """Leases of a step: blocks of the reduction tree, one per worker where M allows. The last step's collection
        is over (its optimizer step done, or abandoned): its gradient buffers are free again."""
        self.reclaim()
        block = 1 if self.per_microbatch else reduction.block_size(self.M, max(self.cfg.cluster.workers,
                                                                                  self.live_workers()))
        self.collector = StepCollector(step, self.M, block=block, strict=strict or self.always_strict)
        self.pace.new_step(step, time.monotonic(), self.live_ids())
        return self.collector

    @property
    def timeout(self) -> float:
        """Seconds a lease of one microbatch may be outstanding (a replica's round of local steps is H microbatches'
        work)."""
        return self.cfg.cluster.lease_timeout * max(1, self.cfg.train.local_steps)

    def reissuable(self) -> bool:
        after = self.reissue.after
        return after is not None and self.collector.reissuable(time.monotonic(), after)

    def lease(self, identity: bytes, info: WorkerInfo, held_version: int,
              prefer: Collection[int] = (), avoid: Collection[int] = ()) -> tuple[int, int, bytes] | None:
        """The next node for this worker (a leaf in `prefer` first, none in `avoid`) and its seal, or None: the worker
        is parked until there is one."""
        now = time.monotonic()
        self.reissue.leased(info, now)
        if not self.pace.allows(info.wid, self.leased_to(info.wid), now):  # its share of this step is leased
            self.parked[identity] = (info, held_version)
            return None
        self.pace.leased(info.wid, now)
        node = self.collector.lease(info.wid, info.inc, now, self.timeout, self.reissue.after, prefer, avoid)
        if node is None:
            self.parked[identity] = (info, held_version)
            return None
        self.parked.pop(identity, None)
        return node[0], node[1], self.seal.seal(self.term, self.collector.step, node[0], node[1], info.wid, info.inc)

    def leased_to(self, wid: str) -> int:
        """Nodes of this step leased to any incarnation of `wid` so far."""
        return sum(any(h[0] == wid for h in holders) for holders in self.collector.granted.values())

    def waiting(self) -> list[tuple[bytes, WorkerInfo, int]]:
        """The parked workers, oldest first: (identity, worker, parameter version it holds)."""
        return [(identity, info, held) for identity, (info, held) in self.parked.items()]

    def has_work(self, finished: bool) -> bool:
        """Is there something for a parked worker: work, an overdue lease, or word that the run is over?"""
        return bool(self.collector.pending) or finished or self.reissuable()

    def release(self, wid: str, max_inc: int | None = None) -> list[int]:
        """Leases of `wid` (incarnations <= max_inc) back to the queue, as leaves."""
        return self.collector.release(wid, max_inc)

    def forget(self, identity: bytes) -> None:
        self.parked.pop(identity, None)
        self.in_flight.discard(identity)
        self.params_sent.pop(identity, None)

    def sent(self, identity: bytes, version: int | None) -> bool:
        """Work went to `identity`, with the parameters of `version` (None: without parameters). True if that
        version had been sent to it already (a duplicate: its first copy was lost, or a resend storm)."""
        self.in_flight.add(identity)
        if version is None:
            return False
        again = self.params_sent.get(identity) == version
        self.params_sent[identity] = version
        return again

    def answered(self, identity: bytes, reask: Any) -> bool:
        """A `want` or `grad` came from `identity`: False for a re-ask while its work is still unanswered (the
        work may still be arriving: do not release or resend, answer `pending`)."""
        if isinstance(reask, int) and not isinstance(reask, bool) and reask > 0 and identity in self.in_flight:
            return False
        self.in_flight.discard(identity)
        return True

    def expire(self, now: float) -> bool:
        """Leases past their timeout back to the queue, as leaves; True if any."""
        return bool(self.collector.expire(now))
