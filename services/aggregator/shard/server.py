"""Parameter-server shard k > 0 of `cluster.shards` (docs/design.md, "Shards").

Shard 0 (the leader, `server.Aggregator`) hands out the leases; a shard k > 0 owns a run of the chunk grid's pieces
(shared/core/grid.py) and their optimizer state, and otherwise only follows:

- workers say hello (registered incarnations only, as at the leader) and send it their gradient's slice for a node of
  the step's reduction tree, at the same time as every other shard's; the step is collected, reported to the leader
  (`shard_have`, `shard_ready`) and stepped at its `shard_commit` by the same rule as the leader's (stepping.py).
- `pull(version)` is answered with that version's slice as soon as the shard has it, or (naming a replica) with the state of a
  replica r ≡ k mod K this shard keeps (`train.inner_states: shards`: it comes with its slice, inner.py).
- a new leader term is joined in place, this process and its state kept (newterm.py), or left by a restart where it
  cannot be. Snapshots go to the checkpointer like the leader's; it writes one checkpoint once it has every shard's
  slice of a step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq
from cmemi.services.aggregator.common.admission import Admission, EnvironmentCheck, LeaseSeal
from cmemi.services.aggregator.common.evaluation import eval_boundary
from cmemi.services.aggregator.common.intake import Drops, Intake
from cmemi.services.aggregator.common.outbox import Encoded, Outbox
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.shard import join as shard_join
from cmemi.services.aggregator.shard import newterm
from cmemi.services.aggregator.shard.door import Door
from cmemi.services.aggregator.shard.inner import ShardStates
from cmemi.services.aggregator.shard.pulls import SliceServer
from cmemi.services.aggregator.shard.stepping import ShardStepper
from cmemi.services.aggregator.shard.upstream import LeaderLink, NewTerm, Rejoin
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.services.aggregator.steplog import shard as shard_log
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.coordination.membership import Member
from cmemi.shared.core.environment import environment
from cmemi.shared.memory import shm
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext, serve_router
from cmemi.shared.wire import limits


class ShardServer:
    def __init__(self, ctx: ServiceContext, shard: int) -> None:
        self.ctx, self.cfg, self.log, self.shard = ctx, ctx.cfg, ctx.log, shard
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        try:
            self.trainer = Trainer(cfg, shard=shard)
        except ConfigError as exc:
            ctx.fatal(str(exc))
        startup.mark("model_built")
        self.total = cfg.train.rounds
        self.codec = make_codec(cfg.compression)  # a NaN or inf is dropped as codec_nonfinite
        self.zctx = zmq.Context()
        self.sock, self.addr = serve_router(ctx, self.zctx, cfg.cluster.aggregator_port)
        self.drops = Drops(self.log)
        self.outbox = Outbox(self.sock, ctx.run, cfg.cluster.message_cap(), self.log, ctx.fatal)
        # the run's fingerprint (door.py) and the lease seal come with the leader's welcome (shard_welcome)
        self.seal: LeaseSeal | None = None
        self.admission = Admission(ctx.redis, ctx.keys, lambda fp: self.door.agrees(fp),
                                   EnvironmentCheck(environment(torch.device("cpu"), cfg)),
                                   cfg.cluster.require_same_environment, self._send, self.drops, self.log)
        self.intake = Intake(ctx.run, cfg.cluster.message_cap(), limits.logical_bytes(cfg), cfg.cluster.checksum,
                             cfg.cluster.workers + cfg.cluster.spare_workers, ctx.curve, ("hello", "grad", "pull"),
                             self.admission.admitted, self.drops, slots=cfg.cluster.transport != "tcp",
                             spare_bytes=2 * limits.nbytes(self.trainer.pieces.values()))
        self.door = Door(self.admission, self.intake, self._send, self.log, shard)  # workers' hellos
        self.member = Member(ctx.redis, ctx.keys, "aggregator", str(shard), cfg.cluster.heartbeat_interval,
                             cfg.cluster.dead_after, extra={"addr": self.addr, **ctx.member_extra}).start()
        self.term, leader_addr, restored_step = shard_join.find_leader(ctx, shard)
        self.ckpt = CheckpointerLink(ctx, self.zctx, self.term, self.drops)
        self.ckpt.sharding = {"shard": shard, "shards": cfg.cluster.shards, "pieces": self.trainer.partition.describe()}
        self.totals = RunTotals()
        self.states = ShardStates(self.trainer, self.outbox.send, self.totals, cfg.cluster.checksum, ctx.emit)
        logged = shard_log.in_use(cfg, self.trainer)  # (its leader moved on: the newest checkpoint, then the log)
        self.door.parks = logged and shard_log.moved_on(ctx, max(restored_step, 0))  # (within the term, maybe)
        joined_at = shard_join.restore_slice(ctx, self.trainer, self.totals, self.ckpt, restored_step, shard,
                                             newest=self.door.parks)
        self.steplog = shard_log.ShardStepLog(ctx, self.zctx, self.term, shard, self.ckpt.on_saved,
                                              shard_log.framed(self.codec, self.trainer)) if logged else None
        if self.steplog is not None and joined_at >= 0:  # this shard's entries, to its leader's replayed step
            joined_at = self.steplog.replay(ctx, self.trainer, self.totals)
        self.snapshotted = -1  # the last step checkpointed here (a forced checkpoint is not sent twice)
        self.last_eval: newterm.Boundary | None = None  # sent at the last evaluation step; a new term may ask again
        self.trainer.keep_own_rows()  # this shard's rows only, from here on (docs/design.md, "Memory")
        # one stage, the whole slice, unless steps are pipelined (cluster.pipeline_stages)
        self.pipelined = bool(cfg.cluster.pipeline_stages)
        self.stages = self.trainer.partition.staged(shard)
        # compression.downlink: the slice sent is the mirror, and streaming most often only its changed pieces: both
        # without slots
        mirror, changed = self.trainer.mirror, self.trainer.changed_since if self.trainer.fragments else None
        self.slices = SliceServer([self._stage(g) for g in range(len(self.stages))], cfg.cluster.checksum, shard,
                                  self._send, self.pipelined, run=ctx.run, mirror=mirror, changed=changed,
                                  slotted=(lambda i: i in self.intake.granted)
                                  if self.intake.slots is not None and mirror is None and changed is None else None)
        # a snapshot still being sent, and parameters still queued for a worker, name what a step changes
        self.trainer.before_change += [self.ckpt.protect, self.slices.protect]
        self.leader = LeaderLink(ctx, self.zctx, leader_addr, shard, self.term, lambda: self.member.incarnation,
                                 self.drops)
        self.leader.join(joined_at, self.addr)  # said again until welcomed (upstream.py)
        self.step = ShardStepper(self.trainer, self.codec, self.stages, self.pipelined, self.intake, self.states,
                                 self.slices, self.steplog, self.leader, self._send, self.drops, ctx.fatal, shard)
        self._next_check = 0.0
        self.done = self.trainer.step >= self.total
        startup.mark("listening")
        startup.report(ctx.redis, ctx.keys, "aggregator", str(shard))
        self.log.info("shard listening", shard=shard, addr=self.addr, term=self.term, step=self.trainer.step,
                      pieces=len(self.trainer.pieces), bytes=self.trainer.partition.bytes_of(shard))

    def _join_here(self) -> None:
        """The join said at this shard's step, where its sums start anew (what the old ones held goes)."""
        self.step.restart()
        self.intake.reclaim()
        self.trainer.release_heap()
        self.done = self.trainer.step >= self.total
        self.leader.join(self.trainer.step, self.addr)

    def _stage(self, g: int) -> dict[str, torch.Tensor]:
        pieces = self.trainer.pieces if self.trainer.mirror is None else self.trainer.mirror.tensors
        return {n: pieces[n] for n in self.stages[g]}

    def _send(self, identity: bytes, mtype: str, encoded: Encoded | None = None, **fields: Any) -> None:
        n = self.outbox.send(identity, mtype, encoded, **fields)
        if mtype == "slice":  # a slot's bytes count as the socket's would (shm.payload_bytes)
            slotted = shm.payload_bytes(fields["shm"]) if "shm" in fields else 0
            self.totals.slot_out += slotted
            self.totals.bytes_out += n + slotted
            self.totals.sent(fields)

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        while True:
            try:
                return self._loop()
            except NewTerm as exc:
                if not self._enter_term(exc):
                    return Exit.REJOIN
            except Rejoin as exc:
                self.log.info("leaving the term; starting again from its checkpoint", reason=str(exc))
                return Exit.REJOIN

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.leader.sock, zmq.POLLIN)
        while not self.ctx.stopping.is_set():
            self.ckpt.wake_for_room(poller)
            events = dict(poller.poll(50))
            if self.leader.sock in events:
                self._from_leader()
            if self.sock in events:
                for _ in range(64):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
            self.ckpt.pump()  # the next parts of a snapshot (outgoing.py)
            self._housekeeping()
        return 0

    def _enter_term(self, new: NewTerm) -> bool:
        """Join the leader's new term in place (newterm.py); False: leave it by a restart."""
        link = newterm.restarts_instead(self.cfg, self.trainer, self.codec, self.done or self.leader.finishing) or \
            newterm.enter(self.ctx, self.zctx, new, self.leader, self.ckpt, self.steplog, self.trainer, self.totals,
                          self.last_eval, lambda: self.member.incarnation, self.drops)
        if isinstance(link, str):
            self.ctx.emit("shard_left_term", shard=self.shard, term=new.term, step=self.trainer.step, why=link)
            self.log.info("leaving the term; starting again from its checkpoint", reason=str(new), why=link)
            return False
        self.leader, self.term, self.seal = link, link.term, None
        self.door.new_term(self.term)
        self.step.new_term(link)
        self._next_check = 0.0
        self._join_here()
        return True

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self.step.report(now, self.done)  # shard_ready again, or shard_have (stepping.py)
        if self.steplog is not None:
            self.steplog.poll()
        self.leader.check_term()  # each pass (a read of what the watch last saw): a new term is left at once
        if now < self._next_check:
            return
        self._next_check = now + 0.25
        self.leader.join_again(self.seal is not None, now)
        self.ckpt.poll()

    def _from_leader(self) -> None:
        for msg in self.leader.received():
            h = msg.header
            if msg.type == "shard_commit" and h["step"] == self.step.version:
                self._commit(h["partials"], h["skip"], h["last"], h["snapshot"])
            elif msg.type == "shard_welcome":
                self.seal = LeaseSeal(h["lease_key"])
                if self.steplog is not None and (boundary := self.steplog.take_boundary()) is not None:
                    # its evaluation may run again; sent once joined (before, a restarted one's would not count)
                    self.leader.send("shard_eval", tensors=boundary[1], step=boundary[0])
                self.door.opened(h["fp"], self.term, self.trainer.step, self.total)
                if self.done and not self.leader.finishing:  # joined at the last step: its end comes only now
                    self._finish()
            elif msg.type == "shard_behind" and self.steplog is not None and self.seal is None:
                # (leader/roster.py `Restarts`; not moved: the join said again in a second asks again)
                if self.steplog.catch_up(self.ctx, self.trainer, self.totals, h["step"]):
                    self._join_here()
            elif msg.type == "shard_fence":
                self.admission.fence(h["wid"], h["inc"])
            elif msg.type == "shard_snapshot" and h["step"] == self.trainer.step != self.snapshotted:
                self._snapshot()  # the step log's forced checkpoint (a restarted checkpointer lost the log)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        taken = self.intake.take(frames)
        if taken is None:
            return
        identity, msg, size = taken
        if msg is None or msg.type == "grad":  # all gradient bytes workers sent (a part: of a bigger one; a slot's)
            self.totals.bytes_in += size
            self.totals.slot_in += self.intake.slot_bytes
        if msg is None:
            return
        h = msg.header
        if msg.type == "hello":
            self.door.hello(identity, h, self.term, self.trainer.step, self.total)
            return
        if self.admission.known(identity, msg.type, h, self.term) is None:
            pass
        elif msg.type == "pull" and (h["replica"] is not None or h["past"]):  # a state, an old version (inner.py)
            self.states.pull(identity, h)
        elif msg.type == "pull":
            self.slices.pull(identity, h["version"], h["have"])
            self.step.answer_pulls()
        else:
            self.step.offer(identity, msg, self.seal, self.term)
        if msg.type == "grad":  # what it landed in is free again unless the step's sums keep it (gradients.Spares)
            self.intake.settle(self.step.holds())

    def _commit(self, partials: list[float], skip: bool, last: bool, snapshot: bool) -> None:
        self.step.commit(partials, skip)  # (stepping.py)
        step = self.trainer.step
        if eval_boundary(self.cfg, step):
            # the leader evaluates the whole model of this step: a copy, the next step changes the pieces
            self.last_eval = (step, {n: p.detach().clone() for n, p in self.trainer.pieces.items()})
            self.leader.send("shard_eval", tensors=self.last_eval[1], step=step)
        if last:  # train.steps, or the leader stopped early
            self._finish()
        elif snapshot:  # the leader names the steps every shard checkpoints
            self._snapshot()

    def _snapshot(self) -> None:
        self.snapshotted = self.trainer.step
        self.ckpt.offer(snapshots.collect(self.trainer, self.totals, self.term, {}, None))

    def _finish(self) -> None:
        """The last step (or joined at it: a leader restarted after it): the final snapshot, then the slice to the
        leader (the run's result); from the loop, not waiting in it (upstream.py `finish`)."""
        self.done = True
        self.intake.release()  # no gradient comes any more: the buffers kept for the next step go
        self.trainer.release_heap()
        self.leader.finish(self.ckpt, self.trainer, self.totals, self.drops.as_dict)

    def close(self) -> None:
        if self.steplog is not None:
            self.steplog.close()
        self.slices.close()
        self.ckpt.close()
        self.member.stop()
        self.sock.close(linger=500)
        self.leader.close()
        self.ctx.curve.close()
        self.zctx.destroy(linger=200)
