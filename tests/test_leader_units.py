"""The leader (shard 0) in-process (services/aggregator/leader/), its loop on a thread of the test, against a worker
and a checkpointer played by real ZeroMQ sockets (tests/helpers/rig.py) and a real Redis: admission, a sealed lease
with the parameters, the drops a lease and a fence protect, the fatal reject of a worker's third misfit in a row,
and a short run from the first lease to summary.json and the worker told to stop. Plus the pieces that need no
socket: where a replica's lease goes (`Handout.placement`), a gradient's checks before decoding (`grads.py`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
from cmemi.services.aggregator.common.pace import Pace
from cmemi.services.aggregator.common.replicas import Holdings
from cmemi.services.aggregator.leader.server import Aggregator
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core.environment import environment

from tests.helpers.rig import Peer, PlayedCheckpointer, context, until

pytestmark = pytest.mark.timeout(120)
FP = {"length": 1797, "sha256": "digits"}


class LeaderRig:
    def __init__(self, tmp_path: Path, redis_url: str, *sets: str) -> None:
        self.ctx = context(tmp_path, redis_url, "cluster.workers=1", "cluster.spare_workers=0",
                           "checkpoint.every_steps=0", "eval.every_steps=0", *sets, name="leaderrig")
        self.checkpointer = PlayedCheckpointer(self.ctx)
        self.agg = Aggregator(self.ctx)
        self.thread = threading.Thread(target=self.agg.run, name="leader", daemon=True)
        self.thread.start()
        self.zctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.me = {"wid": "w0", "inc": 1}
        params = dict(build_model(self.ctx.cfg).named_parameters())
        self.shapes = {n: p.shape for n, p in params.items()}

    @property
    def term(self) -> int:
        return self.agg.p.term

    def worker(self) -> Peer:
        """Worker w0's DEALER, its incarnation registered in Redis (not admitted yet)."""
        self.ctx.redis.hset(self.ctx.keys.member("worker", "w0"), mapping={"incarnation": "1"})
        return self.peer()

    def peer(self) -> Peer:
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.agg.p.addr)
        self.sockets.append(sock)
        return Peer(self.ctx, sock)

    def hello(self, w: Peer) -> None:
        w.send("hello", {**self.me, "host": "here", "fp": FP, "env": environment(torch.device("cpu"), self.ctx.cfg)})

    def admitted(self) -> Peer:
        w = self.worker()
        self.hello(w)
        assert w.expect("welcome", "reject").type == "welcome"
        return w

    def want(self, w: Peer, version: int = -1) -> Any:
        w.send("want", {**self.me, "term": self.term, "version": version})
        return w.expect("work", "reject", "stop")

    def grad(self, w: Peer, work: dict[str, Any], lo: int | None = None, misfit: bool = False) -> None:
        lo = work["lo"] if lo is None else lo
        hi = work["hi"] if lo == work["lo"] else lo + 1
        info, frames = make_codec(self.ctx.cfg.compression, flat=False).encode(
            {n: torch.full(s, 0.01) for n, s in self.shapes.items()}, 0)
        if misfit:  # one matrix sent with its shape swapped, as another model's would be
            first = next(n for n in info if len(info[n]["shape"]) == 2 and len(set(info[n]["shape"])) == 2)
            info[first]["shape"] = info[first]["shape"][::-1]
        w.send("grad", {**self.me, "term": self.term, "step": work["step"], "lo": lo, "hi": hi,
                        "version": work["version"], "losses": [0.5] * (hi - lo), "n": 16 * (hi - lo), "finite": True,
                        "encode_s": 0.0, "lease": work.get("lease", b""), "codec": info}, frames)

    def drops(self, reason: str) -> int:
        return self.agg.p.drops.as_dict().get(reason, 0)

    def close(self) -> None:
        self.ctx.stopping.set()
        self.thread.join(timeout=30)
        self.agg.close()
        for sock in self.sockets:
            sock.close(linger=0)
        self.zctx.term()
        self.checkpointer.close()


@pytest.fixture
def rig(tmp_path: Path, redis_server):
    r = LeaderRig(tmp_path, redis_server.url)
    try:
        yield r
    finally:
        r.close()


