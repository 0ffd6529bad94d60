"""A shard's current step, stage by stage (cluster.pipeline_stages; one stage, the whole slice, otherwise).

Each stage is collected on its own (one `StepCollector` each, strict: a NaN or inf is dropped on arrival). The
step's version is the collectors' step: once a pipelined stage is stepped the trainer's own step runs ahead of it
until the leader's commit. Complete means every stage stepped (pipelined) or the mean gradient taken (not).

Pipelined (`cluster.pipeline_stages`: S, no clipping, no fp16): the slice is cut into S stages, each collected on
its own and stepped as soon as every microbatch's copy of it is in, then sent to the pulls waiting for it, while
later stages still arrive; `shard_ready` follows the last stage and the commit applies nothing. Version s stays
servable until the commit (a microbatch leased again is computed from it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.common.userstep import users_step


class StepStages:
    def __init__(self, stages: list[list[str]], microbatches: int, step: int, pipelined: bool) -> None:
        self.names, self.M, self.pipelined = stages, microbatches, pipelined
        self.collectors = self._new(step)
        self.applied: set[int] = set()  # pipelined: stages of the current step already stepped
        self.mean: tuple[dict[str, torch.Tensor] | None, float] | None = None  # the complete step, until committed

    def _new(self, step: int) -> list[StepCollector]:
        return [StepCollector(step, self.M, leased=False, strict=True) for _ in self.names]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def version(self) -> int:
        """The parameter version the current step's gradients are computed from."""
        return self.collectors[0].step

    @property
    def complete(self) -> bool:
        return len(self.applied) == len(self.names) if self.pipelined else self.mean is not None

    def held(self, g: int, node: tuple[int, int]) -> bool:
        """Stage g holds this node already: the first complete copy won (a lease handed out again, or reopened)."""
        return self.mean is not None or g in self.applied or self.collectors[g].check(node, None) == "duplicate"

    def have(self) -> list[int]:
        """The microbatches every stage holds (what the shard tells the leader it has)."""
        return sorted(set.intersection(*(c.received for c in self.collectors)))

    def holds(self) -> list[torch.Tensor]:
        """The buffers the step's sums keep (gradients.Spares)."""
        return [t for c in self.collectors for t in c.holds()]

    def next_step(self, step: int) -> None:
        self.collectors = self._new(step)
        self.applied.clear()

    def step_stage(self, g: int, trainer: Trainer, fatal: Callable[[str], NoReturn], where: str) -> None:
        """Pipelined: stage g of the step is in: step it; the trainer's step ends with the last stage."""
        grads, _ = self.collectors[g].mean()  # None: a stage without pieces (no overflow: no fp16 here)
        with users_step(fatal, self.version + 1, where):
            trainer.apply_stage(grads or {})
            if len(self.applied) == len(self.names) - 1:
                trainer.end_step()
        self.applied.add(g)

    def apply(self, trainer: Trainer, skip: bool, partials: list[float], fatal: Callable[[str], NoReturn],
              where: str) -> None:
        """The leader's commit of the complete step: not pipelined, its mean gradient applied (or skipped: an
        overflow somewhere); pipelined, its stages were stepped as they came."""
        if self.pipelined:
            return
        assert self.mean is not None
        grads, _ = self.mean
        self.mean = None
        with users_step(fatal, trainer.step + 1, where):
            trainer.apply(None if skip else grads, None, partials=partials)
