"""A small ResNet-style CNN with BatchNorm and dropout on scikit-learn's 8x8 digits, with random augmentation.

What real image training looks like, in miniature: the dataset's `__getitem__` augments each sample at
random — a random crop of the zero-padded image (torch's RNG), pixel noise (numpy's) and a brightness
jitter (Python's `random`) — and the model keeps BatchNorm running statistics. CMEMI seeds all three
generators per microbatch before reading its data, and folds the BatchNorm buffers once per step, so
any number of workers (and any faults) give the bits of `cmemi reference`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from cmemi.examples.digits import splits
from torch import nn
from torch.utils.data import Dataset


class AugmentedDigits(Dataset):
    """8x8 digit images (1 channel); training samples are randomly shifted, noised and brightened."""

    def __init__(self, split: str = "train", shift: int = 1, noise: float = 0.05, brightness: float = 0.1) -> None:
        xtr, ytr, xte, yte = splits()
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        x, self.y = (xtr, ytr) if split == "train" else (xte, yte)
        self.x = x.reshape(-1, 1, 8, 8)
        self.augment = split == "train"
        self.shift, self.noise, self.brightness = shift, noise, brightness

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.x[i]
        if self.augment:
            s = self.shift
            padded = nn.functional.pad(img, (s, s, s, s))
            dx, dy = (int(v) for v in torch.randint(0, 2 * s + 1, (2,)))  # random crop: torch's RNG
            img = padded[:, dy:dy + 8, dx:dx + 8]
            img = img + torch.from_numpy(np.random.normal(0.0, self.noise, img.shape).astype(np.float32))  # numpy's
            img = img * (1.0 + random.uniform(-self.brightness, self.brightness))  # Python's
        return img, self.y[i]


def make_dataset(split: str = "train", **kwargs: Any) -> AugmentedDigits:
    return AugmentedDigits(split, **kwargs)


class Block(nn.Module):
    def __init__(self, channels: int, momentum: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


def make_model(channels: int = 16, blocks: int = 2, dropout: float = 0.2, bn_momentum: float = 0.1) -> nn.Module:
    """`bn_momentum`: BatchNorm's; CMEMI updates running statistics once per global step (docs/guides/buffers.md), so a
    short run may want a larger one than a process updating them every microbatch."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels, momentum=bn_momentum), nn.ReLU(),
        *[Block(channels, bn_momentum) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(channels, 10),
    )


def evaluate(model: nn.Module) -> dict[str, float]:
    """Test accuracy and loss, in eval mode (BatchNorm uses its running statistics)."""
    ds = AugmentedDigits("test")
    with torch.no_grad():
        logits = model(ds.x)
    return {"accuracy": (logits.argmax(1) == ds.y).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, ds.y).item()}
