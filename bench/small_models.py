"""Small models on a small synthetic dataset, for bench/small.py (usable from a config: `bench.small_models:...`).

The workload a new user tries first: 4,000 samples of 40 features, 10 classes, an MLP or a small 1-D CNN
whose plain PyTorch step takes a few milliseconds. The labels come from a fixed random teacher, so the
models can learn them; every process builds the same bytes (CMEMI compares dataset fingerprints).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def dataset(n: int = 4000, features: int = 40, classes: int = 10, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def mlp(features: int = 40, hidden: int = 256, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def cnn1d(features: int = 40, channels: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, features)),
        nn.Conv1d(1, channels, 5, padding=2), nn.ReLU(),
        nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
        nn.Flatten(), nn.Linear(channels * (features // 2), classes),
    )


class Augmented(torch.utils.data.Dataset):
    """The same samples, augmented per item in `__getitem__` as image pipelines do: torch noise, a numpy
    scale jitter and a `random` feature dropout (about 20 µs of Python per sample)."""

    def __init__(self, **kwargs: int) -> None:
        self.x, self.y = dataset(**kwargs).tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        import numpy as np

        x = self.x[i] + 0.05 * torch.randn(self.x.shape[1])
        x = x * float(np.random.uniform(0.9, 1.1))
        for j in random.sample(range(x.shape[0]), 4):
            x[j] = 0.0
        return x, self.y[i]


def augmented(**kwargs: int) -> Augmented:
    return Augmented(**kwargs)
