"""A user module that is slow to import and to build its data, for bench/small.py's start-up workload.

Like a research project's `mypkg.data`: importing it does about a second of work (tables built at import, as a
large package does), and its dataset factory generates 4,000 noisy 1-D signals of 64 samples in 8 classes (a
frequency each) with a per-sample Python loop, about another second. A plain Python process that imports it
and builds the dataset takes T seconds (bench/small.py measures T); `cmemi up` with 2 workers should reach its
first step within T + 3 s. The import uses the standard library and numpy only, no torch op: it starts no
thread pool in the zygote (cmemi/launcher/zygote_user_code.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import TensorDataset

IMPORT_WORK = 1_500_000  # table entries built at import: about a second of CPU
TABLE = [math.sin(i * 1e-3) * math.cos(i * 7e-4) for i in range(IMPORT_WORK)]


def dataset(n: int = 4000, length: int = 64, classes: int = 8, seed: int = 7) -> TensorDataset:
    """Noisy sines, one frequency per class; features smoothed sample by sample (the slow, Python part)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    t = np.arange(length)
    x = np.empty((n, length), dtype=np.float32)
    for i in range(n):
        wave = np.sin(2 * math.pi * (labels[i] + 1) * t / length + rng.uniform(0, 2 * math.pi))
        noisy = wave + 0.3 * rng.standard_normal(length)
        smooth = [float(noisy[0])]
        for v in noisy[1:]:
            smooth.append(0.7 * smooth[-1] + 0.3 * float(v))
        x[i] = smooth
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels))
