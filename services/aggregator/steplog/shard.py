"""The step log on a shard k > 0 (`cluster.shards` > 1, docs/design/step-log.md, "Sharded").

A shard ships its slice's entry (its reduced gradient slice) with its `shard_ready`, before the leader's commit:
the leader's own entry records the commit's decision (every shard's norm partials, the skip) and the checkpointer
acknowledges it only once it holds every shard's entry of that step, so the shard applies the commit without an
ack of its own. It keeps each entry until the checkpointer answers `logged` (at most two: the leader committed step
s - 1 only after its ack of s - 2, which needs this shard's entry of s - 2 held), and sends them again after a
`log_gap` (a restarted checkpointer holds nothing until the leader's forced checkpoint, `shard_snapshot`, is
written) or to a restarted checkpointer. A restarted shard restores its slice of the checkpoint its leader
restored and replays its own entries with the leader's decisions, as far as the log holds both (on to the leader's
step when told it: `shard_behind`); restarted within a term, it is then taken in that term
(services/aggregator/leader/roster.py `Restarts`).

A kept entry still unacknowledged `resend_after(cluster)` after it was last sent goes again (link.py: the 300-fault
soak's stall, issue 47): one lost with a connection that a one-way cut or a SIGSTOPped checkpointer ended would
otherwise be sent again only to a restarted checkpointer, and the leader's ack of that step, which waits for it,
would never come. Nothing here waits to send (the link's SendQueue).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.evaluation import eval_boundary
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.steplog import frames
from cmemi.services.aggregator.steplog.connection import resend_after
from cmemi.services.aggregator.steplog.link import RECHECK_S, StepLogLink
from cmemi.services.aggregator.steplog.replay import replay
from cmemi.services.aggregator.steplog.replicas import states_of
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.config.schema import Config
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import limits


def in_use(cfg: Config, trainer: Trainer) -> bool:
    """Is the step log on for this server? With local steps too (the leader's entry carries the replicas' states:
    replicas.py; at K > 1 each shard ships its slice of the mean change as it ships a gradient slice), not with
    pipelined shards (stages are stepped before the commit, from no single entry). The same answer on every shard,
    so a cluster has the log on all or none."""
    return cfg.checkpoint.step_log and not (trainer.sharded and cfg.cluster.pipeline_stages)


def replays_in_term(cfg: Config, trainer: Trainer, codec: GradientCodec) -> bool:
    """Can a restarted shard's replay alone give it back its dead incarnation's place within the term (the leader's
    `Restarts`), or must the cluster go to a new term? Its replay brings back what its log holds: its slice, with
    the log `in_use`. What a new term also resets, and a restart within the term does not, lives outside the shard:
    the replicas' states of local steps (`trainer.local`: the worker-side rules that keep them exact were built and
    tested for a new term; in the term the suite saw a local-steps shard not replay) and a stateful codec's residuals
    (`codec.stateful`, error feedback: the rewound residual of services/worker/residual.py, likewise; in the term
    the suite saw a topk run off `cmemi reference`). Those go to a new term, whose leader and shards replay the log
    (still no step redone)."""
    return in_use(cfg, trainer) and not trainer.local and not codec.stateful


def framed(codec: GradientCodec, trainer: Trainer) -> int:
    """Below how many bytes a step's gradients as they came are kept for this shard's entry (frames.py `room`): its
    dense slice's; 0: never (`in_use`)."""
    return limits.nbytes(trainer.pieces.values()) if frames.in_use(codec, trainer) else 0


