"""A server's side of the step log: each step's inputs shipped to the checkpointer, the step committed on its ack.

`ship` sends a step's entry (the leader's: right after the step's parameters went out). The leader does not wait for its acknowledgement there: it
publishes the step's parameters at once and commits the step when the ack comes (`poll`, from its loop), waiting
(`confirm`) only if the ack is still missing when the next step is ready, so at most one entry is ever
unacknowledged (docs/design/step-log.md). The reduced gradient goes zero-copy where nothing can change it until the
ack (`copy=False`); the pipelined leader ships a copy it took before the optimizer step, since the step changes the
gradient in place, the next step's sums may reuse its memory while ZeroMQ still sends it, and a restarted
checkpointer is sent the entry again.

Its own DEALER to the checkpointer's step log socket (services/checkpointer/logserver.py: its own thread there, so
an entry never waits behind a checkpoint's parts or its write). That address (`log` in the checkpointer's Redis
record) is read at the start and again only when an acknowledgement is slow (a restarted checkpointer, on a new
address or incarnation: the entry is sent again).

A checkpointer on this host (its address's host identity, shared/wire/samehost.py; `cluster.transport` not tcp) is
reached over its ipc:// endpoint, with CurveZMQ as over tcp://, and an entry's message carries the descriptor of the
shared-memory slot `stage` copied its tensors into (staging.py). A 2.4 MB message's round trip (pyzmq, DEALER to
ROUTER, a 2-core machine under load) took 2.8-3.1 ms of CPU with CurveZMQ over tcp:// or ipc:// and 0.3-1.0 ms
without: the encryption, not the TCP stack, was the step log's cost on a machine whose workers need the same cores
(issue 47), and a descriptor is a few hundred bytes.

A replay reads the log over this link (reading.py: two entries ahead).

Nothing here waits on the checkpointer to send (issue 47, the 300-fault soak's stall at step 15,059). The DEALER
had no link options (shared/runtime/links.py) and no bound on its sends: after a one-way cut into the checkpointer's
host a connection stayed "established" while TCP retransmitted with a backoff of up to two minutes, so an entry in
it (shard 1's of step 15060, which the leader's ack waits for) came after ACK_TIMEOUT_S if at all; an entry lost
with a connection went again only to a restarted checkpointer; and a send into a full pipe (the peer SIGSTOPped or
cut: nothing read) blocked the server's loop. Now: the link options, sends through a SendQueue (sendq.py: handed
over as the socket takes them), and an entry unacknowledged `resend_after` after its last send goes again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
import torch
import zmq
from cmemi.services.aggregator.steplog.staging import Staging
from cmemi.shared.config.system import ClusterConfig
from cmemi.shared.coordination.membership import texts
from cmemi.shared.memory import shm
from cmemi.shared.runtime.links import link_timeout, set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import assembly, limits, protocol, samehost, transfer
from cmemi.shared.wire.sendq import SendQueue

ACK_TIMEOUT_S = 120.0  # a checkpointer away this long stops the run (its restart takes about a second)
RECHECK_S = 0.5  # an acknowledgement this late: is the checkpointer still the one sent to?
GRAD, BUFFER = "g.", "b."
SNDHWM = 4  # ZeroMQ messages held for the checkpointer at most: the rest waits in the SendQueue, in order
QUEUED = 8  # logical messages the SendQueue keeps (a pending entry, a shard's two kept, their resends, log_reqs)


def resend_after(cluster: ClusterConfig) -> float:
    """Seconds an entry goes unacknowledged before it is sent again: 2 T, the link that lost it given up and redialled."""
    return 2 * link_timeout(cluster)


def tensors_of(grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
               copy: bool = True) -> dict[str, torch.Tensor]:
    """An entry's tensors: the reduced gradient slice (`g.` names; copied unless `copy` is False) and a copy of the
    step's buffer sum (`b.`: folded into the buffers in place)."""
    out = {GRAD + n: g.detach().clone() if copy else g.detach() for n, g in (grads or {}).items()}
    out.update({BUFFER + n: b.detach().clone() for n, b in (buffer_sum or {}).items()})
    return out


