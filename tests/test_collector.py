"""Leases and tree-ordered summation: bitwise identical sums in any arrival order and any blocking; leases move
on death/expiry (blocks come back as leaves)."""

from __future__ import annotations

import itertools

import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.shared.core.reduction import TreeAccumulator, add_into, block_size


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
            assert c.offer(m, grads(m), float(m), holder=("a", 1)) is None
        mean, loss = c.mean()
        results.add((mean["w"].numpy().tobytes(), mean["b"].numpy().tobytes(), loss))
    assert len(results) == 1
    expected = ((grads(0)["w"] + grads(1)["w"]) + (grads(2)["w"] + grads(3)["w"])) / 4  # the reduction tree
    assert torch.equal(torch.frombuffer(bytearray(results.pop()[0]), dtype=torch.float32), expected)


def test_leases_expire_release_and_duplicates_drop() -> None:
    c = StepCollector(5, 3)
    assert [c.lease("a", 1, now=0, timeout=10), c.lease("b", 1, now=0, timeout=1), c.lease("a", 1, 0, 10)] == [
        (0, 1), (1, 2), (2, 3)]
    assert c.lease("c", 1, 0, 10) is None
    assert c.expire(now=5) == [1]  # b's lease ran out
    assert c.lease("c", 1, 5, 10) == (1, 2)
    assert c.release("a", max_inc=1) == [0, 2]  # a died: its leases go back, in order
    assert list(c.pending) == [(0, 1), (2, 3)]
    assert c.offer(1, grads(1), 0.1, holder=("c", 1)) is None
    assert c.offer(1, grads(1), 0.1, holder=("c", 1)) == "duplicate"
    assert c.offer(7, grads(1), 0.1, holder=("c", 1)) == "bad_microbatch"
    # a's incarnation was released (it died): its late gradient no longer counts, whoever computed it
    assert c.offer(0, grads(0), 0.0, holder=("a", 1)) == "not_leased" and (0, 1) in c.pending
    # b's lease only expired: its late gradient is still the same numbers, first one wins
    assert c.offer(2, grads(2), 0.2, holder=("b", 1)) == "not_leased"  # b was never leased m=2
    assert c.lease("d", 1, 6, 10) == (0, 1) and c.lease("d", 1, 6, 10) == (2, 3)
    assert c.offer(0, grads(0), 0.0, holder=("d", 1)) is None
    assert c.offer(2, grads(2), 0.2, holder=("d", 1)) is None and c.complete


def test_gradients_count_only_from_lease_holders_and_late_ones_still_win() -> None:
    c = StepCollector(0, 2)
    assert c.lease("a", 1, now=0, timeout=1) == (0, 1) and c.lease("b", 1, 0, 10) == (1, 2)
    assert c.offer(0, grads(0), 0.0, holder=("mallory", 9)) == "not_leased"  # injection for someone else's lease
    assert c.offer(0, grads(0), 0.0, holder=("a", 2)) == "not_leased"  # another incarnation of the holder
    assert c.expire(now=5) == [0]
    assert c.offer(0, grads(0), 0.0, holder=("a", 1)) is None  # expired, not fenced: a late gradient still wins
    assert (0, 1) not in c.pending


def test_idle_workers_get_outstanding_leases_again() -> None:
    """A withheld lease costs one recomputation: once it is older than reissue_after, the next idle worker
    gets it too (fewest holders first, then oldest); the first gradient wins, the other is a duplicate."""
    c = StepCollector(0, 3)
    assert [c.lease("hoarder", 1, 0, 100), c.lease("b", 1, 1, 100), c.lease("c", 1, 2, 100)] == [(0, 1), (1, 2),
                                                                                                (2, 3)]
    assert c.lease("b", 1, 2.5, 100, reissue_after=1.0) == (0, 1)  # oldest outstanding, not b's own
    assert c.reissuable(now=2.5, reissue_after=1.0)
    assert c.lease("c", 1, 2.5, 100, reissue_after=1.0) == (1, 2)  # fewest holders first (0 has two now)
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


