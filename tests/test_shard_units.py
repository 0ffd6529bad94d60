"""A parameter-server shard k > 0 in-process (services/aggregator/shard/), its loop on a thread of the test, against
a leader and a worker played by real ZeroMQ sockets (tests/helpers/rig.py) and a real Redis: what the shard admits,
which gradients it drops before decoding them, its fatal reject of a worker whose gradients do not fit, and a step
from the first gradient to the leader's commit. The integration suites cannot test the misfit reject at a shard: a
test client never beats the honest worker handed the same lease (tests/test_shard_admission.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from cmemi.services.aggregator.common.admission import LeaseSeal
from cmemi.services.aggregator.shard import checks
from cmemi.services.aggregator.shard.server import ShardServer
from cmemi.services.aggregator.shard.stages import StepStages
from cmemi.services.aggregator.shard.upstream import JOIN_AGAIN_S
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core.environment import environment
from cmemi.shared.core.grid import Partition

from tests.helpers.rig import Peer, context, until

pytestmark = pytest.mark.timeout(120)
TERM, FP = 7, {"length": 1797, "sha256": "digits"}


class ShardRig:
    def __init__(self, tmp_path: Path, redis_url: str) -> None:
        self.ctx = context(tmp_path, redis_url, "cluster.shards=2", "cluster.workers=1", "cluster.spare_workers=0",
                           "checkpoint.every_steps=0", "eval.every_steps=0", name="shardrig")
        self.zctx = zmq.Context()
        sock = self.zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        self.leader = Peer(self.ctx, sock)
        self.ctx.redis.hset(self.ctx.keys.aggregator, mapping={
            "addr": sock.getsockopt_string(zmq.LAST_ENDPOINT), "term": TERM, "restored": -1})
        self.shard = ShardServer(self.ctx, 1)
        self.join = self.leader.expect("shard_join").header
        self.seal = LeaseSeal(os.urandom(32))
        self.thread = threading.Thread(target=self.shard.run, name="shard-1", daemon=True)
        self.thread.start()
        params = dict(build_model(self.ctx.cfg).named_parameters())
        self.pieces = Partition(params, 2).views(params, 1)  # shard 1's pieces, by name
        self.worker: Peer | None = None
        self.sockets = [sock]

    def welcome(self) -> None:
        self.leader.send("shard_welcome", {"term": TERM, "fp": FP, "lease_key": self.seal.key})

    def admitted_worker(self) -> Peer:
        """A worker registered in Redis, said hello (after the leader's welcome), welcomed."""
        self.worker = self.registered_worker()
        hello = {"wid": "w0", "inc": 1, "host": "here", "fp": FP, "env": environment(torch.device("cpu"), self.ctx.cfg)}
        self.worker.send("hello", hello)
        reply = self.worker.expect("welcome", "reject")
        if reply.type == "reject" and "not joined" in reply.header["reason"]:  # the welcome is still on its way
            reply = until(lambda: self._hello(hello), 10, "admitted once the leader's welcome is in")
        assert reply.type == "welcome", reply.header
        return self.worker

    def registered_worker(self) -> Peer:
        """A worker's DEALER to the shard, its incarnation registered in Redis (not admitted yet)."""
        self.ctx.redis.hset(self.ctx.keys.member("worker", "w0"), mapping={"incarnation": "1"})
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.shard.addr)
        self.sockets.append(sock)
        return Peer(self.ctx, sock)

    def _hello(self, hello: dict) -> object:
        assert self.worker is not None
        self.worker.send("hello", hello)
        reply = self.worker.expect("welcome", "reject")
        return reply if reply.type == "welcome" else None

    def grad(self, lo: int, hi: int, encoded: tuple[dict, dict], step: int = 0, lease: bytes | None = None) -> None:
        assert self.worker is not None
        fields = {"wid": "w0", "inc": 1, "term": TERM, "step": step, "version": step, "lo": lo, "hi": hi,
                  "losses": [0.5] * (hi - lo), "n": 16 * (hi - lo), "finite": True, "encode_s": 0.0,
                  "lease": self.seal.seal(TERM, step, lo, hi, "w0", 1) if lease is None else lease,
                  "codec": encoded[0]}
        self.worker.send("grad", fields, encoded[1])

    def drops(self, reason: str) -> int:
        return self.shard.drops.as_dict().get(reason, 0)

    def close(self) -> None:
        self.ctx.stopping.set()
        self.thread.join(timeout=10)
        self.shard.close()
        for sock in self.sockets:
            sock.close(linger=0)
        self.zctx.term()


