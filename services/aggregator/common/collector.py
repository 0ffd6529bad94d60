"""Leases and ordered summation of one global step's M microbatch gradients (no sockets: unit-testable).

A lease is a node [lo, hi) of the step's reduction tree (docs/design.md, "Leases"): a block of
microbatches that one worker computes and sums itself, in tree order, sending one gradient. A block
that expires, or whose worker is declared dead, goes back to the pending queue split into leaves,
handed out one by one, so a step never waits for one replacement to redo a whole block. The first
complete contribution for a set of microbatches is accepted (any worker computes it bitwise
identically); one overlapping microbatches already received is a duplicate and is dropped. A
contribution counts only from a worker incarnation that was leased exactly that node in this step
(`granted`): nobody injects a gradient for work it was not given. When the queue is empty, an
outstanding lease held longer than `reissue_after` per microbatch is handed to the next idle worker
as well (fewest holders first, then oldest), so a withheld lease costs one recomputation, never a
whole `lease_timeout` (docs/design.md, "Idle workers"). Accepted contributions are summed by the
fixed reduction tree of `shared.reduction`, so the sum is bitwise the same whatever arrives when.

Sharded (`cluster.shards`), a worker sends every shard its slice at once, so the leader can hold a
microbatch that another shard never gets (the worker died between its sends, or that shard kept an
overlapping copy): `reopen` hands such microbatches out again, as leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cmemi.shared.core.reduction import TreeAccumulator, add_into, blocks, is_subtree

Node = tuple[int, int]  # [lo, hi): microbatches lo..hi-1 of the step


_DIVISORS: dict[int, torch.Tensor] = {}  # M -> M as a 0-d fp32 tensor, made once (read only)


def _divisor(m: int) -> torch.Tensor:
    t = _DIVISORS.get(m)
    if t is None:
        t = _DIVISORS[m] = torch.tensor(float(m))
    return t


@dataclass
class Lease:
    wid: str
    inc: int
    deadline: float


def node_of(x: int | Node) -> Node:
    """A leaf m, or a node (lo, hi), as a node."""
    return (x, x + 1) if isinstance(x, int) else (int(x[0]), int(x[1]))


class StepCollector:
    def __init__(self, step: int, microbatches: int, block: int = 1, strict: bool = False, leased: bool = True) -> None:
        """`block`: the most microbatches one lease holds (a power of two; 1 leases microbatch by microbatch).
        `leased` false: contributions need no lease (a shard k > 0: the leader leases, workers report to it)."""
        self.step = step
        self.leased = leased
        self.M = microbatches
        self.strict = strict  # a second collection of a step whose sum was not finite: check each gradient
        self.pending: deque[Node] = deque(blocks(microbatches, max(1, block)))
        self.leases: dict[Node, Lease] = {}  # node -> its newest holder (whose deadline counts)
        self.granted: dict[Node, set[tuple[str, int]]] = {}  # node -> every (wid, inc) leased it in this step
        self.leased_at: dict[Node, float] = {}  # node -> when it was first leased (re-issue oldest first)
        self.received: set[int] = set()  # microbatches covered by accepted contributions
        self._tree: TreeAccumulator = TreeAccumulator(microbatches, add_into)
        self._buffers: TreeAccumulator = TreeAccumulator(microbatches, add_into)  # model.buffers: mean
        self._losses: dict[int, float] = {}
        self.overflow = False  # some microbatch overflowed: the step is skipped, like GradScaler does
        self._lacking: dict[int, float] = {}  # microbatch -> when another shard was first seen lacking it (or re-queued)
        self.kept: list[Any] = []  # what `offer` was given to keep of each accepted contribution (steplog/frames.py)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.M

    def _covered(self, node: Node) -> bool:
        return any(m in self.received for m in range(*node))

    def lease(self, wid: str, inc: int, now: float, timeout: float, reissue_after: float | None = None,
              prefer: Collection[int] = (), avoid: Collection[int] = ()) -> Node | None:
        """The next node for worker (wid, inc): from the queue (a leaf in `prefer` first: with local steps, a replica
        whose inner state the worker holds; never a leaf in `avoid`: streaming, one another worker holds), else (with
        `reissue_after`, seconds per microbatch) an outstanding lease held at least that long by another worker; None
        if there is nothing to hand out. A lease of n microbatches expires after n × `timeout`."""
        def leaf_in(node: Node, among: Collection[int]) -> bool:
            return node[1] - node[0] == 1 and node[0] in among
        if self.pending:
            node = next((n for n in self.pending if leaf_in(n, prefer)), None) or \
                next((n for n in self.pending if not leaf_in(n, avoid)), None)
            if node is None:
                return None
            self.pending.remove(node)
        elif reissue_after is None or (node := self._reissuable(wid, inc, now, reissue_after)) is None:
            return None
        self.leases[node] = Lease(wid, inc, now + timeout * (node[1] - node[0]))
        self.granted.setdefault(node, set()).add((wid, inc))
        self.leased_at.setdefault(node, now)
        return node

    def _outstanding(self, now: float, reissue_after: float) -> list[Node]:
        return [n for n, t in self.leased_at.items()
                if not self._covered(n) and t <= now - reissue_after * (n[1] - n[0])]

    def _reissuable(self, wid: str, inc: int, now: float, reissue_after: float) -> Node | None:
        mine = [n for n in self._outstanding(now, reissue_after) if (wid, inc) not in self.granted.get(n, ())]
        return min(mine, key=lambda n: (len(self.granted.get(n, ())), self.leased_at[n], n), default=None)

    def reissuable(self, now: float, reissue_after: float) -> bool:
        return not self.pending and bool(self._outstanding(now, reissue_after))

    def _requeue(self, nodes: list[Node]) -> list[int]:
        """Put nodes back at the front of the queue, split into the leaves not yet received; returns those."""
        leaves = sorted({m for node in nodes for m in range(*node) if m not in self.received})
        for node in nodes:
            self.leases.pop(node, None)
            self.leased_at.pop(node, None)
        queued = {m for lo, hi in self.pending for m in range(lo, hi)}
        self.pending.extendleft((m, m + 1) for m in reversed(leaves) if m not in queued)
        return leaves

    def release(self, wid: str, max_inc: int | None = None) -> list[int]:
        """Return the leases of worker `wid` (of incarnations <= max_inc) to the front of the queue, as leaves;
        returns the microbatches freed."""
        freed = self._requeue(sorted(n for n, lease in self.leases.items()
                                     if lease.wid == wid and (max_inc is None or lease.inc <= max_inc)))
        for holders in self.granted.values():  # a fenced or departed incarnation's gradients no longer count
            holders -= {h for h in holders if h[0] == wid and (max_inc is None or h[1] <= max_inc)}
        return freed

    def expire(self, now: float) -> list[int]:
        return self._requeue(sorted(n for n, lease in self.leases.items() if lease.deadline < now))

    def reopen(self, have: Sequence[int], now: float, grace: float, early: bool = False) -> list[int]:
        """Another shard holds only the microbatches `have` of this step. Once this collection is complete, the ones
        it lacks go back to the front of the queue as leaves when they have been lacking `grace` seconds (time for
        a slice still on its way), and again every `grace` seconds while they still are; returns those queued.
        Their gradients reach that shard; here they are duplicates (the first copy stays). `early` (that shard is a
        restarted incarnation, which lost all it held): the ones received here go back before this collection is
        complete too; nothing of theirs is on its way to it, and the rest is still leased or queued here."""
        if not (self.complete or early):
            return []
        held = set(have)
        due = [m for m in sorted(self.received) if m not in held and now - self._lacking.setdefault(m, now) >= grace]
        queued = {m for lo, hi in self.pending for m in range(lo, hi)}
        due = [m for m in due if m not in queued]
        for m in due:
            self._lacking[m] = now
        self.pending.extendleft((m, m + 1) for m in reversed(due))
        return due

    def check(self, node: int | Node, holder: tuple[str, int] | None) -> str | None:
        """Why a contribution for `node` from `holder` would be dropped (None: it would be accepted)."""
        node = node_of(node)
        if not is_subtree(*node, self.M):
            return "bad_microbatch"
        if self._covered(node):
            return "duplicate"
        if self.leased and holder not in self.granted.get(node, ()):
            return "not_leased"
        return None

    def offer(self, node: int | Node, grads: dict[str, torch.Tensor] | None, losses: float | Sequence[float],
              holder: tuple[str, int] | None, buffers: dict[str, torch.Tensor] | None = None,
              own: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
              keep: Any = None) -> str | None:
        """Accept the tree sum over `node` (a leaf m or (lo, hi)) from `holder` = (wid, inc) (grads None: it
        overflowed under fp16 loss scaling), one loss per microbatch, and its buffer contribution (the tree sum of
        shared.buffers.contribution; None for a model whose buffers do not travel); returns a drop reason instead if
        it is not wanted. The collector owns accepted tensors; with `own`, `grads` are borrowed (a shared-memory slot's
        views): only read, summed into a waiting sibling or kept as `own(grads)`, a copy (shared/core/reduction.py).
        `keep`: kept in `kept` if the contribution is accepted (the step log's copy of it as it came, frames.py)."""
        node = node_of(node)
        if (reason := self.check(node, holder)) is not None:
            return reason
        losses = [float(losses)] if isinstance(losses, (int, float)) else [float(x) for x in losses]
        if len(losses) != node[1] - node[0]:
            return "bad_losses"
        self.received.update(range(*node))
        # whatever else holds or queues these microbatches is no longer needed; its leaves not received go back
        overlapping = {n for n in [*self.leases, *self.leased_at, *self.pending] if n[0] < node[1] and node[0] < n[1]}
        for n in overlapping.intersection(self.pending):
            self.pending.remove(n)
        self._requeue(sorted(overlapping))
        self._losses.update(zip(range(*node), losses, strict=True))
        self.overflow |= grads is None
        self._tree.add(*node, grads or {}, own)  # received buffers become accumulators: no copy, no allocation
        if buffers is not None:
            self._buffers.add(*node, buffers)
        if keep is not None:
            self.kept.append(keep)
        return None

    def holds(self) -> list[torch.Tensor]:
        """The tensors the step's partial sums keep (received buffers become the accumulators; the right operand of
        an add, a dropped gradient are not among them)."""
        return [t for tree in (self._tree, self._buffers) for node in tree.partial_sums() for t in node.values()]

    def buffer_sum(self) -> dict[str, torch.Tensor] | None:
        """The tree sum of the step's buffer contributions (same tree as the gradients); None if none came."""
        return self._buffers.result() if self._buffers.complete else None

    def mean(self) -> tuple[dict[str, torch.Tensor] | None, float]:
        """The average gradient (None if any microbatch overflowed) and loss over the M microbatches."""
        if not self.complete:
            raise RuntimeError(f"step {self.step}: {len(self.received)}/{self.M} microbatches received")
        total = self._tree.result()
        if self.overflow:  # (no overflow and no tensors: a shard that owns no piece, its mean is empty)
            return None, float("inf")
        if self.M > 1 and total:  # (x / 1 is x: a borrowed root, services/aggregator/leader/server.py, is never written)
            # one foreach division by a 0-d tensor: the same quotient bits as `v.div_(M)` (M is exact in fp32;
            # tests/test_collector.py), without wrapping the Python number once per tensor (~5 us each, issue 45)
            torch._foreach_div_(list(total.values()), _divisor(self.M))
        loss = 0.0
        for m in range(self.M):
            loss += self._losses[m]
        return total, loss / self.M
