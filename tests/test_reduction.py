"""The reduction tree: one bracketing, whatever the arrival order or block structure."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from cmemi.shared.core.reduction import TreeAccumulator, blocks, is_subtree, split, tree_reduce


def test_tree_shape_for_six():
    assert tree_reduce(list("abcdef"), lambda a, b: f"({a}{b})") == "(((ab)(cd))(ef))"
    assert split(0, 6) == 4 and split(4, 6) == 5 and split(0, 8) == 4 and split(0, 5) == 4


@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 8, 13])
def test_aligned_power_of_two_blocks_are_subtrees(M):
    for j in range(5):
        size = 1 << j
        for lo in range(0, M, size):
            assert is_subtree(lo, lo + size, M) == (lo + size <= M)
    assert list(itertools.chain.from_iterable(range(a, b) for a, b in blocks(M, 2))) == list(range(M))


def _grads(M, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(M)]


@pytest.mark.parametrize("M", [3, 6, 8, 11])
def test_accumulator_is_bitwise_the_tree_in_any_order_and_blocking(M):
    grads = _grads(M)
    expected = tree_reduce([g.clone() for g in grads], lambda a, b: a.add_(b))
    rng = random.Random(M)
    for size in (1, 2, 4):
        for _ in range(5):
            parts = list(blocks(M, size))
            rng.shuffle(parts)
            acc = TreeAccumulator(M, lambda a, b: a.add_(b))
            for lo, hi in parts:  # a worker sums its block alone, in tree order
                acc.add(lo, hi, tree_reduce([g.clone() for g in grads[lo:hi]], lambda a, b: a.add_(b)))
            assert torch.equal(acc.result(), expected)
    in_m_order = grads[0].clone()
    for g in grads[1:]:
        in_m_order += g
    assert not torch.equal(in_m_order, expected) or M <= 3  # the bracketing matters (M <= 3: it is m order)


@pytest.mark.parametrize("M", [2, 6, 8])
def test_borrowed_contributions_are_only_read_and_give_the_same_bits(M):
    """A borrowed contribution (a shared-memory slot's views: services/aggregator/common/intake.py) is summed into a waiting
    sibling's storage or copied by `own`, never written; the sum is bitwise the owned path's in any order."""
    grads = _grads(M)
    expected = tree_reduce([g.clone() for g in grads], lambda a, b: a.add_(b))
    rng = random.Random(M)
    for _ in range(6):
        order = list(range(M))
        rng.shuffle(order)
        lent = {m: grads[m].clone() for m in order if rng.random() < 0.6}  # the rest come owned
        before = {m: t.clone() for m, t in lent.items()}
        owned: list[int] = []

        def own(t, owned=owned):
            owned.append(1)
            return t.clone()

        acc = TreeAccumulator(M, lambda a, b: a.add_(b))
        for m in order:
            acc.add(m, m + 1, lent[m], own) if m in lent else acc.add(m, m + 1, grads[m].clone())
        assert torch.equal(acc.result(), expected)
        assert all(torch.equal(lent[m], before[m]) for m in lent)  # read, never written
        assert len(owned) <= len(lent)
        assert all(acc.result() is not t for t in lent.values())


def test_a_borrowed_contribution_beside_an_overflowed_sibling_is_still_copied():
    acc = TreeAccumulator(2, lambda a, b: (a.update({k: v + b[k] for k, v in a.items()}) or a) if a and b else a or b)
    acc.add(0, 1, {})  # fp16 overflow: no tensors
    lent = {"w": torch.ones(3)}
    acc.add(1, 2, lent, lambda t: {k: v.clone() for k, v in t.items()})
    assert acc.result() is not lent and torch.equal(acc.result()["w"], lent["w"])


def test_overlapping_or_misaligned_contributions_are_refused():
    acc = TreeAccumulator(8, lambda a, b: a + b)
    acc.add(0, 1, 1.0)
    assert not acc.disjoint(0, 2)
    with pytest.raises(ValueError, match="overlaps"):
        acc.add(0, 2, 2.0)
    with pytest.raises(ValueError, match="not a node"):
        acc.add(1, 3, 2.0)
    for m in range(1, 8):
        acc.add(m, m + 1, 1.0)
    assert acc.complete and acc.result() == 8.0