def block_sum(lo: int, hi: int) -> dict[str, torch.Tensor]:
    """What a worker holding the lease [lo, hi) sends: its microbatches summed by the tree of the node's length."""
    acc = TreeAccumulator(hi - lo, add_into)
    for m in range(lo, hi):
        acc.add(m - lo, m - lo + 1, grads(m))
    return acc.result()


def test_blocks_give_the_bits_of_leaves_whoever_sums_them() -> None:
    """Leases are nodes of the tree: a block summed by a worker is bitwise the node the collector builds from leaves,
    for every M and every block size (1, 2 or 3 workers' shares), in any arrival order."""
    for M in (1, 3, 4, 6, 8):
        want = None
        for W in (1, 2, 3, M):
            b = block_size(M, W)
            c = StepCollector(0, M, block=b)
            nodes = [c.lease("w", 1, 0, 10) for _ in range(len(c.pending))]
            assert all(hi - lo <= b for lo, hi in nodes) and sum(hi - lo for lo, hi in nodes) == M
            for lo, hi in reversed(nodes):
                assert c.offer((lo, hi), block_sum(lo, hi), [float(m) for m in range(lo, hi)], ("w", 1)) is None
            mean, loss = c.mean()
            got = (mean["w"].numpy().tobytes(), mean["b"].numpy().tobytes(), loss)
            assert want is None or got == want, (M, W)
            want = got


def test_block_size_policy() -> None:
    assert [block_size(8, w) for w in (1, 2, 3, 4, 8, 9)] == [8, 4, 2, 2, 1, 1]
    assert [len(list(StepCollector(0, 8, block=block_size(8, w)).pending)) for w in (1, 2, 3)] == [1, 2, 4]
    assert list(StepCollector(0, 6, block=4).pending) == [(0, 4), (4, 6)]


def test_a_lost_block_comes_back_as_leaves_and_the_first_complete_copy_wins() -> None:
    c = StepCollector(0, 8, block=4)
    assert c.lease("a", 1, now=0, timeout=1) == (0, 4) and c.lease("b", 1, 0, 10) == (4, 8)
    assert c.leases[(0, 4)].deadline == 4  # a lease's timeout scales with its size
    assert c.expire(now=5) == [0, 1, 2, 3]  # a is slow: its block goes back split into leaves
    assert list(c.pending) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert c.lease("b", 1, 5, 10) == (0, 1)
    assert c.offer((0, 1), grads(0), 0.0, ("b", 1)) is None
    assert c.offer((0, 4), block_sum(0, 4), [0.0] * 4, ("a", 1)) == "duplicate"  # overlaps a leaf received
    assert c.offer((2, 4), block_sum(2, 4), [0.0] * 2, ("a", 1)) == "not_leased"  # a node nobody leased
    assert c.offer((1, 3), block_sum(1, 3), [0.0] * 2, ("a", 1)) == "bad_microbatch"  # not a node of the tree
    c2 = StepCollector(0, 8, block=4)
    c2.lease("a", 1, 0, 1), c2.lease("b", 1, 0, 10)
    c2.expire(now=5)
    assert c2.lease("c", 1, 5, 10) == (0, 1)
    assert c2.offer((0, 4), block_sum(0, 4), [0.0] * 4, ("a", 1)) is None  # expired, not fenced: late a still wins
    assert list(c2.pending) == [] and (0, 1) not in c2.leases  # its leaves are no longer wanted from anyone
    assert c2.offer((0, 1), grads(0), 0.0, ("c", 1)) == "duplicate"
    assert c2.offer((4, 8), block_sum(4, 8), [0.0] * 3, ("b", 1)) == "bad_losses"
    assert c2.offer((4, 8), block_sum(4, 8), [0.0] * 4, ("b", 1)) is None and c2.complete
    c3 = StepCollector(0, 8, block=4)
    c3.lease("a", 1, 0, 10), c3.lease("b", 1, 0, 10)
    assert c3.release("a", max_inc=1) == [0, 1, 2, 3]  # a died: leaves, and its block no longer counts
    assert c3.offer((0, 4), block_sum(0, 4), [0.0] * 4, ("a", 1)) == "not_leased"


