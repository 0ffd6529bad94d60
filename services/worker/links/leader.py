"""A worker's connection to the leader: one DEALER socket per term, what goes out on it and what comes in.

Everything the worker sends travels as `transfer.messages` (in parts over cluster.max_message_bytes: never one message
over the cap, which the aggregator could only drop), and every send or receipt restarts the wait before asking again
(services/worker/links/patience.py). Parameters land straight in the model's tensors as they arrive (`landing`): until a
transfer's last part, or when a message is dropped, they may be half written, so the link tells the worker to forget
its version (`forget`). A dropped reply is remembered (`lost_reply`): the worker asks again once idle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zmq
from cmemi.services.worker.links.patience import Patience
from cmemi.shared.config.schema import Config
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, transfer


class LeaderLink:
    def __init__(self, ctx: ServiceContext, cfg: Config, landing: Callable[[], dict[str, torch.Tensor]],
                 forget: Callable[[], None], holds: Callable[[], list[list[int]] | None]) -> None:
        self.ctx, self.cfg, self.landing, self.forget, self.holds = ctx, cfg, landing, forget, holds
        self.near: Callable[[], list[int]] = list  # local steps, K > 1: the servers on this host (worker.py sets it)
        self.patience = Patience(max(2.0, 2 * cfg.cluster.dead_after))  # when to ask again
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(cfg), cfg.cluster.checksum,
                                        on_abandon=self._abandoned)  # parameters bigger than one message
        self.zctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.addr: str | None = None
        self.term = -1
        self.slots = False  # the leader granted shared-memory slots on this connection
        self.lost_reply = False  # a reply was dropped: ask again once idle
        self.sender: dict[str, Any] = {}  # {"wid", "inc"}: who every message is from (once the worker has an identity)

    def open(self, identity: str) -> zmq.Socket:
        """A fresh socket for a new connection (the old one closed, with the rest of any unfinished transfer: it will
        never come on a new socket)."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.parts.keep(())
        self.sock = self.zctx.socket(zmq.DEALER)
        set_link_options(self.sock, self.cfg.cluster)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.derive_max_message_bytes(self.cfg))
        return self.sock

    def send(self, mtype: str, tensors: dict[str, torch.Tensor] | None = None,
             trackers: list[zmq.MessageTracker] | None = None, **fields: Any) -> None:
        assert self.sock is not None
        if mtype in ("want", "grad") and (holds := self.holds()) is not None:  # local steps: which replicas' next
            fields["holds"] = holds  # rounds need no state sent
            if mtype == "want" and (near := self.near()):  # and which servers' replicas' states stay on this host
                fields["near"] = near
        try:  # over the cap: in parts (never one message over it: the aggregator could only drop it)
            msgs = transfer.messages(mtype, self.ctx.run, {**self.sender, **fields},
                                     limits.derive_max_message_bytes(self.cfg), tensors, self.cfg.cluster.checksum,
                                     part=transfer.PART)  # a server queues two per worker (serve_router)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"worker {self.sender.get('wid')}: {exc}")
        transfer.send(self.sock, msgs, trackers=trackers)
        self.patience.heard()

    def want(self, version: int, **fields: Any) -> None:
        """Ask for work (and the parameters of a version other than `version`, the one held or NOTHING)."""
        self.send("want", term=self.term, version=version, **fields)

    def reask_if_due(self, version: int, now: float) -> bool:
        """Silent for too long (a want, work or grad went missing?): ask again, numbered; True if it did."""
        if (waited := self.patience.due(now)) is None:
            return False
        self.ctx.log.info("no reply; asking again", after_s=round(waited, 1))
        self.want(version, reask=self.patience.reask())
        return True

    def pending(self, msg: protocol.Message, version: int) -> bool:
        """The leader's `pending` answer to a re-ask: it still waits for the work it last sent us. Asked before that
        work arrived, it means nothing; asked after, the work (or our gradient of it) was lost, and only a plain `want`
        gets new work (its lease goes back to the queue). True if it asked."""
        if not self.patience.lost(msg.header["reask"]):
            return False
        self.ctx.log.info("work or gradient lost on the way; asking again", reask=msg.header["reask"])
        self.want(version)
        return True

    def waiting(self) -> bool:
        """Is a message waiting (a lease goes before work computed ahead)?"""
        assert self.sock is not None
        return bool(protocol.poll(self.sock, 0))

    def recv(self, timeout_ms: int) -> protocol.Message | None:
        """The next whole message within `timeout_ms` (parameters landing where `landing` says); None if none yet."""
        assert self.sock is not None
        if not protocol.poll(self.sock, timeout_ms):
            return None
        self.patience.heard()
        try:  # new parameters land straight in the model's tensors
            msg = self.parts.recv(self.sock, into=self.landing())
            if msg is None and self.parts.pending:  # parameters in parts are half written until the last one
                self.forget()
            return msg
        except protocol.ProtocolError as exc:
            if exc.reason == "stale_part":  # the rest of a transfer already dropped (and asked again for)
                return None
            # A reply was lost (and parameters may be half-written): ask again, for a full set of parameters.
            self.ctx.log.warning("message dropped", reason=exc.reason, detail=str(exc)[:200])
            self.forget()
            self.lost_reply = True
            return None

    def _abandoned(self, reason: str, detail: str) -> None:
        self.ctx.log.warning("message dropped", reason=reason, detail=detail[:200])
        self.forget()  # parameters may be half written

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=200)
        self.zctx.destroy(linger=200)
