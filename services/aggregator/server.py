"""The parameter server loop: hand out microbatch leases, collect gradients, step once per global step.

Workers pull: `want` (or a `grad`, which implies the next `want`) is answered with `work` —
carrying the parameters when the worker's version is stale — or parked until work exists.
With `cluster.shards` > 1 this is shard 0, the leader: it leases for every shard, steps its own slice,
and commits each step on all of them (docs/design.md §4; the others run `shard.ShardServer`).
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
from cmemi.services.aggregator import dataprint, snapshots
from cmemi.services.aggregator.admission import ROLE_OF, EnvironmentCheck, ReissuePolicy, registered
from cmemi.services.aggregator.collector import StepCollector
from cmemi.services.aggregator.evaluation import BackgroundEval, EvalError, Probe, eval_boundary, run_eval
from cmemi.services.aggregator.progress import ProgressWriter
from cmemi.services.aggregator.publish import Publisher
from cmemi.services.aggregator.snapshots import CheckpointerLink
from cmemi.services.aggregator.throughput import Throughput
from cmemi.services.aggregator.totals import RunTotals
from cmemi.services.aggregator.trainer import Trainer
from cmemi.shared import atomic, limits, metrics, protocol, reduction, startup, state, transfer
from cmemi.shared.buffers import PREFIX
from cmemi.shared.codecs import CodecError, all_finite, make_codec
from cmemi.shared.config import ConfigError
from cmemi.shared.environment import environment
from cmemi.shared.layout import Layout
from cmemi.shared.membership import Member, allocate
from cmemi.shared.plugins import resolve
from cmemi.shared.service import EXIT_REJOIN, ServiceContext, serve_router
from cmemi.shared.watch import Watch


@dataclass
class WorkerInfo:
    wid: str
    inc: int
    host: str


@dataclass
class ShardInfo:
    """A shard k > 0 as the leader knows it (services/aggregator/shard.py)."""
    identity: bytes
    inc: int
    addr: str
    ready: tuple[int, list[float], bool] | None = None  # (step, partials, overflow) of its last complete step
    final: dict[str, torch.Tensor] | None = None  # its pieces after the last step
    totals: dict[str, Any] | None = None  # with them: its bytes in and out over the run, its dropped messages
    eval: tuple[int, dict[str, torch.Tensor]] | None = None  # its pieces at an evaluation step (eval.every_steps)


class Aggregator:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx, self.cfg, self.log = ctx, ctx.cfg, ctx.log
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        try:
            self.trainer = Trainer(cfg)
            startup.mark("model_built")
            self.eval_fn = resolve(cfg.eval.fn, "eval.fn") if cfg.eval.fn else None
        except ConfigError as exc:
            ctx.fatal(str(exc))
        self.fp: dict[str, Any] = {}  # the checkpoint's, else the first admitted worker's: the aggregator reads no data
        self.M = cfg.train.microbatches
        self.environment = EnvironmentCheck(environment(torch.device("cpu"), cfg))
        self.report_buffers = bool(self.trainer.buffers) and cfg.model.buffers == "mean"
        # Decode side, stateless. NaN/inf is checked once per step on the sum, not per message (see _apply_step).
        self.codec = make_codec(cfg.compression, check_finite=False)
        self.checking_codec = make_codec(cfg.compression)  # a strict collection's: NaN/inf dropped as codec_nonfinite
        self.total = cfg.train.steps
        self.zctx = zmq.Context()
        self.sock, self.addr = serve_router(ctx, self.zctx, cfg.cluster.aggregator_port)
        self.drops: Counter[str] = Counter()
        # messages bigger than one, from admitted workers (gradients) and joined shards (their final and evaluation
        # slices) only: one partial transfer each, and one for a replacement
        self.parts = transfer.Assembler(ctx.run, limits.logical_bytes(cfg), cfg.cluster.checksum,
                                        peers=cfg.cluster.workers + cfg.cluster.spare_workers + cfg.cluster.shards,
                                        on_abandon=self._drop)
        self.term = allocate(ctx.redis, ctx.keys.term)
        self.totals = RunTotals()  # restored from the checkpoint
        self.ckpt = CheckpointerLink(ctx, self.zctx, self.term, self._drop)
        self.layout = Layout(self.trainer.wire_state())  # of the parameters sent out (shared/layout.py)
        self.publisher = Publisher(cfg.cluster.checksum, self.layout)
        self.bg_eval = BackgroundEval(cfg, self.eval_fn) if self.eval_fn and cfg.eval.every_steps else None
        restored = self.ckpt.fetch_latest(timeout=120)
        startup.mark("checkpoint_asked")
        if restored is not None:
            try:
                snapshots.restore(self.trainer, self.totals, self.fp, self.bg_eval, restored.header["meta"],
                                  restored.tensors)
            except (state.StateError, KeyError, RuntimeError, ValueError) as exc:
                ctx.fatal(f"cannot restore checkpoint of step {restored.header['step']}: {exc}")
            self.log.info("restored from checkpoint", step=self.trainer.step)
        self.member = Member(ctx.redis, ctx.keys, "aggregator", "0", cfg.cluster.heartbeat_interval,
                             cfg.cluster.dead_after, extra={"addr": self.addr, "term": self.term, **ctx.member_extra}).start()
        self.restored_step = self.trainer.step if restored is not None else -1  # shards k > 0 restore exactly it
        self.shards: dict[int, ShardInfo] = {}  # k > 0, once joined this term
        self.waiting: list[tuple[bytes, protocol.Message]] = []  # hellos that came before every shard joined
        self._mean: tuple[dict[str, torch.Tensor] | None, float] | None = None  # a complete step, until applied
        self._eval_wait: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, weights) for every shard's slice
        if self.trainer.sharded:
            self.ckpt.sharding = {"shard": 0, "shards": self.trainer.partition.shards,
                                  "pieces": self.trainer.partition.describe()}
        self._advertise()
        self.workers: dict[bytes, WorkerInfo] = {}
        self.parked: dict[bytes, tuple[WorkerInfo, int]] = {}  # identity -> (worker, parameter version it holds)
        self._contributed: set[tuple[str, int]] = set()
        self._unpublished_mb: Counter[str] = Counter()  # accepted microbatches per "wid:incarnation", not yet in Redis
        self._next_progress = 0.0
        self.progress = ProgressWriter(ctx.redis, ctx.keys)
        # Redis may restart empty: is this leader still advertised? (read off the loop: shared/watch.py)
        self.advertised = Watch(ctx.redis, 1.0, lambda r: r.exists(ctx.keys.aggregator), "leader").start()
        self._step_codec_s = 0.0  # encode (reported by workers) + decode time of this step's accepted gradients
        self.ckpt_stall_s: list[float] = []
        self.stopped_early = False
        self.fenced: dict[str, int] = {}
        self._last_commit: dict[str, Any] | None = None  # the shard_commit fields of the last step sent
        self._after: tuple[int, float, float, int, dict[str, Any] | None, bool] | None = None  # see _after_step
        self.collector = self._collector(self.trainer.step)
        self.reissue = ReissuePolicy()
        self._step_bytes_in = self._step_bytes_out = 0
        self.throughput = Throughput(cfg.train.global_batch)  # the progress line's samples/s
        self._t_step = time.monotonic()
        self.done = self.trainer.step >= self.total
        self.metrics = open(ctx.run_dir / "metrics.jsonl", "a", buffering=1)
        # A broken eval.fn (wrong signature, raises) stops the run now, not after training: evaluate once at step 0.
        self.probe = (Probe(cfg, self.eval_fn, self._weights()) if self.eval_fn and self.trainer.step == 0
                      and not self.done else None)
        ctx.emit("aggregator_started", term=self.term, addr=self.addr, step=self.trainer.step)
        startup.mark("listening")
        startup.report(ctx.redis, ctx.keys, "aggregator", "0")
        self.log.info("aggregator listening", addr=self.addr, term=self.term, fingerprint=self.fp.get("sha256", "(the first worker's)")[:12])

    def _advertise(self) -> None:
        self.ctx.redis.hset(self.ctx.keys.aggregator, mapping={"addr": self.addr, "term": self.term,
                                                               "incarnation": self.member.incarnation,
                                                               "restored": self.restored_step})

    def _collector(self, step: int, strict: bool = False) -> StepCollector:
        """Leases of a step: blocks of the reduction tree, one per worker where M allows (docs/design.md, "Leases").
        A stateless lossy codec (fp16/bf16/int8) rounds each microbatch's gradient, as the reference does, so it
        leases microbatch by microbatch; the lossless and the error-feedback codecs encode a block's sum."""
        block = 1 if self.codec.per_microbatch else reduction.block_size(self.M, max(self.cfg.cluster.workers,
                                                                                        len(self.workers)))
        # sharded: every gradient is checked on arrival (a second collection would need every shard's)
        return StepCollector(step, self.M, block=block, strict=strict or self.trainer.sharded)

    def _reissuable(self) -> bool:
        after = self.reissue.after
        return after is not None and self.collector.reissuable(time.monotonic(), after)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.trainer.model.state_dict().items()}

    def _housekeeping(self, now: float) -> None:
        if self.probe is not None and self.probe.done.is_set():
            if self.probe.error is not None:
                self.ctx.fatal(self.probe.error)
            self.probe = None
        if self.collector.expire(now):
            self.ctx.emit("lease_expired", step=self.collector.step)
            self._serve_parked()
        elif self.parked and self._reissuable():  # a lease is withheld (or slow) while workers idle
            self._serve_parked()
        self.parts.keep(self.workers)  # a fenced or departed worker's unfinished gradient goes
        if self.advertised.take() == (0,):  # Redis restarted empty: advertise again
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
                    self._after_step()
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
        admitted = identity in self.workers or any(info.identity == identity for info in self.shards.values())
        try:  # a part allocates only for an admitted worker or shard (an unauthenticated flood cannot make us allocate)
            msg = self.parts.decode(identity, frames[1:], allow_parts=admitted)
        except protocol.ProtocolError as exc:
            self._drop(exc.reason, str(exc))
            return
        if msg is None:  # a part of a bigger message (a worker's gradient, a shard's pieces); the rest is coming
            if identity in self.workers:
                self._count_grad_bytes(size)
            return
        handler = self._handlers.get(msg.type)
        if handler is None:
            self._drop("unexpected_type", msg.type)
            return
        if (role := self.ctx.curve.role(frames[1])) is not None and role != ROLE_OF[msg.type]:
            self._drop("wrong_role", f"{msg.type} from a {role or 'unknown'} key")  # e.g. a worker key fencing
            return
        if msg.type == "grad":  # all gradient bytes workers sent, accepted or not
            self._count_grad_bytes(size)
        handler(self, identity, msg)

    def _count_grad_bytes(self, size: int) -> None:
        metrics.BYTES_IN.inc(size)
        self.totals.bytes_in += size
        self._step_bytes_in += size

    def _drop(self, reason: str, detail: str = "") -> None:
        self.drops[reason] += 1
        metrics.DROPPED.labels(reason).inc()
        if self.drops[reason] <= 5 or self.drops[reason] % 1000 == 0:
            self.log.warning("message dropped", reason=reason, detail=detail[:200], count=self.drops[reason])

    def _send(self, identity: bytes, mtype: str, params: bool = False, **fields: Any) -> None:
        """Send a message; `params`: with the current parameters (encoded once per version, sent zero-copy)."""
        encoded, trackers = None, None
        if params:
            encoded, trackers = self.publisher.encoded(self.trainer.wire_state(), self.trainer.step)
            if self.publisher.layout is not None:
                fields["layout"] = self.layout.digest
        elif mtype == "work":  # a work message always lists its tensors, here none
            encoded = ([], [])
        try:  # parameters over the cap go in parts
            msgs = transfer.messages(mtype, self.ctx.run, fields, self.cfg.cluster.max_message_bytes, encoded=encoded)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"aggregator: {exc}")
        try:
            n = transfer.send(self.sock, msgs, identity, trackers)
        except zmq.ZMQError as exc:
            self.log.warning("send failed", error=str(exc))
            return
        if mtype == "work":
            metrics.BYTES_OUT.inc(n)
            self.totals.bytes_out += n
            self._step_bytes_out += n

    # ------------------------------------------------------------------ handlers
    def _on_hello(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        wid, inc = h["wid"], h["inc"]
        if len(self.shards) < self.trainer.partition.shards - 1:  # answered once every shard joined this term
            self.waiting = [(i, m) for i, m in self.waiting if i != identity][-256:] + [(identity, msg)]
            return
        if (why := registered(self.ctx.redis, self.ctx.keys, wid, inc)) is not None:
            # Not the incarnation Redis holds for this id: a forgery or a stale process. The reply says nothing
            # the sender did not know (no incarnation, no dataset hash); a real worker retries after registering.
            self._drop(why, f"{wid}/{inc}")
            self._send(identity, "reject", fatal=False, reason=f"worker {wid} on host {h['host']}: incarnation "
                       f"{inc} is not registered for it ({why}); say hello after registering")
            return
        if not dataprint.agrees(self.fp, h["fp"]):  # names the worker's own fingerprint only: the reply reveals none of ours
            self._send(identity, "reject", fatal=True, reason=(
                f"worker {wid} on host {h['host']} has a different dataset (length {h['fp'].get('length')}, "
                f"sha256 {str(h['fp'].get('sha256'))[:12]}) than the run's; make data.factory/data.kwargs "
                "give the same data on every host (compare the fingerprints in each service's log)"))
            return
        if self._is_fenced(wid, inc):
            self._send(identity, "reject", fatal=False, reason=f"incarnation {inc} of worker {wid} is fenced")
            return
        if not self._same_environment(identity, wid, h):
            return
        self._fence(wid, inc - 1, announce=False)  # a worker id has one live incarnation: the newest
        self.workers[identity] = WorkerInfo(wid, inc, h["host"])
        self._send(identity, "welcome", term=self.term, step=self.trainer.step, version=self.trainer.step,
                   total_steps=self.total, shards=[self.shards[k].addr for k in sorted(self.shards)])
        self.ctx.emit("worker_admitted", worker=wid, incarnation=inc, host=h["host"], term=self.term)
        self.log.info("worker admitted", worker=wid, incarnation=inc, host=h["host"])

    def _same_environment(self, identity: bytes, wid: str, h: dict[str, Any]) -> bool:
        """Bitwise equality needs the same torch, threads, CPU kernels and device on every worker."""
        diff = self.environment.differences(h.get("env"))
        if not diff:
            return True
        what = (f"worker {wid} on host {h['host']} has a different environment: {', '.join(diff)}; results would "
                "not be bitwise equal")
        if self.cfg.cluster.require_same_environment:
            self._send(identity, "reject", fatal=True, reason=f"{what}; install the same torch and hardware everywhere, "
                       "or set cluster.require_same_environment: false to admit it anyway")
            return False
        self.log.warning("environment differs (admitted: cluster.require_same_environment is false)", detail=what)
        return True

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
        produced = {k[len(PREFIX):]: msg.tensors.pop(k) for k in [k for k in msg.tensors if k.startswith(PREFIX)]}
        if h["step"] != self.collector.step or h["version"] != self.trainer.step:
            self._drop("stale_step", f"{info.wid}: step {h['step']} v{h['version']}, current {self.collector.step}")
            self._serve(identity, info, h["version"])
            return
        holder, node = (info.wid, info.inc), (h["lo"], h["hi"])
        if (reason := self.collector.check(node, holder)) is not None:  # before decoding: injection costs little
            self._drop(reason, f"{info.wid}: step {h['step']} microbatches [{h['lo']}, {h['hi']})")
            self._serve(identity, info, h["version"])
            return
        if h["finite"] or not self.trainer.scaler.enabled:
            try:
                t0 = time.perf_counter()
                codec = self.checking_codec if self.collector.strict else self.codec
                grads = codec.decode(h["codec"], msg.tensors, shapes=self.trainer.shapes)
                self._step_codec_s += time.perf_counter() - t0 + float(h["encode_s"])
            except CodecError as exc:
                self._drop(f"codec_{exc.reason}", f"{info.wid}: {exc}")
                self._serve(identity, info, h["version"])
                return
        where = f"{info.wid}: step {h['step']} microbatches [{h['lo']}, {h['hi']})"
        losses = h["losses"]
        if grads is not None and (bad := self.trainer.check_grads(grads)) is not None:
            self._drop(bad, f"{info.wid}: gradient tensors do not match the model")
        elif self.report_buffers and not self.trainer.valid_buffers(produced):  # model.buffers: mean
            self._drop("bad_buffers", f"{info.wid}: buffers do not match the model or are not finite")
        elif not all(isinstance(x, (int, float)) for x in losses):
            self._drop("bad_losses", where)
        elif (reason := self.collector.offer(node, grads, losses, holder,
                                             produced if self.report_buffers else None)) is not None:
            self._drop(reason, where)
        else:
            self.reissue.accepted(info, time.monotonic(), node[1] - node[0])
            self._unpublished_mb[f"{info.wid}:{info.inc}"] += node[1] - node[0]
            if (info.wid, info.inc) not in self._contributed:
                self._contributed.add((info.wid, info.inc))
                self.ctx.emit("first_grad_accepted", worker=info.wid, incarnation=info.inc, step=h["step"],
                              lo=h["lo"], hi=h["hi"])
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

    def _on_shard_join(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        k, known = h["shard"], self.shards.get(h["shard"])
        if h["term"] != self.term or not 0 < k < self.trainer.partition.shards:
            self._drop("stale_shard", f"shard {k} of term {h['term']}")
            self._send(identity, "reject", fatal=False, reason=f"term {self.term} started: join it")
            return
        if known is not None and known.inc == h["inc"]:
            return  # said again (its link was slow): nothing changed
        if known is not None or h["step"] != self.trainer.step:
            # a shard restarted: its slice went back to the checkpoint, so the whole cluster goes back with it
            self.ctx.emit("shard_restarted", shard=k, step=self.trainer.step, restored=h["step"])
            self.log.warning("a shard restarted; the cluster restarts from the last complete checkpoint", shard=k,
                             its_step=h["step"], step=self.trainer.step)
            raise SystemExit(EXIT_REJOIN)
        self.shards[k] = ShardInfo(identity, h["inc"], h["addr"])
        self.log.info("shard joined", shard=k, addr=h["addr"], step=h["step"])
        if len(self.shards) == self.trainer.partition.shards - 1:
            waiting, self.waiting = self.waiting, []
            for ident, hello in waiting:
                self._on_hello(ident, hello)

    def _shard(self, identity: bytes, msg: protocol.Message) -> ShardInfo | None:
        info = self.shards.get(msg.header["shard"])
        if info is None or info.identity != identity or info.inc != msg.header["inc"] or msg.header["term"] != self.term:
            self._drop("unknown_shard", f"shard {msg.header['shard']}/{msg.header['inc']}")
            return None
        return info

    def _on_shard_have(self, identity: bytes, msg: protocol.Message) -> None:
        """A shard's microbatches of its incomplete step: what it lacks of a step complete here is leased again."""
        if self._shard(identity, msg) is None or msg.header["step"] != self.collector.step:
            return
        have = msg.header["have"]
        if not all(isinstance(m, int) for m in have):
            self._drop("bad_have", f"shard {msg.header['shard']}")
            return
        if lacking := self.collector.reopen(have, time.monotonic(), grace=2 * self.cfg.cluster.dead_after):
            self.ctx.emit("leases_reopened", step=self.collector.step, shard=msg.header["shard"], microbatches=lacking)
            self.log.warning("a shard lacks microbatches this step holds; leasing them again", shard=msg.header["shard"],
                             microbatches=lacking)
            self._serve_parked()

    def _on_shard_ready(self, identity: bytes, msg: protocol.Message) -> None:
        if (info := self._shard(identity, msg)) is None:
            return
        h = msg.header
        if not all(isinstance(x, (int, float)) for x in h["partials"]):
            self._drop("bad_partials", f"shard {h['shard']}")
            return
        if h["step"] < self.collector.step:  # applied already: its commit was lost on the way
            if self._last_commit is not None and self._last_commit["step"] == h["step"]:
                self._send(identity, "shard_commit", **self._last_commit)
            return
        info.ready = (h["step"], [float(x) for x in h["partials"]], h["overflow"])
        if self._mean is not None:
            self._apply_step()

    def _on_shard_eval(self, identity: bytes, msg: protocol.Message) -> None:
        if (info := self._shard(identity, msg)) is not None:
            info.eval = (msg.header["step"], msg.tensors)
            self._start_sharded_eval()

    def _start_sharded_eval(self) -> None:
        """The evaluation of the step `_eval_wait` holds, once every shard's pieces of that step are in it."""
        if self._eval_wait is None or self.bg_eval is None:
            return
        step, weights = self._eval_wait
        if any(info.eval is None or info.eval[0] != step for info in self.shards.values()):
            return
        for k, info in self.shards.items():
            assert info.eval is not None
            self._place(k, info.eval[1], weights)
            info.eval = None
        self._eval_wait = None
        self._start_eval(step, weights)

    def _on_shard_final(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        if (info := self._shard(identity, msg)) is not None and h["step"] == self.trainer.step:
            info.final = msg.tensors
            info.totals = {"bytes_sent": h["bytes_in"], "bytes_received": h["bytes_out"],
                           "dropped_messages": {str(k): v for k, v in h["drops"].items() if isinstance(v, int)}}

    _handlers = {"hello": _on_hello, "want": _on_want, "grad": _on_grad, "leave": _on_leave, "fence": _on_fence,
                 "shard_join": _on_shard_join, "shard_have": _on_shard_have, "shard_ready": _on_shard_ready,
                 "shard_eval": _on_shard_eval, "shard_final": _on_shard_final}

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
        if self.totals.started(time.monotonic()):
            self._t_step = time.monotonic()
        now = time.monotonic()
        self.reissue.leased(info, now)
        node = self.collector.lease(info.wid, info.inc, now, self.cfg.cluster.lease_timeout, self.reissue.after)
        if node is None:
            self.parked[identity] = (info, held_version)
            return
        self.parked.pop(identity, None)
        self._send(identity, "work", params=held_version != self.trainer.step, term=self.term,
                   step=self.collector.step, lo=node[0], hi=node[1], version=self.trainer.step,
                   scale=self.trainer.scaler.scale)

    def _serve_parked(self) -> None:
        for identity, (info, held_version) in list(self.parked.items()):
            if not self.collector.pending and not self.done and not self._reissuable():
                return
            del self.parked[identity]
            self._serve(identity, info, held_version)

    def _others_ready(self) -> tuple[list[float], bool] | None:
        """Every shard k > 0's share of this step (partials in shard order, any overflow), once all reported."""
        step, partials, overflow = self.collector.step, [], False
        for k in range(1, self.trainer.partition.shards):
            ready = self.shards[k].ready if k in self.shards else None
            if ready is None or ready[0] != step:
                return None
            partials += ready[1]
            overflow |= ready[2]
        return partials, overflow

    def _apply_step(self) -> None:
        """The step's gradient is complete here. Sharded: once every shard reported its own complete too (what one
        lacks is leased again: _on_shard_have), one rule for all — the global norm from every piece's partial in
        grid order, any overflow skips — and each shard is told to apply it."""
        if self._mean is None:
            self._mean = self.collector.mean()
        grads, loss = self._mean
        partials = None
        if self.trainer.sharded and (others := self._others_ready()) is None:
            return  # _on_shard_ready comes back here
        stop = self._stops_at(self.trainer.step + 1)
        snapshot = not stop and self._snapshot_due(self.trainer.step + 1)
        if self.trainer.sharded:
            if others[1]:
                grads = None
            partials = self.trainer.partials(grads) + others[0] if grads is not None else []
            last = stop or self.trainer.step + 1 >= self.total
            self._last_commit = {"term": self.term, "step": self.collector.step, "partials": partials,
                                 "skip": grads is None, "last": last, "snapshot": snapshot}
            for info in self.shards.values():
                self._send(info.identity, "shard_commit", **self._last_commit)
        self._mean = None
        if grads is not None and not all_finite(grads.values()):
            # Honest workers never send NaN/inf (they stop the run, or flag an fp16 overflow), so one pass over
            # the sum replaces a pass over every gradient. If it fails, the step is collected again with each
            # gradient checked on arrival: the bad ones are dropped and counted, the others recomputed (bitwise
            # the same). Still not finite then: the sum of finite gradients overflows, the run diverged.
            if self.collector.strict:
                self.ctx.fatal(f"the summed gradient of step {self.trainer.step + 1} is not finite (it overflows); "
                               "the run diverged: lower optimizer.kwargs.lr or set train.clip_grad_norm")
            self._drop("nonfinite_step", f"step {self.collector.step}: collecting it again, checking each gradient")
            self.collector = self._collector(self.collector.step, strict=True)
            self._serve_parked()
            return
        try:
            self.trainer.apply(grads, self.collector.buffer_sum(), partials=partials)
        except Exception as exc:  # the user's optimizer/scheduler: restarting would fail the same way
            self.ctx.fatal(f"optimizer/scheduler failed at step {self.trainer.step + 1}: {type(exc).__name__}: {exc}; "
                           "check optimizer.kwargs and scheduler.kwargs")
        now = time.monotonic()
        dt = now - self._t_step
        self._t_step = now
        self.totals.final_loss = loss
        step = self.trainer.step
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(dt)
        metrics.LIVE_WORKERS.set(len(self.workers))
        line = None
        if step % self.cfg.train.log_every == 0 or step == self.total:
            line = {"step": step, "loss": loss, "lr": self.trainer.lr, "step_time_s": dt,
                    **({"loss_scale": self.trainer.scaler.scale, "skipped": grads is None}
                       if self.trainer.scaler.enabled else {}),
                    "samples_per_s": self.cfg.train.global_batch / dt if dt > 0 else None,
                    "bytes_in": self._step_bytes_in, "bytes_out": self._step_bytes_out, "codec_s": self._step_codec_s,
                    "live_workers": len(self.workers), "t": time.time()}
        if eval_boundary(self.cfg, step):
            if self.trainer.sharded:  # the other shards' pieces of this step come after their commit
                self._eval_wait = (step, self._weights())
                self._start_sharded_eval()
            else:
                self._start_eval(step, self._weights())
        if stop:
            self.stopped_early = True
            self.log.info("early stop", metric=self.cfg.eval.early_stop_metric, patience=self.cfg.eval.patience)
        if step >= self.total or self.stopped_early:
            self.done = True
        else:
            self.collector = self._collector(step)
        self._after = (step, loss, dt, self._step_bytes_in + self._step_bytes_out, line, snapshot)
        self._step_bytes_in = self._step_bytes_out = 0
        self._step_codec_s = 0.0
        self._serve_parked()

    def _snapshot_due(self, step: int) -> bool:
        """Is the state after `step` checkpointed (checkpoint.every_steps)? Sharded, the leader decides for every
        shard (its commit says so), so the checkpointer gets each shard's slice of the same steps: a boundary that
        comes while the last checkpoint is still being written is left out, unless retention keeps it
        (checkpoint.keep_every). One aggregator sends the newest boundary once the last one is written."""
        every = self.cfg.checkpoint.every_steps
        if not every or step % every or step >= self.total:
            return False
        if not self.trainer.sharded:
            return True
        self.ckpt.poll()  # an acknowledgement that came since the last housekeeping
        return self.ckpt.idle or self.ckpt.milestone(step)

    def _stops_at(self, step: int) -> bool:
        """At an evaluation boundary, before the step is applied (so a sharded commit can say it is the last): the
        evaluation started at the previous boundary is collected, waiting if needed, and decides early stopping.
        Deterministic: the same evaluations decide at the same step, whatever ran faster."""
        if not eval_boundary(self.cfg, step):
            return False
        assert self.bg_eval is not None
        if self._eval_wait is not None:  # shards send those pieces before their shard_ready of the next step
            self.ctx.fatal(f"evaluation of step {self._eval_wait[0]}: the other shards' pieces did not come before "
                           "their next step (a shard of another version?)")
        try:
            for entry in self.bg_eval.collect(wait=True):
                self._log_eval(entry)
        except EvalError as exc:
            self.ctx.fatal(str(exc))
        return self.bg_eval.should_stop

    def _start_eval(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        """Evaluate the weights of `step` in the background (the previous evaluation was collected: _stops_at)."""
        assert self.bg_eval is not None
        try:
            self.bg_eval.start(step, weights)
        except EvalError as exc:
            self.ctx.fatal(str(exc))

    def _after_step(self) -> None:
        """What a step leaves for after its parameters went out (to the parked workers, and to the one whose
        gradient completed it, answered by the handler): the metrics line, the checkpoint snapshot, progress.
        It runs before the next message is read, so the snapshot is still of this step."""
        if self._after is None:
            return
        step, loss, dt, nbytes, line, snapshot = self._after
        self._after = None
        if line is not None:
            self.metrics.write(json.dumps(line) + "\n")
        if snapshot:
            t0 = time.monotonic()
            self.ckpt.offer(self._snapshot())  # in-memory copy only: the disk is the checkpointer's
            self.ckpt_stall_s.append(time.monotonic() - t0)
            metrics.CHECKPOINT_STALL.observe(self.ckpt_stall_s[-1])
        now = time.monotonic()
        if now >= self._next_progress or self.done:
            self._next_progress = now + 0.1  # enough for status and the progress bar; spares Redis
            self._publish_progress(step, loss, nbytes / dt if dt > 0 else 0.0)

    def _snapshot(self) -> snapshots.Snapshot:
        if self.bg_eval is not None and self.bg_eval.running_step() not in (None, self.trainer.step):
            # An evaluation of an earlier step is still running: its weights are not in this snapshot, so wait for
            # it (rare: only when checkpoints fall between evaluation boundaries and evaluation is slow).
            for entry in self.bg_eval.collect(wait=True):
                self._log_eval(entry)
        pending = self._eval_wait[0] if self._eval_wait is not None else None
        return snapshots.collect(self.trainer, self.totals, self.term, self.fp, self.bg_eval,
                                 evaluating=pending if pending == self.trainer.step else None)

    def _publish_progress(self, step: int, loss: float, bytes_s: float) -> None:
        """Progress for `cmemi up`'s bar and `cmemi status` (at most every 0.1 s), written off the loop."""
        self.progress.put({
            "step": step, "total": self.total, "loss": f"{loss:.6g}", "lr": f"{self.trainer.lr:.6g}",
            "samples_s": f"{self.throughput.rate(step, self.totals.wall_s(), whole_run=self.done):.1f}",
            "bytes_s": f"{bytes_s:.0f}", "live_workers": len(self.workers), "term": self.term, "t": time.time()},
            self._unpublished_mb)
        self._unpublished_mb.clear()

    def _log_eval(self, entry: dict[str, Any]) -> None:
        self.metrics.write(json.dumps({**entry, "t": time.time()}) + "\n")
        self.ctx.emit("eval", step=entry["step"], **entry["eval"])

    # ------------------------------------------------------------------ end of run
    def _gather(self, timeout: float = 120) -> None:
        """Sharded: every shard's pieces after the last step into this model, for the result over the whole model
        (params_sha256, the final evaluation). They come on their own once a shard applied the last commit."""
        deadline = time.monotonic() + timeout
        while any(info.final is None for info in self.shards.values()):
            if time.monotonic() > deadline:
                missing = sorted(k for k, info in self.shards.items() if info.final is None)
                raise RuntimeError(f"shards {missing} did not send their final slice within {timeout:g} s")
            if self.sock.poll(50):
                frames = self.sock.recv_multipart(copy=False)
                self._receive(frames)
        for k, info in self.shards.items():
            assert info.final is not None
            self._place(k, info.final, self.trainer.params)

    def _place(self, k: int, pieces: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
        """Shard k's pieces (its final or evaluation slice) into the whole model's tensors `into`."""
        views = self.trainer.partition.views(into, k)
        if pieces.keys() != views.keys() or any(pieces[n].shape != v.shape for n, v in views.items()):
            self.ctx.fatal(f"shard {k}'s slice does not fit this model: use the same model.factory, model.kwargs and "
                           "cluster.shards for every shard")
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(pieces[name])

    def _shards_total(self, field: str) -> int:
        return sum(int((info.totals or {}).get(field, 0)) for info in self.shards.values())

    def _finish(self) -> None:
        wall = self.totals.wall_s()
        if self.trainer.sharded:
            self._gather()
        try:
            if self.bg_eval is not None:
                for entry in self.bg_eval.collect(wait=True):
                    self._log_eval(entry)
        except EvalError as exc:
            self.ctx.fatal(str(exc))
        summary = {
            "steps": self.trainer.step, "final_loss": self.totals.final_loss, "eval": {}, "wall_s": wall,
            "samples_per_s": self.trainer.step * self.cfg.train.global_batch / wall if wall > 0 else None,
            "workers": self.cfg.cluster.workers, "bytes_sent": self.totals.bytes_in + self._shards_total("bytes_sent"),
            "bytes_received": self.totals.bytes_out + self._shards_total("bytes_received"),
            "params_sha256": self.trainer.params_sha256(), "final_lr": self.trainer.lr,
            "dropped_messages": dict(self.drops), "term": self.term, "codec": self.cfg.compression.codec,
            "precision": self.cfg.precision, "skipped_steps": self.trainer.skipped,
            "stopped_early": self.stopped_early,
            "eval_history": self.bg_eval.history if self.bg_eval is not None else [],
        }
        if self.trainer.sharded:  # bytes_sent/received above are the whole cluster's; here, shard by shard
            summary["shards"] = [{"shard": 0, "bytes_sent": self.totals.bytes_in, "bytes_received": self.totals.bytes_out},
                                 *({"shard": k, **(self.shards[k].totals or {})} for k in sorted(self.shards))]
        step, meta, tensors = self._snapshot()
        meta["summary"] = dict(summary)  # (its "eval" is empty: the final checkpoint is written before the final
        summary["final_checkpoint"] = self.ckpt.save_final((step, meta, tensors))  # evaluation, so a crash there loses nothing)
        if self.eval_fn:
            try:
                summary["eval"] = run_eval(self.eval_fn, self.trainer.model, str(self.cfg.eval.fn))
            except EvalError as exc:
                self.ctx.fatal(f"{exc} (the final checkpoint {summary['final_checkpoint']} was written)")
        summary["checkpointer_dropped_messages"] = self._checkpointer_drops()
        if self.ckpt_stall_s:
            summary["checkpoint_stall_s_median"] = statistics.median(self.ckpt_stall_s)
        atomic.write_text(self.ctx.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.progress.flush(timeout=10)  # the last step's progress before the run is complete
        self._set_completed()
        self.ctx.emit("run_completed", steps=self.trainer.step, params_sha256=summary["params_sha256"])
        self.log.info("run completed", **{k: summary[k] for k in ("steps", "final_loss", "eval", "wall_s")})
        self._linger(1.0)

    def _checkpointer_drops(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in self.ctx.redis.hgetall(self.ctx.keys.ckpt_dropped).items()}
        except redis.RedisError:
            return {}

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
        self.advertised.stop()
        self.progress.close()
        self.ckpt.close()
        self.member.stop()
        self.metrics.close()
        self.sock.close(linger=500)
        self.ctx.curve.close()
        self.zctx.destroy(linger=200)

