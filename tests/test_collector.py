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
        for _ in range(4):
            c.lease("a", 1, now=0, timeout=10)
        for m in order:
            assert c.offer(m, grads(m), loss=float(m), holder=("a", 1)) is None
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
    assert c.offer(1, grads(1), 0.1, holder=("c", 1)) is None
    assert c.offer(1, grads(1), 0.1, holder=("c", 1)) == "duplicate"
    assert c.offer(7, grads(1), 0.1, holder=("c", 1)) == "bad_microbatch"
    # a's incarnation was released (it died): its late gradient no longer counts, whoever computed it
    assert c.offer(0, grads(0), 0.0, holder=("a", 1)) == "not_leased" and 0 in c.pending
    # b's lease only expired: its late gradient is still the same numbers, first one wins
    assert c.offer(2, grads(2), 0.2, holder=("b", 1)) == "not_leased"  # b was never leased m=2
    assert c.lease("d", 1, 6, 10) == 0 and c.lease("d", 1, 6, 10) == 2
    assert c.offer(0, grads(0), 0.0, holder=("d", 1)) is None
    assert c.offer(2, grads(2), 0.2, holder=("d", 1)) is None and c.complete


def test_gradients_count_only_from_lease_holders_and_late_ones_still_win() -> None:
    c = StepCollector(0, 2)
    assert c.lease("a", 1, now=0, timeout=1) == 0 and c.lease("b", 1, 0, 10) == 1
    assert c.offer(0, grads(0), 0.0, holder=("mallory", 9)) == "not_leased"  # injection for someone else's lease
    assert c.offer(0, grads(0), 0.0, holder=("a", 2)) == "not_leased"  # another incarnation of the holder
    assert c.expire(now=5) == [0]
    assert c.offer(0, grads(0), 0.0, holder=("a", 1)) is None  # expired, not fenced: a late gradient still wins
    assert 0 not in c.pending


def test_idle_workers_get_outstanding_leases_again() -> None:
    """A withheld lease costs one recomputation: once it is older than reissue_after, the next idle worker
    gets it too (fewest holders first, then oldest); the first gradient wins, the other is a duplicate."""
    c = StepCollector(0, 3)
    assert [c.lease("hoarder", 1, 0, 100), c.lease("b", 1, 1, 100), c.lease("c", 1, 2, 100)] == [0, 1, 2]
    assert c.lease("b", 1, 2.5, 100, reissue_after=1.0) == 0  # oldest outstanding, not b's own
    assert c.reissuable(now=2.5, reissue_after=1.0)
    assert c.lease("c", 1, 2.5, 100, reissue_after=1.0) == 1  # fewest holders first (0 has two now)
    assert c.lease("b", 1, 2.5, 100, reissue_after=10.0) is None  # not yet old enough to take again
    assert c.offer(1, grads(1), 0.1, holder=("b", 1)) is None
    assert c.offer(0, grads(0), 0.0, holder=("b", 1)) is None  # the hoarder's lease, computed by b
    assert c.offer(0, grads(0), 0.0, holder=("hoarder", 1)) == "duplicate"
    assert c.offer(2, grads(2), 0.2, holder=("c", 1)) is None and c.complete


def test_release_respects_incarnation() -> None:
    c = StepCollector(0, 2)
    c.lease("a", 5, 0, 10)
    assert c.release("a", max_inc=4) == []  # only older incarnations were fenced
    assert c.release("a", max_inc=5) == [0]
