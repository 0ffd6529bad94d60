"""What the leader does with each message of a shard k > 0 (docs/design.md §4; the shard's side is
services/aggregator/shard/): the roster keeps the shards' state, and here each message's consequence for the
leader's own loop — the hellos held back until every shard joined, the leases a shard still lacks, the step
that waits for every shard's share, the evaluation that waits for every shard's pieces.
"""

from __future__ import annotations

from collections.abc import Callable

from cmemi.services.aggregator.leader.parts import LeaderParts
from cmemi.services.aggregator.leader.stepping import Stepper
from cmemi.shared.wire import protocol

Handler = Callable[[bytes, protocol.Message], None]


class ShardMessages:
    def __init__(self, parts: LeaderParts, stepper: Stepper, serve_parked: Callable[[], None],
                 hello: Handler) -> None:
        self.p, self.stepper, self.serve_parked, self.hello = parts, stepper, serve_parked, hello

    def handlers(self) -> dict[str, Handler]:
        return {"shard_join": self.on_join, "shard_have": self.on_have, "shard_ready": self.on_ready,
                "shard_eval": self.on_eval, "shard_final": self.on_final}

    def on_join(self, identity: bytes, msg: protocol.Message) -> None:
        """Once every shard joined this term, the workers' hellos held back meanwhile are answered."""
        assert self.p.roster is not None
        if self.p.roster.join(identity, msg.header, self.p.trainer.step):
            waiting, self.p.waiting = self.p.waiting, []
            for ident, hello in waiting:
                self.hello(ident, hello)

    def on_have(self, identity: bytes, msg: protocol.Message) -> None:
        """A shard's microbatches of its incomplete step: what it lacks of a step complete here is leased again (a
        restarted incarnation's, of what is here, at once: roster.py `have`)."""
        if self.p.roster is not None and self.p.roster.have(identity, msg.header, self.p.leasing.collector,
                                                            grace=2 * self.p.cfg.cluster.dead_after):
            self.serve_parked()

    def on_ready(self, identity: bytes, msg: protocol.Message) -> None:
        """A shard's share of the step is complete: the step is applied once every shard's is (and the leader's)."""
        if (self.p.roster is not None and self.p.roster.ready(identity, msg.header, self.p.leasing.collector.step)
                and self.stepper.mean is not None):
            self.stepper.apply()

    def on_eval(self, identity: bytes, msg: protocol.Message) -> None:
        if self.p.slices is not None:
            self.p.slices.eval_pieces(identity, msg.header, msg.tensors)
            self.p.evals.pieces_in(self.p.slices.place_eval)

    def on_final(self, identity: bytes, msg: protocol.Message) -> None:
        if self.p.slices is not None:
            self.p.slices.final(identity, msg.header, msg.tensors, self.p.trainer.step)
