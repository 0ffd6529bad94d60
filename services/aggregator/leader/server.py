"""The parameter server's leader (shard 0): the receive loop, and which module each message type goes to.

Workers pull: `want` (or a `grad`, which implies the next `want`) is answered with `work` — carrying the
parameters when the worker's version is stale — or parked until work exists. With `cluster.shards` > 1 the
leader leases for every shard, steps its own slice, and commits each step on all of them (docs/design.md §4;
the others run `shard.server.ShardServer`). Each job lives in its own module (docs/design.md §7): the wiring
(`parts.py`), the intake (`common/intake.py`), admission (`common/admission.py`), leases (`leasing.py`), what a
lease carries (`handout.py`), a gradient's checks (`grads.py`), the shards (`roster.py`, `shard_messages.py`),
the step (`stepping.py`), evaluation (`eval_schedule.py`), reporting (`reporting.py`) and the end of the run
(`finish.py`). Here is only the loop and the workers' membership messages, each handler a few lines.
"""

from __future__ import annotations

import time

import redis
import zmq
from cmemi.services.aggregator.common.admission import WorkerInfo
from cmemi.services.aggregator.leader import finish
from cmemi.services.aggregator.leader.grads import GradIntake
from cmemi.services.aggregator.leader.handout import Handout
from cmemi.services.aggregator.leader.parts import build
from cmemi.services.aggregator.leader.shard_messages import Handler, ShardMessages
from cmemi.services.aggregator.leader.stepping import Stepper
from cmemi.shared.coordination.heard import HeardWriter
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.log import debug_enabled
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import protocol


