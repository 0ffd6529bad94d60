"""Leases and tree-ordered summation: bitwise identical sums in any arrival order; leases move on death/expiry."""

from __future__ import annotations

import itertools

import torch
from cmemi.services.aggregator.collector import StepCollector


def grads(m: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return {"w": torch.randn(50, generator=g) * 10 ** (m % 3), "b": torch.randn(3, generator=g)}


def test_sum_is_bitwise_identical_for_every_arrival_order() -> None:
    results = set()
    for order in itertools.permutations(range(4)):
        c = StepCollector(0, 4)
        for m in order:
            assert c.offer(m, grads(m), loss=float(m)) is None
        mean, loss = c.mean()
        results.add((mean["w"].numpy().tobytes(), mean["b"].numpy().tobytes(), loss))
    assert len(results) == 1
    expected = ((grads(0)["w"] + grads(1)["w"]) + (grads(2)["w"] + grads(3)["w"])) / 4  # the reduction tree
    assert torch.equal(torch.frombuffer(bytearray(results.pop()[0]), dtype=torch.float32), expected)


def test_leases_expire_release_and_duplicates_drop() -> None:
    c = StepCollector(5, 3)
    assert [c.lease("a", 1, now=0, timeout=10), c.lease("b", 1, now=0, timeout=1), c.lease("a", 1, 0, 10)] == [0, 1, 2]
    assert c.lease("c", 1, 0, 10) is None
    assert c.expire(now=5) == [1]  # b's lease ran out
    assert c.lease("c", 1, 5, 10) == 1
    assert c.release("a", max_inc=1) == [0, 2]  # a died: its leases go back, in order
    assert list(c.pending) == [0, 2]
    assert c.offer(1, grads(1), 0.1) is None
    assert c.offer(1, grads(1), 0.1) == "duplicate"
    assert c.offer(7, grads(1), 0.1) == "bad_microbatch"
    # a late gradient from a worker whose lease moved on is still the same numbers: first one wins
    assert c.offer(0, grads(0), 0.0) is None and 0 not in c.pending
    assert c.offer(2, grads(2), 0.2) is None and c.complete


def test_release_respects_incarnation() -> None:
    c = StepCollector(0, 2)
    c.lease("a", 5, 0, 10)
    assert c.release("a", max_inc=4) == []  # only older incarnations were fenced
    assert c.release("a", max_inc=5) == [0]
