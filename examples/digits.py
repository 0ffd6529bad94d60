"""An MLP on scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download).

Deterministic 80/20 train/test split; `evaluate` reports test accuracy.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's `load_digits(return_X_y=True)`: the same file, read the same way, without importing
    scikit-learn (scipy and all: ~2.4 s of CPU in every process that builds the dataset)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        from cmemi.shared.config.extras import require

        require("sklearn", "examples", "the digits example's data")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


@functools.lru_cache(maxsize=1)
def splits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): 80/20 by a fixed permutation, the one split every digits example reads."""
    xs, ys = _load_digits()
    x = torch.tensor(xs, dtype=torch.float32) / 16.0
    y = torch.tensor(ys, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def make_dataset(split: str = "train") -> TensorDataset:
    xtr, ytr, xte, yte = splits()
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
    _, _, xte, yte = splits()
    with torch.no_grad():
        logits = model(xte)
    return {"accuracy": (logits.argmax(1) == yte).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, yte).item()}
