"""The fp16 loss scale the aggregator owns: one decision per global step, from whether any microbatch overflowed.

A pure function of the sequence of overflow flags, so a step log that records each step's flag (or a skipped
step) replays it exactly (services/aggregator/steplog/)."""

from __future__ import annotations


class LossScaler:
    """Dynamic loss scaling for fp16, with torch.amp.GradScaler's defaults and update rule, coordinated
    across workers: the aggregator owns the scale; one overflowing microbatch skips the whole step."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, sd: dict[str, float]) -> None:
        self.scale, self.growth_tracker = float(sd["scale"]), int(sd["growth_tracker"])

