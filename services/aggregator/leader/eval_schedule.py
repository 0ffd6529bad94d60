"""When the leader evaluates, and what early stopping decides (eval.every_steps, eval.patience).

- A probe evaluates the initial weights at step 0 in the background: a broken `eval.fn` stops the run at once,
  not after training.
- At each evaluation boundary the weights of that step are evaluated in the background; sharded, once every
  shard's pieces of that step are in (`ShardSlices.place_eval`).
- Before the next boundary's step is applied, the evaluation started at the previous one is collected (waiting
  if needed) and decides early stopping — deterministic: the same evaluations decide at the same step, whatever
  ran faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.aggregator.common.evaluation import BackgroundEval, EvalError, Probe, eval_boundary
from cmemi.shared.config.schema import Config
from cmemi.shared.runtime.service import ServiceContext


class EvalSchedule:
    def __init__(self, ctx: ServiceContext, cfg: Config, fn: Any, report: Callable[[dict[str, Any]], None]) -> None:
        self.ctx, self.cfg, self.fn, self.report = ctx, cfg, fn, report
        self.bg = BackgroundEval(cfg, fn) if fn and cfg.eval.every_steps else None
        self.probe: Probe | None = None
        self.waiting: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, weights) for every shard's slice

    def start_probe(self, weights: dict[str, torch.Tensor]) -> None:
        if self.fn:
            self.probe = Probe(self.cfg, self.fn, weights)

    def check_probe(self) -> None:
        if self.probe is not None and self.probe.done.is_set():
            if self.probe.error is not None:
                self.ctx.fatal(self.probe.error)
            self.probe = None

    def _collect(self, wait: bool) -> None:
        assert self.bg is not None
        try:
            for entry in self.bg.collect(wait=wait):
                self.report(entry)
        except EvalError as exc:
            self.ctx.fatal(str(exc))

    def stops_at(self, step: int) -> bool:
        """At an evaluation boundary, before step `step` is applied: the previous evaluation decides."""
        if not eval_boundary(self.cfg, step):
            return False
        assert self.bg is not None
        if self.waiting is not None:  # shards send those pieces before their shard_ready of the next step
            self.ctx.fatal(f"evaluation of step {self.waiting[0]}: the other shards' pieces did not come before "
                           "their next step (a shard of another version?)")
        self._collect(wait=True)
        return self.bg.should_stop

    def after_step(self, step: int, weights: Callable[[], dict[str, torch.Tensor]], sharded: bool,
                   place: Callable[[int, dict[str, torch.Tensor]], bool]) -> None:
        """Step `step` was applied: evaluate its weights at a boundary (sharded: once `place` put every shard's
        pieces in them)."""
        if not eval_boundary(self.cfg, step):
            return
        if sharded:  # the other shards' pieces of this step come after their commit
            self.waiting = (step, weights())
            self.pieces_in(place)
        else:
            self._start(step, weights())

    def pieces_in(self, place: Callable[[int, dict[str, torch.Tensor]], bool]) -> None:
        """A shard's pieces came: start the waiting evaluation once every shard's are placed."""
        if self.waiting is None or self.bg is None:
            return
        step, weights = self.waiting
        if place(step, weights):
            self.waiting = None
            self._start(step, weights)

    def _start(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        assert self.bg is not None
        try:
            self.bg.start(step, weights)
        except EvalError as exc:
            self.ctx.fatal(str(exc))

    def settle(self, step: int) -> int | None:
        """Before a snapshot of `step`: an evaluation of an earlier step still running is collected (its weights
        are not in the snapshot; rare). Returns the step of an evaluation of `step` not started yet (sharded)."""
        if self.bg is not None and self.bg.running_step() not in (None, step):
            self._collect(wait=True)
        pending = self.waiting[0] if self.waiting is not None else None
        return pending if pending == step else None

    def finish(self) -> None:
        if self.bg is not None:
            self._collect(wait=True)

    @property
    def stopped(self) -> bool:
        return self.bg is not None and self.bg.should_stop

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.bg.history if self.bg is not None else []

    def close(self) -> None:
        if self.bg is not None:
            self.bg.close()
