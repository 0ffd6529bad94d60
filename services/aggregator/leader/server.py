"""The parameter server's leader (shard 0): wiring, the receive loop, and what each message type does.

Workers pull: `want` (or a `grad`, which implies the next `want`) is answered with `work` — carrying the
parameters when the worker's version is stale — or parked until work exists. With `cluster.shards` > 1 the
leader leases for every shard, steps its own slice, and commits each step on all of them (docs/design.md §4;
the others run `shard.ShardServer`). Each job lives in its own module (docs/design.md §7): the intake
(`intake.py`), admission (`admission.py`), leases (`leasing.py`), the shards (`leader.py`), the step
(`stepping.py`), evaluation (`eval_schedule.py`), reporting (`reporting.py`) and the end of the run (`finish.py`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator.common import gradients
from cmemi.services.aggregator.common.admission import Admission, EnvironmentCheck, LeaseSeal, WorkerInfo
from cmemi.services.aggregator.common.intake import Drops, Intake
from cmemi.services.aggregator.common.misfits import Misfits
from cmemi.services.aggregator.common.outbox import Outbox
from cmemi.services.aggregator.common.publish import Publisher, SlotPublisher
from cmemi.services.aggregator.common.replicas import Holdings
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.leader import dataprint, finish
from cmemi.services.aggregator.leader.eval_schedule import EvalSchedule
from cmemi.services.aggregator.leader.leasing import Leasing
from cmemi.services.aggregator.leader.reporting import Reporter
from cmemi.services.aggregator.leader.roster import ShardRoster
from cmemi.services.aggregator.leader.stepping import Stepper
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.shared.compression.codecs import make_codec
from cmemi.shared.compression.downlink import DELTA, DENSE, SentChanges
from cmemi.shared.config.plugins import resolve
from cmemi.shared.config.schema import ConfigError
from cmemi.shared.coordination.membership import Member, allocate
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.core.environment import environment
from cmemi.shared.memory import shm
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.service import ServiceContext, serve_router
from cmemi.shared.wire import limits, protocol, state
from cmemi.shared.wire.layout import Layout

TYPES = ("hello", "want", "grad", "leave", "fence", "shard_join", "shard_have", "shard_ready", "shard_eval",
         "shard_final")


class Aggregator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        try:
            self.trainer = Trainer(cfg)
            if self.trainer.inner is not None:  # train.local_steps: what a replica's inner state must look like
                self.trainer.inner.expect(innerstate.layout_of(cfg, {n: (s, self.trainer.params[n].dtype)
                                                                  for n, s in self.trainer.whole_shapes.items()}))
            startup.mark("model_built")
            eval_fn = resolve(cfg.eval.fn, "eval.fn") if cfg.eval.fn else None
        except ConfigError as exc:
            ctx.fatal(str(exc))
        self.fp: dict[str, Any] = {}  # the checkpoint's, else the first admitted worker's: the aggregator reads no data
        self.report_buffers = bool(self.trainer.buffers) and cfg.model.buffers == "mean"
        # Decode side, stateless. NaN/inf is checked once per step on the sum, not per message (stepping.py).
        self.codec = make_codec(cfg.compression, check_finite=False)
        self.checking_codec = make_codec(cfg.compression)  # a strict collection's: NaN/inf dropped as codec_nonfinite
        self.zctx = zmq.Context()
        self.sock, self.addr = serve_router(ctx, self.zctx, cfg.cluster.aggregator_port)
        self.drops = Drops(self.log)
        self.misfits = Misfits()  # admitted workers' gradients in a row that do not fit (misfits.py)
        self.outbox = Outbox(self.sock, ctx.run, cfg.cluster.max_message_bytes, self.log, ctx.fatal)
        self.term = allocate(ctx.redis, ctx.keys.term)
        self.seal = LeaseSeal(os.urandom(32))  # this term's: given to the shards when they join
        self.admission = Admission(ctx.redis, ctx.keys, lambda fp: dataprint.agrees(self.fp, fp),
                                   EnvironmentCheck(environment(torch.device("cpu"), cfg)),
                                   cfg.cluster.require_same_environment, self._reply, self.drops, self.log)
        self.told_stop: set[bytes] = set()  # workers told that the run is over
        self.roster = (ShardRoster(ctx, self.trainer.partition, self.term, self.outbox, self.drops,
                                   lambda: {"lease_key": self.seal.key, "fp": dict(self.fp)})
                       if self.trainer.sharded else None)
        # messages bigger than one, from admitted workers (gradients) and joined shards (their final and evaluation
        # slices) only: one partial transfer each, and one for a replacement
        self.intake = Intake(ctx.run, cfg.cluster.max_message_bytes, limits.logical_bytes(cfg), cfg.cluster.checksum,
                             cfg.cluster.workers + cfg.cluster.spare_workers + cfg.cluster.shards, ctx.curve, TYPES,
                             self._admitted, self.drops, slots=cfg.cluster.transport != "tcp", borrows=True,
                             spare_bytes=2 * limits.nbytes(self.trainer.pieces.values()))
        self.totals = RunTotals()  # restored from the checkpoint
        self.ckpt = CheckpointerLink(ctx, self.zctx, self.term, self.drops)
        self.layout = Layout(self.trainer.wire_state())  # of the parameters sent out (shared/wire/layout.py)
        self.publisher = Publisher(cfg.cluster.checksum, self.layout)
        # a snapshot still being sent, and parameters still queued for a worker, name what a step changes
        self.trainer.before_change += [self.ckpt.protect, self.publisher.protect]
        # same-host workers (cluster.transport auto or shm, over ipc://): parameters in shared-memory slots, written
        # once per version for all of them, and their gradients read from their own (shared/memory/shm.py)
        # (not with compression.downlink: a version's change is a few small frames, sent as they are)
        self.slots = SlotPublisher(ctx.run, "leader", cfg.cluster.checksum, self.layout) \
            if self.intake.slots is not None and self.trainer.mirror is None else None
        self._deltas = SentChanges()  # compression.downlink, streaming: the current version's changes, encoded, by base
        self.reporter = Reporter(ctx, cfg, self.totals, self.term)
        self.evals = EvalSchedule(ctx, cfg, eval_fn, self.reporter.eval)
        restored = self.ckpt.fetch_latest(timeout=120, trainer=self.trainer)
        startup.mark("checkpoint_asked")
        if restored is not None:
            try:
                snapshots.restore(self.trainer, self.totals, self.fp, self.evals.bg, restored.header["meta"],
                                  restored.tensors)
            except (state.StateError, KeyError, RuntimeError, ValueError) as exc:
                ctx.fatal(f"cannot restore checkpoint of step {restored.header['step']}: {exc}")
            self.log.info("restored from checkpoint", step=self.trainer.step)
        self.member = Member(ctx.redis, ctx.keys, "aggregator", "0", cfg.cluster.heartbeat_interval,
                             cfg.cluster.dead_after, extra={"addr": self.addr, "term": self.term, **ctx.member_extra}).start()
        self.restored_step = self.trainer.step if restored is not None else -1  # shards k > 0 restore exactly it
        self.waiting: list[tuple[bytes, protocol.Message]] = []  # hellos that came before every shard joined
        if self.trainer.sharded:
            self.ckpt.sharding = {"shard": 0, "shards": self.trainer.partition.shards,
                                  "pieces": self.trainer.partition.describe()}
        self._advertise()
        self._contributed: set[tuple[str, int]] = set()
        # local steps: the (replica, round) inner states each worker holds (services/aggregator/common/replicas.py)
        self.holdings = Holdings(self.trainer.inner.R) if self.trainer.inner is not None else None
        # Redis may restart empty: is this leader still advertised? (read off the loop: shared/coordination/watch.py)
        self.advertised = Watch(ctx.redis, 1.0, lambda r: r.exists(ctx.keys.aggregator), "leader").start()
        # (local steps: a lease is one replica's round)
        self.leasing = Leasing(cfg, self.codec.per_microbatch or self.trainer.local, self.trainer.sharded, self.seal, self.term,
                               lambda: len(self.admission.workers), self.intake.reclaim)
        self.leasing.new_step(self.trainer.step)
        self.stepper = Stepper(ctx, self.trainer, self.leasing, self.roster, self.evals, self.reporter, self.ckpt,
                               self.totals, self.term, lambda: self.fp, self.drops, lambda: len(self.admission.workers),
                               self._serve_parked)
        if eval_fn and self.trainer.step == 0 and not self.stepper.done:
            self.evals.start_probe(self.stepper.weights())  # a broken eval.fn stops the run now, not after training
        self.trainer.keep_own_rows()  # sharded: this shard's rows only, from here on (docs/design.md, "Memory")
        ctx.emit("aggregator_started", term=self.term, addr=self.addr, step=self.trainer.step)
        startup.mark("listening")
        startup.report(ctx.redis, ctx.keys, "aggregator", "0")
        self.log.info("aggregator listening", addr=self.addr, term=self.term,
                      fingerprint=self.fp.get("sha256", "(the first worker's)")[:12])

    def _advertise(self) -> None:
        self.ctx.redis.hset(self.ctx.keys.aggregator, mapping={"addr": self.addr, "term": self.term,
                                                               "incarnation": self.member.incarnation,
                                                               "restored": self.restored_step})

    def _admitted(self, identity: bytes) -> bool:
        return self.admission.admitted(identity) or (self.roster is not None and self.roster.is_shard(identity))

    def _reply(self, identity: bytes, mtype: str, **fields: Any) -> None:
        self.outbox.send(identity, mtype, **fields)

    def _housekeeping(self, now: float) -> None:
        self.evals.check_probe()
        if self.leasing.expire(now):
            self.ctx.emit("lease_expired", step=self.leasing.collector.step)
            self._serve_parked()
        elif self.leasing.parked and (self.leasing.collector.pending or self.leasing.reissuable()):
            self._serve_parked()  # a lease is withheld (or slow), or one kept for its holder is free, while workers idle
        self.intake.keep(self.admission.workers)  # a fenced or departed worker's unfinished gradient goes
        if self.advertised.take() == (0,):  # Redis restarted empty: advertise again
            self._advertise()
            self.log.info("re-advertised after Redis lost its data")

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_housekeeping = 0.0
        while not self.ctx.stopping.is_set() and not self.stepper.done:
            self.ckpt.wake_for_room(poller)
            if poller.poll(50):
                for _ in range(64):  # drain a burst without starving housekeeping
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
                    self.stepper.after_step()
                    if self.stepper.done:
                        break
            self.ckpt.pump()  # the next parts of a snapshot (outgoing.py)
            now = time.monotonic()
            if now >= next_housekeeping:
                next_housekeeping = now + 0.1
                try:
                    self.ckpt.poll()
                    self._housekeeping(now)
                except redis.RedisError as exc:  # Redis down or restarting: training goes on without it
                    self.log.warning("redis unavailable", error=str(exc))
        if self.stepper.done:
            self.publisher.release()  # no version goes out again: its copy is not kept for the end's peak
            self.intake.release()  # nor does a gradient come: the step's buffers kept for the next go too
            self.trainer.release_heap()
            if self.slots is not None:
                self.slots.close()  # likewise its slots (unlinked; the pages go with the workers' last reads)
            finish.finish(self.ctx, self.trainer, self.stepper, self.evals, self.roster, self.reporter, self.ckpt,
                          self.totals, self.term, self.drops.as_dict(), self._pump)
            for identity, _, _ in self.leasing.waiting():
                self._tell_stop(identity)
            self.leasing.parked.clear()
            finish.linger(self.sock, self._tell_stop, lambda: set(self.admission.workers) <= self.told_stop, 1.0)

    def _tell_stop(self, identity: bytes) -> None:
        self.outbox.send(identity, "stop", reason="training complete")
        self.told_stop.add(identity)

    def _pump(self) -> None:
        """Receive one message, if one comes within 50 ms (the end of a run waits for the shards' pieces)."""
        if self.sock.poll(50):
            self._receive(self.sock.recv_multipart(copy=False))

    def _receive(self, frames: list[zmq.Frame]) -> None:
        taken = self.intake.take(frames)
        if taken is None:
            return
        identity, msg, size = taken
        if msg is None:  # a part of a bigger message (a worker's gradient, a shard's pieces); the rest is coming
            if self.admission.admitted(identity):
                self.reporter.grad_bytes(size)
            return
        if msg.type == "grad":  # all gradient bytes workers sent, accepted or not (a slot's too: Intake.take)
            self.reporter.grad_bytes(size)
            self.totals.slot_in += self.intake.slot_bytes
        self._handlers[msg.type](self, identity, msg)
        if msg.type == "grad":  # what it landed in is free again unless the step's sums keep it (gradients.Spares)
            self.intake.settle(self.leasing.collector.holds())

    def _work(self, identity: bytes, node: tuple[int, int, bytes], held_version: int, last: bool = False) -> None:
        """Send a lease; with the current parameters (encoded once per version, sent zero-copy) if the worker's
        are stale. `last`: the worker's last lease of this step, as things stand."""
        fields: dict[str, Any] = {"last": True} if last else {}
        if held_version != self.trainer.step and self.trainer.mirror is not None:
            encoded = self._downlink(held_version, fields)
        elif held_version != self.trainer.step and \
                (pieces := self.trainer.changed_since(held_version, self.trainer.step)) is not None:
            encoded = self._pieces(held_version, pieces, fields)
        elif held_version != self.trainer.step and self.slots is not None and identity in self.intake.granted \
                and (wire := self.trainer.wire_state()):
            fields["shm"] = self.slots.descriptor(wire, self.trainer.step)  # no frames: the worker reads the slot
            if self.slots.layout is not None:
                fields["layout"] = self.layout.digest
            encoded = (([], []), None)
        elif held_version != self.trainer.step:
            encoded = self.publisher.encoded(self.trainer.wire_state(), self.trainer.step)
            if self.publisher.layout is not None:
                fields["layout"] = self.layout.digest
        else:
            encoded = (([], []), None)  # a work message always lists its tensors, here none
        if self.trainer.inner is not None:
            self._inner(identity, node[0])
        n = self.outbox.send(identity, "work", encoded, term=self.term, step=self.leasing.collector.step, lo=node[0],
                             hi=node[1], lease=node[2], version=self.trainer.step, scale=self.trainer.scaler.scale,
                             **fields)
        self.totals.duplicate_param_sends += self.leasing.sent(identity, self.trainer.step if held_version !=
                                                                self.trainer.step else None)
        self.totals.sent(fields)
        slotted = shm.payload_bytes(fields["shm"]) if "shm" in fields else 0  # counted as the socket's would be
        self.totals.slot_out += slotted
        self.reporter.work_bytes(n + slotted)

    def _inner(self, identity: bytes, r: int) -> None:
        """Local steps: replica r's inner state at the start of this round, ahead of its work, unless the worker holds it
        (it computed the replica's last round: docs/design.md §10)."""
        step = self.trainer.step
        assert self.trainer.inner is not None and self.holdings is not None
        if self.holdings.has(identity, r, step):
            return
        meta, tensors = self.trainer.inner.wire(r)
        self.totals.inner_states_sent += bool(meta)  # (a fresh one, round 0's, is an empty map)
        if self.trainer.fragments:  # streaming: the snapshot's own segment (the worker computes the ones since again)
            step = (self.trainer.inner.start(r) or {}).get("start", 0)
        n = self.outbox.send(identity, "inner", (protocol.encode_tensors(tensors, self.cfg.cluster.checksum), None),
                             replica=r, round=step, meta=meta)
        self.reporter.work_bytes(n)

    def _note_holds(self, identity: bytes, h: dict[str, Any]) -> None:
        """Local steps: the (replica, round) inner states a worker says it holds (a `want` or `grad`)."""
        if self.holdings is not None:
            self.holdings.note(identity, h.get("holds"), self.admission.admitted)

    def _downlink(self, held_version: int, fields: dict[str, Any]) -> Any:
        """compression.downlink: the change (or the chain of them) from the worker's version to the current one when
        the mirror kept them (encoded once per version and base, with the step's buffers as they are), else the whole
        mirror (docs/design.md §9)."""
        mirror, step = self.trainer.mirror, self.trainer.step
        assert mirror is not None
        if (change := mirror.change(held_version)) is None:
            fields["downlink"] = DENSE
            if self.publisher.layout is not None:
                fields["layout"] = self.layout.digest
            return self.publisher.encoded(self.trainer.wire_state(), step)
        def encode() -> tuple[Any, Any]:
            buffers = {k: b.clone() for k, b in self.trainer.wire_buffers().items()}  # folded in place next step
            return change[0], protocol.encode_tensors({**change[1], **buffers}, self.cfg.cluster.checksum)
        info, encoded = self._deltas.get(step, held_version, encode)
        fields.update(downlink=DELTA, base=held_version, codec=info)
        return (encoded, None)

    def _pieces(self, held_version: int, pieces: dict[str, torch.Tensor], fields: dict[str, Any]) -> Any:
        """Streaming: only the pieces the steps since the worker's version changed (its fragments: P / F a step, not
        P), and the step's buffers; copied, as the next step changes them in place, once per version and base."""
        fields.update(downlink=fragmenting.PIECES, base=held_version)
        return (self._deltas.get(self.trainer.step, held_version,
                                 lambda: fragmenting.encoded(pieces, self.cfg.cluster.checksum)), None)

    def _serve(self, identity: bytes, info: WorkerInfo, held_version: int, after_grad: bool = False) -> None:
        if self.stepper.done:
            self._tell_stop(identity)
            return
        self.reporter.started(time.monotonic())
        step, holdings = self.leasing.collector.step, self.holdings
        prefer = holdings.prefer(identity, step) if holdings is not None else set()
        avoid: set[int] = set()
        if holdings is not None and self.trainer.fragments:
            # streaming: a replica another live worker holds waits for it (it may have computed it ahead already), never
            # moves with its state to whoever asks first; a holder silent for a lease's timeout holds nothing back
            fair = -(-self.cfg.train.microbatches // max(1, len(self.admission.workers)))
            avoid = holdings.elsewhere(identity, step, self.admission.admitted, fair, self.leasing.timeout)
        if (node := self.leasing.lease(identity, info, held_version, prefer, avoid)) is not None:
            # streaming: nothing else this step for this worker (every leaf left is held elsewhere), so it may compute
            # its next segments as soon as it has sent this one, not only once its gradient is here (`parked`)
            last = bool(self.trainer.fragments) and \
                all(hi - lo == 1 and lo in avoid for lo, hi in self.leasing.collector.pending)
            self._work(identity, node, held_version, last)
        elif after_grad and self.trainer.fragments:  # streaming: the worker may compute its next segments meanwhile
            self.outbox.send(identity, "parked", step=self.leasing.collector.step)

    def _serve_parked(self) -> None:
        for identity, info, held_version in self.leasing.waiting():
            if not self.leasing.has_work(self.stepper.done):
                return
            self.leasing.forget(identity)
            self._serve(identity, info, held_version)

    # ------------------------------------------------------------------ workers
    def _on_hello(self, identity: bytes, msg: protocol.Message) -> None:
        if self.roster is not None and not self.roster.complete:  # answered once every shard joined this term
            self.waiting = [(i, m) for i, m in self.waiting if i != identity][-256:] + [(identity, msg)]
            return
        h = msg.header
        if (info := self.admission.hello(identity, h)) is None:
            return
        if self.roster is not None:
            self.roster.announce()  # the run's fingerprint, once the first worker set it, before any shard's hello
        self._fenced(info.wid, info.inc - 1, announce=False)  # admission fenced the older incarnations
        slots = self.intake.grant(identity, h)
        self.outbox.send(identity, "welcome", term=self.term, step=self.trainer.step, version=self.trainer.step,
                         total_steps=self.cfg.train.rounds, shards=self.roster.addrs() if self.roster else [],
                         shm=slots)
        self.ctx.emit("worker_admitted", worker=info.wid, incarnation=info.inc, host=info.host, term=self.term)
        self.log.info("worker admitted", worker=info.wid, incarnation=info.inc, host=info.host)

    def _on_want(self, identity: bytes, msg: protocol.Message) -> None:
        info = self.admission.known(identity, msg.header, self.term)
        if info is not None:
            if not self.leasing.answered(identity, msg.header.get("reask")):  # its work may still be arriving
                self.outbox.send(identity, "pending", reask=msg.header["reask"])
                return
            # A worker that asks plainly holds no lease (it works on one at a time, and the link keeps order): a
            # lease still on its name was lost on the way (its work or its grad); it goes back to the queue now.
            if self.leasing.release(info.wid, info.inc):
                self._serve_parked()
            self._note_holds(identity, msg.header)
            self._serve(identity, info, msg.header["version"])

    def _on_grad(self, identity: bytes, msg: protocol.Message) -> None:
        info = self.admission.known(identity, msg.header, self.term)
        if info is None:
            return
        h = msg.header
        self.leasing.answered(identity, None)
        self._take_grad(identity, info, h, msg.tensors)
        self._note_holds(identity, h)
        self._serve(identity, info, h["version"], after_grad=True)

    def _misfit(self, identity: bytes, info: WorkerInfo, reason: str, detail: str) -> None:
        """Drop a gradient that does not fit (misfits.py); the worker's LIMIT-th in a row gets a fatal reject."""
        self.drops(reason, detail)
        if (why := self.misfits.reject(identity, info.wid, reason, detail, "the aggregator")) is not None:
            self.outbox.send(identity, "reject", fatal=True, reason=why)

    def _take_grad(self, identity: bytes, info: WorkerInfo, h: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        collector = self.leasing.collector
        where = f"{info.wid}: step {h['step']} microbatches [{h['lo']}, {h['hi']})"
        borrowed = self.intake.lent is not None  # views of the worker's slot: read, never kept (intake.py)
        produced = {k[len(PREFIX):]: tensors.pop(k).clone() if borrowed else tensors.pop(k)
                    for k in [k for k in tensors if k.startswith(PREFIX)]}
        inner_tensors = {k: tensors.pop(k).clone() if borrowed else tensors.pop(k)
                         for k in [k for k in tensors if k.startswith(innerstate.PREFIX + ".")]}
        if h["step"] != collector.step or h["version"] != self.trainer.step:
            self.drops("stale_step", f"{info.wid}: step {h['step']} v{h['version']}, current {collector.step}")
            return
        holder, node = (info.wid, info.inc), (h["lo"], h["hi"])
        if (reason := collector.check(node, holder)) is not None:  # before decoding: injection costs little
            self.drops(reason, where)
            return
        inner, bad, keep = None, None, self.trainer.inner is not None
        if self.trainer.fragments and not fragmenting.ships_state(h["step"], self.trainer.snapshot_every, h["lo"]):
            keep, bad = False, "bad_inner" if h.get("inner") or inner_tensors else None  # streaming: no state this time
        elif self.trainer.inner is not None:  # local steps: the state the replica's round ended with, kept once accepted
            inner, bad = self.trainer.inner.parse(h["lo"], h.get("inner"), inner_tensors)
        if bad is not None:
            self._misfit(identity, info, bad, where)
            return
        codec = self.checking_codec if collector.strict else self.codec
        grads, bad, seconds = gradients.decode(codec, self.trainer, h, tensors, self.trainer.expected(h["step"]))
        # a borrowed gradient is copied where it is kept, but the one microbatch of M = 1 under an optimizer that only
        # reads it: stepped from the slot (its worker writes that slot again only after work sent past this step)
        own = self.intake.spares.own if borrowed and not (collector.M == 1 and self.trainer.reads_grads_only) else None
        if bad is not None:
            self._misfit(identity, info, bad, where)
        elif self.report_buffers and not self.trainer.valid_buffers(produced):  # model.buffers: mean
            self._misfit(identity, info, "bad_buffers", f"{info.wid}: buffers do not match the model or are not finite")
        elif (reason := collector.offer(node, grads, h["losses"], holder, produced if self.report_buffers else None,
                                        own=own)) is not None:
            self.drops(reason, where)
        elif not self.intake.intact():  # the slot was written while summed: this step's sum is unknown, so again
            self.drops("shm_overwritten", f"{where}: its slot was written while read; collecting the step again")
            self.leasing.new_step(collector.step, strict=collector.strict)
            self._serve_parked()
        else:
            self.misfits.forget(identity)
            if keep and self.trainer.inner is not None:
                self.trainer.inner.keep(h["lo"], inner)
            self.reporter.codec_s += seconds + float(h["encode_s"])
            if h.get("ahead") is True:  # streaming: computed before its lease, so its time says nothing of compute's
                self.totals.segments_ahead += 1
            else:
                self.leasing.reissue.accepted(info, time.monotonic(), node[1] - node[0])
            self.reporter.accepted(info.wid, info.inc, node[1] - node[0])
            if (info.wid, info.inc) not in self._contributed:
                self._contributed.add((info.wid, info.inc))
                self.ctx.emit("first_grad_accepted", worker=info.wid, incarnation=info.inc, step=h["step"],
                              lo=h["lo"], hi=h["hi"])
            if collector.complete:
                self.stepper.apply()

    def _on_leave(self, identity: bytes, msg: protocol.Message) -> None:
        info = self.admission.leave(identity)
        self.leasing.forget(identity)
        self.misfits.forget(identity)
        if info is not None:
            freed = self.leasing.release(info.wid, info.inc)
            self.ctx.emit("worker_left", worker=info.wid, incarnation=info.inc, freed=freed)
            self._serve_parked()

    def _on_fence(self, identity: bytes, msg: protocol.Message) -> None:
        wid, inc = msg.header["wid"], msg.header["inc"]
        # The coordinator records every fence in Redis before it sends one: a fence Redis does not back
        # is a forgery (or a stranger) and must not be able to stop training.
        try:
            recorded = self.ctx.redis.get(self.ctx.keys.fence("worker", wid))
        except redis.RedisError:
            recorded = None
        if recorded is None or int(recorded) < inc:
            self.drops("unverified_fence", f"{wid}/{inc}")
            return
        self.admission.fence(wid, inc)
        self._fenced(wid, inc, announce=True)
        if self.roster is not None:
            self.roster.fence(wid, inc)
        self._serve_parked()

    def _fenced(self, wid: str, max_inc: int, announce: bool) -> None:
        """Incarnations <= max_inc of `wid` are fenced: forget them where parked, and free their leases."""
        for identity, _, _ in self.leasing.waiting():
            if not self.admission.admitted(identity):
                self.leasing.forget(identity)
        freed = self.leasing.release(wid, max_inc)
        if freed or announce:
            self.ctx.emit("leases_freed", worker=wid, incarnation=max_inc, step=self.leasing.collector.step,
                          microbatches=freed)

    # ------------------------------------------------------------------ shards k > 0
    def _on_shard_join(self, identity: bytes, msg: protocol.Message) -> None:
        assert self.roster is not None
        if self.roster.join(identity, msg.header, self.trainer.step):
            waiting, self.waiting = self.waiting, []
            for ident, hello in waiting:
                self._on_hello(ident, hello)

    def _on_shard_have(self, identity: bytes, msg: protocol.Message) -> None:
        """A shard's microbatches of its incomplete step: what it lacks of a step complete here is leased again."""
        if self.roster is not None and self.roster.have(identity, msg.header, self.leasing.collector,
                                                        grace=2 * self.cfg.cluster.dead_after):
            self._serve_parked()

    def _on_shard_ready(self, identity: bytes, msg: protocol.Message) -> None:
        if (self.roster is not None and self.roster.ready(identity, msg.header, self.leasing.collector.step)
                and self.stepper.mean is not None):
            self.stepper.apply()

    def _on_shard_eval(self, identity: bytes, msg: protocol.Message) -> None:
        if self.roster is not None:
            self.roster.eval_pieces(identity, msg.header, msg.tensors)
            self.evals.pieces_in(self.roster.place_eval)

    def _on_shard_final(self, identity: bytes, msg: protocol.Message) -> None:
        if self.roster is not None:
            self.roster.final(identity, msg.header, msg.tensors, self.trainer.step)

    _handlers = {"hello": _on_hello, "want": _on_want, "grad": _on_grad, "leave": _on_leave, "fence": _on_fence,
                 "shard_join": _on_shard_join, "shard_have": _on_shard_have, "shard_ready": _on_shard_ready,
                 "shard_eval": _on_shard_eval, "shard_final": _on_shard_final}

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        self.evals.close()
        self.advertised.stop()
        self.reporter.close()
        self.ckpt.close()
        self.member.stop()
        self.sock.close(linger=500)
        self.ctx.curve.close()
        self.zctx.destroy(linger=200)