def test_an_idle_worker_gets_a_withheld_block_after_its_size_times_the_reissue_time() -> None:
    c = StepCollector(0, 8, block=4)
    assert c.lease("hoarder", 1, 0, 100) == (0, 4) and c.lease("b", 1, 0, 100) == (4, 8)
    assert c.offer((4, 8), block_sum(4, 8), [0.0] * 4, ("b", 1)) is None
    assert c.lease("b", 1, 3.9, 100, reissue_after=1.0) is None  # 4 microbatches: 4 × 1 s
    assert c.lease("b", 1, 4.0, 100, reissue_after=1.0) == (0, 4)
    assert c.offer((0, 4), block_sum(0, 4), [0.0] * 4, ("b", 1)) is None and c.complete


def test_microbatches_another_shard_lacks_are_leased_again_as_leaves_after_a_grace() -> None:
    """Sharded: a worker sends every shard its slice at once. The leader holds the block [0, 4) while shard k kept
    leaf 0 from someone else and never got 1..3 (or the block's worker died between its sends)."""
    c = StepCollector(0, 8, block=4)
    assert c.lease("a", 1, now=0, timeout=10) == (0, 4) and c.lease("b", 1, 0, 10) == (4, 8)
    assert c.reopen([0], now=0, grace=2) == []  # incomplete here: nothing to say yet
    assert c.offer((0, 4), grads(0), [0.0] * 4, holder=("a", 1)) is None
    assert c.offer((4, 8), grads(4), [0.0] * 4, holder=("b", 1)) is None and c.complete
    assert c.reopen([0, 4, 5, 6, 7], now=10, grace=2) == []  # first seen lacking: maybe still on its way
    assert c.reopen([0, 4, 5, 6, 7], now=11, grace=2) == [] and not c.pending
    assert c.reopen([0, 4, 5, 6, 7], now=12, grace=2) == [1, 2, 3]
    assert [c.lease("c", 1, 12, 10) for _ in range(4)] == [(1, 2), (2, 3), (3, 4), None]
    assert c.offer(1, grads(1), 0.0, holder=("c", 1)) == "duplicate"  # the leader keeps its first copy
    assert c.reopen([0, 1, 4, 5, 6, 7], now=13, grace=2) == []  # 2, 3 were re-queued at 12: leased, not lost yet
    assert c.reopen([0, 1, 2, 4, 5, 6, 7], now=14, grace=2) == [3]  # still lacking 2 s later: out again
    assert c.reopen(list(range(8)), now=20, grace=2) == [] and c.complete
    mean, _ = c.mean()  # the leader's own sum never changed
    assert torch.equal(mean["w"], (grads(0)["w"] + grads(4)["w"]) / 8)


def test_a_restarted_shard_gets_what_it_lacks_of_what_is_here_at_once_even_before_this_step_is_complete() -> None:
    """A restarted shard incarnation lost every slice of the step (leader/roster.py `have`): `early`, what the leader
    holds and it lacks goes out again at once and at each report while it lacks it (grace 0), complete here or not;
    what the leader does not hold yet is still leased (its slice goes to the new shard with the leader's)."""
    c = StepCollector(0, 8, block=4)
    assert c.lease("a", 1, now=0, timeout=10) == (0, 4) and c.lease("b", 1, 0, 10) == (4, 8)
    assert c.offer((0, 4), grads(0), [0.0] * 4, holder=("a", 1)) is None and not c.complete
    assert c.reopen([], now=1, grace=0, early=True) == [0, 1, 2, 3]  # before issue 47's fix: [] until complete
    assert [c.lease("c", 1, 1, 10) for _ in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 4), None]
    assert c.reopen([0, 1], now=1.5, grace=0, early=True) == [2, 3]  # their slices went to its dead address
    assert c.offer((4, 8), grads(4), [0.0] * 4, holder=("b", 1)) is None and c.complete
    assert c.reopen([0, 1, 2, 3], now=2, grace=0, early=True) == [4, 5, 6, 7]
    mean, _ = c.mean()
    assert torch.equal(mean["w"], (grads(0)["w"] + grads(4)["w"]) / 8)