class Aggregator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        self.timing = debug_enabled(ctx.log)  # `grad_timing` lines (CMEMI_LOG_LEVEL=DEBUG); else not timed
        self.p = p = build(ctx)
        self.stepper = Stepper(p, self._serve_parked)
        self.handout = Handout(p)
        self.grads = GradIntake(p, self.stepper, self._serve_parked)
        self.heard = HeardWriter(ctx.redis, ctx.keys, self.cfg.cluster.heartbeat_interval)  # a 2nd liveness channel
        self.handlers: dict[str, Handler] = {
            "hello": self._on_hello, "want": self._on_want, "grad": self._on_grad, "leave": self._on_leave,
            "fence": self._on_fence, **ShardMessages(p, self.stepper, self._serve_parked, self._on_hello).handlers()}
        if p.eval_fn and p.trainer.step == 0 and not self.stepper.done:
            p.evals.start_probe(self.stepper.weights())  # a broken eval.fn stops the run now, not after training
        p.trainer.keep_own_rows()  # sharded: this shard's rows only, from here on (docs/design.md, "Memory")
        ctx.emit("aggregator_started", term=p.term, addr=p.addr, step=p.trainer.step)
        startup.mark("listening")
        startup.report(ctx.redis, ctx.keys, "aggregator", "0")
        self.log.info("aggregator listening", addr=p.addr, term=p.term,
                      fingerprint=p.fp.get("sha256", "(the first worker's)")[:12])

    def _housekeeping(self, now: float) -> None:
        p = self.p
        p.evals.check_probe()
        if p.leasing.expire(now):
            self.ctx.emit("lease_expired", step=p.leasing.collector.step)
            self._serve_parked()
        elif p.leasing.parked and (p.leasing.collector.pending or p.leasing.reissuable()):
            self._serve_parked()  # a lease is withheld (or slow), or one kept for its holder is free, while workers idle
        p.intake.keep(p.admission.workers)  # a fenced or departed worker's unfinished gradient goes
        assert p.advertised is not None
        if p.advertised.take() == (0,):  # Redis restarted empty: advertise again
            p.advertise()
            self.log.info("re-advertised after Redis lost its data")

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        p = self.p
        poller = zmq.Poller()
        poller.register(p.sock, zmq.POLLIN)
        next_housekeeping = 0.0
        # restarted after the last step (its log held it), the leader still waits for every shard to join: each one
        # that joins at that step ends the run there too (shard/server.py `_finish`), which the final checkpoint needs
        while not self.ctx.stopping.is_set() and not (self.stepper.done and (p.roster is None or p.roster.complete)):
            p.ckpt.wake_for_room(poller)
            if poller.poll(50):
                for _ in range(64):  # drain a burst without starving housekeeping
                    try:
                        frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
                    self.stepper.after_step()
                    if self.stepper.done:
                        break
            p.ckpt.pump()  # the next parts of a snapshot (outgoing.py)
            now = time.monotonic()
            if now >= next_housekeeping:
                next_housekeeping = now + 0.1
                try:
                    p.ckpt.poll()
                    self._housekeeping(now)
                except redis.RedisError as exc:  # Redis down or restarting: training goes on without it
                    self.log.warning("redis unavailable", error=str(exc))
        if self.stepper.done:
            p.publisher.release()  # no version goes out again: its copy is not kept for the end's peak
            p.intake.release()  # nor does a gradient come: the step's buffers kept for the next go too
            p.trainer.release_heap()
            if p.slots is not None:
                p.slots.close()  # likewise its slots (unlinked; the pages go with the workers' last reads)
            finish.finish(p, self.stepper, self._pump)
            for identity, _, _ in p.leasing.waiting():
                self._tell_stop(identity)
            p.leasing.parked.clear()
            finish.linger(p.sock, self._tell_stop, lambda: set(p.admission.workers) <= p.told_stop, 1.0)

    def _tell_stop(self, identity: bytes) -> None:
        self.p.outbox.send(identity, "stop", reason="training complete")
        self.p.told_stop.add(identity)

    def _pump(self) -> None:
        """Receive one message, if one comes within 50 ms (the end of a run waits for the shards' pieces)."""
        if self.p.sock.poll(50):
            self._receive(self.p.sock.recv_multipart(copy=False))

    def _receive(self, frames: list[zmq.Frame]) -> None:
        p = self.p
        taken = p.intake.take(frames)
        if taken is None:
            return
        identity, msg, size = taken
        if (sender := p.admission.workers.get(identity)) is not None:
            self.heard.note(sender.wid, sender.inc)  # the coordinator's second witness (shared/coordination/heard.py)
        if msg is None:  # a part of a bigger message (a worker's gradient, a shard's pieces); the rest is coming
            if p.admission.admitted(identity):
                p.reporter.grad_bytes(size)
            return
        if msg.type == "grad":  # all gradient bytes workers sent, accepted or not (a slot's too: Intake.take)
            p.reporter.grad_bytes(size)
            p.totals.slot_in += p.intake.slot_bytes
        self.handlers[msg.type](identity, msg)
        if msg.type == "grad":  # what it landed in is free again unless the step's sums keep it (gradients.Spares)
            p.intake.settle(p.leasing.collector.holds())

    def _serve(self, identity: bytes, info: WorkerInfo, held_version: int, after_grad: bool = False) -> None:
        p = self.p
        if self.stepper.done:
            self._tell_stop(identity)
            return
        p.reporter.started(time.monotonic())
        prefer, avoid = self.handout.placement(identity, p.leasing.collector.step)
        if avoid and p.leasing.pace.cap:  # local steps: a slow worker's replicas beyond its share go to others
            avoid -= p.leasing.pace.movable(self._held(p.leasing.collector.step), time.monotonic())
        if (node := p.leasing.lease(identity, info, held_version, prefer, avoid)) is not None:
            # streaming: nothing else this step for this worker (every leaf left is held elsewhere), so it may compute
            # its next segments as soon as it has sent this one, not only once its gradient is here (`parked`)
            last = bool(p.trainer.fragments) and \
                all(hi - lo == 1 and lo in avoid for lo, hi in p.leasing.collector.pending)
            self.handout.work(identity, node, held_version, last)
        elif after_grad and p.trainer.fragments:  # streaming: the worker may compute its next segments meanwhile
            p.outbox.send(identity, "parked", step=p.leasing.collector.step)

    def _held(self, step: int) -> dict[str, list[int]]:
        """Local steps: the replicas each admitted worker holds for `step` (Holdings), by worker id."""
        p = self.p
        if p.holdings is None:
            return {}
        return {w.wid: sorted(p.holdings.prefer(i, step)) for i, w in p.admission.workers.items()}

    def _serve_parked(self) -> None:
        for identity, info, held_version in self.p.leasing.waiting():
            if not self.p.leasing.has_work(self.stepper.done):
                return
            self.p.leasing.forget(identity)
            self._serve(identity, info, held_version)

    # ------------------------------------------------------------------ workers
    def _on_hello(self, identity: bytes, msg: protocol.Message) -> None:
        p, h = self.p, msg.header
        if p.roster is not None and not p.roster.complete:  # answered once every shard joined this term
            p.waiting = [(i, m) for i, m in p.waiting if i != identity][-256:] + [(identity, msg)]
            return
        if (info := p.admission.hello(identity, h)) is None:
            return
        if p.roster is not None:
            p.roster.announce()  # the run's fingerprint, once the first worker set it, before any shard's hello
        self._fenced(info.wid, info.inc - 1, announce=False)  # admission fenced the older incarnations
        slots = p.intake.grant(identity, h)
        p.outbox.send(identity, "welcome", term=p.term, step=p.trainer.step, version=p.trainer.step,
                      total_steps=self.cfg.train.rounds, shards=p.roster.addrs() if p.roster else [], shm=slots)
        self.ctx.emit("worker_admitted", worker=info.wid, incarnation=info.inc, host=info.host, term=p.term)
        self.log.info("worker admitted", worker=info.wid, incarnation=info.inc, host=info.host)

    def _on_want(self, identity: bytes, msg: protocol.Message) -> None:
        p = self.p
        if (info := p.admission.known(identity, "want", msg.header, p.term)) is None:
            return
        if not p.leasing.answered(identity, msg.header["reask"]):  # its work may still be arriving
            p.outbox.send(identity, "pending", reask=msg.header["reask"])
            return
        # A worker that asks plainly holds no lease (it works on one at a time, and the link keeps order): a
        # lease still on its name was lost on the way (its work or its grad); it goes back to the queue now.
        if p.leasing.release(info.wid, info.inc):
            self._serve_parked()
        self.handout.note_holds(identity, msg.header)
        self._serve(identity, info, msg.header["version"])

    def _on_grad(self, identity: bytes, msg: protocol.Message) -> None:
        if (info := self.p.admission.known(identity, "grad", msg.header, self.p.term)) is None:
            return
        self.p.leasing.answered(identity, None)
        arrived = time.time() if self.timing else 0.0  # (`grad_timing`: a step's timeline, bench/round_timeline.py)
        self.grads.take(identity, info, msg.header, msg.tensors)
        if self.timing:
            self.log.debug("grad_timing", wid=info.wid, step=msg.header["step"], lo=msg.header["lo"], arrived=arrived,
                           taken=time.time())
        self.handout.note_holds(identity, msg.header)
        self._serve(identity, info, msg.header["version"], after_grad=True)

    def _on_leave(self, identity: bytes, msg: protocol.Message) -> None:
        p = self.p
        info = p.admission.leave(identity)
        p.leasing.forget(identity)
        p.misfits.forget(identity)
        if info is not None:
            freed = p.leasing.release(info.wid, info.inc)
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
            self.p.drops("unverified_fence", f"{wid}/{inc}")
            return
        self.p.admission.fence(wid, inc)
        self._fenced(wid, inc, announce=True)
        if self.p.roster is not None:
            self.p.roster.fence(wid, inc)
        self._serve_parked()

    def _fenced(self, wid: str, max_inc: int, announce: bool) -> None:
        """Incarnations <= max_inc of `wid` are fenced: forget them where parked, and free their leases."""
        for identity, _, _ in self.p.leasing.waiting():
            if not self.p.admission.admitted(identity):
                self.p.leasing.forget(identity)
        freed = self.p.leasing.release(wid, max_inc)
        if freed or announce:
            self.ctx.emit("leases_freed", worker=wid, incarnation=max_inc, step=self.p.leasing.collector.step,
                          microbatches=freed)

    def close(self) -> None:
        p = self.p
        self.heard.close()
        if p.slots is not None:
            p.slots.close()
        p.evals.close()
        if p.advertised is not None:
            p.advertised.stop()
        p.reporter.close()
        p.ckpt.close()
        if p.steplog is not None:
            p.steplog.close()
        if p.member is not None:
            p.member.stop()
        p.sock.close(linger=500)
        self.ctx.curve.close()
        p.zctx.destroy(linger=200)
