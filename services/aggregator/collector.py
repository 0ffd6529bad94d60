"""Leases and ordered summation of one global step's M microbatch gradients (no sockets: unit-testable).

Microbatch m of step s is leased to one worker at a time. A lease that expires, or whose worker
is declared dead, goes back to the pending queue and is handed to the next worker that asks.
The first gradient to arrive for m is accepted (any worker computes it bitwise identically);
every later one is a duplicate and is dropped. Accepted gradients are summed by the fixed reduction
tree of `shared.reduction`, so the sum is bitwise the same whatever order they arrive in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from cmemi.shared.reduction import TreeAccumulator


def add_into(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """a += b, tensor by tensor, in a's storage (an empty dict stands for an overflowed microbatch)."""
    if not a or not b:
        return a or b
    for k, v in a.items():
        v.add_(b[k])
    return a


@dataclass
class Lease:
    wid: str
    inc: int
    deadline: float


class StepCollector:
    def __init__(self, step: int, microbatches: int, strict: bool = False) -> None:
        self.step = step
        self.M = microbatches
        self.strict = strict  # a second collection of a step whose sum was not finite: check each gradient
        self.pending: deque[int] = deque(range(microbatches))
        self.leases: dict[int, Lease] = {}
        self.received: set[int] = set()
        self._tree: TreeAccumulator = TreeAccumulator(microbatches, add_into)
        self._buffers: TreeAccumulator = TreeAccumulator(microbatches, add_into)  # model.buffers: mean
        self._losses: dict[int, float] = {}
        self.overflow = False  # some microbatch overflowed: the step is skipped, like GradScaler does

    @property
    def complete(self) -> bool:
        return len(self.received) == self.M

    def lease(self, wid: str, inc: int, now: float, timeout: float) -> int | None:
        if not self.pending:
            return None
        m = self.pending.popleft()
        self.leases[m] = Lease(wid, inc, now + timeout)
        return m

    def release(self, wid: str, max_inc: int | None = None) -> list[int]:
        """Return the leases of worker `wid` (of incarnations <= max_inc) to the front of the queue."""
        freed = sorted(m for m, lease in self.leases.items()
                       if lease.wid == wid and (max_inc is None or lease.inc <= max_inc))
        for m in reversed(freed):
            del self.leases[m]
            self.pending.appendleft(m)
        return freed

    def expire(self, now: float) -> list[int]:
        expired = sorted(m for m, lease in self.leases.items() if lease.deadline < now)
        for m in reversed(expired):
            del self.leases[m]
            self.pending.appendleft(m)
        return expired

    def offer(self, m: int, grads: dict[str, torch.Tensor] | None, loss: float,
              buffers: dict[str, torch.Tensor] | None = None) -> str | None:
        """Accept microbatch m's gradient (None: it overflowed under fp16 loss scaling) and its buffer
        contribution (shared.buffers.contribution; None for a model whose buffers do not travel); returns
        a drop reason instead if it is not wanted. The collector owns accepted tensors: it sums into them."""
        if not 0 <= m < self.M:
            return "bad_microbatch"
        if m in self.received:
            return "duplicate"
        self.received.add(m)
        self.leases.pop(m, None)
        if m in self.pending:
            self.pending.remove(m)
        self._losses[m] = loss
        self.overflow |= grads is None
        self._tree.add(m, m + 1, grads or {})  # received buffers become accumulators: no copy, no allocation
        if buffers is not None:
            self._buffers.add(m, m + 1, buffers)
        return None

    def buffer_sum(self) -> dict[str, torch.Tensor] | None:
        """The tree sum of the step's buffer contributions (same tree as the gradients); None if none came."""
        return self._buffers.result() if self._buffers.complete else None

    def mean(self) -> tuple[dict[str, torch.Tensor] | None, float]:
        """The average gradient (None if any microbatch overflowed) and loss over the M microbatches."""
        if not self.complete:
            raise RuntimeError(f"step {self.step}: {len(self.received)}/{self.M} microbatches received")
        total = self._tree.result()
        if self.overflow or not total:
            return None, float("inf")
        for v in total.values():
            v.div_(self.M)
        loss = 0.0
        for m in range(self.M):
            loss += self._losses[m]
        return total, loss / self.M
