"""The leader's side of sharding, split by job: who the shards of this term are and the step barrier
(services/aggregator/leader/roster.py: `ShardRoster`), and the slices they send, placed into the whole model
(shard_slices.py: `ShardSlices`). Real rosters and partitions of a real model; the outbox records what is sent and
the context what is emitted (the socket and Redis sides are test_leader_units.py's and test_shards.py's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cmemi.services.aggregator.leader.roster import ShardRoster
from cmemi.services.aggregator.leader.shard_slices import ShardSlices
from cmemi.shared.core.grid import Partition
from cmemi.shared.runtime.exits import Exit
from torch import nn

TERM = 3


class Sent:
    """An outbox that keeps (identity, type, fields) of every send."""

    def __init__(self) -> None:
        self.log: list[tuple[bytes, str, dict[str, Any]]] = []

    def send(self, identity: bytes, mtype: str, encoded: Any = None, **fields: Any) -> int:
        self.log.append((identity, mtype, fields))
        return 0


class Fatal(Exception):
    pass


def context() -> SimpleNamespace:
    """What the roster uses of a ServiceContext: emit (recorded), log, fatal (raised)."""
    def fatal(msg: str) -> None:
        raise Fatal(msg)
    emitted: list[str] = []
    log = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    return SimpleNamespace(emitted=emitted, emit=lambda event, **kw: emitted.append(event), log=log, fatal=fatal)


def model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).named_parameters()}


def roster(shards: int = 3) -> tuple[ShardRoster, Sent, list[tuple[str, str]], Partition]:
    sent, drops = Sent(), []  # (reason, detail) of each drop
    partition = Partition(model(), shards=shards)
    r = ShardRoster(context(), partition, TERM, sent, lambda reason, detail: drops.append((reason, detail)),
                    lambda: {"lease_key": b"k", "fp": {"sha256": "x"}})
    return r, sent, drops, partition


def placed(partition: Partition, into: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> bool:
    """Shards 1 and 2's pieces are the model's, and the leader's own (shard 0's) untouched: zero."""
    theirs = [torch.equal(v, partition.views(whole, k)[n]) for k in (1, 2) for n, v in partition.views(into, k).items()]
    ours = [not v.any() for v in partition.views(into, 0).values()]
    return bool(theirs) and all(theirs) and all(ours)


def join(r: ShardRoster, k: int, inc: int = 1, step: int = 0, term: int = TERM) -> bool:
    return r.join(f"s{k}".encode(), {"shard": k, "term": term, "inc": inc, "step": step, "addr": f"tcp://s{k}"}, step=0)


def test_workers_wait_until_every_shard_joined_this_term() -> None:
    r, sent, drops, _ = roster(shards=3)
    assert not join(r, 1) and not r.complete
    assert not join(r, 1)  # said again (a slow link): welcomed again, still one shard
    assert not join(r, 5) and drops[-1][0] == "stale_shard"  # no shard 5 of 3
    assert not join(r, 2, term=TERM - 1) and drops[-1][0] == "stale_shard"
    assert join(r, 2) and r.complete and r.addrs() == ["tcp://s1", "tcp://s2"]
    assert [m for _, m, _ in sent.log] == ["shard_welcome", "shard_welcome", "reject", "reject", "shard_welcome"]
    assert r.is_shard(b"s1") and not r.is_shard(b"w0")


def test_a_shard_that_restarted_within_the_term_rolls_the_cluster_back() -> None:
    r, _, _, _ = roster()
    join(r, 1)
    with pytest.raises(SystemExit) as exc:
        join(r, 1, inc=2)  # a new incarnation of a joined shard
    assert exc.value.code == Exit.REJOIN and r.ctx.emitted == ["shard_restarted"]


def test_the_step_is_committed_once_every_shard_reported_it() -> None:
    r, sent, drops, _ = roster(shards=3)
    join(r, 1), join(r, 2)

    def ready(k: int, step: int, partials: list[Any], overflow: bool = False, inc: int = 1, now: int = 5) -> bool:
        return r.ready(f"s{k}".encode(), {"shard": k, "inc": inc, "term": TERM, "step": step, "partials": partials,
                                          "overflow": overflow}, step=now)

    assert ready(1, 5, [1.0, 2.0]) and r.others_ready(5) is None  # shard 2's share is missing
    assert not ready(2, 5, ["x"]) and drops[-1][0] == "bad_partials"
    assert not ready(2, 5, [3.0], inc=9) and drops[-1][0] == "unknown_shard"
    assert ready(2, 5, [3.0], overflow=True)
    assert r.others_ready(5) == ([1.0, 2.0, 3.0], True) and r.others_ready(6) is None
    r.commit(step=5, skip=True)
    commits = [(i, f) for i, m, f in sent.log if m == "shard_commit"]
    assert [i for i, _ in commits] == [b"s1", b"s2"] and commits[0][1] == {"term": TERM, "step": 5, "skip": True}
    n = len(sent.log)
    assert not ready(1, 5, [1.0], now=6)  # step 5 is applied: its commit was lost on the way, so it goes again
    assert sent.log[n:] == [(b"s1", "shard_commit", {"term": TERM, "step": 5, "skip": True})]
    assert not ready(1, 4, [1.0], now=6) and len(sent.log) == n + 1  # an older one: nothing left to send


def test_a_shard_that_lacks_microbatches_reopens_them() -> None:
    from cmemi.services.aggregator.common.collector import StepCollector

    r, _, drops, _ = roster(shards=2)
    join(r, 1)
    collector = StepCollector(step=0, microbatches=4)
    h = {"shard": 1, "inc": 1, "term": TERM, "step": 0}
    assert not r.have(b"s1", {**h, "have": ["a"]}, collector, grace=0.0) and drops[-1][0] == "bad_have"
    assert not r.have(b"s1", {**h, "step": 1, "have": []}, collector, grace=0.0)  # another step: nothing to say


def test_every_shards_slice_is_placed_where_the_partition_puts_it() -> None:
    r, _, _, partition = roster(shards=3)
    join(r, 1), join(r, 2)
    slices, whole = ShardSlices(r), model()
    shapes = {n: t.shape for n, t in whole.items()}
    for k in (1, 2):
        h = {"shard": k, "inc": 1, "term": TERM, "step": 7, "mirror": None, "bytes_in": 10 * k, "bytes_out": k,
             "drops": {"stale_step": k, "junk": "x"}, "slot_in": 5}
        slices.final(f"s{k}".encode(), h, {n: v.clone() for n, v in partition.views(whole, k).items()}, step=7)
    got = slices.gather(shapes, pump=lambda: pytest.fail("every slice is here: nothing to wait for"))
    into = {n: torch.zeros(s) for n, s in shapes.items()}
    for k, pieces in got.items():
        slices.place(k, pieces, into)
    assert placed(partition, into, whole)
    assert slices.total("bytes_sent") == 30 and slices.total("bytes_sent_via_slots") == 10
    assert slices.summary()[1] == {"shard": 2, "bytes_sent": 20, "bytes_received": 2, "bytes_sent_via_slots": 5,
                                   "dropped_messages": {"stale_step": 2}}


def test_an_evaluation_waits_for_every_shards_pieces_of_that_step() -> None:
    r, _, drops, partition = roster(shards=3)
    join(r, 1), join(r, 2)
    slices, whole = ShardSlices(r), model()
    weights = {n: torch.zeros_like(t) for n, t in whole.items()}
    h = {"inc": 1, "term": TERM, "step": 4}
    slices.eval_pieces(b"s1", {**h, "shard": 1}, partition.views(whole, 1))
    slices.eval_pieces(b"s2", {**h, "shard": 2, "inc": 2}, partition.views(whole, 2))  # not shard 2's incarnation
    assert drops[-1][0] == "unknown_shard" and not slices.place_eval(4, weights)
    slices.eval_pieces(b"s2", {**h, "shard": 2}, partition.views(whole, 2))
    assert not slices.place_eval(5, weights) and slices.place_eval(4, weights)
    assert placed(partition, weights, whole)


def test_a_slice_that_does_not_fit_the_model_stops_the_run_naming_the_fix() -> None:
    r, _, _, partition = roster(shards=2)
    join(r, 1)
    pieces = {n: torch.zeros(3) for n in partition.views(model(), 1)}
    with pytest.raises(Fatal, match="model.factory, model.kwargs and cluster.shards"):
        ShardSlices(r).place(1, pieces, model())


def test_a_shard_whose_link_was_dialled_again_is_answered_on_the_new_connection() -> None:
    """Issue 47's stall (tests/test_partitions.py, shard 1 cut from the leader): the link comes back under a new
    identity. The one-line change that makes it fail: test `info.identity != identity` in `member` again."""
    r, sent, drops, _ = roster(shards=2)
    join(r, 1)
    r.fence("w0", 2)
    h = {"shard": 1, "inc": 1, "term": TERM, "step": 5, "partials": [1.0], "overflow": False}
    n = len(sent.log)
    assert r.ready(b"s1-again", h, step=5) and not drops and r.ctx.emitted == ["shard_redialled"]
    assert r.is_shard(b"s1-again") and not r.is_shard(b"s1")
    welcome = {"term": TERM, "lease_key": b"k", "fp": {"sha256": "x"}}
    assert sent.log[n:] == [(b"s1-again", "shard_welcome", welcome),  # what went to the cut connection, again
                            (b"s1-again", "shard_fence", {"term": TERM, "wid": "w0", "inc": 2})]
    r.commit(step=5, skip=False)
    assert sent.log[-1][0] == b"s1-again" and r.others_ready(5) == ([1.0], False)
    assert not r.ready(b"s1-again", {**h, "inc": 2}, step=5) and drops[-1][0] == "unknown_shard"  # not its incarnation
    assert not r.ready(b"s1-again", {**h, "term": TERM + 1}, step=5) and drops[-1][0] == "unknown_shard"
    # its join said again on a third connection (the welcome lost on the second): welcomed there, not a restart
    assert not r.join(b"s1-third", {"shard": 1, "term": TERM, "inc": 1, "step": 0, "addr": "tcp://s1"}, step=5)
    assert sent.log[-2][:2] == (b"s1-third", "shard_welcome") and r.is_shard(b"s1-third")
    assert r.ctx.emitted == ["shard_redialled", "shard_redialled"]


def test_a_dealer_dialled_again_comes_to_the_router_under_a_new_identity() -> None:
    """The mechanism on real sockets: a shard's link to its leader (a DEALER without a routing id, upstream.py)
    that reconnects is a new peer to the leader's ROUTER, and the roster keeps it as the same shard."""
    import zmq

    zctx = zmq.Context()
    router, dealer = zctx.socket(zmq.ROUTER), zctx.socket(zmq.DEALER)
    try:
        router.bind("tcp://127.0.0.1:0")
        addr = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        idents = []
        for _ in range(2):
            dealer.connect(addr)
            dealer.send(b"shard_ready")
            assert router.poll(10_000), "no message within 10 s"
            idents.append(router.recv_multipart()[0])
            dealer.disconnect(addr)  # as a connection given up at the link timeout
        assert idents[0] != idents[1]
        r, _, drops, _ = roster(shards=2)
        r.join(idents[0], {"shard": 1, "term": TERM, "inc": 1, "step": 0, "addr": "tcp://s1"}, step=0)
        h = {"shard": 1, "inc": 1, "term": TERM, "step": 0, "partials": [1.0], "overflow": False}
        assert r.ready(idents[1], h, step=0) and not drops and r.is_shard(idents[1])
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        zctx.term()