@pytest.fixture
def rig(tmp_path: Path, redis_server):
    r = ShardRig(tmp_path, redis_server.url)
    try:
        yield r
    finally:
        r.close()


def encoded(pieces: dict[str, torch.Tensor], value: float = 0.0, swap_first_matrix: bool = False) -> tuple:
    """The run's wire encoding of a gradient of `pieces` (all `value`), tensor by tensor; optionally with its first
    matrix that is not square sent with its shape swapped, as another model's or CMEMI version's would be."""
    info, frames = make_codec(context_free_compression(), flat=False).encode(
        {n: torch.full(p.shape, value) for n, p in pieces.items()}, 0)
    if swap_first_matrix:
        first = next(n for n in info if len(info[n]["shape"]) == 2 and len(set(info[n]["shape"])) == 2)
        info[first]["shape"] = info[first]["shape"][::-1]
    return info, frames


def context_free_compression():
    from cmemi.shared.config.loading import load_config

    from tests.conftest import DIGITS

    return load_config(DIGITS).compression


def test_a_shard_joins_its_leaders_term_at_the_step_it_restored(rig: ShardRig) -> None:
    assert (rig.join["shard"], rig.join["term"], rig.join["step"]) == (1, TERM, 0)
    assert rig.join["addr"] == rig.shard.addr


def test_a_shard_says_its_join_again_until_the_leaders_welcome_comes(rig: ShardRig) -> None:
    """A join lost on a cut link (issue 47) must not leave the leader without this shard. The one-line change that
    makes it fail: `join_again` returning at once (services/aggregator/shard/upstream.py)."""
    again = rig.leader.expect("shard_join", timeout=5).header  # the first one went unanswered
    assert (again["step"], again["term"], again["addr"]) == (rig.join["step"], TERM, rig.shard.addr)
    rig.welcome()
    until(lambda: rig.shard.seal is not None, 10, "the welcome taken", lambda: rig.leader.quiet(0.05))
    joins, deadline = 0, time.monotonic() + 3 * JOIN_AGAIN_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            rig.leader.expect("shard_join", timeout=left)
        except AssertionError:
            break
        joins += 1
    assert joins <= 1, f"{joins} joins in {3 * JOIN_AGAIN_S:g} s after the welcome (one may have been on its way)"


def test_a_hello_before_the_leaders_welcome_is_refused_without_stopping_the_worker(rig: ShardRig) -> None:
    worker = rig.registered_worker()
    worker.send("hello", {"wid": "w0", "inc": 1, "host": "here", "fp": FP})
    reply = worker.expect("reject", "welcome")
    assert reply.type == "reject" and not reply.header["fatal"], reply.header
    assert "has not joined its leader's term yet" in reply.header["reason"]


def test_the_third_gradient_in_a_row_that_does_not_fit_gets_a_fatal_reject_naming_the_reason(rig: ShardRig) -> None:
    rig.welcome()
    worker = rig.admitted_worker()
    misfit = encoded(rig.pieces, swap_first_matrix=True)
    for _ in range(2):
        rig.grad(0, 1, misfit)
    until(lambda: rig.drops("codec_bad_shape") == 2, 10, f"two misfits dropped ({rig.shard.drops.as_dict()})",
          lambda: worker.quiet(0.02))
    assert worker.quiet(0.2), "a shard rejected a worker before its third misfit in a row"
    rig.grad(0, 1, misfit)
    reply = worker.expect("reject")
    assert reply.header["fatal"] is True
    assert reply.header["reason"].startswith("parameter-server shard 1 dropped 3 gradients in a row of worker w0 as "
                                             "codec_bad_shape"), reply.header["reason"]


