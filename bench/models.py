"""Models and synthetic data for the benchmarks, usable from a CMEMI config (`bench.models:...`).

- `cnn`: compute-bound (about 100 k parameters, about 0.17 GFLOP forward+backward per 3x32x32 sample).
- `mlp`: communication-bound when wide and fed small batches (many parameters, little compute per parameter).
- `synthetic`: a deterministic TensorDataset (same bytes in every process: CMEMI compares fingerprints).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset


def cnn(channels: int = 32, classes: int = 10, image: int = 32) -> nn.Module:
    c = channels
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * (image // 4) ** 2, classes),
    )


def mlp(in_dim: int = 512, hidden: int = 2048, depth: int = 3, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    d = in_dim
    for _ in range(depth - 1):
        layers += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


def mlp_for_params(params: int, in_dim: int = 256, depth: int = 3, classes: int = 10) -> nn.Module:
    """An MLP of `depth` layers whose parameter count is close to `params` (for size sweeps)."""
    return mlp(in_dim, hidden_for_params(params, in_dim, depth, classes), depth, classes)


def hidden_for_params(params: int, in_dim: int = 256, depth: int = 3, classes: int = 10) -> int:
    # params ~= (depth-2) h^2 + h (in_dim + classes + depth - 1) + classes
    a, b = depth - 2, in_dim + classes + depth - 1
    h = (params - classes) / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * (params - classes))) / (2 * a)
    return max(1, int(round(h)))


def synthetic(n: int = 1024, shape: list[int] | tuple[int, ...] = (3, 32, 32), classes: int = 10,
              seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# The two workloads of overhead.py (and the defaults elsewhere): model, data and batch.
WORKLOADS: dict[str, dict] = {
    "compute_bound": {
        "model": {"factory": "bench.models:cnn", "kwargs": {"channels": 32}},
        "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 1024, "shape": [3, 32, 32]}},
        "global_batch": 64,
        "lr": 0.01,
    },
    "comm_bound": {
        "model": {"factory": "bench.models:mlp", "kwargs": {"in_dim": 512, "hidden": 2048, "depth": 3}},
        "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 1024, "shape": [512]}},
        "global_batch": 8,
        "lr": 0.01,
    },
    # recovery.py / checkpoint.py: a small MLP with steps of some tens of milliseconds
    "small": {
        "model": {"factory": "bench.models:mlp", "kwargs": {"in_dim": 128, "hidden": 512, "depth": 3}},
        "data": {"factory": "bench.models:synthetic", "kwargs": {"n": 8192, "shape": [128]}},
        "global_batch": 1024,
        "lr": 0.01,
    },
}
