"""A user module whose dataset factory builds an MNIST-1D-like dataset, for bench/startup_data.py.

Like the MNIST-1D script of issue 46: ten 1-D digit templates, each sample padded, sheared, scaled and resampled
to 40 points with correlated and white noise, one sample at a time in a Python loop, from numpy's global generator
seeded by the factory (as `mnist1d.data.make_dataset` seeds it). With the default size it is a few seconds of CPU,
the same every time (deterministic): a plain script's import of torch plus this build is T, the time `cmemi up`
with 2 workers is measured against. Importing the module does no work and starts no thread.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

TEMPLATES = np.array([  # 12 points each, one per digit (the shapes MNIST-1D draws)
    [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5], [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
    [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5], [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
    [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5], [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
    [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5], [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
    [5, 4, 3.5, 3.5, 4, 4.75, 5.25, 6, 6.5, 6.5, 6, 5], [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
]) - 5
LENGTH, CLASSES = 40, 10


def _sample(template: np.ndarray) -> np.ndarray:
    """One sample: pad, shear, scale, correlated and white noise, resampled to LENGTH points (MNIST-1D's steps)."""
    padded = np.concatenate([np.zeros(np.random.randint(6, 18)), template, np.zeros(np.random.randint(6, 18))])
    t = np.linspace(-1, 1, len(padded))
    sheared = padded + np.random.uniform(-0.75, 0.75) * t
    scale = np.random.uniform(0.8, 1.2)
    stretched = np.interp(np.linspace(0, 1, int(len(sheared) * scale)), np.linspace(0, 1, len(sheared)), sheared)
    correlated = np.convolve(np.random.normal(size=len(stretched) + 6), np.ones(7) / 7, mode="valid") * 0.25
    noisy = stretched + correlated + np.random.normal(scale=0.25, size=len(stretched))
    return np.interp(np.linspace(0, 1, LENGTH), np.linspace(0, 1, len(noisy)), noisy)


def make_dataset(samples: int = 120_000, seed: int = 42) -> TensorDataset:
    """`samples` MNIST-1D-like signals and their digits, built with numpy's global generator seeded with `seed`."""
    np.random.seed(seed)
    labels = np.random.randint(0, CLASSES, samples)
    x = np.stack([_sample(TEMPLATES[y]) for y in labels]).astype(np.float32)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64)))


def make_model(hidden: int = 100) -> nn.Module:
    """MNIST-1D's MLP baseline."""
    return nn.Sequential(nn.Linear(LENGTH, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))
