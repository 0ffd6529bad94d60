"""An ordinary single-process PyTorch loop, independent of CMEMI's worker/aggregator code: the yardstick
for models with buffers and random augmentation (gradient accumulation over M microbatches, BatchNorm
updated by each microbatch's forward, every RNG seeded once at the start)."""

from __future__ import annotations

import random

import numpy as np
import torch
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_optimizer, build_scheduler
from cmemi.shared.config.schema import Config
from torch.utils.data import default_collate


def plain_loop(cfg: Config, seed: int) -> dict[str, float]:
    """Train cfg with its own seed `seed`; returns cfg's evaluation of the result."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = resolve(cfg.model.factory, "model.factory")(**cfg.model.kwargs)
    opt = build_optimizer(cfg, model.parameters())
    sched = build_scheduler(cfg, opt)
    ds = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
    loss_fn = resolve(cfg.train.loss, "train.loss")
    M, B = cfg.train.microbatches, cfg.train.global_batch
    order: list[int] = []
    model.train()
    for _ in range(cfg.train.steps):
        if len(order) < B:
            order = torch.randperm(len(ds)).tolist()
        batch, order = order[:B], order[B:]
        opt.zero_grad()
        for m in range(M):
            x, y = default_collate([ds[i] for i in batch[m * B // M:(m + 1) * B // M]])
            (loss_fn(model(x), y) / M).backward()
        opt.step()
        if sched is not None:
            sched.step()
    model.eval()
    with torch.no_grad():
        return dict(resolve(cfg.eval.fn, "eval.fn")(model))