def inputs_of(tensors: dict[str, torch.Tensor], skip: bool) -> tuple[dict[str, torch.Tensor] | None,
                                                                     dict[str, torch.Tensor] | None]:
    """(the reduced gradient or None for a skipped step, the buffer sum or None): what `tensors_of` shipped."""
    grads = None if skip else {n[len(GRAD):]: t for n, t in tensors.items() if n.startswith(GRAD)}
    bufs = {n[len(BUFFER):]: t for n, t in tensors.items() if n.startswith(BUFFER)}
    return grads, bufs or None


class StepLogLink:
    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, term: int, shard: int = 0) -> None:
        self.ctx, self.zctx, self.term, self.shard = ctx, zctx, term, shard
        self.cap = ctx.cfg.cluster.message_cap()
        self.parts = assembly.Assembler(ctx.run, limits.logical_bytes(ctx.cfg), ctx.cfg.cluster.checksum)
        self.sock: zmq.Socket | None = None
        self.to: tuple[str | None, str | None] = (None, None)  # the checkpointer's (step log address, incarnation)
        self.pending: tuple[int, dict[str, Any], dict[str, torch.Tensor]] | None = None  # until acknowledged:
        # (step, the entry's fields, its tensors: views of a slot, or the kept buffers)
        self.local = False  # the checkpointer connected to is on this host (ipc://, slots)
        self.staging = Staging(ctx.run, shard, ctx.cfg.cluster.checksum)  # where `stage` copies an entry to
        self.backlog: list[protocol.Message] = []  # replies read after the one a wait took
        self.shipped_bytes = 0
        self.queue = SendQueue("the checkpointer's step log", QUEUED, ctx.log)  # what the socket did not take yet
        self.sent_at = 0.0  # when the last message was put on its way (monotonic)
        self.resend_s = resend_after(ctx.cfg.cluster)

    def _where(self) -> tuple[str | None, str | None]:
        try:
            addr, inc = texts(self.ctx.redis.hmget(self.ctx.keys.checkpointer, ["log", "incarnation"]))
        except redis.RedisError:
            return self.to  # Redis away: keep talking to the checkpointer known
        return addr, inc

    def _connect(self) -> bool:
        """(Re)connect if the checkpointer moved; True if the one now connected is not the one sent to before."""
        where = self._where()
        if where[0] is None or where == self.to:
            return False
        if where[0] != self.to[0] or self.sock is None:
            if self.sock is not None:
                self.sock.close(linger=0)
                self.parts.keep(())
            self.queue.clear()  # for the checkpointer gone: the caller sends what it needs again, to the new one
            self.sock = self.zctx.socket(zmq.DEALER)
            set_link_options(self.sock, self.ctx.cfg.cluster)  # a dead connection given up in T, dialled again
            self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
            self.ctx.curve.connect_as_client(self.sock)  # CurveZMQ over ipc:// too (samehost.bind_ipc)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.cap)
            ipc = samehost.same_host(where[0], self.ctx.cfg.cluster.transport) if shm.available() else None
            self.local = ipc is not None
            self.sock.connect(ipc or samehost.tcp_of(where[0]))
        self.to = where
        return True

    def _send(self, msgs: list[list[Any]]) -> None:
        if self.sock is None:
            self._connect()
        if self.sock is not None:
            self.queue.put(msgs)
            self.sent_at = time.monotonic()
            self._flush()

    def _flush(self) -> int:
        """Hand the socket what it takes now of what waits; returns the bytes handed over."""
        n = self.queue.flush(self.sock) if self.sock is not None and len(self.queue) else 0
        self.shipped_bytes += n
        return n

    def late(self) -> bool:
        """Was the last message sent `resend_s` ago or more, and nothing of it is still waiting to go?"""
        return time.monotonic() - self.sent_at >= self.resend_s and not len(self.queue)

    def stage(self, grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
              extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A copy of a step's inputs (`tensors_of`'s names, and `extra`'s: local steps' replica states, replicas.py),
        taken before its optimizer step changes them in place (staging.py: into a slot on this host, else kept
        buffers). Called only once the previous entry is acknowledged (the checkpointer holds its own copy of it by
        then)."""
        src = {GRAD + n: g.detach() for n, g in (grads or {}).items()}
        src.update({BUFFER + n: b.detach() for n, b in (buffer_sum or {}).items()})
        src.update({n: t.detach() for n, t in (extra or {}).items()})
        if self.sock is None:
            self._connect()
        return self.staging.copy(src, self.local)

    def ship(self, step: int, grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
             partials: list[float] | None, loss: float, copy: bool = True,
             evals: dict[str, Any] | None = None) -> None:
        """Send step `step`'s inputs (its reduced gradient, None if skipped; its buffer sum; sharded, the norm
        partials it is applied with; `evals`: early stopping's state, where evaluations were collected before it:
        replay.py); `poll` or `confirm` then takes the acknowledgement. `copy=False`: the gradient is
        sent from where it lies (zero-copy), only where nothing changes that memory before the ack is taken."""
        self.staging.unstaged()
        self.ship_staged(step, tensors_of(grads, buffer_sum, copy), grads is None, partials, loss, evals)

    def ship_staged(self, step: int, tensors: dict[str, torch.Tensor], skip: bool, partials: list[float] | None,
                    loss: float, evals: dict[str, Any] | None = None, replicas: list[Any] | None = None) -> None:
        """`ship` of what `stage` copied (`tensors`; `skip`: the step's gradient is None; `replicas`: local steps'
        replica states' metadata, replicas.py)."""
        fields = {"step": step, "term": self.term, "shard": self.shard, "skip": skip, "loss": float(loss),
                  "partials": partials, "evals": evals, "replicas": replicas}
        self.pending = (step, fields, tensors)
        self._send(self._messages())

    def _messages(self) -> list[list[Any]]:
        """The pending entry's messages to the checkpointer connected now: its slot's descriptor if it is on this
        host (the tensors written into a slot first if they were staged for another), else its tensors' frames."""
        assert self.pending is not None
        _step, fields, tensors = self.pending
        try:
            if self.local and tensors:
                return transfer.messages("step_log", self.ctx.run, {**fields, "shm": self.staging.descriptor(tensors)},
                                         self.cap, {})
            return transfer.messages("step_log", self.ctx.run, fields, self.cap, tensors, self.ctx.cfg.cluster.checksum)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"aggregator: {exc}")

    # a shard k > 0 ships without waiting for acks and keeps its entries for a resend (steplog/shard.py): they
    # travel as frames, never through the staging slot, which the next step's entry overwrites
    def encode(self, step: int, grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
               partials: list[float] | None, loss: float, replicas: list[Any] | None = None,
               states: dict[str, torch.Tensor] | None = None) -> list[list[Any]]:
        """Step `step`'s entry, encoded as frames (`ship`'s arguments; the tensors copied; `replicas`, `states`: the
        replicas' states the step makes current, of a shard that keeps some: replicas.py)."""
        fields = {"step": step, "term": self.term, "shard": self.shard, "skip": grads is None, "loss": float(loss),
                  "partials": partials, "evals": None, "replicas": replicas}
        try:
            return transfer.messages("step_log", self.ctx.run, fields, self.cap,
                                     {**tensors_of(grads, buffer_sum), **(states or {})}, self.ctx.cfg.cluster.checksum)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"aggregator: {exc}")

    def send(self, msgs: list[list[Any]]) -> None:
        self._send(msgs)

    def replies(self) -> list[protocol.Message]:
        """The checkpointer's answers waiting now."""
        return self._replies(0)

    def moved(self) -> bool:
        """True if the checkpointer restarted (or was not known yet): what it lost is to be sent again."""
        return self._connect()

    def _replies(self, timeout_ms: int) -> list[protocol.Message]:
        """The replies read before and not taken (`_wait`), then those that came, waiting up to `timeout_ms` for one."""
        out, self.backlog = self.backlog, []
        deadline = time.monotonic() + (0 if out else timeout_ms / 1000)
        while self.sock is not None:
            handed = self._flush()  # what waits goes as the socket takes it, while this waits for replies
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = self.sock.poll(wait_ms, zmq.POLLIN | (zmq.POLLOUT if len(self.queue) else 0))
            if not events & zmq.POLLIN:
                if events & zmq.POLLOUT and handed:
                    continue
                break
            try:
                msg = self.parts.decode(b"", self.sock.recv_multipart(copy=False))
                if msg is not None:
                    out.append(msg)
            except protocol.ProtocolError as exc:
                self.ctx.log.warning("bad reply from checkpointer", error=str(exc))
            deadline = 0.0
        return out

    @property
    def unacknowledged(self) -> int | None:
        """The step whose entry was shipped and not acknowledged yet (None: every entry is)."""
        return self.pending[0] if self.pending is not None else None

    def poll(self, on_gap: Callable[[int], None]) -> bool | None:
        """`confirm` without waiting: None while the pending entry's acknowledgement has not come."""
        assert self.pending is not None, "poll without ship"
        step = self.pending[0]
        for msg in self._replies(0):
            if self._acks(msg, step):
                return self._settled(msg, on_gap)
        if self.late():  # lost with a connection a cut or a stopped checkpointer ended: again
            self._send(self._messages())
        return None

    def confirm(self, on_gap: Callable[[int], None]) -> bool:
        """Wait until the checkpointer holds the pending entry. `on_gap(step)`: it cannot (it restarted since the
        last checkpoint and lost the log): the caller makes the state after `step` durable at once (a checkpoint);
        True then."""
        assert self.pending is not None, "confirm without ship"
        step = self.pending[0]
        msg = self.wait(lambda m: self._acks(m, step), lambda: self._send(self._messages()),
                         f"the step log entry of step {step}", again_when_late=True)
        return self._settled(msg, on_gap)

    @staticmethod
    def _acks(msg: protocol.Message, step: int) -> bool:
        return msg.type in ("logged", "log_gap") and msg.header["step"] == step

    def _settled(self, msg: protocol.Message, on_gap: Callable[[int], None]) -> bool:
        step = msg.header["step"]
        self.pending = None
        if msg.type == "log_gap":
            self.ctx.log.info("step log: the checkpointer holds no log since its checkpoint; checkpointing now",
                              step=step, base=msg.header["base"])
            self.ctx.emit("step_log_rebased", step=step, base=msg.header["base"], shard=self.shard)
            on_gap(step)
            return True
        return False

    def wait(self, accept: Callable[[protocol.Message], bool], resend: Callable[[], None],
              what: str, again_when_late: bool = False) -> protocol.Message:
        """The first reply `accept` takes; `resend()` to a restarted checkpointer, and with `again_when_late` when the
        last send is `resend_s` old (not a replay's requests: each answer takes a slot of the checkpointer's ring)."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        waited = 0
        while time.monotonic() < deadline:
            replies = self._replies(int(RECHECK_S * 1000) if waited else 10)
            for i, msg in enumerate(replies):
                if accept(msg):
                    self.backlog = replies[i + 1:]  # (a replay's next entry, read with this one)
                    return msg
            waited += 1
            if waited > 1 and self._connect():  # the checkpointer restarted (or was not known yet): again, to it
                resend()
            elif again_when_late and self.late():
                resend()
            elif self.sock is None:
                time.sleep(0.05)
        self.ctx.fatal(f"the checkpointer did not answer {what} within {ACK_TIMEOUT_S:g}s; is `cmemi checkpointer` "
                       "running and reachable? (checkpoint.step_log: false trains without the step log)")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.parts.close()
        self.staging.close()

