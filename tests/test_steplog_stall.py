"""The 300-fault soak's stall (issue 47), its mechanism on real ZeroMQ sockets in process: a server's step log link
to a checkpointer that reads nothing (SIGSTOPped, or behind a link cut one way into its host) must never hold the
server's loop, and an entry lost on the way must be sent again without waiting for a restarted checkpointer.

Before the fix a shard's ship blocked for good once its DEALER's pipe was full (the first test hangs in `ship`, and
fails at its join), and an entry the checkpointer never got was sent again only to a restarted one (the others time
out waiting for the resend)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import structlog
import torch
import zmq
from cmemi.services.aggregator.steplog.connection import QUEUED, resend_after
from cmemi.services.aggregator.steplog.link import StepLogLink
from cmemi.services.aggregator.steplog.reading import LogEntries
from cmemi.services.aggregator.steplog.shard import ShardStepLog
from cmemi.services.checkpointer.logserver import reply
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits
from cmemi.shared.wire.sendq import SendQueue

from tests.helpers.rig import context, until
from tests.helpers.sockets import pair

pytestmark = pytest.mark.timeout(120)

STEPS = 2000  # 16 KiB entries: past ZeroMQ's default SNDHWM (1000) and the kernel's buffers on loopback


class Checkpointer:
    """The checkpointer's step log socket, played: it reads nothing until `reading`; then each entry it gets is
    acknowledged (`logged`), except the first copy of the steps in `lose` (lost on the way, as with a connection
    a cut ended); a replay's `log_req` is answered `log_end`, except the first `lose_reqs` of them."""

    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, lose: set[int] = frozenset()) -> None:
        self.ctx, self.lose = ctx, set(lose)
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": addr, "incarnation": "1", "log": addr})
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum, peers=4)
        self.got: list[int] = []  # the steps of the entries received, in order (a copy sent again counts again)
        self.reqs: list[int] = []  # the `after` of each log_req received
        self.lose_reqs = 0  # the first this many log_reqs are lost (not answered)

    def serve(self, timeout_ms: int = 20) -> None:
        while self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart(copy=False)
            msg = self.parts.decode(frames[0].bytes, frames[1:])
            timeout_ms = 0
            if msg is not None and msg.type == "log_req":  # a replay's: this log holds nothing (log_end)
                self.reqs.append(msg.header["after"])
                if len(self.reqs) > self.lose_reqs:
                    reply(self.ctx, self.sock, frames[0].bytes, "log_end", {"after": msg.header["after"]})
            if msg is None or msg.type != "step_log":
                continue
            step = msg.header["step"]
            self.got.append(step)
            if step in self.lose:
                self.lose.discard(step)
            else:
                reply(self.ctx, self.sock, frames[0].bytes, "logged", {"step": step})

    def close(self) -> None:
        self.parts.close()
        self.sock.close(linger=0)


def grads(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), float(step))}


def test_a_shards_loop_turns_while_the_checkpointer_reads_nothing_and_its_entries_go_once_it_does(
        tmp_path: Path, redis_server) -> None:
    ctx = context(tmp_path, redis_server.url)
    zctx = zmq.Context()
    peer = Checkpointer(ctx, zctx)
    log = ShardStepLog(ctx, zctx, term=1, shard=1)
    turned: list[int] = []

    def loop() -> None:  # the shard's: one entry shipped per step, the link polled every turn
        for step in range(1, STEPS + 1):
            log.ship(step, grads(step))
            log.poll()
            turned.append(step)

    shard = threading.Thread(target=loop, daemon=True)
    shard.start()
    shard.join(timeout=60)
    try:
        assert not shard.is_alive(), f"the shard's loop blocked in the step log after step {len(turned)}"
        assert len(log.link.queue) <= QUEUED and sorted(log.kept) == [STEPS - 1, STEPS]
        assert log.link.queue.dropped > 0, "the checkpointer read nothing: what the socket did not take was dropped"
        # the checkpointer reads again (SIGCONT, the link healed): the two kept entries get there within a resend
        t0 = time.monotonic()
        until(lambda: not log.kept, resend_after(ctx.cfg.cluster) + 10, "the kept entries acknowledged",
              lambda: (peer.serve(), log.poll()))
        assert time.monotonic() - t0 < resend_after(ctx.cfg.cluster) + 10
        assert {STEPS - 1, STEPS} <= set(peer.got)
    finally:
        if not shard.is_alive():
            log.close()
            peer.close()
            zctx.term()


