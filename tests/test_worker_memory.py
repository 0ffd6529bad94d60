"""What a worker keeps between and within blocks (issue 34, docs/memory_accounting.md §3): no gradient left in the
model after a microbatch, gradients folded into the block's sum as backward produces them (the same bits as summing
whole gradients, tied, frozen and unused parameters included), parameters landing straight in the model's pieces
from the leader and from shard k, a slice of another version never landing there, and no received slice kept.
Fast: in process, one pair of real sockets."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import zmq
from cmemi.services.worker.compute.block import FOLD_MIN_BYTES, BlockComputer
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.links.inbox import Inbox
from cmemi.services.worker.links.shard_links import Link, Lost, ShardLinks
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.core.grid import Partition
from cmemi.shared.core.reduction import TreeAccumulator, add_into
from cmemi.shared.wire import assembly, layout, limits, transfer
from torch.utils.checkpoint import checkpoint

from tests.conftest import DIGITS
from tests.helpers.sockets import joined_pair

CFG = load_config(DIGITS, ["run.name=memory", "train.global_batch=32", "train.microbatches=4"])
RUN = CFG.run.name


class Tied(torch.nn.Module):
    """`b` is used twice (tied), `frozen` needs no gradient, `unused` gets none; `reentrant`: `b` also runs inside a
    reentrant checkpoint, so its gradient is accumulated twice in one backward pass."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = torch.nn.Linear(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 10)
        self.frozen, self.unused = torch.nn.Linear(32, 32).requires_grad_(False), torch.nn.Linear(3, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = checkpoint(self.b, h, use_reentrant=True) if self.reentrant else self.b(h)
        return self.head(self.b(torch.relu(h)) + self.frozen(h))


def runner(model: torch.nn.Module) -> MicrobatchRunner:
    data = resolve(CFG.data.factory, "data.factory")(**CFG.data.kwargs)
    return MicrobatchRunner(CFG, model, data, torch.nn.functional.cross_entropy)


def whole_gradients_summed(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """The reference's sum (cmemi/commands/reference.py offer_block): whole gradients, one dict per microbatch, by the tree."""
    r, tree = runner(model), TreeAccumulator(4, add_into)
    for m in range(4):
        tree.add(m, m + 1, r.run(step, m)[1])
    return tree.result()


@pytest.mark.parametrize("reentrant", [False, True], ids=["tied", "accumulated-twice"])
def test_a_block_folds_each_gradient_as_it_appears_with_the_bits_of_whole_gradients(reentrant: bool) -> None:
    expected = whole_gradients_summed(Tied(reentrant), step=3)
    r = runner(Tied(reentrant))
    logged: list[str] = []
    block = BlockComputer(CFG, r, SimpleNamespace(info=lambda event, **_: logged.append(event)),
                          lambda message: pytest.fail(message), lambda: "w0")
    block.fold = True  # (a model this small folds only when told: block.py FOLD_MIN_BYTES)
    losses, total, _, finite = block.block(3, 0, 4, 1.0)
    assert finite and len(losses) == 4
    assert total.keys() == expected.keys() == {n for n, p in r.model.named_parameters() if p.requires_grad}
    for n, g in expected.items():
        assert torch.equal(total[n].view(torch.int32), g.view(torch.int32)), n
    assert all(p.grad is None for p in r.model.parameters()), "a gradient left in the model after the block"
    if reentrant:  # the first part of b's gradient was taken as final: the block was summed again, whole
        assert r.twice and logged
    else:  # folded as backward went: only the unused layer's zeros came back whole from the last microbatch
        assert not r.twice and not logged and r.taken == {"a.weight", "a.bias", "b.weight", "b.bias", "head.weight",
                                                          "head.bias"}


def test_a_small_models_block_sums_whole_gradients_with_no_hook() -> None:
    """Below FOLD_MIN_BYTES a block does not fold: no hook is registered (none runs per parameter per backward), and
    the sum has the same bits."""
    expected = whole_gradients_summed(Tied(), step=3)
    r = runner(Tied())
    block = BlockComputer(CFG, r, SimpleNamespace(info=lambda event, **_: pytest.fail(event)),
                          lambda message: pytest.fail(message), lambda: "w0")
    assert not block.fold and limits.nbytes(r.params.values()) < FOLD_MIN_BYTES
    _, total, _, finite = block.block(3, 0, 4, 1.0)
    assert finite and total.keys() == expected.keys()
    for n, g in expected.items():
        assert torch.equal(total[n].view(torch.int32), g.view(torch.int32)), n
    assert not r.hooked and not r.taken and all(p.grad is None for p in r.model.parameters())
    assert all(not p._post_accumulate_grad_hooks for p in r.params.values()), "a hook registered"


def test_a_microbatch_leaves_no_gradient_in_the_model() -> None:
    r = runner(Tied())
    _, grads, _ = r.run(0, 1)
    assert grads.keys() >= {"b.weight", "unused.weight"} and not r.taken
    assert all(p.grad is None for p in r.model.parameters()), "the gradient handed out is still held by the model"


def test_the_leaders_slice_lands_in_the_models_own_pieces_at_any_shard_count(monkeypatch) -> None:
    monkeypatch.setattr(layout, "FLAT_MAX_BYTES", 0)  # a big model's layout: one frame per piece
    params = {"w": torch.zeros(300, 600), "b": torch.zeros(7)}
    for shards in (1, 2):
        partition = Partition(params, shards)
        assert partition.split
        inbox = Inbox(partition, params, {}, torch.device("cpu"))
        pieces = partition.views(params, 0)
        assert inbox.bound and inbox.tensors.keys() == pieces.keys()
        for n, piece in pieces.items():  # the same bytes: what lands there is in the model, no second copy
            assert inbox.tensors[n].data_ptr() == piece.data_ptr() and inbox.tensors[n].shape == piece.shape


class Shard:
    """Shard 1 of 2, seen from a worker: one link over a real socket pair, its slices sent by hand."""

    def __init__(self, monkeypatch) -> None:
        monkeypatch.setattr(layout, "FLAT_MAX_BYTES", 0)
        self.params = {"w": torch.zeros(300, 600), "b": torch.zeros(7)}
        self.partition = Partition(self.params, 2)
        self.zctx = zmq.Context()
        # a ROUTER drops messages to a peer it has not heard from yet: the DEALER says hello first
        self.router, dealer, hello = joined_pair(self.zctx, b"", identity=b"w0")
        assert hello == [b"w0", b""]
        fatal = lambda message: pytest.fail(message)  # noqa: E731
        ctx = SimpleNamespace(run=RUN, stopping=threading.Event(), fatal=fatal)
        self.links = ShardLinks(ctx, CFG, self.partition, self.params, lambda: {"wid": "w0", "inc": 1},
                                lambda sock, addr, peer: "tcp")  # not used: the link is made here
        views = self.partition.views(self.params, 1)
        staged = [{n: views[n] for n in names} for names in self.partition.staged(1)]
        self.link = Link(1, dealer, [layout.Layout(s) for s in staged], assembly.Assembler(RUN, 1 << 30), staged)
        self.links.links = [self.link]
        self.views = staged[0]
        self.link.asked = 4  # asked ahead: no pull goes out

    def slice(self, version: int, parts: int | None = None) -> dict[str, torch.Tensor]:
        """Send the slice of `version` (every element = version) in parts; only the first `parts` of them if given."""
        tensors = {n: torch.full_like(v, float(version)) for n, v in self.views.items()}
        msgs = transfer.messages("slice", RUN, {"version": version, "asked": version, "shard": 1}, 1 << 16, tensors)
        assert len(msgs) > 2
        for m in msgs[:parts]:
            self.router.send_multipart([b"w0", *m])
        return tensors

    def model(self) -> set[float]:
        return {float(x) for v in self.views.values() for x in v.unique()}

    def close(self) -> None:
        self.links.close()
        self.router.close(linger=0)
        self.zctx.term()


def test_a_shards_slice_lands_in_the_model_only_for_the_version_fetched_and_none_is_kept(monkeypatch) -> None:
    shard = Shard(monkeypatch)
    try:
        link, consumed = shard.link, []
        keep = link.consumed
        link.consumed = lambda: (consumed.append(list(link.got)), keep())  # type: ignore[method-assign]
        shard.slice(4)
        assert shard.links.fetch(4) and link.have == 4 and shard.model() == {4.0}
        assert all(consumed[-1][0].tensors[n] is v for n, v in shard.views.items()), "not landed in place"
        assert link.got == [None], "the slice received is still referenced after it was copied"
        # an answer to a pull of 5, arriving while version 4 is in use (no fetch of 5): not in the model
        link.asked = 5
        shard.slice(5)
        shard.links._wait(lambda: link.got[0] is not None, lambda _l, _m: None)
        assert shard.model() == {4.0} and link.have == 4
        assert shard.links.fetch(5) and shard.model() == {5.0} and link.got == [None]
        # fetching 6, the answer to a pull of 7 comes first, then "6 is over": 7 must not land in the model
        link.asked = 6
        shard.slice(7)
        shard.router.send_multipart([b"w0", *transfer.messages("slice", RUN, {"version": 7, "asked": 6, "shard": 1},
                                                                1 << 16, {})[0]])
        assert not shard.links.fetch(6) and shard.model() == {5.0} and link.have == 5
    finally:
        shard.close()


def test_a_slice_cut_off_midway_leaves_the_model_marked_as_no_version(monkeypatch) -> None:
    """The shard dies after the first parts of version 5's slice: half the model's pieces of shard 1 are 5, the rest
    still 4. The link must not say it holds 4 (a lease of 4 would be computed on both)."""
    shard = Shard(monkeypatch)
    try:
        shard.slice(4)
        assert shard.links.fetch(4)
        shard.link.asked = 5
        shard.slice(5, parts=1)
        shard.links.timeout = 0.5
        with pytest.raises(Lost):
            shard.links.fetch(5)
        assert shard.model() == {4.0, 5.0} and shard.link.have == -1
    finally:
        shard.close()
