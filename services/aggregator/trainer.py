"""The aggregator's model, optimizer and LR scheduler: one optimizer.step() and scheduler.step() per global step."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from shared.config import Config
from shared.plugins import build_model, build_optimizer, build_scheduler


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.model = build_model(cfg)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = build_optimizer(cfg, list(self.params.values()))
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.step = 0  # number of optimizer steps applied == parameter version
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self._published: dict[str, torch.Tensor] | None = None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def published(self) -> dict[str, torch.Tensor]:
        """Immutable copy of the current parameters for sending: the optimizer never mutates what is in flight."""
        if self._published is None:
            self._published = {n: p.detach().clone() for n, p in self.params.items()}
        return self._published

    def invalidate(self) -> None:
        """Parameters changed outside apply() (a restore): re-publish."""
        self._published = None

    def check_grads(self, grads: dict[str, torch.Tensor]) -> str | None:
        if grads.keys() != self.params.keys():
            return "grad_names"
        for n, g in grads.items():
            if tuple(g.shape) != self.shapes[n] or g.dtype != torch.float32:
                return "grad_shape"
        return None

    def apply(self, mean_grads: dict[str, torch.Tensor]) -> None:
        for n, p in self.params.items():
            p.grad = mean_grads[n]
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._published = None

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