def test_a_leaders_entry_lost_on_the_way_is_sent_again_and_its_ack_comes(tmp_path: Path, redis_server) -> None:
    ctx = context(tmp_path, redis_server.url)
    zctx = zmq.Context()
    peer = Checkpointer(ctx, zctx, lose={1, 2})
    stop = threading.Event()
    served = threading.Thread(target=lambda: [peer.serve() for _ in iter(stop.is_set, True)], daemon=True)
    served.start()  # (its socket is used on that thread only)
    link = StepLogLink(ctx, zctx, term=1)
    gap = lambda s: pytest.fail(f"log_gap at {s}")  # noqa: E731
    try:
        link.ship(1, grads(1), None, None, 1.0)
        t0 = time.monotonic()
        until(lambda: link.unacknowledged is None, resend_after(ctx.cfg.cluster) + 5, "step 1's ack",
              lambda: (link.poll(gap), link.sock is not None and link.sock.poll(20)))
        assert time.monotonic() - t0 >= resend_after(ctx.cfg.cluster) * 0.9, "acknowledged before it was resent?"
        link.ship(2, grads(2), None, None, 2.0)  # confirm (the leader's wait for its ack) sends it again too
        assert link.confirm(gap) is False
    finally:
        stop.set()
        served.join(timeout=10)
        link.close()
        peer.close()
        zctx.term()
    assert peer.got == [1, 1, 2, 2], "each lost once and sent again once"


def test_a_send_queue_keeps_order_never_waits_and_drops_the_oldest_past_its_limit() -> None:
    """shared/wire/sendq.py on its own, as the shard's link to its leader uses it (services/aggregator/shard/upstream.py)."""
    zctx = zmq.Context()
    router, dealer = pair(zctx, {zmq.RCVHWM: 1, zmq.RCVBUF: 4096}, {zmq.SNDHWM: 2})
    q = SendQueue("a peer that reads nothing", 4, structlog.get_logger())
    try:
        t0 = time.monotonic()
        for i in range(3000):
            q.put([[f"{i}".encode(), b"x" * 16384]])  # one logical message of one ZeroMQ message
            q.flush(dealer)
        assert time.monotonic() - t0 < 30 and len(q) == 4 and q.dropped > 0
        got: list[int] = []
        until(lambda: got and got[-1] == 2999, 30, "the last message", lambda: (
            q.flush(dealer), [got.append(int(router.recv_multipart()[1])) for _ in iter(lambda: router.poll(20), 0)]))
        assert got == sorted(got) and got[-4:] == [2996, 2997, 2998, 2999], "in order, the newest kept"
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        zctx.term()


def test_a_replays_request_lost_on_the_way_is_asked_again_and_answered(tmp_path: Path, redis_server) -> None:
    """The 300-fault soak run from the stall fix's first commit: a leader's replay after a shard's restart waited
    for "the step log's entry after step 921" until ACK_TIMEOUT_S (its request lost with a connection the link options
    gave up): the replay's requests are asked again when their answer is late, as an entry is sent again."""
    ctx = context(tmp_path, redis_server.url)
    zctx = zmq.Context()
    peer = Checkpointer(ctx, zctx)
    peer.lose_reqs = 2  # both requests out (two ahead) lost
    stop = threading.Event()
    served = threading.Thread(target=lambda: [peer.serve() for _ in iter(stop.is_set, True)], daemon=True)
    served.start()
    link = StepLogLink(ctx, zctx, term=2)
    try:
        t0 = time.monotonic()
        assert list(LogEntries(link).entries(5)) == [], "the log holds nothing after step 5"
        assert time.monotonic() - t0 < resend_after(ctx.cfg.cluster) + 10
    finally:
        stop.set()
        served.join(timeout=10)
        link.close()
        peer.close()
        zctx.term()
    assert peer.reqs[:4] == [5, 6, 5, 6], "both asked again once late"
