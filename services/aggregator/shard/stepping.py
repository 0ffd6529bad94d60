"""A shard k > 0's current step, from the workers' gradient slices to the leader's commit (docs/design.md, "Shards").

- `offer`: a worker's slice of its gradient for a node of the step's reduction tree, checked before a byte of it is
  decoded (checks.py), then decoded and offered to the stage's collector: the first complete copy of each microbatch
  wins, as at the leader. A slice that does not fit is dropped, and the worker's LIMIT-th in a row gets a fatal
  reject (misfits.py).
- `report`: while its step is incomplete, the shard tells the leader every half second which microbatches it holds
  (`shard_have`): once the leader's own step is complete, what a shard still lacks after a grace (its worker died
  between its sends) is leased again (`StepCollector.reopen`). A complete step is reported (`shard_ready`: one
  squared norm per piece for clipping, the fp16 overflow flag), and again every second until committed (the leader
  may have missed it: restarting).
- `commit`: the leader's `shard_commit` carries every shard's share once all are in; the shard steps its pieces by the
  same rule as the leader (`Trainer.apply`) and answers the pulls waiting for the new version.
- pipelined (`cluster.pipeline_stages`), each stage is stepped as soon as it is in (stages.py).

The server (server.py) owns the loop, the leader's term and what follows a commit (evaluation, snapshot, the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn

import torch
from cmemi.services.aggregator.common import gradients
from cmemi.services.aggregator.common.admission import LeaseSeal
from cmemi.services.aggregator.common.intake import Drops, Intake
from cmemi.services.aggregator.common.misfits import Misfits
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard import checks
from cmemi.services.aggregator.shard.inner import ShardStates
from cmemi.services.aggregator.shard.pulls import SliceServer
from cmemi.services.aggregator.shard.stages import StepStages
from cmemi.services.aggregator.shard.upstream import LeaderLink, Rejoin
from cmemi.services.aggregator.steplog.shard import ShardStepLog
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.wire import protocol


class ShardStepper:
    def __init__(self, trainer: Trainer, codec: GradientCodec, stages: list[list[str]], pipelined: bool,
                 intake: Intake, states: ShardStates, slices: SliceServer, steplog: ShardStepLog | None,
                 leader: LeaderLink, send: Callable[..., None], drops: Drops, fatal: Callable[[str], NoReturn],
                 shard: int) -> None:
        """`send(identity, mtype, encoded, **fields)`: to a worker (a fatal `reject`); `leader`: the link of the
        current term (`new_term` names the next one)."""
        self.trainer, self.codec, self.stages, self.pipelined = trainer, codec, stages, pipelined
        self.intake, self.states, self.slices, self.steplog = intake, states, slices, steplog
        self.leader, self.send, self.drops, self.fatal, self.shard = leader, send, drops, fatal, shard
        self.M = trainer.cfg.train.microbatches
        self.misfits = Misfits()  # admitted workers' gradients in a row that do not fit (misfits.py)
        self.current = StepStages(stages, self.M, trainer.step, pipelined)
        self.next_ready = self.next_have = 0.0

    @property
    def version(self) -> int:
        """The parameter version the current step's gradients are computed from."""
        return self.current.version

    def restart(self) -> None:
        """The step collected anew at the trainer's step (a join said there): what the old sums held goes."""
        self.current = StepStages(self.stages, self.M, self.trainer.step, self.pipelined)

    def new_term(self, leader: LeaderLink) -> None:
        """The leader's new term, joined in place: its link; what the old leader was told is said again at once."""
        self.leader = leader
        self.next_ready = self.next_have = 0.0

    def offer(self, identity: bytes, msg: protocol.Message, seal: LeaseSeal | None, term: int) -> None:
        """A worker's gradient slice (admitted: its hello was answered in this term)."""
        h = msg.header
        if (refused := checks.refusal(h, seal, term, self.current.version, self.M, len(self.stages))):
            self.drops(*refused)
            return
        node, where, g = (h["lo"], h["hi"]), checks.where(h), h["stage"]
        collector = self.current.collectors[g]
        if self.current.held(g, node):
            return
        inner, keep, bad = self.states.take(h, msg.tensors)  # local steps: the replica's state, if kept here
        kept = self.steplog.keep(h, msg.tensors, collector.kept) if self.steplog is not None and bad is None else None
        grads, bad, _ = gradients.decode(self.codec, self.trainer, h, msg.tensors, self.trainer.expected(
            h["step"], self.stages[g])) if bad is None else (None, bad, 0.0)
        if bad is not None:
            self.drops(bad, where)
            if (why := self.misfits.reject(identity, h["wid"], bad, where, f"parameter-server shard {self.shard}")):
                self.send(identity, "reject", fatal=True, reason=why)  # its LIMIT-th in a row (misfits.py)
            return
        self.misfits.forget(identity)
        if (reason := collector.offer(node, grads, h["losses"], None, keep=kept)) is not None:
            self.drops(reason, where)
            return
        self.states.accepted(h["lo"], inner, keep)
        if collector.complete and self.pipelined:
            self._step_stage(g)
        elif collector.complete:
            self.current.mean = collector.mean()
            self.ready()

    def _step_stage(self, g: int) -> None:
        """Pipelined: stage g of the step is in; step it and send it to the pulls waiting for it. Version s of the
        stage stays encoded (Publisher.kept) until the commit; after the last stage the step is complete."""
        self.slices.encoded(g, self.current.version)
        self.current.step_stage(g, self.trainer, self.fatal, f" on shard {self.shard}")
        self.answer_pulls()
        if self.current.complete:
            self.ready()

    def report(self, now: float, done: bool) -> None:
        """Each pass of the loop: a complete step's `shard_ready` again each second, an incomplete one's `shard_have`
        every half second."""
        if self.current.complete and now >= self.next_ready:  # the leader may have missed it (restarting)
            self.ready()
        elif not self.current.complete and not done and now >= self.next_have:
            self.next_have = now + 0.5
            self.leader.send("shard_have", step=self.current.version, have=self.current.have())

    def ready(self) -> None:
        grads, _ = self.current.mean if self.current.mean is not None else (None, 0.0)
        if self.steplog is not None:  # its step log entry first (once per step, however often it is ready)
            self.steplog.ship(self.current.version + 1, grads, self.trainer.inner, self.current.collectors[0])
        self.leader.send("shard_ready", step=self.current.version, partials=self.trainer.partials(grads),
                         overflow=grads is None and not self.pipelined)
        self.next_ready = time.monotonic() + 1.0

    def commit(self, partials: list[float], skip: bool) -> None:
        """The leader's commit of the current step: applied (pipelined: its stages were stepped as they came), the
        next step's collectors made, the pulls of the new version answered."""
        version = self.current.version
        if not self.current.complete:  # the leader commits only once every shard reported its step complete
            raise Rejoin(f"told to commit step {version}, which is not complete here")
        if self.pipelined and skip:  # nothing overflows without fp16: a leader of another configuration
            self.fatal(f"shard {self.shard}: told to skip step {version + 1} of a pipelined run; use the "
                       "same cluster.pipeline_stages and precision everywhere")
        self.current.apply(self.trainer, skip, partials, self.fatal, f" on shard {self.shard}")
        self.intake.reclaim()  # the step's gradient buffers take the next step's
        self.current.next_step(self.trainer.step)
        self.trainer.release_heap()  # the step's gradient sum is gone with its collectors
        self.answer_pulls()

    def answer_pulls(self) -> None:
        self.slices.answer(self.current.version, self.current.applied)
        self.states.answer()

    def holds(self) -> list[torch.Tensor]:
        """The buffers the step's sums keep (gradients.Spares)."""
        return self.current.holds()
