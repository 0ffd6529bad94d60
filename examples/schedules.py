"""A custom LR scheduler, plugged in by import path: `scheduler: {name: cmemi.examples.schedules:WarmupCosine}`."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """Linear warm-up for `warmup` steps, then cosine decay to `floor` x the base LR at `total` steps."""

    def __init__(self, optimizer, warmup: int, total: int, floor: float = 0.0) -> None:
        if not 0 <= warmup < total:
            raise ValueError(f"need 0 <= warmup < total, got warmup={warmup}, total={total}")
        self.warmup, self.total, self.floor = warmup, total, floor
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
