"""A snapshot on its way to the checkpointer (services/aggregator/snapshots/outgoing.py): no copy when it is taken, a few
parts in ZeroMQ at a time, copy-on-write before the live state changes, and a restart only when it gives the
snapshot's bytes."""

from __future__ import annotations

import time

import torch
import zmq
from cmemi.services.aggregator.snapshots.outgoing import Outgoing
from cmemi.shared.wire import assembly, transfer

RUN = "r1"
CAP = 64 << 10  # parts of 64 KiB: a 1 MiB state is 17 of them


def live_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model.w": torch.randn(512, 256, generator=g), "optimizer.state.0.exp_avg": torch.randn(256, generator=g)}


def outgoing(tensors: dict[str, torch.Tensor], step: int = 7) -> Outgoing:
    fields = {"step": step, "term": 1, "final": False, "meta": {}}
    return Outgoing(step, False, lambda: transfer.messages("snapshot", RUN, fields, CAP, tensors))


def sockets(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER that holds at most one message more (SNDHWM 1, as CheckpointerLink sets it) and its ROUTER."""
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.SNDHWM, 1)
        s.setsockopt(zmq.RCVHWM, 1)
    router.bind(f"inproc://{name}")
    dealer.connect(f"inproc://{name}")
    return dealer, router


def receive(router: zmq.Socket, dealer: zmq.Socket, out: Outgoing, deadline_s: float = 10) -> dict[str, torch.Tensor]:
    """Read parts while pumping the rest, until the whole snapshot is reassembled."""
    parts = assembly.Assembler(RUN, 1 << 30)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out.pump(dealer)
        if router.poll(50):
            frames = router.recv_multipart(copy=False)
            msg = parts.decode(frames[0].bytes, frames[1:])
            if msg is not None:
                return msg.tensors
    raise AssertionError("the snapshot did not arrive")


def test_only_some_parts_wait_in_zeromq_and_the_rest_is_copied_before_the_state_changes() -> None:
    ctx = zmq.Context()
    try:
        dealer, router = sockets(ctx, "outgoing-cow")
        live = live_state()
        expected = {n: t.clone() for n, t in live.items()}
        out = outgoing(live)
        total = len(out.msgs)
        assert total > 8
        out.pump(dealer)
        assert 0 < out.next < total // 2  # the socket takes a few parts, not the snapshot
        assert not out.changed
        out.protect()  # the optimizer is about to step
        for t in live.values():
            t.add_(1.0)  # ... and steps, while most of the snapshot is still unsent
        got = receive(router, dealer, out)
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        assert out.sent and all(m == [] for m in out.msgs)  # nothing kept once sent
    finally:
        ctx.destroy(linger=0)


def test_a_restart_resends_from_the_live_state_while_it_is_unchanged_and_gives_up_after() -> None:
    ctx = zmq.Context()
    try:
        dealer, router = sockets(ctx, "outgoing-restart")
        live = live_state()
        out = outgoing(live)
        out.pump(dealer)
        assert out.next > 0
        first_xfer = out.msgs[-1][0]
        assert out.restart() and out.next == 0  # no step since: rebuilt from the live tensors, a new transfer
        assert out.msgs[-1][0] != first_xfer
        while router.poll(50):  # the checkpointer reads what was queued; the socket takes parts again
            router.recv_multipart()
        out.pump(dealer)
        assert out.next > 0
        out.protect()
        assert not out.restart()  # parts went out, then the state moved on: its bytes are gone

        untouched = outgoing(live)
        untouched.protect()  # the state changes before any part went out: every part is a copy
        assert untouched.restart() and untouched.next == 0
    finally:
        ctx.destroy(linger=0)
