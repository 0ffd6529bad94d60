"""The parameter server loop: hand out microbatch leases, collect gradients, step once per global step.

Workers pull: `want` (or a `grad`, which implies the next `want`) is answered with `work` —
carrying the parameters when the worker's version is stale — or parked until work exists.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator import snapshots
from cmemi.services.aggregator.collector import StepCollector
from cmemi.services.aggregator.evaluation import BackgroundEval
from cmemi.services.aggregator.publish import Publisher
from cmemi.services.aggregator.snapshots import CheckpointerLink
from cmemi.services.aggregator.trainer import Trainer
from cmemi.shared import atomic, metrics, protocol, state
from cmemi.shared.codecs import CodecError, all_finite, make_codec
from cmemi.shared.config import ConfigError
from cmemi.shared.data import data_error, fingerprint
from cmemi.shared.membership import Member, allocate
from cmemi.shared.plugins import resolve
from cmemi.shared.service import ServiceContext


@dataclass
class WorkerInfo:
    wid: str
    inc: int
    host: str
    last_seen: float


class Aggregator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        try:
            self.trainer = Trainer(cfg)
            factory = resolve(cfg.data.factory, "data.factory")
            self.eval_fn = resolve(cfg.eval.fn, "eval.fn") if cfg.eval.fn else None
        except ConfigError as exc:
            ctx.fatal(str(exc))
        try:
            self.fp = fingerprint(factory(**cfg.data.kwargs))
        except Exception as exc:  # user data code may raise anything: report it in one line
            ctx.fatal(data_error("aggregator", cfg, exc))
        self.M = cfg.train.microbatches
        # Decode side, stateless. NaN/inf is checked once per step on the sum, not per message (see _apply_step).
        self.codec = make_codec(cfg.compression, check_finite=False)
        self.total = cfg.train.steps
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.ROUTER)
        ctx.curve.serve(self.zctx, self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.cluster.max_message_bytes)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.addr = protocol.bind(self.sock, cfg.cluster.host, cfg.cluster.aggregator_port)
        self.term = allocate(ctx.redis, ctx.keys.term)
        self.final_loss = float("nan")
        self.bytes_in = self.bytes_out = 0
        self.wall_before = 0.0  # training seconds of earlier terms (restored from the checkpoint)
        self.ckpt = CheckpointerLink(self)
        self.publisher = Publisher(cfg.cluster.checksum)
        restored = self.ckpt.fetch_latest(timeout=120)
        if restored is not None:
            try:
                snapshots.restore(self, restored.header["meta"], restored.tensors)
            except (state.StateError, KeyError, RuntimeError, ValueError) as exc:
                ctx.fatal(f"cannot restore checkpoint of step {restored.header['step']}: {exc}")
            self.log.info("restored from checkpoint", step=self.trainer.step)
        self.member = Member(ctx.redis, ctx.keys, "aggregator", "0", cfg.cluster.heartbeat_interval,
                             cfg.cluster.dead_after, extra={"addr": self.addr, "term": self.term, **ctx.member_extra}).start()
        self._advertise()
        self.workers: dict[bytes, WorkerInfo] = {}
        self.parked: dict[bytes, tuple[WorkerInfo, int]] = {}  # identity -> (worker, parameter version it holds)
        self._contributed: set[tuple[str, int]] = set()
        self._unpublished_mb: Counter[str] = Counter()  # accepted microbatches per "wid:incarnation", not yet in Redis
        self._next_progress = 0.0
        self._next_redis_check = 0.0
        self._step_codec_s = 0.0  # encode (reported by workers) + decode time of this step's accepted gradients
        self.ckpt_stall_s: list[float] = []
        self.bg_eval = BackgroundEval(cfg, self.eval_fn) if self.eval_fn and cfg.eval.every_steps else None
        self.stopped_early = False
        self.fenced: dict[str, int] = {}
        self.collector = StepCollector(self.trainer.step, self.M)
        self.drops: Counter[str] = Counter()
        self._step_bytes_in = self._step_bytes_out = 0
        self.t_start: float | None = None
        self._t_step = time.monotonic()
        self.done = self.trainer.step >= self.total
        self.metrics = open(ctx.run_dir / "metrics.jsonl", "a", buffering=1)
        ctx.emit("aggregator_started", term=self.term, addr=self.addr, step=self.trainer.step)
        self.log.info("aggregator listening", addr=self.addr, term=self.term, fingerprint=self.fp["sha256"][:12])

    def _advertise(self) -> None:
        self.ctx.redis.hset(self.ctx.keys.aggregator, mapping={"addr": self.addr, "term": self.term,
                                                               "incarnation": self.member.incarnation})

    def _housekeeping(self, now: float) -> None:
        if self.collector.expire(now):
            self.ctx.emit("lease_expired", step=self.collector.step)
            self._serve_parked()
        if now >= self._next_redis_check:  # Redis may have restarted empty: advertise again
            self._next_redis_check = now + 1.0
            if not self.ctx.redis.exists(self.ctx.keys.aggregator):
                self._advertise()
                self.log.info("re-advertised after Redis lost its data")

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_housekeeping = 0.0
        while not self.ctx.stopping.is_set() and not self.done:
            if poller.poll(50):
                for _ in range(64):  # drain a burst without starving housekeeping
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
                    if self.done:
                        break
            now = time.monotonic()
            if now >= next_housekeeping:
                next_housekeeping = now + 0.1
                try:
                    self.ckpt.poll()
                    self._housekeeping(now)
                except redis.RedisError as exc:  # Redis down or restarting: training goes on without it
                    self.log.warning("redis unavailable", error=str(exc))
        if self.done:
            self._finish()

    def _receive(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.drops["no_identity"] += 1
            return
        identity = frames[0].bytes
        size = protocol.message_bytes(frames[1:])
        if size > self.cfg.cluster.max_message_bytes:  # ZeroMQ's MAXMSGSIZE bounds one frame; this, the whole
            self._drop("too_big", f"{size} bytes")
            return
        try:
            msg = protocol.decode(frames[1:], self.ctx.run, self.cfg.cluster.checksum)
        except protocol.ProtocolError as exc:
            self._drop(exc.reason, str(exc))
            return
        handler = self._handlers.get(msg.type)
        if handler is None:
            self._drop("unexpected_type", msg.type)
            return
        if msg.type == "grad":  # all gradient bytes workers sent, accepted or not
            metrics.BYTES_IN.inc(size)
            self.bytes_in += size
            self._step_bytes_in += size
        handler(self, identity, msg)

    def _drop(self, reason: str, detail: str = "") -> None:
        self.drops[reason] += 1
        metrics.DROPPED.labels(reason).inc()
        if self.drops[reason] <= 5 or self.drops[reason] % 1000 == 0:
            self.log.warning("message dropped", reason=reason, detail=detail[:200], count=self.drops[reason])

    def _send(self, identity: bytes, mtype: str, params: bool = False, **fields: Any) -> None:
        """Send a message; `params`: with the current parameters (encoded once per version, sent zero-copy)."""
        encoded, trackers = None, None
        if params:
            encoded, trackers = self.publisher.encoded(self.trainer.params, self.trainer.step)
        elif mtype == "work":  # a work message always lists its tensors, here none
            encoded = ([], [])
        parts = protocol.encode(mtype, self.ctx.run, fields, encoded=encoded)
        try:
            n = protocol.send(self.sock, parts, identity, trackers)
        except zmq.ZMQError as exc:
            self.log.warning("send failed", error=str(exc))
            return
        if mtype == "work":
            metrics.BYTES_OUT.inc(n)
            self.bytes_out += n
            self._step_bytes_out += n

    # ------------------------------------------------------------------ handlers
    def _on_hello(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        wid, inc = h["wid"], h["inc"]
        if h["fp"] != self.fp:
            self._send(identity, "reject", fatal=True, reason=(
                f"worker {wid} on host {h['host']} has a different dataset: length {h['fp'].get('length')} "
                f"sha256 {str(h['fp'].get('sha256'))[:12]}, the aggregator's is length {self.fp['length']} "
                f"sha256 {self.fp['sha256'][:12]}; make data.factory/data.kwargs give the same data on every host"))
            return
        if self._is_fenced(wid, inc):
            self._send(identity, "reject", fatal=False, reason=f"incarnation {inc} of worker {wid} is fenced")
            return
        self._fence(wid, inc - 1, announce=False)  # a worker id has one live incarnation: the newest
        self.workers[identity] = WorkerInfo(wid, inc, h["host"], time.monotonic())
        self._send(identity, "welcome", term=self.term, step=self.trainer.step, version=self.trainer.step,
                   total_steps=self.total)
        self.ctx.emit("worker_admitted", worker=wid, incarnation=inc, host=h["host"], term=self.term)
        self.log.info("worker admitted", worker=wid, incarnation=inc, host=h["host"])

    def _known(self, identity: bytes, msg: protocol.Message) -> WorkerInfo | None:
        h = msg.header
        if self._is_fenced(h["wid"], h["inc"]):
            self._drop("fenced", f"{h['wid']}/{h['inc']}")
            self._send(identity, "reject", fatal=False, reason=f"incarnation {h['inc']} of worker {h['wid']} is fenced")
            return None
        info = self.workers.get(identity)
        if info is None or info.wid != h["wid"] or info.inc != h["inc"]:
            self._drop("unknown_worker", f"{h['wid']}/{h['inc']}")
            self._send(identity, "reject", fatal=False, reason="unknown worker: say hello first")
            return None
        if h.get("term") not in (None, self.term):
            self._drop("wrong_term", f"{info.wid}: term {h.get('term')}, current {self.term}")
            self._send(identity, "reject", fatal=False, reason=f"term {self.term} started: say hello again")
            return None
        info.last_seen = time.monotonic()
        return info

    def _on_want(self, identity: bytes, msg: protocol.Message) -> None:
        info = self._known(identity, msg)
        if info is not None:
            # A worker that asks holds no lease (it works on one at a time, and the link keeps order): a lease
            # still on its name was lost on the way (its work or its grad); it goes back to the queue now.
            if self.collector.release(info.wid, info.inc):
                self._serve_parked()
            self._serve(identity, info, msg.header["version"])

    def _on_grad(self, identity: bytes, msg: protocol.Message) -> None:
        info = self._known(identity, msg)
        if info is None:
            return
        h = msg.header
        grads = None
        if h["step"] != self.collector.step or h["version"] != self.trainer.step:
            self._drop("stale_step", f"{info.wid}: step {h['step']} v{h['version']}, current {self.collector.step}")
            self._serve(identity, info, h["version"])
            return
        if h["finite"] or not self.trainer.scaler.enabled:
            try:
                t0 = time.perf_counter()
                grads = self.codec.decode(h["codec"], msg.tensors, shapes=self.trainer.shapes)
                self._step_codec_s += time.perf_counter() - t0 + float(h["encode_s"])
            except CodecError as exc:
                self._drop(f"codec_{exc.reason}", f"{info.wid}: {exc}")
                self._serve(identity, info, h["version"])
                return
        if grads is not None and (bad := self.trainer.check_grads(grads)) is not None:
            self._drop(bad, f"{info.wid}: gradient tensors do not match the model")
        elif grads is not None and self.collector.strict and not all_finite(grads.values()):
            self._drop("codec_nonfinite", f"{info.wid}: step {h['step']} m {h['m']}: NaN or inf in the gradient")
        elif (reason := self.collector.offer(h["m"], grads, float(h["loss"]))) is not None:
            self._drop(reason, f"{info.wid}: step {h['step']} m {h['m']}")
        else:
            self._unpublished_mb[f"{info.wid}:{info.inc}"] += 1
            if (info.wid, info.inc) not in self._contributed:
                self._contributed.add((info.wid, info.inc))
                self.ctx.emit("first_grad_accepted", worker=info.wid, incarnation=info.inc, step=h["step"], m=h["m"])
            if self.collector.complete:
                self._apply_step()
        self._serve(identity, info, h["version"])

    def _on_leave(self, identity: bytes, msg: protocol.Message) -> None:
        info = self.workers.pop(identity, None)
        self.parked.pop(identity, None)
        if info is not None:
            freed = self.collector.release(info.wid, info.inc)
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
            self._drop("unverified_fence", f"{wid}/{inc}")
            return
        self._fence(wid, inc, announce=True)
        self._serve_parked()

    _handlers = {"hello": _on_hello, "want": _on_want, "grad": _on_grad, "leave": _on_leave, "fence": _on_fence}

    # ------------------------------------------------------------------ leases and steps
    def _is_fenced(self, wid: str, inc: int) -> bool:
        return self.fenced.get(wid, 0) >= inc

    def _fence(self, wid: str, max_inc: int, announce: bool) -> None:
        if max_inc <= self.fenced.get(wid, 0) and not announce:
            return
        self.fenced[wid] = max(self.fenced.get(wid, 0), max_inc)
        for ident in [i for i, w in self.workers.items() if w.wid == wid and w.inc <= max_inc]:
            self.workers.pop(ident)
            self.parked.pop(ident, None)
        freed = self.collector.release(wid, max_inc)
        if freed or announce:
            self.ctx.emit("leases_freed", worker=wid, incarnation=max_inc, step=self.collector.step, microbatches=freed)

    def _serve(self, identity: bytes, info: WorkerInfo, held_version: int) -> None:
        if self.done:
            self._send(identity, "stop", reason="training complete")
            return
        if self.t_start is None:
            self.t_start = self._t_step = time.monotonic()
        m = self.collector.lease(info.wid, info.inc, time.monotonic(), self.cfg.cluster.lease_timeout)
        if m is None:
            self.parked[identity] = (info, held_version)
            return
        self.parked.pop(identity, None)
        self._send(identity, "work", params=held_version != self.trainer.step, term=self.term,
                   step=self.collector.step, m=m, version=self.trainer.step, scale=self.trainer.scaler.scale)

    def _serve_parked(self) -> None:
        for identity, (info, held_version) in list(self.parked.items()):
            if not self.collector.pending and not self.done:
                return
            del self.parked[identity]
            self._serve(identity, info, held_version)

    def _apply_step(self) -> None:
        grads, loss = self.collector.mean()
        if grads is not None and not all_finite(grads.values()):
            # Honest workers never send NaN/inf (they stop the run, or flag an fp16 overflow), so one pass over
            # the sum replaces a pass over every gradient. If it fails, the step is collected again with each
            # gradient checked on arrival: the bad ones are dropped and counted, the others recomputed (bitwise
            # the same). Still not finite then: the sum of finite gradients overflows, the run diverged.
            if self.collector.strict:
                self.ctx.fatal(f"the summed gradient of step {self.trainer.step + 1} is not finite (it overflows); "
                               "the run diverged: lower optimizer.kwargs.lr or set train.clip_grad_norm")
            self._drop("nonfinite_step", f"step {self.collector.step}: collecting it again, checking each gradient")
            self.collector = StepCollector(self.collector.step, self.M, strict=True)
            self._serve_parked()
            return
        try:
            self.trainer.apply(grads)
        except Exception as exc:  # the user's optimizer/scheduler: restarting would fail the same way
            self.ctx.fatal(f"optimizer/scheduler failed at step {self.trainer.step + 1}: {type(exc).__name__}: {exc}; "
                           "check optimizer.kwargs and scheduler.kwargs")
        now = time.monotonic()
        dt = now - self._t_step
        self._t_step = now
        self.final_loss = loss
        step = self.trainer.step
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(dt)
        metrics.LIVE_WORKERS.set(len(self.workers))
        if step % self.cfg.train.log_every == 0 or step == self.total:
            line = {"step": step, "loss": loss, "lr": self.trainer.lr, "step_time_s": dt,
                    **({"loss_scale": self.trainer.scaler.scale, "skipped": grads is None}
                       if self.trainer.scaler.enabled else {}),
                    "samples_per_s": self.cfg.train.global_batch / dt if dt > 0 else None,
                    "bytes_in": self._step_bytes_in, "bytes_out": self._step_bytes_out, "codec_s": self._step_codec_s,
                    "live_workers": len(self.workers), "t": time.time()}
            self.metrics.write(json.dumps(line) + "\n")
        if self.bg_eval is not None and step % self.cfg.eval.every_steps == 0 and step < self.total:
            for entry in self.bg_eval.start(step, {k: v.clone() for k, v in self.trainer.model.state_dict().items()}):
                self._log_eval(entry)
            if self.bg_eval.should_stop:  # decided from the previous evaluation: deterministic
                self.stopped_early = True
                self.log.info("early stop", metric=self.cfg.eval.early_stop_metric, patience=self.cfg.eval.patience)
        every = self.cfg.checkpoint.every_steps
        if every and step % every == 0 and step < self.total:
            t0 = time.monotonic()
            self.ckpt.offer(snapshots.collect(self))  # in-memory copy only: the disk is the checkpointer's
            self.ckpt_stall_s.append(time.monotonic() - t0)
            metrics.CHECKPOINT_STALL.observe(self.ckpt_stall_s[-1])
        if step >= self.total or self.stopped_early:
            self.done = True
        else:
            self.collector = StepCollector(step, self.M)
        if now >= self._next_progress or self.done:
            self._next_progress = now + 0.1  # enough for status and the progress bar; spares Redis
            self._publish_progress(step, loss, dt)
        self._step_bytes_in = self._step_bytes_out = 0
        self._step_codec_s = 0.0
        self._serve_parked()

    def wall_s(self) -> float:
        """Training wall time of the whole run, earlier terms included."""
        return self.wall_before + (time.monotonic() - self.t_start if self.t_start is not None else 0.0)

    def _publish_progress(self, step: int, loss: float, dt: float) -> None:
        """Progress for `cmemi up`'s bar and `cmemi status`: one pipelined round trip (at most every 0.1 s)."""
        try:
            pipe = self.ctx.redis.pipeline(transaction=False)
            pipe.hset(self.ctx.keys.progress, mapping={
                "step": step, "total": self.total, "loss": f"{loss:.6g}", "lr": f"{self.trainer.lr:.6g}",
                "samples_s": f"{self.cfg.train.global_batch / dt:.1f}" if dt > 0 else "0",
                "bytes_s": f"{(self._step_bytes_in + self._step_bytes_out) / dt:.0f}" if dt > 0 else "0",
                "live_workers": len(self.workers), "term": self.term, "t": time.time()})
            for worker, n in self._unpublished_mb.items():
                pipe.hincrby(self.ctx.keys.microbatches, worker, n)
            pipe.execute()
            self._unpublished_mb.clear()
        except redis.RedisError:  # progress is cosmetic; Redis may be restarting
            pass

    def _log_eval(self, entry: dict[str, Any]) -> None:
        self.metrics.write(json.dumps({**entry, "t": time.time()}) + "\n")
        self.ctx.emit("eval", step=entry["step"], **entry["eval"])

    # ------------------------------------------------------------------ end of run
    def _finish(self) -> None:
        wall = self.wall_s()
        if self.bg_eval is not None:
            for entry in self.bg_eval.collect(wait=True):
                self._log_eval(entry)
        evaluation = self.trainer.evaluate(self.eval_fn) if self.eval_fn else {}
        summary = {
            "steps": self.trainer.step, "final_loss": self.final_loss, "eval": evaluation, "wall_s": wall,
            "samples_per_s": self.trainer.step * self.cfg.train.global_batch / wall if wall > 0 else None,
            "workers": self.cfg.cluster.workers, "bytes_sent": self.bytes_in, "bytes_received": self.bytes_out,
            "params_sha256": self.trainer.params_sha256(), "final_lr": self.trainer.lr,
            "dropped_messages": dict(self.drops), "term": self.term, "codec": self.cfg.compression.codec,
            "precision": self.cfg.precision, "skipped_steps": self.trainer.skipped,
            "stopped_early": self.stopped_early,
            "eval_history": self.bg_eval.history if self.bg_eval is not None else [],
        }
        step, meta, tensors = snapshots.collect(self)
        meta["summary"] = summary
        summary["final_checkpoint"] = self.ckpt.save_final((step, meta, tensors))
        if self.ckpt_stall_s:
            summary["checkpoint_stall_s_median"] = statistics.median(self.ckpt_stall_s)
        atomic.write_text(self.ctx.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self._set_completed()
        self.ctx.emit("run_completed", steps=self.trainer.step, params_sha256=summary["params_sha256"])
        self.log.info("run completed", **{k: summary[k] for k in ("steps", "final_loss", "eval", "wall_s")})
        self._linger(1.0)

    def _set_completed(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ctx.redis.set(self.ctx.keys.state, "completed")
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _linger(self, seconds: float) -> None:
        """Tell every worker that asks in the next moments to stop, so they exit cleanly."""
        for identity in list(self.parked):
            self._send(identity, "stop", reason="training complete")
        self.parked.clear()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart(copy=False)
                if len(frames) >= 2:
                    self._send(frames[0].bytes, "stop", reason="training complete")

    def close(self) -> None:
        if self.bg_eval is not None:
            self.bg_eval.close()
        self.member.stop()
        self.metrics.close()
        self.sock.close(linger=500)
        self.ctx.curve.close()
        self.zctx.destroy(linger=200)

