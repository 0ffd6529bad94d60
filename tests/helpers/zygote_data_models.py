"""User code for the data-built-once tests (tests/test_zygote_data*.py): factories that draw from every global
generator, augment at random, count their builds, raise, or run a torch op big enough for a parallel region.

`augmented_dataset` is what the sharing must not change: its tensors come from torch's generator where the model
factory left it (seeded with run.seed) and from numpy's, seeded by the factory itself; its items are augmented
with torch, numpy and `random` (seeded per microbatch by CMEMI). `count` names a file the factory appends its pid to,
so a test counts the builds.
"""

from __future__ import annotations

import os
import random

import numpy
import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES = 16, 4


def make_model(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random jitter, flip and scale on every read: the samples depend on the generators' states then."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(FEATURES)
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(numpy.random.uniform(0.9, 1.1)), self.y[i]


def augmented_dataset(n: int = 512, count: str | None = None, big_op: bool = False) -> Augmented:
    if count is not None:
        with open(count, "a") as f:
            f.write(f"{os.getpid()}\n")
    if big_op:  # large enough for a parallel region had the zygote more than one intra-op thread
        torch.ones(1 << 22).mul(2.0).sum()
    numpy.random.seed(7)  # the factory seeds numpy and random itself: the same data in any process
    random.seed(11)
    base = torch.randn(n, FEATURES)  # torch's generator, as the model factory left it
    noise = torch.from_numpy(numpy.random.standard_normal((n, FEATURES))).float()
    x = base + 0.1 * noise * random.random()
    y = (x[:, :CLASSES].sum(1) * 10).long().remainder(CLASSES)
    return Augmented(x, y)


def raising_dataset(n: int = 8) -> Augmented:
    raise ValueError(f"the corpus has {n} lines, fewer than one batch")


CONFIG = """\
run: {{name: zdata, seed: 3}}
model: {{factory: "tests.helpers.zygote_data_models:make_model", kwargs: {{hidden: 32}}}}
data:
  factory: "tests.helpers.zygote_data_models:{factory}"
  kwargs: {kwargs}
optimizer: {{name: SGD, kwargs: {{lr: 0.05, momentum: 0.9}}}}
train: {{steps: {steps}, global_batch: 32, microbatches: 4, loss: "torch.nn.functional:cross_entropy"}}
cluster: {{workers: 2, spare_workers: 0}}
checkpoint: {{every_steps: 0}}
"""


def write_config(path: str, factory: str = "augmented_dataset", steps: int = 20, **kwargs: object) -> str:
    kw = "{" + ", ".join(f"{k}: {v!r}" if not isinstance(v, str) else f'{k}: "{v}"' for k, v in kwargs.items()) + "}"
    with open(path, "w") as f:
        f.write(CONFIG.format(factory=factory, kwargs=kw, steps=steps))
    return path