def test_spares_are_reused_only_after_reclaim_and_bounded():
    from cmemi.services.aggregator.common.gradients import Spares
    spares = Spares(limit=1 << 20)
    g = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    a = spares.own(g)
    assert all(torch.equal(a[n], g[n]) and a[n].data_ptr() != g[n].data_ptr() for n in g)
    b = spares.own(g)  # the first is still lent: a second buffer
    assert a["w"].data_ptr() != b["w"].data_ptr()
    spares.reclaim()
    c = spares.own({"w": torch.zeros(2, 3), "b": torch.zeros(2)})
    assert c["w"].data_ptr() in (a["w"].data_ptr(), b["w"].data_ptr()) and torch.equal(c["w"], torch.zeros(2, 3))
    assert spares.own({"w": torch.zeros(4)})["w"].shape == (4,)  # another shape: a new buffer
    # a transfer still arriving keeps its buffers through a reclaim; what the step did not use goes
    metas = [{"name": "w", "dtype": "float32", "shape": [2, 3], "nbytes": 24, "xxh": None}]
    arriving = spares.lend(metas)["w"]
    spares.reclaim(busy=[arriving])
    assert all(spares.lend(metas)["w"] is not arriving for _ in range(3))
    assert sum(len(v) for v in spares.free.values()) <= 3
    # past the limit, buffers are plain allocations, not kept
    small = Spares(limit=24)
    small.lend(metas)
    small.lend(metas)
    assert len(small.lent) == 1


def test_a_gradient_no_sum_keeps_is_lent_again_in_its_step():
    """A duplicate (a lease handed out again) or the right operand of an add gives its spares back for the step's next
    gradient: a step of two leaves and a duplicate lands in two buffers, not three, and both stay kept."""
    from cmemi.services.aggregator.common.gradients import Spares
    metas = [{"name": "w", "dtype": "float32", "shape": [2, 3], "nbytes": 24, "xxh": None}]
    spares = Spares(limit=3 * 24)
    c = StepCollector(0, 2, leased=False)
    first = spares.lend(metas)
    first["w"].fill_(1.0)
    assert c.offer(0, first, 0.0, holder=None) is None
    spares.give_back(c.holds())
    assert spares.lent_bytes == 24  # the waiting leaf keeps its buffer
    dup = spares.lend(metas)
    dup["w"].fill_(7.0)
    assert c.offer(0, dup, 0.0, holder=None) == "duplicate"
    spares.give_back(c.holds())
    assert spares.lent_bytes == 24  # the duplicate's buffer is free again...
    second = spares.lend(metas)
    assert second["w"].data_ptr() == dup["w"].data_ptr()  # ...and the step's last gradient lands in it
    second["w"].fill_(2.0)
    arriving = spares.lend(metas)  # (a transfer of the next gradient, still arriving: kept lent)
    assert c.offer(1, second, 0.0, holder=None) is None and c.complete
    spares.give_back([*c.holds(), *arriving.values()])
    assert [t.data_ptr() for _, t in spares.lent] == [first["w"].data_ptr(), arriving["w"].data_ptr()]
    mean, _ = c.mean()
    assert torch.equal(mean["w"], torch.full((2, 3), 1.5)) and mean["w"].data_ptr() == first["w"].data_ptr()
    spares.reclaim(busy=list(arriving.values()))  # the buffer given back mid-step was used: it stays kept
    assert sum(len(v) for v in spares.free.values()) == 2 and spares.lent_bytes == 24
    spares.reclaim()  # a step that lent nothing but the transfer that was arriving: the others go
    assert [t.data_ptr() for v in spares.free.values() for t in v] == [arriving["w"].data_ptr()]


def test_a_decoded_view_of_a_spare_keeps_it_lent():
    from cmemi.services.aggregator.common.gradients import Spares
    spares = Spares(limit=1 << 20)
    lent = spares.lend([{"name": "w", "dtype": "float32", "shape": [6], "nbytes": 24, "xxh": None}])["w"]
    spares.give_back([lent.view(2, 3)])  # the same bytes under another tensor object
    assert spares.lent_bytes == 24 and not spares.free
