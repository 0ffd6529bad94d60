"""A restarted server replays the step log: the checkpoint restored, each logged step's inputs go through its
optimizer again — optimizer steps only, no forward or backward anywhere, no worker recomputes a committed step.

CPU torch gives the same bits for the same inputs, and an entry holds every input of a step that is not a function
of the step and the checkpoint (the reduced gradient, or the encoded gradients it was reduced from, reduced again
by the live step's code: frames.py; a skipped step, the buffer sum, with local steps the replicas' states the step
makes current: replicas.py; the LR schedule, the loss scale and the downlink mirror follow from those), so the
state after the replay is bitwise the one the dead server had.
The steps the log does not hold (none, unless the checkpointer died too, or the newest checkpoint was damaged) are
redone by the workers, as without the log; the run says how many in events.jsonl (`steps_redone`). So are the
steps from the first whose replicas' states this server's state spool lost (its host died: `state_spool_lost`,
statespool.py): the replay stops before it and the log is cut there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from cmemi.services.aggregator.common.evaluation import BackgroundEval, eval_boundary
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.common.userstep import users_step
from cmemi.services.aggregator.steplog import frames, replicas
from cmemi.services.aggregator.steplog.evals import EvalReplay
from cmemi.services.aggregator.steplog.link import StepLogLink, inputs_of
from cmemi.services.aggregator.steplog.reading import LogEntries, batch_of
from cmemi.services.aggregator.steplog.statespool import Lost
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import limits


def replay(ctx: ServiceContext, trainer: Trainer, link: StepLogLink, totals: RunTotals,
           bg: BackgroundEval | None = None, where: str = "",
           unlogged: Callable[[int, float, float], None] | None = None, judge: bool = True,
           upto: int | None = None, each: Callable[[int], None] | None = None,
           resume: Callable[[int, dict[str, torch.Tensor]], None] | None = None, checkpoint: int | None = None) -> int:
    """Replay every entry after the trainer's step; returns how many. `bg`: the leader's evaluations (early
    stopping: evals.py). `where`: who replays (" on shard 2"). `unlogged(step, loss, lr)`: called for each replayed
    step past metrics.jsonl's last step line — one whose entry was acknowledged (committed) while its server died
    before writing its line (the leader writes it then: every committed step has its line, once). `judge`: say how
    many committed steps the log did not hold (`steps_redone`); a shard k > 0 leaves that to its leader, whose log end
    is the cluster's. `upto`: the step to stop at (a shard k > 0: the one its leader replayed to). `each(step)`: after each
    replayed step. `resume(step, weights)`: starts the last boundary's evaluation no entry holds (evals.py).
    `checkpoint`: the step this server restored, where the replay goes on from an earlier one's end (a shard told
    `shard_behind`); the event says it, and where this replay started (`start`), not that end as a checkpoint."""
    restored, t0 = trainer.step, time.monotonic()
    logged = _last_metrics_step(ctx.run_dir / "metrics.jsonl") if unlogged is not None else None
    evals = EvalReplay(bg)
    codec = make_codec(ctx.cfg.compression, check_finite=False)  # (decoding is stateless)
    entries, lost = LogEntries(link), None
    # (two requested ahead: the next one travels while this one applies; a gradient only read is applied from the
    # checkpointer's slot where it lies, reading.py)
    lend = trainer.reads_grads_only and not trainer.local
    for msg in entries.entries(trainer.step, lend=lend, count=batch_of(limits.nbytes(trainer.pieces.values()))):
        if upto is not None and trainer.step >= upto:  # (a shard: no further than its leader's log end)
            break
        h = msg.header
        grads, buffer_sum = inputs_of(msg.tensors, h["skip"])
        if h.get("encoded") is not None and not h["skip"]:  # the step's gradients as they came: reduced again (frames.py)
            try:
                grads = frames.reduce(codec, trainer, trainer.step, h["encoded"], msg.tensors)
            except frames.EntryError as exc:
                ctx.fatal(f"aggregator: the step log's entry of step {h['step']} cannot be replayed: {exc}")
        evals.load(h["evals"])
        if trainer.inner is not None:  # local steps: the replicas' states this step makes current (replicas.py)
            try:
                replicas.restore(trainer.inner, h["replicas"], msg.tensors, link.states, h["step"])
            except replicas.EntryError as exc:
                ctx.fatal(f"aggregator: the step log's entry of step {h['step']} cannot be replayed: {exc}")
            except Lost as exc:  # this host's state spool lost it (a double fault): the log ends here
                lost = f"the replicas' states of step {h['step']} are not in this server's state spool ({exc})"
                break
        with users_step(ctx.fatal, trainer.step + 1, where):
            trainer.apply(grads, buffer_sum, partials=h["partials"])
        totals.final_loss = float(h["loss"])
        if unlogged is not None and trainer.step > (logged or 0):
            unlogged(trainer.step, float(h["loss"]), trainer.lr)
        evals.replayed(trainer.step, trainer.state_copy() if eval_boundary(ctx.cfg, trainer.step) else None)
        if each is not None:
            each(trainer.step)
    evals.resume(resume)
    if lost is not None:
        state_spool_lost(ctx, entries, trainer.step, trainer.shard, lost)
    replayed = trainer.step - restored
    committed = last_committed(ctx) if judge else None
    if replayed or restored:  # (not a fresh run's start)
        checkpoint = restored if checkpoint is None else checkpoint
        ctx.emit("step_log_replayed", checkpoint=checkpoint, start=restored, replayed=replayed, step=trainer.step,
                 shard=trainer.shard, seconds=round(time.monotonic() - t0, 4))
        ctx.log.info("step log replayed", checkpoint=checkpoint, start=restored, replayed=replayed, step=trainer.step)
    if committed is not None and committed > trainer.step:  # the log did not hold them: the workers redo them
        ctx.emit("steps_redone", steps=committed - trainer.step, step=trainer.step, committed=committed,
                 shard=trainer.shard, reason=lost or "not in the step log (the checkpointer restarted, or a "
                                                      "checkpoint was damaged): back to the checkpoint")
        ctx.log.warning("steps redone: the step log did not hold them", steps=committed - trainer.step,
                        step=trainer.step, committed=committed)
    return replayed


def state_spool_lost(ctx: ServiceContext, entries: LogEntries, step: int, shard: int, reason: str) -> None:
    """The replay stopped at `step` (`reason`: a step's states this server's spool lost): the log past it is cut at the
    checkpointer, so the steps after it are computed again and their new entries logged in the old ones' place."""
    ctx.emit("state_spool_lost", step=step, shard=shard, reason=reason)
    ctx.log.warning("step log replay stopped: the state spool lost a step's replicas' states", step=step, reason=reason)
    entries.cut(step)


def last_committed(ctx: ServiceContext) -> int | None:
    """The newest step the run committed, as far as it is known: its progress in Redis (written off the loop, a few
    steps behind) or the last step line of metrics.jsonl (written at each commit; every train.log_every steps),
    whichever is newer. None if neither says."""
    found = []
    try:
        value = ctx.redis.hget(ctx.keys.progress, "step")
        if value is not None:
            found.append(int(value))
    except redis.RedisError:
        pass
    if (last := _last_metrics_step(ctx.run_dir / "metrics.jsonl")) is not None:
        found.append(last)
    return max(found, default=None)


def _last_metrics_step(path: Path, tail: int = 1 << 16) -> int | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # the first line of the tail, cut, or one a SIGKILL cut short
        if isinstance(entry, dict) and "loss" in entry and "eval" not in entry and isinstance(entry.get("step"), int):
            return int(entry["step"])
    return None
