"""The leader's collaborators, built once and passed as one (the way torch.distributed.elastic passes a
`WorkerGroup` where a long argument list would otherwise grow).

`build` wires them in the order the leader needs them: the model first (a config error stops the run before a
socket opens), then the socket and what reads from it, then the checkpoint (restored before any worker is
admitted), then membership and the leases of the restored step. The server, the step and the end of the run
each take `LeaderParts` instead of a dozen arguments; what they share (the run's fingerprint, the admitted
workers) is read off it when used, never copied.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from cmemi.services.aggregator.common import dataprint
from cmemi.services.aggregator.common.admission import Admission, EnvironmentCheck, LeaseSeal
from cmemi.services.aggregator.common.intake import Drops, Intake
from cmemi.services.aggregator.common.misfits import Misfits
from cmemi.services.aggregator.common.outbox import Outbox
from cmemi.services.aggregator.common.publish import Publisher, SlotPublisher
from cmemi.services.aggregator.common.replicas import Holdings
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.aggregator.leader.eval_schedule import EvalSchedule
from cmemi.services.aggregator.leader.leasing import Leasing
from cmemi.services.aggregator.leader.reporting import Reporter
from cmemi.services.aggregator.leader.roster import ShardRoster
from cmemi.services.aggregator.leader.shard_slices import ShardSlices
from cmemi.services.aggregator.snapshots import contents as snapshots
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.services.aggregator.steplog.link import StepLogLink
from cmemi.services.aggregator.steplog.replay import replay
from cmemi.services.aggregator.steplog.shard import in_use as steplog_in_use
from cmemi.services.aggregator.steplog.shard import replays_in_term
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.schema import Config
from cmemi.shared.coordination.membership import Member, allocate
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.core import innerstate
from cmemi.shared.core.environment import environment
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.service import ServiceContext, serve_router
from cmemi.shared.wire import limits, protocol
from cmemi.shared.wire.layout import Layout

TYPES = ("hello", "want", "grad", "leave", "fence", "shard_join", "shard_have", "shard_ready", "shard_eval",
         "shard_final")


@dataclass
class LeaderParts:
    ctx: ServiceContext
    trainer: Trainer
    eval_fn: Callable[..., Any] | None
    fp: dict[str, Any]  # the checkpoint's, else the first admitted worker's: the aggregator reads no data
    codec: GradientCodec  # decode side, stateless; NaN/inf is checked once per step on the sum (stepping.py)
    checking_codec: GradientCodec  # a strict collection's: NaN/inf dropped as codec_nonfinite
    zctx: zmq.Context
    sock: zmq.Socket
    addr: str
    drops: Drops
    misfits: Misfits  # admitted workers' gradients in a row that do not fit (misfits.py)
    outbox: Outbox
    term: int
    seal: LeaseSeal  # this term's: given to the shards when they join
    admission: Admission
    roster: ShardRoster | None  # sharded only
    intake: Intake
    totals: RunTotals  # restored from the checkpoint
    ckpt: CheckpointerLink
    layout: Layout  # of the parameters sent out (shared/wire/layout.py)
    publisher: Publisher
    slots: SlotPublisher | None  # same-host workers' parameters in shared-memory slots (shared/memory/shm.py)
    reporter: Reporter
    evals: EvalSchedule
    member: Member | None = None
    slices: ShardSlices | None = None  # sharded only: the shards' evaluation and final slices (shard_slices.py)
    restored_step: int = -1  # the step restored, which shards k > 0 restore exactly; -1: none (a fresh run)
    replayed_step: int = -1  # the step log: the step replayed to, which shards k > 0 replay to; -1: no log
    holdings: Holdings | None = None  # local steps: the (replica, round) inner states each worker holds
    advertised: Watch[int] | None = None  # is this leader still advertised (Redis may restart empty)?
    steplog: StepLogLink | None = None  # checkpoint.step_log: each step's inputs held by the checkpointer
    leasing: Leasing = field(init=False)
    told_stop: set[bytes] = field(default_factory=set)  # workers told that the run is over
    waiting: list[tuple[bytes, protocol.Message]] = field(default_factory=list)  # hellos before every shard joined

    @property
    def cfg(self) -> Config:
        return self.ctx.cfg

    @property
    def report_buffers(self) -> bool:
        """model.buffers: mean — the workers' buffers are checked and averaged with the gradients."""
        return bool(self.trainer.buffers) and self.cfg.model.buffers == "mean"

    @property
    def live_workers(self) -> int:
        return len(self.admission.workers)

    def admitted(self, identity: bytes) -> bool:
        """An admitted worker, or a joined shard: whose messages bigger than one the intake takes."""
        return self.admission.admitted(identity) or (self.roster is not None and self.roster.is_shard(identity))

    def advertise(self) -> None:
        """This leader's address and term in Redis, where workers and shards find it."""
        assert self.member is not None
        self.ctx.redis.hset(self.ctx.keys.aggregator, mapping={"addr": self.addr, "term": self.term,
                                                               "incarnation": self.member.incarnation,
                                                               "restored": self.restored_step,
                                                               "replayed": self.replayed_step})


