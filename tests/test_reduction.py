"""The reduction tree: one bracketing, whatever the arrival order or block structure."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from cmemi.shared.reduction import TreeAccumulator, blocks, is_subtree, split, tree_reduce


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
