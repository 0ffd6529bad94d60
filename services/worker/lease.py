"""One lease of work, in four named steps: its parameters in, its gradient computed, sent, and what comes after.

1. `_parameters`: a restarted shard's address first when the lease names it (`told`), then the leader's slice lands
   in the model (services/worker/links/intake.py) and every other shard's slice of the same version is fetched
   (services/worker/links/shard_links.py). Any of them stale or torn: ask again.
2. `_compute`: a block of microbatches (services/worker/compute/block.py), or a replica's round of local steps
   (services/worker/compute/replicas.py; a state not held is asked of the shard that keeps it, r mod K, when not the
   leader: train.inner_states). Before it, the last gradient's frames leave ZeroMQ's queues (a big model
   never holds two gradients, services/worker/links/inflight.py). A slot read in place that was rewritten while
   computed on (services/worker/links/lending.py) makes the lease stale: nothing is sent, the whole version is asked for.
3. `outbox.send`: encoded and sent to every shard (services/worker/links/outbox.py).
4. `_after`: streaming computes the next step's segments ahead; a data loader guesses the next step's block.

At CMEMI_LOG_LEVEL=DEBUG each lease logs `lease_timing` (wall-clock times it was in hand, its parameters in, computed,
sent): with the leader's `grad_timing` and `step_timing`, where a step's time goes (bench/round_timeline.py).
"""

from __future__ import annotations

import time
from typing import Any

from cmemi.services.worker.compute.block import BlockComputer, StaleParameters
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.compute.replicas import Replicas
from cmemi.services.worker.links.inflight import InFlight
from cmemi.services.worker.links.intake import Intake
from cmemi.services.worker.links.leader import LeaderLink
from cmemi.services.worker.links.outbox import Gradient, Outbox
from cmemi.services.worker.links.shard_links import ShardLinks
from cmemi.shared.config.schema import Config
from cmemi.shared.core import innerstate
from cmemi.shared.wire import protocol


