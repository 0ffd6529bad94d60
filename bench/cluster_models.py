"""The emulated cluster's workload (`bench/cluster.py`): an MLP whose forward pass also sleeps a fixed time.

`bench.cluster_models:sleepy_mlp` in a CMEMI config or a DDP rank gives the same model to both systems. The
sleep stands in for a GPU's compute: eight workers' real compute on two shared cores would measure the cores,
not the network, and a sleep costs the same wall time on every emulated host without using a core.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from bench.models import mlp


class SleepyForward(nn.Module):
    """Wraps a model; every forward pass first sleeps `sleep_ms` (parameter names stay the inner model's)."""

    def __init__(self, inner: nn.Module, sleep_ms: float) -> None:
        super().__init__()
        self.inner = inner
        self.sleep_s = sleep_ms / 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        return self.inner(x)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepInBackward(nn.Module):
    """Identity forward; its backward sleeps: placed between layers, the layers after it have their gradients
    before the sleep, the ones before it after (a GPU's backward, layer by layer)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInBackward.apply(x, self.seconds)


def sleepy_mlp(in_dim: int = 784, hidden: int = 512, depth: int = 3, classes: int = 10,
               sleep_ms: float = 20.0, backward_ms: float = 0.0) -> nn.Module:
    """The MLP 784-512-512-10 (669,706 parameters, 2.68 MB fp32) with `sleep_ms` of emulated compute per forward
    and `backward_ms` per backward, spread over the gaps between its layers (parameter names do not change)."""
    inner = mlp(in_dim, hidden, depth, classes)
    if backward_ms > 0:
        gaps = [i for i, layer in enumerate(inner) if isinstance(layer, nn.ReLU)]
        for i in gaps:
            inner[i] = nn.Sequential(nn.ReLU(), SleepInBackward(backward_ms / 1000 / len(gaps)))
    return SleepyForward(inner, sleep_ms)
