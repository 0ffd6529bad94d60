"""Buffers are training state: the one rule that folds a step's microbatch buffers into the model.

BatchNorm's running_mean / running_var / num_batches_tracked, and anything a model registers with
`register_buffer`, change in the forward pass. Every microbatch (s, m) of a step starts from the same
buffers B_s (the ones the aggregator sent with the parameters of version s) and its forward produces
B_s,m. The aggregator folds them once per step (`model.buffers: mean`):

- floating buffers: B_{s+1} = tree_sum_m(B_s,m) / M — summed by the fixed reduction tree of
  `shared.reduction` (the same one as the gradients), then divided by M;
- integer buffers (counters like num_batches_tracked): B_{s+1} = B_s + sum_m(B_s,m - B_s), so a counter
  advances by M per step, exactly as in one process doing gradient accumulation over M microbatches;
- bool buffers (masks) never change.

For BatchNorm with momentum μ this gives running = (1-μ)·running + μ·mean_m(batch statistic): one
update per global step with the statistic averaged over the global batch (like DDP's SyncBatchNorm's
update frequency, with per-microbatch statistics averaged), not M chained updates as a single process
accumulating gradients would make. `model.buffers: frozen` keeps the initial buffers (workers still
start every microbatch from them, so results do not depend on which worker ran what).

Only persistent buffers (those in `state_dict`) travel; a model without any pays nothing.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("mean", "frozen")
PREFIX = "buffer:"  # wire names of buffer tensors in `work` and `grad` messages


def travelling(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent, non-bool buffers, by name (the live tensors, not copies)."""
    persistent = set(model.state_dict(keep_vars=True))
    return {n: b for n, b in model.named_buffers() if n in persistent and b.dtype != torch.bool}


def contribution(start: dict[str, torch.Tensor], produced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What microbatch m adds to the step's buffer sum: its floating buffers, and its integer counters'
    advance over the step's start. `produced` is consumed (integer entries are updated in place)."""
    for n, b in produced.items():
        if not b.is_floating_point():
            b.sub_(start[n])
    return produced


def fold(buffers: dict[str, torch.Tensor], total: dict[str, torch.Tensor], M: int) -> None:
    """Write the step's folded buffers into `buffers` (the model's): floating: total / M; integer: += total."""
    with torch.no_grad():
        for n, b in buffers.items():
            if b.is_floating_point():
                b.copy_(total[n].div_(M))
            else:
                b.add_(total[n])


def check(reported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """Do reported buffers have the model's names, shapes and dtypes?"""
    if reported.keys() != expected.keys():
        return False
    return all(reported[n].shape == b.shape and reported[n].dtype == b.dtype for n, b in expected.items())
