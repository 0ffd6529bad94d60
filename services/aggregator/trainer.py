"""The aggregator's model, optimizer and LR scheduler: one optimizer.step() and scheduler.step() per global step."""

from __future__ import annotations

import hashlib

import torch
from cmemi.shared import buffers as buffer_rule
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
        self.buffers = buffer_rule.travelling(self.model)  # empty for most MLPs: then nothing is done for them
        self.model.train()  # as on the workers (evaluation switches to eval() and back)

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

    def valid_buffers(self, reported: dict[str, torch.Tensor]) -> bool:
        """Do reported buffers (or a buffer contribution) match the model and are they finite? (Honest workers
        stop the run before sending anything else.)"""
        return buffer_rule.check(reported, self.buffers) and all(
            bool(torch.isfinite(b).all()) for b in reported.values() if b.is_floating_point())

    def contribution(self, produced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A microbatch's produced buffers as a term of the step's buffer sum; None if they are not valid."""
        return buffer_rule.contribution(self.buffers, produced) if self.valid_buffers(produced) else None

    def apply(self, mean_grads: dict[str, torch.Tensor] | None,
              buffer_sum: dict[str, torch.Tensor] | None = None) -> None:
        """One global step. `None` (a microbatch overflowed): skip optimizer.step() as GradScaler.step()
        would, but step the scheduler, as the usual AMP loop does, so the schedule stays aligned.
        `buffer_sum` (model.buffers: mean): the tree sum of the microbatches' buffer contributions."""
        if buffer_sum is not None:
            buffer_rule.fold(self.buffers, buffer_sum, self.cfg.train.microbatches)
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
        """SHA-256 of the parameters' bytes (sorted by name), then the travelling buffers' (sorted by name):
        trained statistics are part of the result. A model without buffers hashes its parameters only."""
        h = hashlib.sha256()
        for group in (self.params, self.buffers):
            for n in sorted(group):
                h.update(group[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def wire_state(self) -> dict[str, torch.Tensor]:
        """What goes out with a new parameter version: the parameters and the step's buffers."""
        if not self.buffers:
            return self.params
        return {**self.params, **{buffer_rule.PREFIX + n: b for n, b in self.buffers.items()}}