def test_the_leader_advertises_its_term_and_welcomes_a_registered_worker_at_its_step(rig: LeaderRig) -> None:
    advertised = rig.ctx.redis.hgetall(rig.ctx.keys.aggregator)
    assert advertised["addr"] == rig.agg.p.addr and int(advertised["term"]) == rig.term
    assert advertised["restored"] == "-1"  # nothing restored: the played checkpointer holds no checkpoint
    w = rig.worker()
    w.send("hello", {**rig.me, "host": "here", "fp": FP, "env": environment(torch.device("cpu"), rig.ctx.cfg)})
    welcome = w.expect("welcome").header
    assert (welcome["term"], welcome["step"], welcome["version"]) == (rig.term, 0, 0)
    assert welcome["total_steps"] == rig.ctx.cfg.train.rounds and welcome["shards"] == []
    assert rig.agg.p.fp == FP  # the first admitted worker's fingerprint is the run's


def test_a_worker_with_another_dataset_is_refused_fatally(rig: LeaderRig) -> None:
    rig.admitted()
    other = rig.worker()
    rig.ctx.redis.hset(rig.ctx.keys.member("worker", "w1"), mapping={"incarnation": "1"})
    other.send("hello", {"wid": "w1", "inc": 1, "host": "there", "fp": {"length": 1, "sha256": "x"}})
    reply = other.expect("reject").header
    assert reply["fatal"] and "different dataset" in reply["reason"]
    assert rig.drops("wrong_dataset") == 1


def test_a_want_is_answered_with_a_sealed_lease_and_the_current_parameters(rig: LeaderRig) -> None:
    w = rig.admitted()
    work = rig.want(w)
    h = work.header
    assert work.type == "work" and (h["term"], h["step"], h["version"]) == (rig.term, 0, 0)
    assert 0 <= h["lo"] < h["hi"] <= rig.ctx.cfg.train.microbatches
    assert h["lease"] == rig.agg.p.seal.seal(rig.term, 0, h["lo"], h["hi"], "w0", 1)
    assert work.tensors, "a stale worker's lease carries the parameters"
    again = rig.want(w, version=0)  # its version is current now: the next lease carries none
    assert again.type == "work" and not again.tensors


def test_a_gradient_for_microbatches_not_leased_to_the_worker_is_dropped_before_decoding(rig: LeaderRig) -> None:
    w = rig.admitted()
    work = rig.want(w).header
    stale = {**work, "step": 5, "version": 5}
    rig.grad(w, stale)
    until(lambda: rig.drops("stale_step") == 1, 10, "the stale gradient dropped", lambda: w.quiet(0.02))
    m = rig.ctx.cfg.train.microbatches
    if work["hi"] < m:  # a microbatch this worker holds no lease on
        rig.grad(w, work, lo=m - 1)
        until(lambda: rig.drops("not_leased") == 1, 10, "the unleased gradient dropped", lambda: w.quiet(0.02))


def test_the_third_gradient_in_a_row_that_does_not_fit_gets_a_fatal_reject(rig: LeaderRig) -> None:
    w = rig.admitted()
    work = rig.want(w)
    for n in (1, 2):
        rig.grad(w, work.header, misfit=True)
        until(lambda n=n: rig.drops("codec_bad_shape") == n, 10, f"misfit {n} dropped", lambda: w.quiet(0.02))
        # the leader hands it its next lease after the gradient, if it has one; else it asks plainly, and its lease
        # goes back to the queue and comes to it again
        work = w.expect("work") if not w.quiet(1.0) else rig.want(w, version=0)
        assert work.type == "work", work.header
    rig.grad(w, work.header, misfit=True)
    reject = w.expect("reject").header
    assert reject["fatal"], reject
    assert reject["reason"].startswith("the aggregator dropped 3 gradients in a row of worker w0 as "
                                       "codec_bad_shape"), reject["reason"]
    assert rig.drops("codec_bad_shape") == 3


def test_a_fence_that_redis_does_not_back_is_dropped_and_the_worker_stays(rig: LeaderRig) -> None:
    w = rig.admitted()
    coordinator = rig.peer()
    coordinator.send("fence", {"wid": "w0", "inc": 1})
    until(lambda: rig.drops("unverified_fence") == 1, 10, "the forged fence dropped", lambda: w.quiet(0.02))
    assert rig.want(w).type == "work"  # still admitted
    rig.ctx.redis.set(rig.ctx.keys.fence("worker", "w0"), 1)  # what the coordinator records before it fences
    coordinator.send("fence", {"wid": "w0", "inc": 1})
    until(lambda: rig.agg.p.admission.fenced.get("w0") == 1, 10, "the backed fence taken", lambda: w.quiet(0.02))
    refused = rig.want(w)
    assert refused.type == "reject" and "is fenced" in refused.header["reason"], refused.header


