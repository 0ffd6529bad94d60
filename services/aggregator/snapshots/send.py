"""Snapshots of the aggregator's full training state, handed to the checkpointer over ZeroMQ.

Taking a snapshot (contents.py: `collect`) copies nothing: it names the live tensors, and its parts go out a few at a
time, copy-on-write (outgoing.py): the step after it copies only what is not sent yet. The checkpointer
writes to disk in its own process. At most one snapshot is in flight; a newer one replaces one not yet
sent, unless retention keeps it. If the checkpointer restarts (a new incarnation in Redis, on a new
address or on the same fixed port), the in-flight snapshot is sent again where it can be (outgoing.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.snapshots.contents import Snapshot
from cmemi.services.aggregator.snapshots.outgoing import Outgoing
from cmemi.shared.coordination.membership import texts
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, transfer
from cmemi.shared.wire.sendq import SendQueue

PROTECT_PATIENCE_S = 0.5


class CheckpointerLink:
    """DEALER to the checkpointer, found (and re-found after a restart) through Redis; `on_drop(reason, detail)`
    counts a part of a restore that had to be abandoned. From the service's loop (`offer`, `poll`) the address
    is the one a watch read last (shared/coordination/watch.py): the loop never waits on Redis."""

    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, term: int, on_drop: Callable[[str, str], None]) -> None:
        self.ctx, self.cfg, self.zctx, self.term = ctx, ctx.cfg, zctx, term
        self.sock: zmq.Socket | None = None
        self.addr: str | None = None
        self.inc: str | None = None  # the checkpointer incarnation last seen in Redis
        self.sharding: dict[str, Any] = {}  # a sharded run's snapshots say whose slice they are: shard, shards, pieces
        self.in_flight: Outgoing | None = None
        self.queued: list[Outgoing] = []  # unsent: milestones and the final one (kept), and at most one other
        self.saved_path: dict[int, str] = {}  # step -> where the checkpointer wrote it (the final one's is reported)
        self.once_saved: dict[int, Callable[[], None]] = {}  # step -> what runs once it is written (`offer_final`)
        self.on_saved: list[Callable[[int], object]] = []  # told each step written (the state spool's retention)
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum,
                                        on_abandon=on_drop)  # a restore bigger than one message
        self._next_check = 0.0
        self._retry_at: float | None = None  # when to send the in-flight snapshot again (the checkpointer's "retry")
        self._polled: zmq.Socket | None = None  # registered for POLLOUT (`wake_for_room`)
        key = ctx.keys.checkpointer
        self.where = Watch(ctx.redis, 0.5, lambda r: texts(r.hmget(key, ["addr", "incarnation"])), "checkpointer").start()

    def _lookup(self, wait: bool = True) -> str | None:
        """The checkpointer's address: read now, or (`wait=False`) the newest the watch read, if any."""
        if wait:
            try:
                addr, inc = texts(self.ctx.redis.hmget(self.ctx.keys.checkpointer, ["addr", "incarnation"]))
            except redis.RedisError:
                return self.addr  # Redis is down: keep talking to the checkpointer we know
        elif (seen := self.where.take()) is not None:
            addr, inc = seen[0]
        else:
            return self.addr
        if addr is not None and inc is not None:
            self.inc = inc
        return addr or self.addr

    def _connect(self, wait: bool = True) -> bool:
        addr = self._lookup(wait)
        if addr is None:
            return False
        if addr != self.addr:
            if self.sock is not None:
                self.sock.close(linger=0)
                self.parts.keep(())  # the rest of a restore in parts will not come on a new socket
            self.sock = self.zctx.socket(zmq.DEALER)
            set_link_options(self.sock, self.cfg.cluster)
            self.ctx.curve.connect_as_client(self.sock)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 1)  # a snapshot's parts wait here, not in ZeroMQ (outgoing.py)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.cluster.message_cap())
            self.sock.connect(addr)
            self.addr = addr
        return True

    def _outgoing(self, snap: Snapshot, final: bool) -> Outgoing:
        step, meta, tensors = snap
        fields = {"step": step, "term": self.term, "final": final, "meta": meta, **self.sharding}
        return Outgoing(step, final, lambda: self._messages("snapshot", fields, tensors, transfer.PART))

    def _messages(self, mtype: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None,
                  part: int | None = None) -> list[list[Any]]:
        """One logical message, in parts if it is over the cap (or, with `part`, of about that many bytes each)."""
        try:
            return transfer.messages(mtype, self.ctx.run, fields, self.cfg.cluster.message_cap(), tensors,
                                     self.cfg.cluster.checksum, part=part)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"aggregator: {exc}")

    def _replies(self, timeout_ms: int) -> list[protocol.Message]:
        out = []
        while self.sock is not None and self.sock.poll(timeout_ms):
            if (msg := self.parts.reply(self.sock, self.ctx.log, "checkpointer")) is not None:
                out.append(msg)
            timeout_ms = 0
        return out

    # ---------------------------------------------------------------- periodic, asynchronous
    def milestone(self, step: int) -> bool:
        """Does retention keep this step (checkpoint.keep_every)? Then its snapshot is never replaced unsent."""
        every = self.cfg.checkpoint.keep_every
        return bool(every) and step % every == 0

    @property
    def idle(self) -> bool:
        """No snapshot is waiting to be written."""
        return self.in_flight is None and not self.queued

    def offer(self, snap: Snapshot) -> None:
        # a newer snapshot replaces an older unsent one, unless retention keeps that one (or it is the final one)
        self.queued = [q for q in self.queued if q.final or self.milestone(q.step)] + [self._outgoing(snap, False)]
        self.pump()

    def protect(self) -> None:
        """Call before the live state changes (an optimizer step). The step waits while the snapshot in flight goes
        out — each part taken within PROTECT_PATIENCE_S — and what is still unsent then (a checkpointer that stopped
        reading, the queued ones) is copied: a slow checkpointer costs the step time, a stalled one half a second,
        and neither a second copy of the state (docs/design.md, "Memory")."""
        out = self.in_flight
        if out is not None and not out.changed and self.sock is not None:
            while not out.sent and self.sock.poll(int(PROTECT_PATIENCE_S * 1000), zmq.POLLOUT):
                out.pump(self.sock)
        for out in (self.in_flight, *self.queued):
            if out is not None:
                out.protect()

    def pump(self) -> None:
        """Call from the aggregator loop (cheap): hand ZeroMQ the next parts of the snapshot in flight."""
        if self.in_flight is None and self.queued and self._connect(wait=False):
            self.in_flight = self.queued.pop(0)
            self.in_flight.to = (self.addr, self.inc)
        if self.in_flight is not None and not self.in_flight.sent and self.sock is not None:
            self.in_flight.pump(self.sock)

    def wake_for_room(self, poller: zmq.Poller) -> None:
        """Call before the aggregator loop polls: while a snapshot's parts wait, the poll also wakes when the socket
        has room (POLLOUT), so they go out as fast as the checkpointer takes them, and the next step finds less to
        copy (`protect`)."""
        want = self.sock if self.in_flight is not None and not self.in_flight.sent else None
        if want is not self._polled:
            if self._polled is not None:
                poller.unregister(self._polled)
            if want is not None:
                poller.register(want, zmq.POLLOUT)
            self._polled = want

    def poll(self) -> list[int]:
        """Call from the aggregator loop: collect acks, send the queued snapshot, resend after a restart."""
        saved = []
        for msg in self._replies(0):
            # "skipped": another shard sent a newer step first; this one will never be complete
            if self.in_flight is None or msg.header.get("step") != self.in_flight.step:
                continue
            if msg.type in ("saved", "skipped"):
                saved.append(msg.header["step"])
                if msg.type == "saved":
                    self.saved_path[msg.header["step"]] = str(msg.header["path"])
                self.in_flight = None
            elif msg.type == "retry":  # the checkpointer could not check our term yet (Redis restarted): again, soon
                self._retry_at = time.monotonic() + 0.5
        for step in saved:
            if step in self.saved_path:
                for told in self.on_saved:
                    told(step)
            if step in self.saved_path and (then := self.once_saved.pop(step, None)) is not None:
                then()
        if self.in_flight is not None and self._retry_at is not None and time.monotonic() > self._retry_at:
            self._retry_at = None
            if not self.in_flight.restart():
                self.ctx.log.warning("checkpoint given up: the checkpointer asked for it again after the state had "
                                     "moved on; the next one is written", step=self.in_flight.step)
                self.in_flight = None
        if self.in_flight is not None and time.monotonic() > self._next_check:
            self._next_check = time.monotonic() + 0.5
            if self._connect(wait=False) and (self.addr, self.inc) != self.in_flight.to:  # the checkpointer restarted
                self.in_flight.to = (self.addr, self.inc)
                if not self.in_flight.restart():
                    self.ctx.log.warning("checkpoint given up: the checkpointer restarted while it was sent, after "
                                         "the state had moved on; the next one is written", step=self.in_flight.step)
                    self.in_flight = None
        self.pump()
        return saved

    # ---------------------------------------------------------------- blocking
    def request(self, mtype: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None,
                accept: Callable[[protocol.Message], bool], timeout: float) -> protocol.Message:
        """Send and wait for a reply that `accept`s; resend if the checkpointer restarts meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._connect():
                time.sleep(0.05)
                continue
            assert self.sock is not None, "_connect returned True without a socket"
            queue = SendQueue("the checkpointer", 1, self.ctx.log)  # never waits past `deadline` (issue 47)
            queue.put(self._messages(mtype, fields, tensors))
            sock = self.sock
            sent_to, next_check = (self.addr, self.inc), time.monotonic() + 0.5
            while time.monotonic() < deadline:
                queue.flush(sock)
                if len(queue):  # its parts go as the socket (SNDHWM 1) takes them; a cut peer costs the deadline
                    sock.poll(100, zmq.POLLOUT)
                for msg in self._replies(0 if len(queue) else 100):
                    if accept(msg):
                        return msg
                if time.monotonic() > next_check:
                    next_check = time.monotonic() + 0.5
                    if (self._lookup(), self.inc) != sent_to:
                        break  # the checkpointer restarted (elsewhere or on the same port): ask again
        raise TimeoutError(f"the checkpointer did not answer {mtype!r} within {timeout:g}s; "
                           "is `cmemi checkpointer` running and reachable?")

    def enter_term(self, term: int) -> None:
        """A shard k > 0 joined its leader's new term in place (shard/newterm.py): the old term's snapshots are the
        checkpointer's to drop (`stale_term`: no answer comes, and one in flight would wait for it for good), so they
        go here too, and the socket with what of them it still holds: the new term's go out on a new connection."""
        self.term = term
        self.in_flight, self.queued, self._retry_at = None, [], None
        self.once_saved.clear()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.parts.keep(())
        self.sock = self.addr = self._polled = None  # (the shard's loop polls with a new Poller from here on)

    def close(self) -> None:
        self.where.stop()

    def offer_final(self, snap: Snapshot, then: Callable[[], None]) -> None:
        """The final snapshot, sent from the service's loop (`pump`, `poll`) without waiting there: `then()` runs from
        `poll` once the checkpointer wrote it. A shard's loop must go on meanwhile (issue 47): a leader that dies
        before the final checkpoint is complete leaves it incomplete for good in that term, and only the loop sees
        the new term (`save_final` waited 300 s for it: the new leader waited for the shard that long)."""
        self.queued.append(self._outgoing(snap, True))
        self.once_saved[snap[0]] = then

    def save_final(self, snap: Snapshot, timeout: float = 300, final: bool = True) -> str:
        """Send the final snapshot (after any still queued) and wait until it is written; returns its path.
        `final=False`: a checkpoint wanted now, mid-run (the step log lost with a checkpointer restart)."""
        self.queued.append(self._outgoing(snap, final))
        return self.wait_saved(snap[0], timeout)

    def wait_saved(self, step: int, timeout: float = 300) -> str:
        """Wait until the snapshot of `step` (queued or sent) is written; returns its path."""
        deadline = time.monotonic() + timeout
        while step not in self.saved_path:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the checkpointer did not write the final checkpoint within {timeout:g}s; "
                                   "is `cmemi checkpointer` running and reachable?")
            self.poll()
            if self.sock is not None:
                self.sock.poll(10)
            else:
                time.sleep(0.05)
        return self.saved_path[step]

    def fetch_latest(self, timeout: float, trainer: Trainer, step: int | None = None) -> protocol.Message | None:
        """The checkpoint `latest` names (or exactly step `step`, as the leader restored it, for shard k > 0). A
        sharded server names the pieces it owns: the checkpointer then leaves the other shards' state out."""
        fields = {"term": self.term, "shard": trainer.shard, "pid": os.getpid(),
                  **({"owned": list(trainer.pieces)} if trainer.sharded else {}),
                  **({"step": step} if step is not None else {})}
        msg = self.request("restore_req", fields, None,
                           lambda m: m.type in ("restore", "no_checkpoint"), timeout)
        return msg if msg.type == "restore" else None
