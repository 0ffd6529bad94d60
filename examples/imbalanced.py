"""Imbalanced classification recipe: digits where classes 0-4 are 10x rarer than 5-9.

`weighted_loss` re-weights the cross-entropy by inverse class frequency (computed from the training
set, so every process computes the same weights), and `evaluate` reports balanced accuracy (mean
per-class recall), the metric that matters when classes are imbalanced.
"""

from __future__ import annotations

import functools

import torch
from cmemi.examples.digits import splits
from torch.nn import functional as F
from torch.utils.data import TensorDataset


@functools.lru_cache(maxsize=1)
def _train() -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _, _ = splits()
    keep = torch.ones(len(y), dtype=torch.bool)
    rare = (y < 5).nonzero().flatten()
    keep[rare[torch.arange(len(rare)) % 10 != 0]] = False  # keep every 10th sample of classes 0-4
    return x[keep], y[keep]


def make_dataset() -> TensorDataset:
    return TensorDataset(*_train())


@functools.lru_cache(maxsize=1)
def class_weights() -> torch.Tensor:
    counts = torch.bincount(_train()[1], minlength=10).float()
    return counts.sum() / (len(counts) * counts)


def weighted_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, weight=class_weights())


def evaluate(model: torch.nn.Module) -> dict[str, float]:
    _, _, xte, yte = splits()
    pred = model(xte).argmax(1)
    recalls = [(pred[yte == c] == c).float().mean().item() for c in range(10)]
    return {"accuracy": (pred == yte).float().mean().item(), "balanced_accuracy": sum(recalls) / 10,
            "rare_class_recall": sum(recalls[:5]) / 5}
