"""Early stopping's state in the step log: the evaluations a step's decisions depend on.

Whether the run stops at a boundary (eval.patience) depends on evaluation results, which are not a function of the
step and the checkpoint alone (an evaluation runs in the background on the weights of its boundary, and is
collected at the next one). So each entry carries the evaluations collected since the previous entry, with early
stopping's state after them; a replay loads them instead of evaluating again, and evaluates only the last
boundary's weights whose result no entry holds (it was running when the server died), as a restore does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.aggregator.common.evaluation import BackgroundEval


class EvalLog:
    """The leader's side: what the next entry carries (`shipped`: the evaluations the log holds already)."""

    def __init__(self, bg: BackgroundEval | None) -> None:
        self.bg = bg
        self.shipped = len(bg.history) if bg is not None else 0

    def to_ship(self) -> dict[str, Any] | None:
        if self.bg is None or len(self.bg.history) == self.shipped:
            return None
        new, self.shipped = self.bg.history[self.shipped:], len(self.bg.history)
        return {"new": list(new), "best": self.bg.best, "since_best": self.bg.since_best}


class EvalReplay:
    """The replay's side: each entry's evaluations loaded, and the weights of the last boundary kept for the
    evaluation no entry holds."""

    def __init__(self, bg: BackgroundEval | None) -> None:
        self.bg = bg
        self.boundary: tuple[int, dict[str, torch.Tensor]] | None = None

    def load(self, evals: dict[str, Any] | None) -> None:
        if self.bg is None or evals is None:
            return
        steps = [int(e["step"]) for e in evals["new"]]
        if self.bg.running is not None and steps and self.bg.running[0] <= max(steps):
            self.bg.running = None  # (a restore restarted it: its result is in the log)
        # an evaluation the restored checkpoint holds already (a snapshot settles the running evaluation into the
        # history, and the next entry carries it too) is not added twice
        held = {int(e["step"]) for e in self.bg.history}
        new = [e for e in evals["new"] if int(e["step"]) not in held]
        self.bg.load_state_dict({"history": self.bg.history + new, "best": evals["best"],
                                 "since_best": evals["since_best"]})

    def replayed(self, step: int, weights: dict[str, torch.Tensor] | None) -> None:
        """Step `step` was replayed; `weights`: a copy of them if it is an evaluation boundary."""
        if self.bg is not None and weights is not None:
            self.boundary = (step, weights)

    def resume(self, start: Callable[[int, dict[str, torch.Tensor]], None] | None = None) -> None:
        """After the replay: the last boundary's evaluation, if no entry held its result and none runs. `start`:
        sharded, it waits for the shards' pieces of that step (they send them once joined: steplog/shard.py)."""
        if self.bg is None or self.boundary is None:
            return
        step, weights = self.boundary
        self.boundary = None
        if step not in {int(e["step"]) for e in self.bg.history} and self.bg.running_step() != step:
            (start or self.bg.start)(step, weights)
