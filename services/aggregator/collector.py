"""Leases and ordered summation of one global step's M microbatch gradients (no sockets: unit-testable).

Microbatch m of step s is leased to one worker at a time. A lease that expires, or whose worker
is declared dead, goes back to the pending queue and is handed to the next worker that asks.
The first gradient to arrive for m is accepted (any worker computes it bitwise identically);
every later one is a duplicate and is dropped. A gradient counts only from a worker incarnation
that was leased that m in this step (`granted`): nobody injects a gradient for a microbatch it
was not given. When the queue is empty, an outstanding lease held longer than `reissue_after` is
handed to the next idle worker as well (oldest first, fewest holders first), so a withheld lease
costs one recomputation, never a whole `lease_timeout` (docs/design.md, "Idle workers"). Accepted gradients are summed by the fixed reduction
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
        self.leases: dict[int, Lease] = {}  # m -> its newest holder (whose deadline counts)
        self.granted: dict[int, set[tuple[str, int]]] = {}  # m -> every (wid, inc) leased it in this step
        self.leased_at: dict[int, float] = {}  # m -> when it was first leased (re-issue oldest first)
        self.received: set[int] = set()
        self._tree: TreeAccumulator = TreeAccumulator(microbatches, add_into)
        self._buffers: TreeAccumulator = TreeAccumulator(microbatches, add_into)  # model.buffers: mean
        self._losses: dict[int, float] = {}
        self.overflow = False  # some microbatch overflowed: the step is skipped, like GradScaler does

    @property
    def complete(self) -> bool:
        return len(self.received) == self.M

    def lease(self, wid: str, inc: int, now: float, timeout: float, reissue_after: float | None = None) -> int | None:
        """The next microbatch for worker (wid, inc): from the queue, else (with `reissue_after`) an outstanding
        lease held at least that long by another worker; None if there is nothing to hand out."""
        if self.pending:
            m = self.pending.popleft()
        elif reissue_after is None or (m := self._reissuable(wid, inc, now - reissue_after)) is None:
            return None
        self.leases[m] = Lease(wid, inc, now + timeout)
        self.granted.setdefault(m, set()).add((wid, inc))
        self.leased_at.setdefault(m, now)
        return m

    def _reissuable(self, wid: str, inc: int, before: float) -> int | None:
        outstanding = [m for m, t in self.leased_at.items()
                       if m not in self.received and t <= before and (wid, inc) not in self.granted.get(m, ())]
        return min(outstanding, key=lambda m: (len(self.granted.get(m, ())), self.leased_at[m], m), default=None)

    def reissuable(self, now: float, reissue_after: float) -> bool:
        return not self.pending and any(m not in self.received and t <= now - reissue_after
                                        for m, t in self.leased_at.items())

    def release(self, wid: str, max_inc: int | None = None) -> list[int]:
        """Return the leases of worker `wid` (of incarnations <= max_inc) to the front of the queue."""
        freed = sorted(m for m, lease in self.leases.items()
                       if lease.wid == wid and (max_inc is None or lease.inc <= max_inc))
        for m in reversed(freed):
            del self.leases[m]
            self.pending.appendleft(m)
            self.leased_at.pop(m, None)
        for holders in self.granted.values():  # a fenced or departed incarnation's gradients no longer count
            holders -= {h for h in holders if h[0] == wid and (max_inc is None or h[1] <= max_inc)}
        return freed

    def expire(self, now: float) -> list[int]:
        expired = sorted(m for m, lease in self.leases.items() if lease.deadline < now)
        for m in reversed(expired):
            del self.leases[m]
            self.pending.appendleft(m)
            self.leased_at.pop(m, None)
        return expired

    def check(self, m: int, holder: tuple[str, int]) -> str | None:
        """Why a gradient for m from `holder` would be dropped (None: it would be accepted)."""
        if not 0 <= m < self.M:
            return "bad_microbatch"
        if m in self.received:
            return "duplicate"
        if holder not in self.granted.get(m, ()):
            return "not_leased"
        return None

    def offer(self, m: int, grads: dict[str, torch.Tensor] | None, loss: float, holder: tuple[str, int],
              buffers: dict[str, torch.Tensor] | None = None) -> str | None:
        """Accept microbatch m's gradient from `holder` = (wid, inc) (grads None: it overflowed under fp16 loss
        scaling) and its buffer contribution (shared.buffers.contribution; None for a model whose buffers do not
        travel); returns a drop reason instead if it is not wanted. The collector owns accepted tensors."""
        if (reason := self.check(m, holder)) is not None:
            return reason
        self.received.add(m)
        self.leases.pop(m, None)
        self.leased_at.pop(m, None)
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