def _model(ctx: ServiceContext) -> tuple[Trainer, Callable[..., Any] | None]:
    cfg = ctx.cfg
    try:
        trainer = Trainer(cfg)
        if trainer.inner is not None:  # train.local_steps: what a replica's inner state must look like
            trainer.inner.expect(innerstate.layout_of(cfg, {n: (s, trainer.params[n].dtype)
                                                            for n, s in trainer.whole_shapes.items()}))
        startup.mark("model_built")
        eval_fn = resolve(cfg.eval.fn, "eval.fn") if cfg.eval.fn else None
    except ConfigError as exc:
        ctx.fatal(str(exc))
    return trainer, eval_fn


def build(ctx: ServiceContext) -> LeaderParts:
    """Every collaborator of the leader, the checkpoint restored, advertised in Redis, leasing the restored step."""
    cfg = ctx.cfg
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    trainer, eval_fn = _model(ctx)
    fp: dict[str, Any] = {}
    codec, checking_codec = make_codec(cfg.compression, check_finite=False), make_codec(cfg.compression)
    zctx = zmq.Context()
    sock, addr = serve_router(ctx, zctx, cfg.cluster.aggregator_port)
    drops, misfits = Drops(ctx.log), Misfits()
    outbox = Outbox(sock, ctx.run, cfg.cluster.message_cap(), ctx.log, ctx.fatal)
    term = allocate(ctx.redis, ctx.keys.term)
    seal = LeaseSeal(os.urandom(32))
    admission = Admission(ctx.redis, ctx.keys, lambda theirs: dataprint.agrees(fp, theirs),
                          EnvironmentCheck(environment(torch.device("cpu"), cfg)),
                          cfg.cluster.require_same_environment, outbox.send, drops, ctx.log)
    roster = (ShardRoster(ctx, trainer.partition, term, outbox, drops, lambda: {"lease_key": seal.key, "fp": dict(fp)},
                          replays=replays_in_term(cfg, trainer, codec))  # (issue 47)
              if trainer.sharded else None)
    # messages bigger than one, from admitted workers (gradients) and joined shards (their final and evaluation
    # slices) only: one partial transfer each, and one for a replacement
    intake = Intake(ctx.run, cfg.cluster.message_cap(), limits.logical_bytes(cfg), cfg.cluster.checksum,
                    cfg.cluster.workers + cfg.cluster.spare_workers + cfg.cluster.shards, ctx.curve, TYPES,
                    lambda identity: p.admitted(identity), drops, slots=cfg.cluster.transport != "tcp", borrows=True,
                    spare_bytes=2 * limits.nbytes(trainer.pieces.values()))
    totals = RunTotals()
    ckpt = CheckpointerLink(ctx, zctx, term, drops)
    layout = Layout(trainer.wire_state())
    publisher = Publisher(cfg.cluster.checksum, layout)
    # a snapshot still being sent, and parameters still queued for a worker, name what a step changes
    trainer.before_change += [ckpt.protect, publisher.protect]
    # same-host workers (cluster.transport auto or shm, over ipc://): parameters in shared-memory slots, written
    # once per version for all of them, and their gradients read from their own (shared/memory/shm.py)
    # (not with compression.downlink: a version's change is a few small frames, sent as they are)
    slots = SlotPublisher(ctx.run, "leader", cfg.cluster.checksum, layout) \
        if intake.slots is not None and trainer.mirror is None else None
    reporter = Reporter(ctx, cfg, totals, term)
    p = LeaderParts(ctx, trainer, eval_fn, fp, codec, checking_codec, zctx, sock, addr, drops, misfits, outbox, term,
                    seal, admission,
                    roster, intake, totals, ckpt, layout, publisher, slots, reporter,
                    EvalSchedule(ctx, cfg, eval_fn, reporter.eval))
    p.slices = ShardSlices(roster) if roster is not None else None
    if steplog_in_use(cfg, trainer):
        p.steplog = StepLogLink(ctx, zctx, term)
        if p.steplog.states is not None:  # a written checkpoint frees the state spool's older segments
            ckpt.on_saved.append(p.steplog.states.covered)
    elif cfg.checkpoint.step_log:  # (docs/design/step-log.md, "Where it stands")
        ctx.log.info("step log not built yet for cluster.pipeline_stages: a server's death goes back to the last "
                     "checkpoint")
    _restore(p)
    p.member = Member(ctx.redis, ctx.keys, "aggregator", "0", cfg.cluster.heartbeat_interval,
                      cfg.cluster.dead_after, extra={"addr": addr, "term": term, **ctx.member_extra}).start()
    if trainer.sharded:
        ckpt.sharding = {"shard": 0, "shards": trainer.partition.shards, "pieces": trainer.partition.describe()}
    p.advertise()
    p.holdings = Holdings(trainer.inner.R, lambda r: innerstate.owner(r, cfg.cluster.shards, cfg.train.inner_states)) \
        if trainer.inner is not None else None
    # Redis may restart empty: is this leader still advertised? (read off the loop: shared/coordination/watch.py)
    p.advertised = Watch(ctx.redis, 1.0, lambda r: r.exists(ctx.keys.aggregator), "leader").start()
    # (local steps: a lease is one replica's round)
    p.leasing = Leasing(cfg, p.codec.per_microbatch or trainer.local, trainer.sharded, seal, term,
                        lambda: p.live_workers, intake.reclaim, lambda: [w.wid for w in p.admission.workers.values()],
                        ctx.emit)
    p.leasing.new_step(trainer.step)
    return p


def _restore(p: LeaderParts) -> None:
    """The newest checkpoint, if any: the run goes on from it, and `restored_step` says which it was; then, with the
    step log, the steps after it (none on a fresh run): optimizer steps only (steplog/replay.py)."""
    restored = p.ckpt.fetch_latest(timeout=120, trainer=p.trainer)
    startup.mark("checkpoint_asked")
    if restored is not None:
        try:
            snapshots.restore(p.trainer, p.totals, p.fp, p.evals.bg, restored.header["meta"], restored.tensors)
        except snapshots.NOT_RESTORABLE as exc:
            p.ctx.fatal(f"cannot restore checkpoint of step {restored.header['step']}: {exc}")
        p.ctx.log.info("restored from checkpoint", step=p.trainer.step)
        p.restored_step = p.trainer.step
    if p.steplog is not None:
        # sharded: the last boundary's evaluation no entry holds waits for the shards' pieces of it
        waits = (lambda step, weights: setattr(p.evals, "waiting", (step, weights))) if p.roster is not None else None
        replay(p.ctx, p.trainer, p.steplog, p.totals, p.evals.bg, unlogged=p.reporter.replayed_line, resume=waits)
        p.replayed_step = p.trainer.step