class LeaseWork:
    def __init__(self, cfg: Config, log: Any, runner: MicrobatchRunner, compute: BlockComputer, intake: Intake,
                 link: LeaderLink, shard_links: ShardLinks, replicas: Replicas, sends: InFlight, outbox: Outbox) -> None:
        self.cfg, self.log, self.runner, self.compute, self.intake = cfg, log, runner, compute, intake
        self.link, self.shard_links, self.replicas, self.sends, self.outbox = link, shard_links, replicas, sends, outbox

    def want(self) -> None:
        """Ask again, naming the version held (or none): the one line every stale lease ends in."""
        self.link.want(self.intake.number)

    def run(self, msg: protocol.Message) -> None:
        """Lease `msg` (a `work` of this term): computed and sent, or (stale) asked for again."""
        h = msg.header
        got = time.time()  # (wall clock: `lease_timing`, a round's timeline on one machine, bench/round_timeline.py)
        if h["shards"] is not None:  # a shard restarted in the term: where it is now, before any slice goes to it
            self.told(h["shards"])
        if not self._parameters(msg):
            self.want()
            return
        ready = time.time()
        self.sends.settle()  # a big model's last gradient is out of ZeroMQ's queues before the next one exists
        g = self._compute(h)
        if g is None:
            self.want()
            return
        computed = time.time()
        self.outbox.send(h, g, self.intake.number)
        self.log.debug("lease_timing", step=h["step"], lo=h["lo"], got=got, ready=ready, computed=computed,
                       sent=time.time(), state="inner" in g.extra or bool(g.inner))
        self._after(h)

    def told(self, entries: Any) -> None:
        """The leader's word on where every shard is (a lease's `shards`): the next pull or push relinks to a
        restarted one (services/worker/links/shard_addrs.py). A malformed entry is dropped and counted; the lease
        goes on (the shard's Redis record still tells)."""
        addrs = self.shard_links.addrs
        if addrs is None:
            return
        before = addrs.dropped
        addrs.told(entries)
        if addrs.dropped > before:
            self.log.warning("message dropped", reason="bad_shard_addr", detail=repr(entries)[:200],
                             count=addrs.dropped)

    def _parameters(self, msg: protocol.Message) -> bool:
        """The leader's slice into the model, then the other shards' slices of the same version; False if stale."""
        if not self.intake.receive(msg, self.link.slots):
            return False
        links = self.shard_links
        return not links.links or links.fetch(self.intake.number)  # the shards past it: this lease is stale

    def _compute(self, h: dict[str, Any]) -> Gradient | None:
        """The lease's gradient; None when it is stale (no state held for the replica, or the slot rewritten)."""
        step, lo, hi = h["step"], h["lo"], h["hi"]
        local = self.replicas.local
        if local is not None:
            if (held := self.replicas.state_for(lo, step)) is None and (k := self.replicas.keeper(lo)):
                self.replicas.hold(self.shard_links.inner(k, lo, step))  # from the shard that keeps it
                held = self.replicas.state_for(lo, step)
            if held is not None and (lacking := self.replicas.lacking(held[0], step)) and not self._past(lacking):
                self.replicas.forget(lo)
                held = None
            if held is None:
                self.log.info("no inner state for this replica's round; asking again", replica=lo, round=step)
                return None
            (losses, grads, buffers, state), ahead = self.replicas.lease(step, lo, held)
            if self.replicas.replayed:  # train.state_every > 1: a snapshot's rounds computed again (at most D − 1)
                r, first, rnd = self.replicas.replayed.pop()
                self.log.info("replayed a replica's rounds from its snapshot", replica=r, first=first, round=rnd,
                              rounds=rnd - first)
            g = Gradient(losses, grads, buffers, True, {"ahead": ahead})
            self.replicas.keep(lo, step + 1, state)
            if local.ships_state(step, lo):
                g.extra["inner"], g.inner = innerstate.to_wire(state)
            return g
        try:
            g = Gradient(*self.compute.block(step, lo, hi, float(h["scale"])))
            stale = not self.intake.lending.valid()
        except StaleParameters:
            stale = True
        if stale:  # a slot read in place was rewritten meanwhile: this lease is stale
            self.log.info("parameters slot rewritten while computed on; asking again", version=self.intake.number)
            self.intake.forget()
            return None
        self.intake.lending.computed()
        return g

    def _past(self, versions: list[int]) -> bool:
        """train.state_every > 1, K > 1: every shard k > 0's pieces of the older versions a replay starts its rounds
        from (each from its history); False if a shard cannot answer one (outside its window: logged, asked again)."""
        for (k, u), msg in self.shard_links.past(versions).items():
            if msg.header["refused"] is not None:
                self.log.warning("a shard cannot answer a replay's past version; asking again", shard=k, version=u,
                                 reason=msg.header["refused"])
                return False
            self.replicas.add_past(k, u, dict(msg.tensors))
        return True

    def _after(self, h: dict[str, Any]) -> None:
        """While the gradient travels and the aggregator steps."""
        if h["last"]:  # streaming: no other lease of this step is coming our way; compute ahead now, while
            self.compute_ahead(h["step"])  # the gradient travels (`parked` would come only once it has arrived)
        lo, hi = h["lo"], h["hi"]
        if self.runner.loader is not None and self.replicas.local is None and (
                hi - lo > 1 or self.cfg.train.microbatches == 1):
            # while the aggregator steps: a block lease is most often this worker's again next step (single
            # microbatches, as a lossy codec leases them, go to whoever asks first: no guess)
            self.runner.loader.guess(h["step"] + 1, range(lo, hi))

    def compute_ahead(self, step: int) -> None:
        """Streaming: the next step's segments, while step `step` is collected (also on `parked`)."""
        self.replicas.compute_ahead(step, self.intake.number, self.link.waiting)
