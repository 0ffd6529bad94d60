"""A shard k > 0 that outlives its leader joins the leader's next term in place (issue 47, docs/design/step-log.md,
"Faults"): it keeps its process, its state and its workers' sockets.

The new leader restored its checkpoint, replayed its log to the last step every shard's log holds (L), and advertised
its term with L (`replayed`) in Redis; it moves past L only once every shard joined. A surviving shard holds L most
often: it joins at once. Short of L (the dead leader's commit of L never reached it, while the log holds L) it first
replays its own entries on to L, as a restarted shard does. Past L (the dead leader committed a step on this shard
and died before the log held its own entry of it) no replay takes that step back: it restarts, restores and replays
as before, and so it does where the log cannot bring it to L (a double fault).

Before, a shard left every new term: its process exit (a zygote-forked interpreter's teardown, 0.7-1.2 s on a loaded
machine), a fork, the restore of the checkpoint and then a replay as long as the leader's, one after the other — the
leader's death cost twice as long at K = 2 as at K = 1 (bench/recovery.py --parts steplog).

Fencing stays the term's. Everything the shard says and ships from here on names the new term: the new leader drops
an older term's join or step (`stale_shard`, `unknown_shard`), the checkpointer an older term's entries and snapshots
(`stale_term`, so what was on its way in the old term is dropped here too, not sent again); the shard itself takes
only the new leader's messages of the new term (a new LeaderLink) and forgets the old term's workers (their
gradients name the old term and a lease sealed with the old term's key: refused, shard/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard.upstream import LeaderLink, NewTerm
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.services.aggregator.steplog import shard as shard_log
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.config.schema import Config
from cmemi.shared.coordination.membership import table
from cmemi.shared.runtime.service import ServiceContext

Boundary = tuple[int, dict[str, torch.Tensor]]  # (an evaluation step, this shard's pieces of it)


def restarts_instead(cfg: Config, trainer: Trainer, codec: GradientCodec, finishing: bool) -> str | None:
    """Why this shard leaves a new term by a restart; None: it joins in place.

    Where its state is not all in the step log (`replays_in_term` false: the log off, local steps' replica states, a
    stateful codec's residuals) the new term's rules that keep the run exact were built for a restarted shard, as
    within a term. A shard whose final snapshot is on its way joins the new term at its restart, as before."""
    if not shard_log.replays_in_term(cfg, trainer, codec):
        return "the step log alone does not hold its state (local steps, a stateful codec, or the log off)"
    if finishing:
        return "its final snapshot was on its way"
    return None


def advertised(ctx: ServiceContext) -> tuple[int, str, int] | None:
    """The leader's (term, address, step it replayed to) as it advertised them in Redis; None if Redis cannot say."""
    try:
        info = table(ctx.redis.hgetall(ctx.keys.aggregator))
    except redis.RedisError:
        return None
    if not {"addr", "term", "replayed"} <= info.keys():
        return None
    return int(info["term"]), info["addr"], int(info["replayed"])


def enter(ctx: ServiceContext, zctx: zmq.Context, new: NewTerm, old: LeaderLink, ckpt: CheckpointerLink,
          steplog: shard_log.ShardStepLog | None, trainer: Trainer, totals: RunTotals, boundary: Boundary | None,
          incarnation: Callable[[], Any], drop: Callable[[str, str], None]) -> LeaderLink | str:
    """The link to the new term's leader (its `term` the new term), with this shard at the leader's replayed step, the
    old link closed and the checkpointer's links moved to the new term; or why the shard restarts instead.
    `boundary`: this shard's pieces at the last evaluation step, which the new leader may evaluate again (sent once
    welcomed, as a restarted shard's replay sends them)."""
    found = advertised(ctx)
    if found is None or found[0] <= old.term or steplog is None:
        return "no newer term advertised in Redis"
    term, addr, step = found
    if trainer.step > step:
        return f"it holds step {trainer.step}, past the step {step} the new leader replayed to"
    old.close()
    ckpt.enter_term(term)
    steplog.enter_term(term, trainer.step, boundary)
    held = trainer.step
    if held < step:  # the old leader's commit of a logged step did not reach it: its entries on to the leader's step
        steplog.catch_up(ctx, trainer, totals, step)
    if trainer.step != step:
        return f"the step log took it from step {held} to {trainer.step}, short of the leader's step {step}"
    if held == step:  # at the term's log end as every server of the term is, with nothing to replay (the event says)
        ctx.emit("step_log_replayed", checkpoint=steplog.restored, start=held, replayed=0, step=step,
                 shard=trainer.shard, seconds=0.0, in_place=True)
    ctx.emit("shard_term_joined", shard=old.shard, term=term, step=step, held=held, left=old.term)
    ctx.log.info("joining the leader's new term in place", shard=old.shard, term=term, step=step, held=held,
                 reason=str(new))
    return LeaderLink(ctx, zctx, addr, old.shard, term, incarnation, drop)
