"""The worker's pieces in process, each a real object (services/worker/): the leader link over a real ZeroMQ pair on
inproc:// (a ROUTER plays the leader, with the leader's own bookkeeping of unanswered work), where parameters land and
which version the model holds (links/intake.py), the local steps' held states (compute/replicas.py), the gradient out
(links/outbox.py), the heap trimmed before each block (compute/block.py), and a whole worker's dispatch. Fast: no
process, no Redis, no sleep."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import torch
import zmq
from cmemi.services.aggregator.common.admission import LeaseSeal
from cmemi.services.aggregator.leader.leasing import Leasing
from cmemi.services.worker.compute.block import BlockComputer
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.compute.replicas import Replicas
from cmemi.services.worker.links.inflight import InFlight
from cmemi.services.worker.links.intake import NOTHING, Intake
from cmemi.services.worker.links.leader import LeaderLink
from cmemi.services.worker.links.outbox import Gradient, Outbox
from cmemi.services.worker.worker import Worker
from cmemi.shared.compression.dense import NoneCodec
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.schema import Config
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import allocator
from cmemi.shared.wire import protocol

from tests.conftest import DIGITS

RUN = "pieces"
TERM = 7
_addresses = itertools.count()


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, event: str, **_: object) -> None:
        self.lines.append(event)

    warning = debug = info


def _fatal(message: str) -> None:
    raise SystemExit(message)


def _ctx() -> Any:
    return SimpleNamespace(run=RUN, log=_Log(), fatal=_fatal)


def _cfg(*sets: str) -> Config:
    return load_config(DIGITS, [f"run.name={RUN}", *sets])


class _Leader:
    """A ROUTER on inproc:// as the leader; `recv` the next message the worker sent (None within `ms`)."""

    def __init__(self, zctx: zmq.Context) -> None:
        self.sock = zctx.socket(zmq.ROUTER)
        self.addr = f"inproc://leader-{os.getpid()}-{next(_addresses)}"
        self.sock.bind(self.addr)
        self.ident = b""

    def recv(self, ms: int = 2000) -> protocol.Message | None:
        if not self.sock.poll(ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.ident = frames[0].bytes
        return protocol.decode(frames[1:], RUN)

    def send(self, mtype: str, header: dict[str, Any]) -> None:
        protocol.send(self.sock, protocol.encode(mtype, RUN, header), self.ident)


@pytest.fixture
def pair() -> Iterator[tuple[LeaderLink, _Leader, list[int]]]:
    """A worker's link to a scripted leader, connected; and how often the link told the worker to forget its version."""
    forgot: list[int] = []
    link = LeaderLink(_ctx(), _cfg(), lambda: {}, lambda: forgot.append(1), lambda: None)
    leader = _Leader(link.zctx)
    link.open("w0/1/7").connect(leader.addr)
    link.sender, link.term = {"wid": "w0", "inc": 1}, TERM
    yield link, leader, forgot
    leader.sock.close(linger=0)
    link.close()


def test_a_want_names_the_term_the_version_held_and_who_asks(pair: tuple[LeaderLink, _Leader, list[int]]) -> None:
    link, leader, _ = pair
    link.want(NOTHING)
    msg = leader.recv()
    assert msg is not None and msg.type == "want"
    assert (msg.header["term"], msg.header["version"], msg.header["wid"], msg.header["inc"]) == (TERM, -1, "w0", 1)
    assert msg.header["reask"] == 0 and msg.header["holds"] is None  # a plain want: neither field on the wire
    link.holds = lambda: [[3, 5]]  # local steps: every want and grad says which replicas' states are held
    link.want(4)
    link.send("leave")
    want, leave = leader.recv(), leader.recv()
    assert want is not None and want.header["holds"] == [[3, 5]] and want.header["version"] == 4
    assert leave is not None and leave.type == "leave" and "holds" not in leave.header


def test_work_lost_on_the_way_is_recovered_only_by_asking_again_after_pending(
        pair: tuple[LeaderLink, _Leader, list[int]]) -> None:
    """The leader leases work and sends it; it is lost. The worker, silent too long, re-asks; the leader (its own
    bookkeeping, services/aggregator/leader/leasing.py) still waits for that work and answers `pending`. Only the
    worker's plain `want` then, the work lost for certain, makes the leader serve it again: without it both wait."""
    link, leader, _ = pair
    leasing = Leasing(_cfg(), False, False, LeaseSeal(os.urandom(32)), 1, lambda: 2)
    link.want(NOTHING)
    want = leader.recv()
    assert want is not None and leasing.answered(leader.ident, want.header.get("reask"))
    leasing.sent(leader.ident, 0)  # the work goes out ... and never arrives
    assert link.recv(0) is None
    assert not link.reask_if_due(NOTHING, link.patience.last_heard)  # not silent for long enough yet
    assert link.reask_if_due(NOTHING, link.patience.last_heard + 10 * link.patience.reask_s)
    reask = leader.recv()
    assert reask is not None and reask.header["reask"] == 1
    assert not leasing.answered(leader.ident, reask.header["reask"])  # the leader still waits for its work
    leader.send("pending", {"reask": 1})
    pending = link.recv(2000)
    assert pending is not None and pending.type == "pending"
    assert link.pending(pending, NOTHING)
    again = leader.recv()
    assert again is not None and again.type == "want" and again.header["reask"] == 0, "the worker did not ask again"
    assert leasing.answered(leader.ident, again.header.get("reask"))  # a plain want: the lease is served again


def test_pending_for_a_reask_sent_before_the_work_arrived_means_nothing(
        pair: tuple[LeaderLink, _Leader, list[int]]) -> None:
    link, leader, _ = pair
    assert link.reask_if_due(NOTHING, link.patience.last_heard + 10 * link.patience.reask_s)
    assert leader.recv() is not None
    link.patience.work_arrived()  # the work was on its way: the pending answer came behind it
    assert not link.pending(protocol.Message({"reask": 1}, {}), NOTHING)
    assert leader.recv(100) is None


def test_a_dropped_reply_is_asked_for_again_and_the_version_forgotten(
        pair: tuple[LeaderLink, _Leader, list[int]]) -> None:
    link, leader, forgot = pair
    link.want(NOTHING)
    assert leader.recv() is not None
    frames = protocol.encode("work", RUN, {"term": TERM, "version": 0}, {"w": torch.ones(4)})
    frames[-1] = bytearray(frames[-1])
    frames[-1][0] ^= 0xFF  # its checksum no longer matches
    protocol.send(leader.sock, frames, leader.ident)
    assert link.recv(2000) is None
    assert link.lost_reply and forgot == [1]


# ---------------------------------------------------------------------------------------------- parameters in

def _intake() -> tuple[Intake, dict[str, torch.Tensor]]:
    cfg = _cfg("train.microbatches=1")
    model = torch.nn.Linear(64, 10)
    params = {n: p for n, p in model.named_parameters()}
    return Intake(_ctx(), cfg, Partition(params), params, {}, None, True), params  # type: ignore[arg-type]


def _work(intake: Intake, version: int, tensors: dict[str, torch.Tensor] | None) -> protocol.Message:
    """A `work` header as decode delivers it (checked, its absent optional fields filled in: messages.Work)."""
    header, _ = protocol.check_header({"type": "work", "proto": protocol.PROTOCOL_VERSION, "run": RUN, "tensors": [],
                                       "term": TERM, "step": version, "lo": 0, "hi": 1, "version": version,
                                       "scale": 1.0, "layout": intake.inbox.layout.digest}, RUN)
    return protocol.Message(header, intake.inbox.layout.pack(tensors) if tensors is not None else {})


def test_parameters_on_the_socket_land_in_the_model_and_make_its_version() -> None:
    intake, params = _intake()
    assert intake.version is None and intake.number == NOTHING
    new = {n: torch.full_like(p, 0.25) for n, p in params.items()}
    assert intake.receive(_work(intake, 3, new), slots=False)
    assert intake.version == 3 and all(torch.equal(params[n], new[n]) for n in params)
    assert intake.receive(_work(intake, 3, None), slots=False)  # work without parameters: the version held
    assert not intake.receive(_work(intake, 4, None), slots=False)  # another version, none sent: never compute stale
    assert intake.version is None and intake.number == NOTHING
    intake.version = -1  # (what the wire says for none is none)
    assert intake.version is None


def test_pieces_or_a_change_from_another_version_are_refused_and_no_version_held() -> None:
    intake, params = _intake()
    assert intake.receive(_work(intake, 3, {n: p.detach().clone() for n, p in params.items()}), slots=False)
    msg = _work(intake, 5, None)
    msg.header.update(downlink="pieces", base=2)
    assert not intake.receive(msg, slots=False) and intake.version is None
    intake.version = 3
    msg.header.update(downlink="delta", base=3)  # no downlink codec in this config: a change cannot be applied
    assert not intake.receive(msg, slots=False) and intake.number == NOTHING


def test_parameters_of_another_model_stop_the_worker_with_the_fix() -> None:
    intake, params = _intake()
    msg = _work(intake, 0, {n: p.detach() for n, p in params.items()})
    msg.header["layout"] = "another model's"
    with pytest.raises(SystemExit, match="do not fit this worker's model.*model.kwargs"):
        intake.receive(msg, slots=False)


# ---------------------------------------------------------------------------------------------- replicas, out

def test_replicas_keep_the_newest_rounds_and_a_state_only_within_its_window() -> None:
    cfg = _cfg("train.microbatches=4", "cluster.workers=2")
    local = SimpleNamespace(window=2, ahead=False, fragments=[["w"]])  # streaming: a state within its window will do
    replicas = Replicas(cfg, local, None, _fatal)  # type: ignore[arg-type]
    assert replicas.hold_at_most == 3
    for r, rnd in ((0, 5), (1, 3), (2, 4), (3, 2)):
        replicas.keep(r, rnd, None)
    assert sorted(replicas.held) == [0, 2, 3]  # the oldest round went, never the one just kept (however old)
    assert sorted(map(tuple, replicas.holds() or [])) == [(0, 5), (2, 4), (3, 2)]
    assert replicas.state_for(0, 6) == (5, None)
    assert replicas.state_for(0, 7) is None and 0 not in replicas.held  # past its window: forgotten
    assert Replicas(cfg, None, None, _fatal).holds() is None  # type: ignore[arg-type]


def test_the_leaders_slice_of_a_gradient_goes_with_the_lease_and_the_shards_are_asked_ahead(
        pair: tuple[LeaderLink, _Leader, list[int]]) -> None:
    link, leader, _ = pair
    cfg = _cfg()
    grads = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    partition = Partition(grads)
    shards = SimpleNamespace(asked=[], pushed=[])
    shards.ask_ahead = shards.asked.append
    shards.push = lambda encoded, fields, trackers: shards.pushed.append((encoded, fields["step"]))
    outbox = Outbox(RUN, cfg, partition, link, shards, InFlight(False, 1.0), by_piece=False)  # type: ignore[arg-type]
    lease = {"step": 4, "lo": 2, "hi": 4, "lease": b"seal"}
    outbox.send(lease, Gradient([0.5, 0.25], grads, None, True), 4)
    grad = leader.recv()
    assert grad is not None and grad.type == "grad"
    h = grad.header
    assert (h["step"], h["lo"], h["hi"], h["version"], h["term"], h["lease"], h["finite"]) == (4, 2, 4, 4, TERM,
                                                                                               b"seal", True)
    assert h["losses"] == [0.5, 0.25] and h["n"] == 2 * (cfg.train.global_batch // cfg.train.microbatches)
    decoded = NoneCodec(cfg.compression).decode(h["codec"], grad.tensors, {n: g.shape for n, g in grads.items()})
    assert all(torch.equal(decoded[n], grads[n]) for n in grads)
    assert shards.asked == [5] and shards.pushed == [([], 4)]
    outbox.send({**lease, "step": 5}, Gradient([float("inf")], grads, None, False), 5)  # an fp16 overflow
    overflow = leader.recv()
    assert overflow is not None and overflow.header["finite"] is False and not overflow.tensors


# ---------------------------------------------------------------------------------------------- the heap

@pytest.mark.parametrize("big", [True, False])
def test_the_heap_is_trimmed_before_each_block_only_for_a_model_big_enough(monkeypatch: pytest.MonkeyPatch,
                                                                            big: bool) -> None:
    """Between steps the worker gives the heap's free pages back (shared/memory/allocator.py) when the model's
    parameters are TRIM_MIN_BYTES or more: here the threshold is moved, not the model grown."""
    calls: list[int] = []
    monkeypatch.setattr(allocator, "trim", lambda: calls.append(1) or True)
    model = torch.nn.Linear(64, 10)
    monkeypatch.setattr(allocator, "TRIM_MIN_BYTES", 0 if big else allocator.TRIM_MIN_BYTES)
    cfg = _cfg("train.microbatches=2")
    dataset = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    runner = MicrobatchRunner(cfg, model, dataset, torch.nn.functional.cross_entropy)
    compute = BlockComputer(cfg, runner, _Log(), _fatal, lambda: "w0")
    assert InFlight(compute.trim, 1.0).tracked is big  # (the worker tracks a big model's gradient frames too)
    for step in range(3):
        compute.block(step, 0, 2, 1.0)
        assert len(calls) == (step + 1 if big else 0)


# ---------------------------------------------------------------------------------------------- the whole worker

@pytest.fixture
def worker() -> Iterator[tuple[Worker, _Leader]]:
    """A digits worker built in process (no Redis: its registration is the one thing stood in for), its link
    connected to a scripted leader on inproc://."""
    cfg = _cfg()
    ctx = SimpleNamespace(cfg=cfg, run=RUN, log=_Log(), fatal=_fatal, stopping=threading.Event(),
                          emit=lambda *a, **k: None)
    w = Worker(ctx, "w0")  # type: ignore[arg-type]
    w.life.register = lambda wid: 1  # type: ignore[method-assign]
    w.assume("w0")
    leader = _Leader(w.link.zctx)
    w.link.open("w0/1/7").connect(leader.addr)
    w.link.term = TERM
    yield w, leader
    structlog.contextvars.clear_contextvars()
    leader.sock.close(linger=0)
    w.close()


def test_a_worker_asks_again_after_pending_for_work_lost_and_computes_the_work_that_follows(
        worker: tuple[Worker, _Leader]) -> None:
    """Through the worker's own dispatch (`handle`, `idle`): the work is lost, the re-ask answered `pending`, the
    worker's plain want brings the work again, and its gradient comes back on the version sent."""
    w, leader = worker
    w.lease.want()
    first = leader.recv()
    assert first is not None and first.type == "want" and first.header["version"] == NOTHING
    w.link.patience.last_heard -= 10 * w.link.patience.reask_s  # (the work lost: silence, not a sleep)
    w.idle()
    reask = leader.recv()
    assert reask is not None and reask.header["reask"] == 1
    leader.send("pending", {"reask": 1})
    msg = w.link.recv(2000)
    assert msg is not None
    w.handle(msg)
    again = leader.recv()
    assert again is not None and again.type == "want" and again.header["reask"] == 0, "the worker did not ask again"
    sent = {n: torch.full_like(p, 0.01) for n, p in w.params.items()}
    work = _work(w.intake, 0, sent)
    protocol.send(leader.sock, protocol.encode("work", RUN, work.header, work.tensors), leader.ident)
    msg = w.link.recv(2000)
    assert msg is not None and msg.type == "work"
    w.handle(msg)
    assert w.intake.version == 0 and all(torch.equal(w.params[n], sent[n]) for n in sent)
    grad = leader.recv()
    assert grad is not None and grad.type == "grad"
    assert (grad.header["version"], grad.header["step"], grad.header["finite"]) == (0, 0, True)


def test_a_loss_given_a_model_output_object_is_told_to_read_its_logits():
    from cmemi.services.worker.compute.microbatch import output_hint

    hint = output_hint(SimpleNamespace(logits=torch.zeros(2, 3)))
    assert ".logits" in hint and "SimpleNamespace" in hint
    assert output_hint(torch.zeros(2, 3)) == ""
    assert output_hint((torch.zeros(1),)) == ""
