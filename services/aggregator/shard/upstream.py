"""A shard k > 0's link to its leader (shard 0): what it says (`shard_join`, `shard_have`, `shard_ready`,
`shard_eval`, `shard_final`, each with the shard's number, incarnation and term) and what it hears.

Only the leader's messages of this shard's term count; a `reject` means this shard's state is not the cluster's any
more (`Rejoin`: it exits and starts again from the checkpoint the term restores). A new term in Redis (the leader
restarted, or rolled back because a shard restarted) is `NewTerm`: the shard joins it in place where it can
(newterm.py), on a new LeaderLink to the new leader, and leaves it as a `Rejoin` elsewhere. The leader's messages bigger
than one arrive in parts and are assembled here, so the shard's loop sees whole messages only.

What the shard says goes through a SendQueue (shared/wire/sendq.py, issue 47): its loop never waits on a leader that
does not read (SIGSTOPped, or cut one way); past `QUEUED` messages waiting the oldest is dropped and counted, and
the shard says its periodic ones (`shard_have`, `shard_ready`, a join) again anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import zmq
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard import join as shard_join
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.shared.coordination.membership import text
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.errors import Interrupt
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, transfer
from cmemi.shared.wire.sendq import SendQueue


class Rejoin(Interrupt):
    """This shard's state is not the cluster's any more: leave the term, start again from its checkpoint."""


class NewTerm(Rejoin):
    """The leader started another term (`term`, read in Redis): joined in place where the shard can (newterm.py)."""

    def __init__(self, term: int, old: int) -> None:
        super().__init__(f"the leader started term {term} (this shard was in {old})")
        self.term = term


JOIN_AGAIN_S = 1.0  # a join not welcomed this long is said again
QUEUED = 64  # messages kept for a leader that does not read: 30 s of shard_have and shard_ready, then drops
QUIET_S = 0.1  # the leader silent this long (dead, restarting, or a slow step): the term is read again at once


class LeaderLink:
    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, addr: str, shard: int, term: int,
                 incarnation: Callable[[], Any], drop: Callable[[str, str], None]) -> None:
        self.ctx, self.shard, self.term, self.incarnation, self.drop = ctx, shard, term, incarnation, drop
        self.sock = shard_join.leader_link(ctx, zctx, addr)
        self.queue = SendQueue("the leader", QUEUED, ctx.log)  # what the socket did not take yet
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum,
                                        on_abandon=drop)  # the leader's messages bigger than one
        # the leader's term and the run's state, read off the loop (shared/coordination/watch.py)
        self.joining: dict[str, Any] | None = None  # the join said, until the leader's welcome (`join_again`)
        self.next_join = 0.0
        self.finishing = False  # the final snapshot went to the checkpointer (`finish`)
        self.heard_at = self.poked_at = time.monotonic()  # the leader's last message here; the last read asked
        self.watch = Watch(ctx.redis, 0.25, lambda r: (text(r.hget(ctx.keys.aggregator, "term")), text(r.get(ctx.keys.state))),
                           "shard").start()

    def send(self, mtype: str, tensors: dict[str, torch.Tensor] | None = None, **fields: Any) -> None:
        cluster = self.ctx.cfg.cluster
        msgs = transfer.messages(mtype, self.ctx.run, {"shard": self.shard, "inc": self.incarnation(),
                                                       "term": self.term, **fields},
                                 cluster.message_cap(), tensors, cluster.checksum)
        self.queue.put(msgs)
        self.queue.flush(self.sock)

    def join(self, step: int, addr: str) -> None:
        """Join the leader's term at `step` (`shard_join`), said again until welcomed (`join_again`)."""
        self.joining = {"step": step, "addr": addr}
        self.send("shard_join", **self.joining)
        self.next_join = time.monotonic() + JOIN_AGAIN_S

    def join_again(self, welcomed: bool, now: float) -> None:
        """Say the join again every JOIN_AGAIN_S until the leader's welcome comes. Said once, a join that a cut link
        lost on the way (given up with what it held, shared/runtime/links.py) left the leader without this shard
        for good, holding every worker's hello (it admits workers once every shard joined); said again, it is
        welcomed again (services/aggregator/leader/roster.py `join`)."""
        self.queue.flush(self.sock)  # (housekeeping calls this every 0.25 s: what the socket did not take before)
        if welcomed:
            self.joining = None
        elif self.joining is not None and now >= self.next_join:
            self.send("shard_join", **self.joining)
            self.next_join = now + JOIN_AGAIN_S

    def received(self) -> Iterator[protocol.Message]:
        """The leader's whole messages of this term that are waiting now; raises Rejoin on a `reject`."""
        while True:
            try:
                msg = self.parts.decode(b"leader", self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            except protocol.ProtocolError as exc:
                self.drop(exc.reason, f"from the leader: {exc}")
                continue
            if msg is None:
                continue
            self.heard_at = time.monotonic()
            if msg.type == "reject":
                raise Rejoin(msg.header["reason"])
            if msg.header.get("term") == self.term:
                yield msg

    def check_term(self) -> None:
        """Raises NewTerm once the leader started another term, SystemExit(0) once the run is over (as Redis said
        when the watch last read it). While the leader is silent, the next reading is asked for at once (every
        QUIET_S at most), as a worker does while idle: a new leader's term is seen within a loop pass or two, not the
        watch's quarter second (most of the wait between the new leader's advertisement and this shard's join)."""
        now = time.monotonic()
        if now - max(self.heard_at, self.poked_at) >= QUIET_S:
            self.poked_at = now
            self.watch.poke()
        if (seen := self.watch.take()) is not None:
            term, state = seen[0]
            if term is not None and int(term) != self.term:
                raise NewTerm(int(term), self.term)
            if state in ("completed", "failed"):
                raise SystemExit(0)

    def finish(self, ckpt: CheckpointerLink, trainer: Trainer, totals: RunTotals,
               drops: Callable[[], dict[str, int]]) -> None:
        """The end of the run here, once: the final snapshot to the checkpointer, then, once it is written, the last
        step's slice to the leader (`final`), the order the leader takes them in (leader/finish.py). Waited for from
        the shard's loop, which meanwhile still sees a new term (`check_term`).

        Before issue 47's fix the slice went first and the loop then waited in `save_final`. The slice waited in TCP
        for the leader, which reads it only after its own wait for that checkpoint; a receive window closed longer
        than the link timeout ends the connection on Linux (TCP_USER_TIMEOUT counts it: shared/runtime/links.py),
        and the reset, reaching the leader's libzmq while its input from this shard was stopped (RCVHWM 2) and a
        heartbeat was due, aborted the leader (`!_io_error`, libzmq 4.3.5 stream_engine_base.cpp:310): no fault
        injected, cluster.max_message_bytes under the slice, the run hung in most runs (tests/test_shards.py). The
        shard, waiting for a checkpoint the dead leader's term never completes, never joined the new term."""
        if self.finishing:
            return
        self.finishing = True
        ckpt.offer_final(snapshots.collect(trainer, totals, self.term, {}, None),
                         then=lambda: self.final(trainer, totals, drops()))

    def final(self, trainer: Trainer, totals: RunTotals, drops: dict[str, int]) -> None:
        """The last step's slice, with this shard's totals: the leader reports the run's result over the whole model."""
        self.ctx.log.info("shard finished", step=trainer.step)
        self.send("shard_final", tensors={n: p.detach() for n, p in trainer.pieces.items()},
                  step=trainer.step, bytes_in=totals.bytes_in, bytes_out=totals.bytes_out,
                  slot_in=totals.slot_in, slot_out=totals.slot_out,
                  changes_sent=totals.changes_sent, mirrors_sent=totals.mirrors_sent,
                  inner_states_sent=totals.inner_states_sent, inner_rounds_replayed=totals.inner_rounds_replayed,
                  drops=drops, mirror=trainer.mirror_hashes())

    def close(self) -> None:
        """Once finishing, what still waits (shard_final) gets half a second to go, and as long again in the socket.
        Else nothing it holds is worth a wait: its periodic messages, or those of a term this shard leaves, to a
        leader that is most often dead (its socket's queue then never drains: the context's end waited out the whole
        linger, 0.5 s of each shard's restart after a leader's death, issue 47)."""
        linger = 500 if self.finishing else 0
        deadline = time.monotonic() + linger / 1000
        while len(self.queue) and self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            self.queue.flush(self.sock)
        self.watch.stop()
        self.sock.close(linger=linger)