class ShardStepLog:
    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, term: int, shard: int,
                 saved: list[Callable[[int], object]] | None = None, frames_below: int = 0) -> None:
        """`saved`: told each checkpoint step written (CheckpointerLink.on_saved): the state spool's retention.
        `frames_below`: the step's gradients as they came are kept for its entry while fewer bytes than this (`framed`;
        0: never)."""
        self.link = StepLogLink(ctx, zctx, term, shard)
        self.frames_below = frames_below
        if saved is not None and self.link.states is not None:
            saved.append(self.link.states.covered)
        self.kept: dict[int, tuple[float, list[list[Any]]]] = {}  # step -> (when shipped, its messages), until logged
        self.resend_s = resend_after(ctx.cfg.cluster)
        self.sent_at = 0.0  # when an entry was last sent (shipped, or sent again)
        self.again_at: float | None = None  # a log_gap came: send what is kept again then
        self.next_check = 0.0
        self.shipped = -1  # the newest step shipped
        self.boundary: tuple[int, dict[str, torch.Tensor]] | None = None  # see _boundary
        self.restored: int | None = None  # the step its slice was restored at (see replay)

    def replay(self, ctx: ServiceContext, trainer: Trainer, totals: RunTotals, upto: int | None = None) -> int:
        """After restoring the leader's checkpoint: this shard's entries, each with its leader's decision, as far as
        the log holds both, or to `upto` (the leader's step, which it tells a restarted shard that joined short of
        it: `shard_behind`). Every step the log holds a decision of was applied by the leader of this term: it
        replayed its log and cut what it had not applied before it advertised the term this shard joins
        (checkpointer/steplog_replies.py). Only when the leader has moved past this shard's checkpoint (at its
        term's start, or since: the run's progress in Redis, a few steps behind) is the log asked at all.
        The first call comes right after the restore: the step restored then is the checkpoint each replay of this
        process names in `step_log_replayed` (`shard_behind`'s goes on from the first one's end, and named that end
        as its checkpoint: the once-seen failure of `checkpoint == 0` in tests/test_steplog_sharded.py)."""
        if self.restored is None:
            self.restored = trainer.step
        if upto is None and not moved_on(ctx, trainer.step):
            return trainer.step
        replay(ctx, trainer, self.link, totals, where=f" on shard {trainer.shard}", judge=False, upto=upto,
               each=lambda step: self._boundary(ctx.cfg, trainer, step), checkpoint=self.restored)
        return trainer.step

    def catch_up(self, ctx: ServiceContext, trainer: Trainer, totals: RunTotals, step: int) -> bool:
        """Behind the leader's `step` (`shard_behind`: restarted within the term, or joined a new one in place):
        this shard's entries on to it; True if it moved (it joins again there)."""
        before = trainer.step
        if step > before:
            self.replay(ctx, trainer, totals, upto=step)
        return trainer.step > before

    def _boundary(self, cfg: Config, trainer: Trainer, step: int) -> None:
        """A copy of this shard's pieces at the last evaluation boundary replayed: the leader evaluates that step
        again if no entry holds its result (it was running when the leader died); sent once joined."""
        if eval_boundary(cfg, step):
            self.boundary = (step, {n: p.detach().clone() for n, p in trainer.pieces.items()})

    def take_boundary(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        boundary, self.boundary = self.boundary, None
        return boundary

    def ship(self, step: int, grads: dict[str, torch.Tensor] | None, inner: InnerStates | None = None,
             collector: StepCollector | None = None) -> None:
        """Step `step`'s slice (None: it overflowed), sent now unless it was already, kept until logged (copied:
        the commit's optimizer step changes the gradient in place). `inner`: with `train.inner_states: shards`, the
        states of this shard's replicas the step makes current (`next`, before the commit advances them), as the
        leader's entry carries its own (replicas.py): a replay of this shard's entries restores them. `collector`:
        the step's; its gradients as they came go instead of the slice where they are fewer bytes (frames.py)."""
        if step <= self.shipped:
            return
        self.shipped = step
        spool = getattr(self.link, "states", None)  # (None: the checkpointer's spool is off, or a test's fake link)
        framed = frames.entry(collector.kept, collector.M) if collector is not None and \
            frames.smaller(collector.kept, grads, collector.M) else None
        msgs = self.link.encode(step, grads, None, None, 0.0, *states_of(inner, spool, step), encoded=framed)
        for old in [s for s in self.kept if s < step - 1]:  # held: see the module's docstring
            del self.kept[old]
        self.sent_at = time.monotonic()
        self.kept[step] = (self.sent_at, msgs)
        self.link.send(msgs)

    def keep(self, h: dict[str, Any], tensors: dict[str, torch.Tensor],
             got: list[frames.Received]) -> frames.Received | None:
        """What the step's collector keeps of a gradient for this shard's entry, taken before its decode (`got`: what
        it kept so far; frames.py `room`)."""
        return frames.received(h, tensors) if frames.room(got, self.frames_below) else None

    def poll(self) -> None:
        """Take the checkpointer's answers; send the kept entries again after a gap, to a restarted checkpointer, or
        when none was acknowledged `resend_s` after the last send."""
        now = time.monotonic()
        for msg in self.link.replies():
            if msg.type == "logged":
                self.kept.pop(msg.header["step"], None)
            elif msg.type == "log_gap" and self.again_at is None:
                self.again_at = now + RECHECK_S
        if not self.kept:
            return
        moved = False
        if now >= self.next_check and min(t for t, _ in self.kept.values()) < now - RECHECK_S:
            self.next_check = now + RECHECK_S  # an ack this late: is the checkpointer still the one sent to?
            moved = self.link.moved()
        late = now - self.sent_at >= self.resend_s and not len(self.link.queue)  # (nothing of it still waits)
        if moved or late or (self.again_at is not None and now >= self.again_at):
            self.again_at, self.sent_at = None, now
            for step in sorted(self.kept):
                self.link.send(self.kept[step][1])

    def enter_term(self, term: int, step: int, boundary: tuple[int, dict[str, torch.Tensor]] | None) -> None:
        """This shard joined its leader's new term in place at `step` (shard/newterm.py). What it kept or queued was
        shipped under the old term, which the checkpointer now drops (`stale_term`), and the new leader's replay cut
        the log after its own step: none of it is sent again. Entries from the next step on go under the new term (a
        step shipped in the old term is shipped again). `boundary`: the pieces of the last evaluation step, sent to
        the new leader once welcomed (`take_boundary`). A replay from here names the checkpoint it restored still."""
        self.link.term = term
        self.link.queue.clear()
        self.kept.clear()
        self.shipped, self.again_at, self.boundary = step, None, boundary

    def close(self) -> None:
        self.link.close()


def moved_on(ctx: ServiceContext, step: int) -> bool:
    """Has the leader moved past `step`: replayed past it at its term's start, or committed a step past it since?"""
    try:
        replayed, progress = ctx.redis.hget(ctx.keys.aggregator, "replayed"), ctx.redis.hget(ctx.keys.progress, "step")
    except redis.RedisError:
        return True  # (Redis away: ask the log)
    return max(int(replayed or -1), int(progress or -1)) > step
