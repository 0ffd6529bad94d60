"""A worker: pull a microbatch lease, compute its gradient, send it, repeat.

The worker owns no training state that matters: parameters come from the aggregator with each
new version, the data of microbatch (s, m) is a pure function of the config. A worker can be
killed at any moment; its replacement needs only the aggregator.

This module wires the worker's pieces and runs its loop: each message from the leader goes to its handler by type
(`handlers`, as the leader dispatches), and while none comes the worker asks again when a reply was lost or the
leader has been silent too long (services/worker/links/patience.py), or checks that the leader is still current. Who
the worker is and when it exits is `lifecycle.py`; how it joins, services/worker/links/joining.py; a lease's steps,
`lease.py`; where parameters land, links/intake.py; the gradient out, links/outbox.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import torch
from cmemi.services.worker.compute.block import BlockComputer
from cmemi.services.worker.compute.device import DeviceError, make_deterministic, pick_device
from cmemi.services.worker.compute.loader import Loader
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.compute.replicas import Replicas
from cmemi.services.worker.lease import LeaseWork
from cmemi.services.worker.lifecycle import Lifecycle
from cmemi.services.worker.links.inflight import InFlight
from cmemi.services.worker.links.intake import Intake
from cmemi.services.worker.links.joining import Joining
from cmemi.services.worker.links.leader import LeaderLink
from cmemi.services.worker.links.outbox import Outbox
from cmemi.services.worker.links.shard_links import Lost, ShardLinks
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_dataset, build_model
from cmemi.shared.core.data import data_error, fingerprint
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import limits, protocol, samehost

Handler = Callable[[protocol.Message], object]


class Worker:
    def __init__(self, ctx: ServiceContext, label: str) -> None:
        """Load everything that does not depend on the worker's identity (so a warm spare can do it early)."""
        self.ctx, self.cfg = ctx, ctx.cfg
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        try:
            resolve(cfg.data.factory, "data.factory")  # a typo fails here, as a config error
            self.model = build_model(cfg)
            startup.mark("model_built")
            self.loss_fn = resolve(cfg.train.loss, "train.loss")
        except ConfigError as exc:
            ctx.fatal(str(exc))
        try:
            self.dataset = build_dataset(cfg)  # the zygote's, when it built it (cluster.zygote_data)
            startup.mark("dataset_built")
            self.fp = fingerprint(self.dataset)
            startup.mark("fingerprinted")
        except Exception as exc:  # any failure reading user data must become a clear, fatal message
            ctx.fatal(data_error(f"worker {label}", cfg, exc))
        self.runner = MicrobatchRunner(cfg, self.model, self.dataset, self.loss_fn)
        if cfg.data.workers:  # forked now, before ZeroMQ's and Redis's threads exist
            self.runner.loader = Loader(cfg, self.dataset, cfg.data.workers, log=ctx.log)
        self.params = self.runner.params
        self.partition = Partition(self.params, cfg.cluster.shards, cfg.cluster.pipeline_stages,  # the leader's slice,
                                   cfg.compression.whole_pieces)  # and the other shards'
        self.device = torch.device("cpu")
        # the leader's segment (and a successor's), read in place where nothing but the slot writes the parameters;
        # made first, as ever: on a CPU the inbox makes the parameters views of where they land
        reader = shm_reader.Reader(ctx.run, shm.checksums(cfg.cluster.checksum), limit=4, bound=limits.logical_bytes(cfg))
        self.intake = Intake(ctx, cfg, self.partition, self.params, self.runner.step_buffers, reader,
                             cfg.compression.downlink == "none" and not cfg.train.local_steps)
        self.compute = BlockComputer(cfg, self.runner, ctx.log, ctx.fatal, lambda: self.wid)
        self.compute.valid = self.intake.lending.valid
        # train.local_steps: a lease is a replica's round (services/worker/compute/local.py)
        local = LocalRound(cfg, self.runner, self.partition) if cfg.train.local_steps else None
        self.replicas = Replicas(cfg, local, self.compute, ctx.fatal)
        self.life = Lifecycle(ctx)
        self.link = LeaderLink(ctx, cfg, lambda: self.intake.inbox.tensors, self.intake.forget, self.replicas.holds)
        self.joining = Joining(ctx, cfg, self.life, self.link, self.fp, limits.nbytes(self.params.values()),
                               self.intake.forget, self._stop_or_reject)
        self.shard_links = ShardLinks(ctx, cfg, self.partition, self.params, lambda: self.link.sender,
                                      self.joining.dial)
        self.joining.shard_links = self.shard_links
        if local is not None and cfg.cluster.shards > 1:  # the servers on this host, whose replicas' states stay here
            self.link.near = lambda: samehost.on_this_host({0: self.link.addr,
                                                            **{lk.k: lk.addr for lk in self.shard_links.links}})
        sends = InFlight(self.compute.trim, max(2.0, 2 * cfg.cluster.dead_after))  # the last gradient's frames
        self.outbox = Outbox(ctx.run, cfg, self.partition, self.link, self.shard_links, sends, local is not None)
        self.lease = LeaseWork(cfg, ctx.log, self.runner, self.compute, self.intake, self.link, self.shard_links,
                               self.replicas, sends, self.outbox)
        self.told_stop = False  # the leader said the run's steps are done (`_stop_or_reject`)
        # each message from the leader by its type (anything else: `_on_other`)
        self.handlers: dict[str, Handler] = {
            "work": self._on_work,
            "pending": lambda msg: self.link.pending(msg, self.intake.number),
            "inner": self.replicas.hold,  # local steps: a replica's state for the work that follows
            "parked": lambda msg: self.lease.compute_ahead(msg.header["step"]),  # streaming: no more of this step
            "reject": self._on_reject,
        }

    def assume(self, wid: str) -> None:
        """Take identity `wid`: register (new incarnation) and start heartbeating."""
        self.wid = self.intake.wid = self.replicas.wid = wid
        try:  # the GPU follows the worker id, so it is known only now (a spare loads on the CPU)
            self.device = pick_device(self.cfg.device, wid)
        except DeviceError as exc:
            self.ctx.fatal(str(exc))
        if self.device.type != "cpu":
            make_deterministic(self.device)
            self.runner.to(self.device)
            self.intake.place(self.device)
            self.compute.valid = self.intake.lending.valid
        self.inc = self.life.register(wid)
        self.link.sender = {"wid": wid, "inc": self.inc}
        startup.mark("registered")
        structlog.contextvars.bind_contextvars(worker_id=wid, incarnation=self.inc)
        self.log = self.ctx.log
        self.ctx.emit("worker_started", worker=wid, incarnation=self.inc, host=self.joining.host)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.joining.connect(self.device)
        if self.ctx.stopping.is_set():
            return
        startup.mark("welcomed")
        startup.report(self.ctx.redis, self.ctx.keys, "worker", self.wid)
        self.lease.want()
        while not self.ctx.stopping.is_set():
            msg = self.link.recv(100)
            if msg is not None:
                self.handle(msg)
            else:
                self.idle()
        if self.link.sock is not None and self.life.member is not None:
            self.link.send("leave")  # graceful: our leases go back at once

    def handle(self, msg: protocol.Message) -> None:
        """A message from the leader, to its handler by type."""
        self.handlers.get(msg.type, self._on_other)(msg)

    def idle(self) -> None:
        """No message came: ask again if a reply was lost or the leader was silent too long; else is it current?"""
        link = self.link
        if link.lost_reply:
            link.lost_reply = False
            self.lease.want()
            return
        if not self.told_stop and link.reask_if_due(self.intake.number, time.monotonic()):
            return
        if (info := self.life.idle_check()) is not None and "addr" in info and (
                info["addr"] != link.addr or int(info["term"]) != link.term):
            self.log.info("aggregator changed; re-syncing", addr=info["addr"], term=int(info["term"]))
            self.told_stop = False
            self._reconnect()

    def _reconnect(self) -> None:
        self.joining.connect(self.device)
        if not self.ctx.stopping.is_set():
            self.lease.want()

    def _on_work(self, msg: protocol.Message) -> None:
        if msg.header["term"] != self.link.term:
            self._on_other(msg)
            return
        self.link.patience.work_arrived()
        try:
            self.lease.run(msg)
        except Lost as exc:  # a shard died or restarted: the cluster starts a new term
            self.log.warning("lost a parameter-server shard; saying hello again", error=str(exc))
            self.intake.forget()
            self._reconnect()

    def _on_reject(self, msg: protocol.Message) -> None:
        self._on_other(msg)
        self._reconnect()

    def _on_other(self, msg: protocol.Message) -> None:
        """`stop`, a `reject`, or a message not used (another term's work): its parameters may have landed."""
        if msg.tensors:
            self.intake.forget()
        self._stop_or_reject(msg)

    def _stop_or_reject(self, msg: protocol.Message) -> None:
        if msg.type == "stop":
            # The run is over once Redis says so (idle_check exits then). Leaving now, before the leader has written
            # the final checkpoint and marked it completed, would be a worker that left early: restarted, a whole
            # process (model included) that builds only to exit. If the leader dies first, its successor's term
            # brings this worker back to work (idle_check sees the new term).
            if not self.told_stop:
                self.log.info("told to stop; leaving once the run is marked completed", reason=msg.header["reason"])
            self.told_stop = True
            return
        if msg.type == "reject":
            if msg.header["fatal"]:
                self.ctx.fatal(msg.header["reason"])
            self.log.warning("rejected", reason=msg.header["reason"])
            self.life.check_fenced()

    def close(self) -> None:
        self.outbox.close()
        self.shard_links.close_slots()
        if self.runner.loader is not None:
            self.runner.loader.close()
        self.life.close()
        self.link.close()
