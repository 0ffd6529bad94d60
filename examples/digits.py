"""An MLP on scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download).

Deterministic 80/20 train/test split; `evaluate` reports test accuracy.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset


@functools.lru_cache(maxsize=1)
def _split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def make_dataset(split: str = "train") -> TensorDataset:
    xtr, ytr, xte, yte = _split()
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return TensorDataset(xtr, ytr) if split == "train" else TensorDataset(xte, yte)


def make_model(hidden: int = 128, dropout: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def evaluate(model: nn.Module) -> dict[str, float]:
    _, _, xte, yte = _split()
    with torch.no_grad():
        logits = model(xte)
    return {"accuracy": (logits.argmax(1) == yte).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, yte).item()}
