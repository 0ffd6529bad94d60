"""The leader applies a complete step: once, in order, the same bits at any K (docs/design.md §1, §4).

- The mean gradient comes from the step's collector. Sharded, the step waits until every shard reported its
  own share complete; then one rule for all — the global norm from every piece's partial in grid order, any
  overflow skips — and each shard is told to apply it (`ShardRoster.commit`).
- Honest workers never send NaN/inf (they stop the run, or flag an fp16 overflow), so one pass over the sum
  replaces a pass over every gradient. If it fails, the step is collected again with each gradient checked on
  arrival: the bad ones are dropped and counted, the others recomputed (bitwise the same). Still not finite
  then: the sum of finite gradients overflows, the run diverged.
- Which steps are checkpointed (checkpoint.every_steps; sharded, the leader picks the same steps for every
  shard), early stopping (services/aggregator/leader/eval_schedule.py), and what a step leaves for after its
  parameters went out: the metrics line, the snapshot, progress.
- With checkpoint.step_log, a step's inputs are copied before its optimizer step; its parameters go out at once,
  then its entry goes to the checkpointer, and the step commits (its metrics line, its snapshot, its evaluation's start, the run's end) only once
  the checkpointer holds them. That ack is taken after each message the loop reads (`after_step`) and waited for
  only when the next step is ready to apply: at most one step is ever unacknowledged, so a leader's death redoes
  at most that uncommitted step (docs/design/step-log.md). With train.local_steps the entry also carries the
  replicas' states the step makes current (steplog/replicas.py). Waiting for the ack before publishing cost 1.2-1.45x
  the step time of a small model on a loaded 2-core machine.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from cmemi.services.aggregator.common.userstep import users_step
from cmemi.services.aggregator.leader.parts import LeaderParts
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.steplog import frames
from cmemi.services.aggregator.steplog.evals import EvalLog
from cmemi.services.aggregator.steplog.replicas import states_of
from cmemi.shared.compression.base import all_finite
from cmemi.shared.runtime import metrics
from cmemi.shared.runtime.log import debug_enabled


class Ending(enum.Enum):
    """Where the run stands: training, ended at train.steps (or restored there), or stopped early (eval.patience).
    One state where two flags (`done`, `stopped_early`) could disagree."""
    TRAINING = "training"
    LAST_STEP = "last_step"
    STOPPED_EARLY = "stopped_early"


@dataclass(frozen=True)
class Applied:
    """A step applied and published, not committed until the step log holds it: what its commit does then."""
    step: int
    loss: float
    dt: float
    nbytes: int
    line: dict[str, Any] | None  # its metrics line (None: not logged, train.log_every)
    snapshot: bool  # checkpointed (checkpoint.every_steps)
    stop: bool  # early stopping ends the run with it


class Stepper:
    """`serve_parked`: hands the new step's leases to the workers parked for work (the server's)."""

    def __init__(self, parts: LeaderParts, serve_parked: Callable[[], None]) -> None:
        self.p, self.ctx, self.cfg, self.trainer, self.roster = parts, parts.ctx, parts.cfg, parts.trainer, parts.roster
        self.evals, self.reporter, self.ckpt = parts.evals, parts.reporter, parts.ckpt
        self.drop, self.serve_parked = parts.drops, serve_parked
        self.total = self.cfg.train.rounds
        self.ending = Ending.LAST_STEP if self.trainer.step >= self.total else Ending.TRAINING
        if self.evals.stopped and self.p.steplog is not None:  # the step log replayed up to an early stop
            self.ending = Ending.STOPPED_EARLY
        self.evallog = EvalLog(self.evals.bg)  # the evaluations the step log holds (steplog/evals.py)
        self.mean: tuple[dict[str, torch.Tensor] | None, float] | None = None  # a complete step, until applied
        self.after: tuple[int, float, float, int, dict[str, Any] | None, bool] | None = None  # see after_step
        self.unacked: Applied | None = None  # published, its step log entry not acknowledged yet
        self.forcing: int | None = None  # sharded: the step whose forced checkpoint is being written (log_gap)
        self.stall_s: list[float] = []  # checkpoint snapshot stalls
        self.timing = debug_enabled(self.ctx.log)  # `step_timing` lines (CMEMI_LOG_LEVEL=DEBUG); else not timed

    def apply(self) -> None:
        """The step's gradient is complete here (called again as shards report theirs complete)."""
        collector = self.p.leasing.collector
        collected = time.time() if self.timing else 0.0  # (`step_timing`, bench/round_timeline.py)
        if self.mean is None:
            self.mean = collector.mean()
        grads, loss = self.mean
        partials = None
        if self.roster is not None and (others := self.roster.others_ready(collector.step)) is None:
            return  # the roster's ready handler comes back here
        # the step before commits first: at most one step is unacknowledged. (Sharded, only once every shard is
        # ready for this step: each shipped its entry of the step before, which that ack waits for; a shard that
        # died before it did is noticed by its restart, never by a wait here.)
        self.settle(block=True)
        stop = self.evals.stops_at(self.trainer.step + 1)
        if stop:
            self.ctx.log.info("early stop", metric=self.cfg.eval.early_stop_metric, patience=self.cfg.eval.patience)
        snapshot = not stop and self._snapshot_due(self.trainer.step + 1)
        if self.roster is not None and others is not None:  # (not None once there is a roster: returned above)
            if others[1]:
                grads = None
            partials = self.trainer.partials(grads) + others[0] if grads is not None else []
            self.roster.commit(step=collector.step, partials=partials, skip=grads is None,
                               last=stop or self.trainer.step + 1 >= self.total, snapshot=snapshot)
        self.mean = None
        if grads is not None and not all_finite(grads.values()):
            if collector.strict:
                self.ctx.fatal(f"the summed gradient of step {self.trainer.step + 1} is not finite (it overflows); "
                               "the run diverged: lower optimizer.kwargs.lr or set train.clip_grad_norm")
            self.drop("nonfinite_step", f"step {collector.step}: collecting it again, checking each gradient")
            self.p.leasing.new_step(collector.step, strict=True)
            self.serve_parked()
            return
        buffer_sum = collector.buffer_sum()
        entry = None
        if self.p.steplog is not None:  # its inputs, copied now (steplog/link.py: into a slot or kept buffers): the
            # step changes them in place, the next reuses them; local steps: the replicas' states it makes current
            replicas, states = states_of(self.trainer.inner, self.p.steplog.states, self.trainer.step + 1)
            # the step's gradients as they came where they are fewer bytes than their mean (steplog/frames.py)
            field, framed = frames.entry(collector.kept, collector.M) if frames.smaller(collector.kept, grads, collector.M) \
                else (None, {})
            entry = (self.trainer.step + 1, self.p.steplog.stage(None if field else grads, buffer_sum,
                                                                 {**(states or {}), **framed}),
                     grads is None, partials, loss, self.evallog.to_ship(), replicas, field)
        with users_step(self.ctx.fatal, self.trainer.step + 1):
            self.trainer.apply(grads, buffer_sum, partials=partials)
        step = self.trainer.step
        dt, nbytes, line = self.reporter.step_done(step, loss, self.trainer.lr, self.p.live_workers,
                                                   self.trainer.scaler, grads is None)
        applied = Applied(step, loss, dt, nbytes, line, snapshot, stop)
        last = stop or step >= self.total
        if entry is None:
            self._commit(applied, forced=False)
        else:
            self.unacked = applied
            if last:  # the run's end (its final checkpoint, the summary) waits for the last ack
                self._ship(entry)
                self.settle(block=True)
        self.p.leasing.new_step(step)  # (done: a collector that leases nothing, and the last gradient sum is freed)
        self.trainer.release_heap()
        stepped = time.time() if self.timing else 0.0
        self.serve_parked()  # the step's parameters go out now, before its entry is even encoded
        if self.timing:
            self.ctx.log.debug("step_timing", step=step, collected=collected, applied=stepped, served=time.time())
        if entry is not None and not last:
            self._ship(entry)  # (a death before this: the step was never committed, and is computed again)

    def _ship(self, entry: tuple[int, dict[str, torch.Tensor], bool, list[float] | None, float,
                                 dict[str, Any] | None, list[Any] | None, dict[str, Any] | None]) -> None:
        assert self.p.steplog is not None
        self.p.steplog.ship_staged(*entry)

    def settle(self, block: bool) -> None:
        """Commit the unacknowledged step once the checkpointer holds it (`block`: wait for that). The trainer has
        not moved past it (the next step is applied only after this), so a forced checkpoint (`log_gap`) and the
        step's snapshot are of the state after it."""
        applied = self.unacked
        if applied is None or self.p.steplog is None:
            return
        forced: bool | None = True
        if self.forcing is None:
            forced = self.p.steplog.confirm(self._checkpoint_now) if block else \
                self.p.steplog.poll(self._checkpoint_now)
            if forced is None:
                return
        if self.forcing is not None:  # sharded: the forced checkpoint is written while the loop goes on
            if not self._written(self.forcing, block):
                return
            self.forcing, forced = None, True
        self.unacked = None
        self._commit(applied, bool(forced))
        self.after_step()  # its metrics line and snapshot now, before another step moves the trainer on

    def _commit(self, a: Applied, forced: bool) -> None:
        self.evals.after_step(a.step, self.weights, self.roster is not None,
                              self.p.slices.place_eval if self.p.slices is not None else lambda _s, _w: True)
        if a.stop:
            self.ending = Ending.STOPPED_EARLY
        elif a.step >= self.total:
            self.ending = Ending.LAST_STEP
        self.after = (a.step, a.loss, a.dt, a.nbytes, a.line, a.snapshot and not forced)  # (forced: written now)

    @property
    def done(self) -> bool:
        """No step is applied any more: the run ends (finish.py)."""
        return self.ending is not Ending.TRAINING

    @property
    def stopped_early(self) -> bool:
        return self.ending is Ending.STOPPED_EARLY

    def weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_copy()

    def _snapshot_due(self, step: int) -> bool:
        """Is the state after `step` checkpointed (checkpoint.every_steps)? Sharded, the leader decides for every
        shard (its commit says so), so the checkpointer gets each shard's slice of the same steps: a boundary that
        comes while the last checkpoint is still being written is left out, unless retention keeps it
        (checkpoint.keep_every). One aggregator sends the newest boundary once the last one is written."""
        every = self.cfg.checkpoint.every_steps
        if not every or step % every or step >= self.total:
            return False
        if not self.trainer.sharded:
            return True
        self.ckpt.poll()  # an acknowledgement that came since the last housekeeping
        return self.ckpt.idle or self.ckpt.milestone(step)

    def after_step(self) -> None:
        """What a step leaves for after its parameters went out (to the parked workers, and to the one whose
        gradient completed it, answered by the handler): the metrics line, the checkpoint snapshot, progress.
        It runs before the next message is read, so the snapshot is still of this step. With the step log it first
        takes the unacknowledged step's ack if it came (its commit comes back here)."""
        if self.unacked is not None:
            self.settle(block=False)
        if self.after is None:
            return
        step, loss, dt, nbytes, line, snapshot = self.after
        self.after = None
        if line is not None:
            self.reporter.write(line)
        if snapshot:
            t0 = time.monotonic()
            self.ckpt.offer(self.snapshot())  # no copy: sent while the next step collects (outgoing.py)
            self.stall_s.append(time.monotonic() - t0)
            metrics.CHECKPOINT_STALL.observe(self.stall_s[-1])
        if self.reporter.progress_due(force=self.done):
            self.reporter.publish(step, loss, self.trainer.lr, nbytes / dt if dt > 0 else 0.0, self.p.live_workers,
                                  self.done)

    def _checkpoint_now(self, step: int) -> None:
        """The step log holds nothing since the last checkpoint (the checkpointer restarted): the state after `step`
        is made durable now, before the step commits (steplog/link.py). Sharded, every shard checkpoints the same
        step (none has moved past it: the next step is committed only after this one) and the loop goes on while
        it is written (`settle` commits the step then), so a shard's restart meanwhile is still noticed."""
        self.ctx.emit("checkpoint_forced", step=step, reason="step log lost with a checkpointer restart")
        if self.roster is None:
            self.ckpt.save_final(self.snapshot(), final=False)
            return
        self.roster.snapshot_now(step)
        self.ckpt.offer(self.snapshot())
        self.forcing = step

    def _written(self, step: int, block: bool) -> bool:
        """Is the forced checkpoint of `step` written (`block`: wait until it is)?"""
        if block:
            self.ckpt.wait_saved(step)
        else:
            self.ckpt.poll()
        return step in self.ckpt.saved_path

    def snapshot(self) -> snapshots.Snapshot:
        evaluating = self.evals.settle(self.trainer.step)
        return snapshots.collect(self.trainer, self.p.totals, self.p.term, self.p.fp, self.evals.bg,
                                 evaluating=evaluating)