def test_a_gradient_without_the_leaders_seal_is_a_forgery_whatever_its_step(rig: ShardRig) -> None:
    rig.welcome()
    worker = rig.admitted_worker()
    good = encoded(rig.pieces)
    rig.grad(0, 1, good, lease=b"\0" * 16)
    rig.grad(0, 1, good, step=5, lease=b"\0" * 16)  # a stale step too: the seal is checked first
    rig.grad(0, 1, good, step=5)  # sealed, but not this step: stale
    until(lambda: rig.drops("stale_step") == 1, 10, "the stale gradient dropped", lambda: worker.quiet(0.02))
    assert rig.drops("forged_lease") == 2


def test_a_complete_step_is_reported_ready_and_the_leaders_commit_steps_it(rig: ShardRig) -> None:
    rig.welcome()
    worker = rig.admitted_worker()
    before = {n: p.detach().clone() for n, p in rig.shard.trainer.pieces.items()}
    m = rig.ctx.cfg.train.microbatches
    rig.grad(0, m, encoded(rig.pieces, 0.25))  # the whole step's tree in one node
    ready = rig.leader.expect("shard_ready").header
    assert (ready["shard"], ready["step"], ready["overflow"]) == (1, 0, False)
    rig.leader.send("shard_commit", {"term": TERM, "step": 0, "partials": ready["partials"], "skip": False,
                                     "last": False, "snapshot": False})
    worker.send("pull", {"wid": "w0", "inc": 1, "term": TERM, "version": 1})
    got = worker.expect("slice")
    assert got.header["version"] == 1 and got.header["shard"] == 1
    after = rig.shard.trainer.pieces
    assert set(after) == set(before) == set(rig.pieces)
    assert all(not torch.equal(after[n], before[n]) for n in before), "the commit stepped nothing"


def test_the_checks_before_decoding_name_the_first_reason() -> None:
    seal = LeaseSeal(b"k" * 32)
    h = {"wid": "w0", "inc": 1, "step": 3, "version": 3, "lo": 0, "hi": 2, "lease": b"", "stage": 0}  # as decoded
    sealed = {**h, "lease": seal.seal(TERM, 3, 0, 2, "w0", 1)}
    assert checks.refusal(sealed, seal, TERM, 3, 4, 1) is None
    assert checks.refusal(h, seal, TERM, 3, 4, 1) == ("forged_lease", "w0: step 3 microbatches [0, 2)")
    assert checks.refusal(sealed, None, TERM, 3, 4, 1)[0] == "forged_lease"  # no welcome yet: no seal to check
    assert checks.refusal(sealed, seal, TERM, 4, 4, 1) == ("stale_step", "w0: step 3 microbatches [0, 2), current step 4")
    odd = {**h, "lo": 1, "hi": 3, "lease": seal.seal(TERM, 3, 1, 3, "w0", 1)}
    assert checks.refusal(odd, seal, TERM, 3, 4, 1)[0] == "bad_microbatch"  # not a node of the reduction tree
    assert checks.refusal({**sealed, "stage": 2}, seal, TERM, 3, 4, 2)[0] == "bad_stage"
    assert checks.refusal({**sealed, "stage": True}, seal, TERM, 3, 4, 2)[0] == "bad_stage"  # a bool is no stage


def test_step_stages_are_complete_when_every_stage_is_stepped_or_the_mean_is_taken() -> None:
    piped = StepStages([["a"], ["b"]], 2, step=4, pipelined=True)
    assert piped.version == 4 and len(piped) == 2 and not piped.complete
    piped.applied.update({0, 1})
    assert piped.complete and piped.held(0, (0, 1))
    piped.next_step(5)
    assert piped.version == 5 and not piped.applied and not piped.complete
    whole = StepStages([["a", "b"]], 2, step=0, pipelined=False)
    whole.mean = (None, 0.0)
    assert whole.complete and whole.held(0, (0, 2))
