"""A restarted server replays the step log: the checkpoint restored, each logged step's inputs go through its
optimizer again — optimizer steps only, no forward or backward anywhere, no worker recomputes a committed step.

CPU torch gives the same bits for the same inputs, and an entry holds every input of a step that is not a function
of the step and the checkpoint (the reduced gradient, a skipped step, the buffer sum; the LR schedule, the loss scale
and the downlink mirror follow from those), so the state after the replay is bitwise the one the dead server had.
The steps the log does not hold (none, unless the checkpointer died too, or the newest checkpoint was damaged) are
redone by the workers, as without the log; the run says how many in events.jsonl (`steps_redone`).
"""

from __future__ import annotations

import time

import redis
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.common.userstep import users_step
from cmemi.services.aggregator.steplog.link import StepLogLink, inputs_of
from cmemi.shared.runtime.service import ServiceContext


def replay(ctx: ServiceContext, trainer: Trainer, link: StepLogLink, totals: RunTotals, where: str = "") -> int:
    """Replay every entry after the trainer's step; returns how many. `where`: who replays (" on shard 2")."""
    restored, t0 = trainer.step, time.monotonic()
    while (msg := link.fetch(trainer.step)) is not None:
        h = msg.header
        grads, buffer_sum = inputs_of(msg.tensors, h["skip"])
        with users_step(ctx.fatal, trainer.step + 1, where):
            trainer.apply(grads, buffer_sum, partials=h["partials"])
        totals.final_loss = float(h["loss"])
    replayed = trainer.step - restored
    committed = last_committed(ctx)
    if replayed or restored:  # (not a fresh run's start)
        ctx.emit("step_log_replayed", checkpoint=restored, replayed=replayed, step=trainer.step, shard=trainer.shard,
                 seconds=round(time.monotonic() - t0, 4))
        ctx.log.info("step log replayed", checkpoint=restored, replayed=replayed, step=trainer.step)
    if committed is not None and committed > trainer.step:  # the log did not hold them: the workers redo them
        ctx.emit("steps_redone", steps=committed - trainer.step, step=trainer.step, committed=committed,
                 shard=trainer.shard, reason="not in the step log (the checkpointer restarted, or a checkpoint "
                                             "was damaged): back to the checkpoint")
        ctx.log.warning("steps redone: the step log did not hold them", steps=committed - trainer.step,
                        step=trainer.step, committed=committed)
    return replayed


def last_committed(ctx: ServiceContext) -> int | None:
    """The newest step the run reported (its progress in Redis, written once a step committed; None if unknown)."""
    try:
        value = ctx.redis.hget(ctx.keys.progress, "step")
    except redis.RedisError:
        return None
    return int(value) if value is not None else None
