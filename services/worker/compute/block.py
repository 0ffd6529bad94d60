"""A lease's gradient: the microbatches [lo, hi) of a step, summed in the reduction tree's order
(docs/design.md §1), so one gradient travels and it is bitwise the node the aggregator would have built from
the leaves; user code that raises is run once more to tell a bug from a transient error."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from cmemi.services.worker.compute.local import InnerStateError, LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner, UserCodeError
from cmemi.shared.compression.base import all_finite
from cmemi.shared.config.schema import Config
from cmemi.shared.config.usercode import describe
from cmemi.shared.core import buffers as buffer_rule
from cmemi.shared.core.innerstate import InnerState
from cmemi.shared.core.reduction import TreeAccumulator, add_into
from cmemi.shared.errors import Interrupt
from cmemi.shared.memory import allocator
from cmemi.shared.wire import limits

# Blocks fold (`_folding`) only where the gradient it keeps from being held twice is this big: below, a Python hook per
# parameter per microbatch costs more than the memory is worth. bench/small.py's cnn1d (12 KB of parameters, a lease
# of 2 microbatches), in one process, blocks alternated: 2.48-2.51 ms of CPU per block folded, 2.41-2.43 ms summed
# whole (the same bits), about 2 % of the whole cluster's CPU per step (issue 45).
FOLD_MIN_BYTES = 16 << 20

Result = tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor] | None, bool]


class StaleParameters(Interrupt):
    """The parameters computed on were rewritten meanwhile (a slot read in place, services/worker/links/inbox.py `lend`):
    what came out is not a gradient of any version, so nothing about it (not even a NaN) is the user's."""


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a += b in a's storage: `add_into`'s step, for one tensor."""
    return a.add_(b)


class BlockComputer:
    def __init__(self, cfg: Config, runner: MicrobatchRunner, log: Any, fatal: Callable[[str], None],
                 who: Callable[[], str]) -> None:
        self.cfg, self.runner, self.log, self.fatal, self.who = cfg, runner, log, fatal, who
        # the last block's gradient is gone by the next one (sent, and the step it was part of is over): its pages
        # go back to the kernel first, so that the heap does not grow by a tensor or two (shared/memory/allocator.py)
        nbytes = limits.nbytes(runner.params.values())
        self.trim = allocator.worth_trimming(nbytes)
        self.fold = nbytes >= FOLD_MIN_BYTES  # (see FOLD_MIN_BYTES)
        # are the parameters still those of the lease? (false only when a slot read in place was rewritten)
        self.valid: Callable[[], bool] = lambda: True

    def block(self, step: int, lo: int, hi: int, scale: float) -> Result:
        """The lease [lo, hi) of step `step`: (loss per microbatch, gradient sum, buffer contribution sum or None,
        finite)."""
        if self.trim:
            allocator.trim()
        if self._folds(hi - lo):
            folded = self._folding(step, lo, hi, scale)
            if folded is not None:
                return folded
        return self._plain(step, lo, hi, scale)

    def _folds(self, n: int) -> bool:
        """Fold each tensor as backward produces it? Not for one microbatch (nothing to fold into), not with fp16 (a
        microbatch's overflow is known only once all of it is there) and on a CPU only (a GPU's hooks run on
        autograd's device threads), and only a model of FOLD_MIN_BYTES or more."""
        return self.fold and n > 1 and self.cfg.precision != "fp16" and self.runner.device.type == "cpu" and not self.runner.twice

    def _folding(self, step: int, lo: int, hi: int, scale: float) -> Result | None:
        """`_plain`'s sum, folded tensor by tensor as backward produces each gradient: one tree per tensor, fed leaf
        m's tensor the moment backward has accumulated it (microbatch.py `take`), so the block holds its waiting partial
        sums and one gradient tensor, not a whole second gradient. Per element it is the same `left.add_(right)` in
        the same bracketing, so the same bits. None when that could not hold (user code raised mid-block: the sums
        have part of a microbatch; a gradient accumulated twice in one backward): the caller computes it again."""
        runner = self.runner
        runner.hook()
        trees = {n: TreeAccumulator(hi - lo, _add) for n in runner.params}
        buffers: TreeAccumulator = TreeAccumulator(hi - lo, add_into)
        losses: list[float] = []
        if runner.loader is not None:
            runner.loader.want(step, range(lo, hi))
        try:
            for m in range(lo, hi):
                runner.take = lambda name, g, m=m: trees[name].add(m - lo, m - lo + 1, g)
                try:
                    loss, rest, produced = runner.run(step, m, scale)
                finally:
                    runner.take = None
                if runner.twice:
                    self.log.info("a gradient was accumulated twice in one backward pass; summing whole "
                                  "gradients from now on", step=step)
                    return None
                for name, g in rest.items():  # parameters backward did not reach: zeros, as in `_plain`
                    trees[name].add(m - lo, m - lo + 1, g)
                losses.append(loss)
                if produced is not None:
                    buffers.add(m - lo, m - lo + 1, buffer_rule.contribution(runner.step_buffers, produced))
        except UserCodeError:
            return None  # `_plain` runs it again, with its retry and its one-line error
        total = {n: t.result() for n, t in trees.items()}
        self._check(step, lo, hi, total, losses)
        return losses, total, buffers.result() if buffers.complete else None, True

    def _plain(self, step: int, lo: int, hi: int, scale: float) -> Result:
        grads: TreeAccumulator = TreeAccumulator(hi - lo, add_into)  # a node's tree has its length's shape
        buffers: TreeAccumulator = TreeAccumulator(hi - lo, add_into)
        losses, finite, fp16 = [], True, self.cfg.precision == "fp16"
        if self.runner.loader is not None:
            self.runner.loader.want(step, range(lo, hi))
        for m in range(lo, hi):
            loss, g, produced = self.one(step, m, scale)
            losses.append(loss)
            if fp16 and finite and not all_finite(g.values()):
                finite = False  # an fp16 overflow, exactly per microbatch as GradScaler sees it: the step is skipped
            grads.add(m - lo, m - lo + 1, g if finite else {})
            if produced is not None:
                buffers.add(m - lo, m - lo + 1, buffer_rule.contribution(self.runner.step_buffers, produced))
        total = grads.result()
        if not fp16:
            self._check(step, lo, hi, total, losses)
        return losses, total, buffers.result() if buffers.complete else None, finite

    def _check(self, step: int, lo: int, hi: int, total: dict[str, torch.Tensor], losses: list[float]) -> None:
        if not all_finite(total.values()):  # one pass over the sum: NaN/inf in any microbatch shows
            if not self.valid():
                raise StaleParameters(f"step {step}")
            self.fatal(f"the gradient of microbatches {lo}..{hi - 1} of step {step} is not finite (losses "
                       f"{losses}); the run diverged: lower optimizer.kwargs.lr, clip, or check the data")

    def one(self, step: int, m: int, scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor],
                                                                  dict[str, torch.Tensor] | None]:
        """Gradient of microbatch (step, m), unscaled, and the buffers its forward produced (see microbatch.py)."""
        return self._twice(lambda: self.runner.run(step, m, scale))

    def local_round(self, local: LocalRound, rnd: int, r: int, first: int, state: InnerState | None,
                    start_of: Callable[[int], Mapping[str, torch.Tensor]] | None = None) -> tuple[
            list[float], dict[str, torch.Tensor], dict[str, torch.Tensor] | None, InnerState]:
        """Replica r's lease at step `rnd` of local steps, from its state at the start of step `first`
        (services/worker/compute/local.py, `LocalRound.lease`): (its mean inner loss as the lease's one loss, Δ_r by piece of
        the grid, its buffer contribution or None, its new inner state). A change that is not finite stops the run."""
        if self.trim:
            allocator.trim()
        try:
            loss, delta, buffers, new = self._twice(lambda: local.lease(rnd, r, first, state, start_of))
        except (FloatingPointError, InnerStateError) as exc:  # diverged; or a state from another config (the leader
            self.fatal(f"worker {self.who()}: {exc}")  # checks each against this model's: not a transient fault)
        return [loss], delta, buffers, new

    def _twice(self, compute: Callable[[], Any]) -> Any:
        """User code that raises is run once more, at once, from the same seeds, buffers (and inner state): failing
        the same way again, the error is deterministic (restarting or moving the work would repeat it) and the run
        stops with one line; succeeding, it was transient and training goes on."""
        try:
            return compute()
        except UserCodeError as first:
            seen = describe(first.cause)
            self.log.warning("user code failed; retrying once to tell a bug from a transient error",
                             error=seen.line(), where=first.phase)
            try:
                return compute()
            except UserCodeError as again:
                if not self.valid():
                    raise StaleParameters(first.phase) from None
                if describe(again.cause) == seen:
                    self.fatal(f"{seen.line()} during {first.phase}, the same way twice on worker {self.who()}: "
                               "a bug in user code, not retried; fix it and run again")
                raise
