"""The aggregator's model, optimizer and LR scheduler: one optimizer.step() and scheduler.step() per global step."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from cmemi.shared.config import Config
from cmemi.shared.plugins import build_model, build_optimizer, build_scheduler


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


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.model = build_model(cfg)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = build_optimizer(cfg, self.params)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.scaler = LossScaler(cfg.precision == "fp16")
        self.step = 0  # number of global steps consumed == parameter version
        self.skipped = 0  # steps whose optimizer.step() was skipped (fp16 overflow)
        self.last_grad_norm: float | None = None  # before clipping, when train.clip_grad_norm is set
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def check_grads(self, grads: dict[str, torch.Tensor]) -> str | None:
        if grads.keys() != self.params.keys():
            return "grad_names"
        for n, g in grads.items():
            if tuple(g.shape) != self.shapes[n] or g.dtype != torch.float32:
                return "grad_shape"
        return None

    def apply(self, mean_grads: dict[str, torch.Tensor] | None) -> None:
        """One global step. `None` (a microbatch overflowed): skip optimizer.step() as GradScaler.step()
        would, but step the scheduler, as the usual AMP loop does, so the schedule stays aligned."""
        if mean_grads is not None:
            for n, p in self.params.items():
                p.grad = mean_grads[n]
            if self.cfg.train.clip_grad_norm is not None:  # global norm of the summed (averaged) gradient
                self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()),
                                                                          self.cfg.train.clip_grad_norm))
            self.optimizer.step()
        else:
            self.skipped += 1
        self.scaler.update(overflow=mean_grads is None)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def params_sha256(self) -> str:
        h = hashlib.sha256()
        for n in sorted(self.params):
            h.update(self.params[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def evaluate(self, fn: Any) -> dict[str, float]:
        self.model.eval()
        try:
            with torch.no_grad():
                result = fn(self.model)
        finally:
            self.model.train()
        return {k: float(v) for k, v in dict(result).items()}
