"""The one summation rule of a step: a fixed balanced binary tree over microbatches m = 0..M-1.

Floating-point addition is commutative but not associative, so the bits of a sum depend on its
bracketing, never on arrival order or operand order. CMEMI fixes the bracketing once, here, and
every place that sums a step's microbatches — the aggregator's collector, a worker summing a block
of leases it holds, the single-process reference (`cmemi reference`) — uses these functions.

The tree over [lo, hi): a leaf when hi - lo == 1; otherwise split at lo + h, h the largest power of
two strictly below hi - lo. So every aligned power-of-two block [k·2^j, (k+1)·2^j) that fits in
[0, M) is a subtree, and a worker leased such a block can sum it alone, in tree order, and send
one gradient that is bitwise the sum the aggregator would have formed from its leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


def add_into(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """a += b, tensor by tensor, in a's storage (an empty dict stands for an overflowed microbatch). One foreach
    call: the same `add_` per pair (the same bits), without a Python dispatch per tensor (issue 45: ~1 us a tensor)."""
    if not a or not b:
        return a or b
    torch._foreach_add_(list(a.values()), [b[k] for k in a])
    return a


def split(lo: int, hi: int) -> int:
    """Where the tree splits [lo, hi) (hi - lo >= 2): lo + the largest power of two below hi - lo."""
    n = hi - lo
    if n < 2:
        raise ValueError(f"[{lo}, {hi}) is a leaf, not an inner node")
    return lo + (1 << ((n - 1).bit_length() - 1))


def is_subtree(lo: int, hi: int, M: int) -> bool:
    """Is [lo, hi) a node of the tree over [0, M)?"""
    if not 0 <= lo < hi <= M:
        return False
    a, b = 0, M
    while (a, b) != (lo, hi):
        if b - a < 2:
            return False
        mid = split(a, b)
        if hi <= mid:
            b = mid
        elif lo >= mid:
            a = mid
        else:
            return False
    return True


def parent(lo: int, hi: int, M: int) -> tuple[int, int, int] | None:
    """(parent_lo, parent_hi, sibling boundary) of node [lo, hi) in the tree over [0, M); None at the root."""
    if (lo, hi) == (0, M):
        return None
    a, b = 0, M
    while True:
        mid = split(a, b)
        if (lo, hi) in ((a, mid), (mid, b)):
            return a, b, mid
        a, b = (a, mid) if hi <= mid else (mid, b)


def tree_reduce(items: Sequence[T], add: Callable[[T, T], T], lo: int = 0) -> T:
    """Reduce items[0..n) (the leaves lo..lo+n of the tree) in tree order; `add(left, right)` may work in place.

    `lo` matters only for documentation: a block starting at an aligned `lo` is split the same way at any
    offset, because the split depends on the block's length alone.
    """
    n = len(items)
    if n == 0:
        raise ValueError("nothing to reduce")
    if n == 1:
        return items[0]
    h = split(0, n)
    return add(tree_reduce(items[:h], add, lo), tree_reduce(items[h:], add, lo + h))


def block_size(M: int, workers: int) -> int:
    """The lease size for `workers` workers (docs/design.md, "Leases"): the largest power of two <= ceil(M / W)."""
    share = max(1, -(-M // max(1, workers)))
    return 1 << (share.bit_length() - 1)


def blocks(M: int, size: int) -> Iterator[tuple[int, int]]:
    """The tree's nodes of at most `size` leaves covering [0, M), left to right (lease units)."""
    def walk(a: int, b: int) -> Iterator[tuple[int, int]]:
        if b - a <= size:
            yield a, b
        else:
            mid = split(a, b)
            yield from walk(a, mid)
            yield from walk(mid, b)
    yield from walk(0, M)


class TreeAccumulator(Generic[T]):
    """Sums the contributions of one step as they arrive, in any order, by the fixed tree.

    A contribution is a node [lo, hi) of the tree (a leaf, or a block a worker summed itself). Each is
    combined with its sibling as soon as both are there, so at most O(log M) partial sums wait. `add`
    may reuse its left operand's storage (the first contribution becomes an accumulator: no copies).
    """

    def __init__(self, M: int, add: Callable[[T, T], T]) -> None:
        self.M = M
        self._add = add
        self._nodes: dict[tuple[int, int], T] = {}
        self.covered = 0  # leaves received so far

    def disjoint(self, lo: int, hi: int) -> bool:
        """No leaf of [lo, hi) has arrived yet (a partial sum covering it would make it a duplicate)."""
        return all(b <= lo or a >= hi for a, b in self._nodes)

    def add(self, lo: int, hi: int, value: T, own: Callable[[T], T] | None = None) -> None:
        """Take the contribution over [lo, hi). `own` given: `value` is borrowed (memory its sender reuses, read-only):
        it is only read, summed into a waiting sibling's storage (a + b and b + a are the same bits), or, with no
        sibling waiting, kept as `own(value)`, a copy."""
        if not is_subtree(lo, hi, self.M):
            raise ValueError(f"[{lo}, {hi}) is not a node of the reduction tree over {self.M} microbatches")
        if not self.disjoint(lo, hi):
            raise ValueError(f"[{lo}, {hi}) overlaps microbatches already received")
        self.covered += hi - lo
        while True:
            up = parent(lo, hi, self.M)
            if up is None:
                break
            a, b, mid = up
            sibling = (mid, b) if hi == mid else (a, mid)
            if sibling not in self._nodes:
                break
            other = self._nodes.pop(sibling)
            if own is not None:  # into the sibling's storage: the borrowed value is read, never written
                summed = self._add(other, value)
                value, own = summed, (own if summed is value else None)  # (an overflowed sibling adds nothing)
            else:
                value = self._add(value, other) if lo == a else self._add(other, value)
            lo, hi = a, b
        self._nodes[(lo, hi)] = value if own is None else own(value)

    @property
    def complete(self) -> bool:
        return (0, self.M) in self._nodes

    def partial_sums(self) -> list[T]:
        """What waits now: the contributions and partial sums not yet combined (the root, once complete)."""
        return list(self._nodes.values())

    def result(self) -> T:
        if not self.complete:
            raise RuntimeError(f"{self.covered}/{self.M} microbatches summed")
        return self._nodes[(0, self.M)]
