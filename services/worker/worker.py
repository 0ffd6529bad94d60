"""A worker: pull a microbatch lease, compute its gradient, send it, repeat.

The worker owns no training state that matters: parameters come from the aggregator with each
new version, the data of microbatch (s, m) is a pure function of the config. A worker can be
killed at any moment; its replacement needs only the aggregator.

Over ipc:// (a same-host leader, `cluster.transport` auto or shm) the worker asks for shared-memory slots
(shared/memory/shm.py): a welcome that grants them means parameters come as a slot's descriptor, copied from the slot into
the model and used only if the slot did not change meanwhile, and the leader's slice of each gradient goes into a
slot of this worker's own segment, with only its descriptor on the socket.

This module is the connection to the leader and the loop; who the worker is and when it exits is
`lifecycle.py`, where parameters land `inbox.py`, a lease's gradient `block.py`, the other shards `shards.py`.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import redis
import structlog
import torch
import zmq
from cmemi.services.worker.compute.block import BlockComputer, StaleParameters
from cmemi.services.worker.compute.device import DeviceError, make_deterministic, pick_device
from cmemi.services.worker.compute.loader import Loader
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.lifecycle import Lifecycle
from cmemi.services.worker.links.inbox import Inbox
from cmemi.services.worker.links.inflight import InFlight
from cmemi.services.worker.links.lending import SlotLending
from cmemi.services.worker.links.patience import Patience
from cmemi.services.worker.links.shard_links import Lost, ShardLinks
from cmemi.shared.compression import downlink
from cmemi.shared.compression.base import CodecError
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.core.data import data_error, fingerprint
from cmemi.shared.core.environment import environment
from cmemi.shared.core.grid import Partition
from cmemi.shared.core.innerstate import InnerState
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, samehost, transfer


class Worker:
    def __init__(self, ctx: ServiceContext, label: str) -> None:
        """Load everything that does not depend on the worker's identity (so a warm spare can do it early)."""
        self.ctx, self.cfg = ctx, ctx.cfg
        cfg = self.cfg
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        self.host = socket.gethostname()
        try:
            factory = resolve(cfg.data.factory, "data.factory")
            self.model = build_model(cfg)
            startup.mark("model_built")
            self.loss_fn = resolve(cfg.train.loss, "train.loss")
        except ConfigError as exc:
            ctx.fatal(str(exc))
        try:
            self.dataset = factory(**cfg.data.kwargs)
            startup.mark("dataset_built")
            self.fp = fingerprint(self.dataset)
            startup.mark("fingerprinted")
        except Exception as exc:  # any failure reading user data must become a clear, fatal message
            ctx.fatal(data_error(f"worker {label}", cfg, exc))
        self.n = self.fp["length"]
        # error-feedback state lives here; a worker that dies takes its residual with it (see README)
        self.codec = make_codec(cfg.compression)
        self.runner = MicrobatchRunner(cfg, self.model, self.dataset, self.loss_fn)
        if cfg.data.workers:  # forked now, before ZeroMQ's and Redis's threads exist
            self.runner.loader = Loader(cfg, self.dataset, cfg.data.workers, log=ctx.log)
        self.params = self.runner.params
        self.partition = Partition(self.params, cfg.cluster.shards, cfg.cluster.pipeline_stages,  # the leader's slice,
                                   cfg.compression.whole_pieces)  # and the other shards'
        self.shard_links = ShardLinks(ctx, cfg, self.partition, self.params, lambda: {"wid": self.wid, "inc": self.inc},
                                      self._link)
        self.device = torch.device("cpu")
        self.inbox = Inbox(self.partition, self.params, self.runner.step_buffers, self.device)
        # compression.downlink: the model's parameters are the mirror, moved by each version's change (shared/compression/downlink.py)
        self.downlink = downlink.codec(cfg.compression) if cfg.compression.downlink != "none" else None
        self.downlink_dropped = 0  # changes refused as malformed (the whole mirror is asked for instead)
        self.compute = BlockComputer(cfg, self.runner, ctx.log, ctx.fatal, lambda: self.wid)
        # train.local_steps: a lease is a replica's round (services/worker/compute/local.py); the inner states this worker
        # holds, replica -> (the round it starts, the state), the last few it computed or was sent
        self.local = LocalRound(cfg, self.runner, self.partition) if cfg.train.local_steps else None
        self.held: dict[int, tuple[int, InnerState | None]] = {}
        # streaming: leases computed ahead, (step, replica) -> (the held state they started from, result)
        self.ahead: dict[tuple[int, int], tuple[tuple[int, InnerState | None], Any]] = {}
        self.hold_at_most = 1 + -(-cfg.train.microbatches // max(1, cfg.cluster.workers))
        self.sends = InFlight(self.compute.trim, max(2.0, 2 * cfg.cluster.dead_after))  # the last gradient's frames
        self.life = Lifecycle(ctx)
        self.version = -1
        self.term = -1
        self.lost_reply = False
        self.told_stop = False  # the leader said the run's steps are done (`_handle_reject_or_stop`)
        self.patience = Patience(max(2.0, 2 * cfg.cluster.dead_after))  # when to ask again (services/worker/links/patience.py)
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(cfg), cfg.cluster.checksum,
                                        on_abandon=self._abandoned)  # parameters bigger than one message
        self.zctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.agg_addr: str | None = None
        self.slots = False  # the leader granted shared-memory slots on this connection
        self.param_bytes = limits.nbytes(self.params.values())
        # the leader's segment (and a successor's)
        self.slot_reader = shm_reader.Reader(ctx.run, shm.checksums(cfg.cluster.checksum), limit=4, bound=limits.logical_bytes(cfg))
        self.slot_writer: shm.Writer | None = None  # this worker's gradients (made on first use)
        self._lend_from(self.inbox)

    def _lend_from(self, inbox: Inbox) -> None:
        """The leader's slot read in place where nothing but the slot writes the parameters (services/worker/links/lending.py;
        the inbox rules out shards' rows and a GPU)."""
        self.lending = SlotLending(inbox, self.slot_reader, self.params, self.downlink is None and self.local is None,
                                   self.ctx.log)
        self.compute.valid = self.lending.valid

    def assume(self, wid: str) -> None:
        """Take identity `wid`: register (new incarnation) and start heartbeating."""
        self.wid = wid
        cfg = self.cfg
        try:  # the GPU follows the worker id, so it is known only now (a spare loads on the CPU)
            self.device = pick_device(cfg.device, wid)
        except DeviceError as exc:
            self.ctx.fatal(str(exc))
        if self.device.type != "cpu":
            make_deterministic(self.device)
            self.runner.to(self.device)
            self.inbox = Inbox(self.partition, self.params, self.runner.step_buffers, self.device)
            self._lend_from(self.inbox)
        self.inc = self.life.register(wid)
        startup.mark("registered")
        structlog.contextvars.bind_contextvars(worker_id=wid, incarnation=self.inc)
        self.log = self.ctx.log
        self.ctx.emit("worker_started", worker=wid, incarnation=self.inc, host=self.host)

    # ------------------------------------------------------------------ connection
    def _aggregator(self) -> tuple[str, int] | None:
        try:
            info = self.ctx.redis.hgetall(self.ctx.keys.aggregator)
        except redis.RedisError:
            return None
        if "addr" not in info:
            return None
        return info["addr"], int(info["term"])

    def _connect(self) -> None:
        """(Re)connect to the current aggregator and say hello; returns once welcomed."""
        while not self.ctx.stopping.is_set():
            self.life.exit_if_finished()
            found = self._aggregator()
            if found is None:
                time.sleep(0.05)
                continue
            addr, term = found
            if self.sock is not None:
                self.sock.close(linger=0)
                self.parts.keep(())  # the rest of an unfinished transfer will never come on a new socket
            self.sock = self.zctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, f"{self.wid}/{self.inc}/{term}".encode())
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.cluster.max_message_bytes)
            self._link(self.sock, addr, "aggregator")
            self.agg_addr = addr
            hello = {"fp": self.fp, "host": self.host, "env": environment(self.device, self.cfg)}
            asks = self.life.links.get("aggregator") == "ipc" and shm.suits(self.param_bytes, self.cfg.cluster.workers)
            self._send("hello", **hello, **({"shm": True} if asks else {}))
            deadline = time.monotonic() + max(5.0, 3 * self.cfg.cluster.dead_after)
            while time.monotonic() < deadline and not self.ctx.stopping.is_set():
                msg = self._recv(100)
                if msg is None:
                    continue
                if msg.type == "welcome":
                    self.term = msg.header["term"]
                    self.slots = asks and msg.header.get("shm") is True
                    if self.slots:  # status and the joined line say so: ipc:// carries descriptors only
                        self.life.transport("aggregator", "shm")
                    self.version = -1  # a new term may have rolled back: always take its parameters
                    self.lost_reply = False  # the caller asks for work next anyway
                    try:
                        self.shard_links.connect(self.zctx, list(msg.header.get("shards") or []), self.term, hello)
                    except Lost as exc:
                        self.log.warning("a parameter-server shard did not welcome us; trying again", error=str(exc))
                        break
                    for link in self.shard_links.links:
                        if link.slots:
                            self.life.transport(f"shard{link.k}", "shm")
                    self.log.info("joined", aggregator=addr, transport=self.life.links, term=self.term, step=msg.header["step"],
                                  shards=1 + len(self.shard_links.links))
                    self.life.forget_readings()
                    return
                self._handle_reject_or_stop(msg)
            self.life.check_fenced()

    def _link(self, sock: zmq.Socket, addr: str, peer: str) -> str:
        """Connect to a server over ipc:// when it is on this host, else CurveZMQ tcp:// (cluster.transport); returns
        the transport taken."""
        try:
            kind = samehost.connect(self.ctx.curve, sock, addr, self.cfg.cluster.transport, peer)
        except samehost.TransportError as exc:
            self.ctx.fatal(f"worker {self.wid}: {exc}")
        self.life.transport(peer, kind)
        return kind

    def _send(self, mtype: str, tensors: dict[str, torch.Tensor] | None = None,
              trackers: list[zmq.MessageTracker] | None = None, **fields: Any) -> None:
        assert self.sock is not None
        if self.local is not None and mtype in ("want", "grad"):  # which replicas' next rounds need no state sent
            fields["holds"] = [[r, t] for r, (t, _) in self.held.items()]
        try:  # over the cap: in parts (never one message over it: the aggregator could only drop it)
            msgs = transfer.messages(mtype, self.ctx.run, {"wid": self.wid, "inc": self.inc, **fields},
                                     self.cfg.cluster.max_message_bytes, tensors, self.cfg.cluster.checksum,
                                     part=transfer.PART)  # a server queues two per worker (serve_router)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"worker {self.wid}: {exc}")
        transfer.send(self.sock, msgs, trackers=trackers)
        self.patience.heard()

    def _recv(self, timeout_ms: int) -> protocol.Message | None:
        assert self.sock is not None
        if not self.sock.poll(timeout_ms):
            return None
        self.patience.heard()
        try:  # new parameters land straight in the model's tensors
            msg = self.parts.recv(self.sock, into=self.inbox.tensors)
            if msg is None and self.parts.pending:  # parameters in parts are half written until the last one
                self.version = -1
            return msg
        except protocol.ProtocolError as exc:
            if exc.reason == "stale_part":  # the rest of a transfer already dropped (and asked again for)
                return None
            # A reply was lost (and parameters may be half-written): ask again, for a full set of parameters.
            self.log.warning("message dropped", reason=exc.reason, detail=str(exc)[:200])
            self.version = -1
            self.lost_reply = True
            return None

    def _abandoned(self, reason: str, detail: str) -> None:
        self.log.warning("message dropped", reason=reason, detail=detail[:200])
        self.version = -1  # parameters may be half written

    def _handle_reject_or_stop(self, msg: protocol.Message) -> None:
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

    # ------------------------------------------------------------------ work
    def run(self) -> None:
        self._connect()
        if self.ctx.stopping.is_set():
            return
        startup.mark("welcomed")
        startup.report(self.ctx.redis, self.ctx.keys, "worker", self.wid)
        self._send("want", term=self.term, version=self.version)
        while not self.ctx.stopping.is_set():
            msg = self._recv(100)
            if msg is not None:
                if msg.type == "pending":
                    if self.patience.lost(msg.header["reask"]):
                        self.log.info("work or gradient lost on the way; asking again", reask=msg.header["reask"])
                        self._send("want", term=self.term, version=self.version)
                    continue
                if msg.type == "inner":
                    self._hold(msg)
                    continue
                if msg.type == "parked":
                    self._compute_ahead(msg.header["step"])
                    continue
                if msg.type == "work" and msg.header["term"] == self.term:
                    self.patience.work_arrived()
                    try:
                        self._work(msg)
                    except Lost as exc:  # a shard died or restarted: the cluster starts a new term
                        self.log.warning("lost a parameter-server shard; saying hello again", error=str(exc))
                        self.version = -1
                        self._reconnect()
                    continue
                if msg.tensors:  # parameters of a message we do not use may have landed in the model
                    self.version = -1
                if msg.type == "reject":
                    self._handle_reject_or_stop(msg)
                    self._reconnect()
                    continue
                self._handle_reject_or_stop(msg)
            elif self.lost_reply:
                self.lost_reply = False
                self._send("want", term=self.term, version=self.version)
            elif not self.told_stop and (waited := self.patience.due(time.monotonic())) is not None:
                # a want, work or grad went missing?
                self.log.info("no reply; asking again", after_s=round(waited, 1))
                self._send("want", term=self.term, version=self.version, reask=self.patience.reask())
            elif (info := self.life.idle_check()) is not None:  # idle: still current?
                if "addr" in info and (info["addr"] != self.agg_addr or int(info["term"]) != self.term):
                    self.log.info("aggregator changed; re-syncing", addr=info["addr"], term=int(info["term"]))
                    self.told_stop = False
                    self._reconnect()
        if self.sock is not None and self.life.member is not None:
            self._send("leave")  # graceful: our leases go back at once

    def _reconnect(self) -> None:
        self._connect()
        if not self.ctx.stopping.is_set():
            self._send("want", term=self.term, version=self.version)

    def _from_slot(self, msg: protocol.Message) -> bool:
        """The parameters of a `work` whose tensors are in the leader's slot, into the model; False (and the model
        holds no version) if the slot is bad or was rewritten while copied: the caller asks again."""
        h = msg.header
        try:
            views = self.slot_reader.views(h["shm"])
        except protocol.ProtocolError as exc:
            self.log.warning("parameters slot unusable; asking again", reason=exc.reason, detail=str(exc)[:200])
            return False
        fits = self.lending.load(protocol.Message(h, views))
        del views
        if not fits:
            self.ctx.fatal(f"worker {self.wid}: the aggregator's parameters (layout {str(h.get('layout'))[:16]}) "
                           f"do not fit this worker's model (layout {self.inbox.layout.digest}, shared/wire/layout.py): "
                           "use the same model.factory and model.kwargs on every host")
        if not self.slot_reader.intact(h["shm"]):
            self.log.info("parameters slot rewritten while read; asking again", version=h["version"])
            return False
        self.version = h["version"]
        return True

    def _apply_change(self, msg: protocol.Message) -> bool:
        """compression.downlink: the leader's change from our version (`base`) into the mirror (the model's pieces),
        by the function the servers use; the step's buffers come with it, dense. False, and nothing changed, when it
        is not from our version or is malformed (counted)."""
        h, tensors = msg.header, msg.tensors
        if self.downlink is None or self.version < 0 or h.get("base") != self.version:
            self.log.info("a parameter change from another version; asking for the whole mirror", base=h.get("base"),
                          have=self.version)
            return False
        buffers = {n: tensors.get(PREFIX + n) for n in self.runner.step_buffers}
        try:
            if any(b is None or b.shape != self.runner.step_buffers[n].shape or b.dtype != self.runner.step_buffers[n].dtype
                   for n, b in buffers.items()):
                raise CodecError("bad_buffers", "the step's buffers are missing or do not match the model")
            pieces = self.partition.views(self.params, 0)
            downlink.apply(self.downlink, pieces, h.get("codec"),
                           {k: t for k, t in tensors.items() if not k.startswith(PREFIX)},
                           {n: tuple(p.shape) for n, p in pieces.items()})
        except CodecError as exc:
            self.downlink_dropped += 1
            self.log.warning("parameter change dropped; asking for the whole mirror", reason=exc.reason,
                             detail=str(exc)[:200], dropped=self.downlink_dropped)
            return False
        with torch.no_grad():
            for n, b in self.runner.step_buffers.items():
                if buffers[n] is not b:
                    b.copy_(buffers[n])
        self.version = h["version"]
        return True

    def _take_pieces(self, msg: protocol.Message) -> bool:
        """Streaming: the leader's pieces that the steps since our version changed, and the step's buffers
        (fragments.PIECES), into the model; False when they are not from our version or do not fit it (the whole
        version is asked for then)."""
        h, buffers = msg.header, {PREFIX + n: b for n, b in self.runner.step_buffers.items()}
        if self.version < 0 or h.get("base") != self.version or not fragmenting.land(
                msg.tensors, {**self.partition.views(self.params, 0), **buffers}, buffers):
            self.log.info("changed pieces not from our version, or not our model's; asking for the whole version",
                          base=h.get("base"), have=self.version)
            return False
        self.version = h["version"]
        return True

    def _hold(self, msg: protocol.Message) -> None:
        """Local steps: a replica's inner state from the leader, for the work that follows."""
        h = msg.header
        try:
            inner = innerstate.from_wire(h["meta"], msg.tensors)
        except ValueError as exc:  # the leader checked it: a bug or another config, not a transient fault
            self.ctx.fatal(f"worker {self.wid}: replica {h['replica']}'s inner state from the aggregator cannot be "
                           f"read ({exc}); use the same optimizer and model on every host")
        self._keep(h["replica"], h["round"], inner)

    def _keep(self, r: int, rnd: int, inner: InnerState | None) -> None:
        self.held[r] = (rnd, inner)
        while len(self.held) > self.hold_at_most:  # the oldest round goes, never the one just kept
            del self.held[min((x for x in self.held if x != r), key=lambda x: self.held[x][0])]

    def _compute_ahead(self, step: int) -> None:
        """Streaming: with no other lease of step `step` coming (its last lease said so, or the leader parked us after
        our gradient), compute the next step's segment of each replica held for it while the step is collected (`LocalRound.ahead`: the model's version gives the same bits), lowest replica
        first (the leader leases a held replica's lowest first); stop as soon as a message waits: a lease goes first."""
        local, nxt = self.local, step + 1
        if local is None or not local.ahead or self.version != step or nxt >= self.cfg.train.rounds:
            return
        assert self.sock is not None
        for r in sorted(self.held):
            held = self.held[r]
            if held[0] != nxt or (nxt, r) in self.ahead:
                continue
            if self.sock.poll(0):
                return
            self.ahead[(nxt, r)] = (held, self.compute.local_round(local, nxt, r, *held))

    def _local(self, step: int, r: int, held: tuple[int, InnerState | None]) -> tuple[Any, bool]:
        """A replica's lease: computed ahead from this very state if it was, else now; and whether it was ahead."""
        ahead = self.ahead.pop((step, r), None)
        self.ahead = {k: v for k, v in self.ahead.items() if k[0] >= step}
        if ahead is not None and ahead[0] is held:
            return ahead[1], True
        assert self.local is not None
        return self.compute.local_round(self.local, step, r, *held), False

    def _work(self, msg: protocol.Message) -> None:
        h = msg.header
        delta = h.get("downlink") == downlink.DELTA  # (a change is from `base`: checked before the version moves)
        pieces = h.get("downlink") == fragmenting.PIECES
        if not msg.tensors and not self.inbox.tensors and not delta and not pieces:  # nothing to receive: a leader without pieces
            self.version = h["version"]  # (pipelined, or more shards than a low-rank codec's whole-tensor pieces)
        if delta:
            if not self._apply_change(msg):  # not our version's, or malformed: the whole mirror instead
                self.version = -1
                self._send("want", term=self.term, version=self.version)
                return
        elif pieces:
            if not self._take_pieces(msg):
                self.version = -1
                self._send("want", term=self.term, version=self.version)
                return
        elif "shm" in h and self.slots and not msg.tensors:
            if not self._from_slot(msg):
                self.version = -1
                self._send("want", term=self.term, version=self.version)
                return
        elif msg.tensors:
            if not self.inbox.take(msg):  # checksums passed: the aggregator's model is not ours (another config)
                self.ctx.fatal(f"worker {self.wid}: the aggregator's parameters (layout {str(h.get('layout'))[:16]}) "
                               f"do not fit this worker's model (layout {self.inbox.layout.digest}, shared/wire/layout.py): "
                               "use the same model.factory and model.kwargs on every host")
            self.version = h["version"]
        if self.version != h["version"]:  # cannot happen with a correct aggregator; never compute on stale weights
            self.version = -1
            self._send("want", term=self.term, version=self.version)
            return
        links = self.shard_links
        if links.links and not links.fetch(self.version):  # the other shards' slices of this version
            self._send("want", term=self.term, version=self.version)  # they are past it: this lease is stale
            return
        lo, hi = h["lo"], h["hi"]
        self.sends.settle()  # a big model's last gradient is out of ZeroMQ's queues before the next one exists
        inner: dict[str, torch.Tensor] = {}
        extra: dict[str, Any] = {}
        if self.local is not None:
            # (streaming: a state from the last snapshot period will do; the segments since are computed again)
            if (held := self.held.get(lo)) is None or not 0 <= h["step"] - held[0] < self.local.window:
                self.log.info("no inner state for this replica's round; asking again", replica=lo, round=h["step"])
                self.held.pop(lo, None)
                self._send("want", term=self.term, version=self.version)
                return
            (losses, grads, buffers, state), ahead = self._local(h["step"], lo, held)
            finite = True
            extra["ahead"] = ahead
            self._keep(lo, h["step"] + 1, state)
            if self.local.ships_state(h["step"], lo):
                extra["inner"], inner = innerstate.to_wire(state)
        else:
            try:
                losses, grads, buffers, finite = self.compute.block(h["step"], lo, hi, float(h["scale"]))
                stale = not self.lending.valid()
            except StaleParameters:
                stale = True
            if stale:  # a slot read in place was rewritten meanwhile: this lease is stale
                self.log.info("parameters slot rewritten while computed on; asking again", version=self.version)
                self.version = -1
                self._send("want", term=self.term, version=self.version)
                return
            self.lending.computed()
        samples = (hi - lo) * (self.cfg.train.global_batch // self.cfg.train.microbatches) * max(1, self.cfg.train.segment)
        fields = {"finite": finite, "term": self.term, "step": h["step"], "lo": lo, "hi": hi, "version": self.version,
                  "losses": losses, "n": samples, "lease": h.get("lease", b"")}  # the leader's seal: every shard checks it
        t0 = time.perf_counter()
        # (an fp16 overflow sends no tensors; a replica's change is by piece already: of one fragment, streaming)
        views = (grads if self.local is not None else self.partition.views(grads)) if finite else {}
        encoded = [[self.codec.encode({n: views[n] for n in names if n in views}, h["step"]) if finite else ({}, {})
                    for names in self.partition.staged(k)] for k in range(self.partition.shards)]
        encode_s = time.perf_counter() - t0
        # the next version asked for first: behind the gradient on the same connection, a pull would reach a shard
        # only once this worker's whole slice had, too late to take a pipelined shard's first stages
        links.ask_ahead(self.version + 1)
        links.push(encoded[1:], {**fields, "encode_s": encode_s}, self.sends.trackers)  # every shard's slice at once, the leader's too
        info, frames = encoded[0][0]  # the leader's slice, one stage (pipelined: it holds no parameters)
        if buffers is not None:
            frames = {**frames, **{PREFIX + n: b for n, b in buffers.items()}}
        frames = {**frames, **inner}
        if self.slots:  # into this worker's slot; the leader copies it out before it answers
            if self.slot_writer is None:
                self.slot_writer = shm.Writer(self.ctx.run, "worker", shm.checksums(self.cfg.cluster.checksum))
            self._send("grad", tensors={}, shm=self.slot_writer.write(frames), codec=info, encode_s=encode_s, **fields,
                       **extra)
        else:
            self._send("grad", tensors=frames, trackers=self.sends.trackers, codec=info, encode_s=encode_s, **fields,
                       **extra)
        if h.get("last") is True:  # streaming: no other lease of this step is coming our way; compute ahead now, while
            self._compute_ahead(h["step"])  # the gradient travels (`parked` would come only once it has arrived)
        if self.runner.loader is not None and self.local is None and (hi - lo > 1 or self.cfg.train.microbatches == 1):
            # while the aggregator steps: a block lease is most often this worker's again next step (single
            # microbatches, as a lossy codec leases them, go to whoever asks first: no guess)
            self.runner.loader.guess(h["step"] + 1, range(lo, hi))

    def close(self) -> None:
        if self.slot_writer is not None:
            self.slot_writer.close()
        self.shard_links.close_slots()
        if self.runner.loader is not None:
            self.runner.loader.close()
        self.life.close()
        if self.sock is not None:
            self.sock.close(linger=200)
        self.zctx.destroy(linger=200)