@pytest.fixture
def short_run(tmp_path: Path, redis_server):
    r = LeaderRig(tmp_path, redis_server.url, "train.steps=3", "scheduler.kwargs.T_max=3")
    try:
        yield r
    finally:
        r.close()


def test_a_short_run_steps_to_its_end_writes_the_summary_and_tells_the_worker_to_stop(short_run: LeaderRig) -> None:
    rig = short_run
    w = rig.admitted()
    msg = rig.want(w)
    steps_seen = set()
    while msg.type == "work":
        steps_seen.add(msg.header["step"])
        rig.grad(w, msg.header)
        msg = w.expect("work", "stop", "parked", timeout=30)
    assert msg.type == "stop" and msg.header["reason"] == "training complete"
    assert steps_seen == {0, 1, 2}
    rig.thread.join(timeout=30)
    summary = json.loads((rig.ctx.run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_checkpoint"] == "ckpt-3"
    assert summary["params_sha256"] and summary["dropped_messages"] == {}
    assert rig.checkpointer.snapshots == [3]  # checkpoint.every_steps 0: the final one only
    assert rig.ctx.redis.get(rig.ctx.keys.state) == "completed"


def test_a_streaming_replica_held_by_another_live_worker_is_not_leased_to_this_one() -> None:
    from cmemi.services.aggregator.leader.handout import Handout

    # what placement reads of the leader's parts: real Holdings, the rest as plain values
    parts = SimpleNamespace(holdings=Holdings(4), trainer=SimpleNamespace(fragments=3), live_workers=2,
                            cfg=SimpleNamespace(train=SimpleNamespace(microbatches=4)),
                            admission=SimpleNamespace(admitted=lambda identity: True),
                            leasing=SimpleNamespace(timeout=60.0, pace=Pace(4)))  # (no share cut)
    parts.holdings.note(b"a", [[0, 0], [1, 0]], lambda identity: True)
    parts.holdings.note(b"b", [[2, 0], [3, 0]], lambda identity: True)
    prefer, avoid = Handout(parts).placement(b"a", 0)  # type: ignore[arg-type]
    assert prefer == {0, 1} and avoid == {2, 3}  # b's replicas wait for b
    parts.live_workers = 4  # two more joined: a fair share is one replica, and a newcomer gets the others' extras
    assert Handout(parts).placement(b"c", 0) == (set(), {0, 2})  # type: ignore[arg-type]


@pytest.fixture
def sharded(tmp_path: Path, redis_server):
    r = LeaderRig(tmp_path, redis_server.url, "cluster.shards=2")
    try:
        yield r
    finally:
        r.close()


def test_workers_are_welcomed_once_every_shard_joined_and_each_shard_is_told_the_runs_fingerprint(
        sharded: LeaderRig) -> None:
    rig = sharded
    w = rig.worker()
    rig.hello(w)
    assert w.quiet(0.3), "a worker was answered before shard 1 joined the term"
    shard = rig.peer()
    shard.send("shard_join", {"shard": 1, "inc": 1, "term": rig.term, "step": 0, "addr": "tcp://127.0.0.1:9"})
    joined = shard.expect("shard_welcome").header
    assert joined["term"] == rig.term and joined["lease_key"] == rig.agg.p.seal.key and joined["fp"] == {}
    welcome = w.expect("welcome").header  # the hello held back is answered now
    assert welcome["shards"] == ["tcp://127.0.0.1:9"]
    assert shard.expect("shard_welcome").header["fp"] == FP  # the first worker set the run's fingerprint


def test_a_shard_of_another_term_is_told_to_join_the_current_one(sharded: LeaderRig) -> None:
    rig = sharded
    shard = rig.peer()
    shard.send("shard_join", {"shard": 1, "inc": 1, "term": rig.term - 1, "step": 0, "addr": "tcp://127.0.0.1:9"})
    reply = shard.expect("reject").header
    assert not reply["fatal"] and reply["reason"] == f"term {rig.term} started: join it"
    assert rig.drops("stale_shard") == 1
