"""A server's side of the step log: each step's inputs shipped to the checkpointer, the step committed on its ack.

`ship` sends a step's entry (the leader's: right after the step's parameters went out). The leader does not wait for its acknowledgement there: it
publishes the step's parameters at once and commits the step when the ack comes (`poll`, from its loop), waiting
(`confirm`) only if the ack is still missing when the next step is ready, so at most one entry is ever
unacknowledged (docs/design/step-log.md). The reduced gradient goes zero-copy where nothing can change it until the
ack (`copy=False`); the pipelined leader ships a copy it took before the optimizer step, since the step changes the
gradient in place, the next step's sums may reuse its memory while ZeroMQ still sends it, and a restarted
checkpointer is sent the entry again.

The connection under it (where the checkpointer is, the DEALER, sends that never wait, `late`) is connection.py's;
this keeps what is sent on it: the pending entry until its ack, sent again when `late` or to a restarted
checkpointer.

A checkpointer on this host is reached over its ipc:// endpoint (connection.py), and an entry's message carries the
descriptor of the shared-memory slot `stage` copied its tensors into (staging.py). A 2.4 MB message's round trip
(pyzmq, DEALER to ROUTER, a 2-core machine under load) took 2.8-3.1 ms of CPU with CurveZMQ over tcp:// or ipc://
and 0.3-1.0 ms without: the encryption, not the TCP stack, was the step log's cost on a machine whose workers need
the same cores (issue 47), and a descriptor is a few hundred bytes.

A replay reads the log over this link (reading.py: two entries ahead).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import zmq
from cmemi.services.aggregator.steplog.connection import LogConnection, resend_after
from cmemi.services.aggregator.steplog.staging import Staging
from cmemi.services.aggregator.steplog.statespool import StateSpool
from cmemi.shared.config.system import ClusterConfig
from cmemi.shared.runtime import metrics
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import limits, protocol, transfer

ACK_TIMEOUT_S = 120.0  # a checkpointer away this long stops the run (its restart takes about a second)
RECHECK_S = 0.5  # an acknowledgement this late: is the checkpointer still the one sent to?
KEEP_RATE = 32 << 20  # bytes/s: the slowest spool write a shard's wait for its slot allows for (`keep_wait_s`)
GRAD, BUFFER = "g.", "b."


def tensors_of(grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
               copy: bool = True) -> dict[str, torch.Tensor]:
    """An entry's tensors: the reduced gradient slice (`g.` names; copied unless `copy` is False) and a copy of the
    step's buffer sum (`b.`: folded into the buffers in place)."""
    out = {GRAD + n: g.detach().clone() if copy else g.detach() for n, g in (grads or {}).items()}
    out.update({BUFFER + n: b.detach().clone() for n, b in (buffer_sum or {}).items()})
    return out


def keep_wait_s(cluster: ClusterConfig, nbytes: int) -> float:
    """How long a shard k > 0 waits for the ack of the entry in its slot before its next entry (`nbytes`) goes as
    frames: the checkpointer's writes of what may lie ahead of that entry in its log thread (every server's entry of
    a step, K + 1 of about this size, at KEEP_RATE), plus `resend_after` (2 T: an entry unacknowledged that long is
    held lost and sent again anyway). The ack is due by then: the shard stages step s + 1 once the commit of s is in,
    which guarantees only its entry of s - 1 held (the leader waits for its ack of s only once every shard is ready
    for s + 1), so its entry of s is still being written whenever the checkpointer's work of a step outlasts the
    workers' (issue 47: a fixed 50 ms sent a 113 M-parameter model's shards' entries as frames, over their memory
    budgets). The wait costs the step nothing: the leader applies s + 1 only after its ack of s, which needs this
    shard's entry of s held."""
    return resend_after(cluster) + (cluster.shards + 1) * nbytes / KEEP_RATE


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` without autograd: itself when nothing tracks it (a reduced gradient never is), which costs no `detach`
    (~1 us a tensor, every step: issue 45)."""
    return t.detach() if t.requires_grad else t


def _nbytes(grads: dict[str, torch.Tensor] | None, states: dict[str, torch.Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for d in (grads, states) if d for t in d.values())


def inputs_of(tensors: dict[str, torch.Tensor], skip: bool) -> tuple[dict[str, torch.Tensor] | None,
                                                                     dict[str, torch.Tensor] | None]:
    """(the reduced gradient or None for a skipped step, the buffer sum or None): what `tensors_of` shipped."""
    grads = None if skip else {n[len(GRAD):]: t for n, t in tensors.items() if n.startswith(GRAD)}
    bufs = {n[len(BUFFER):]: t for n, t in tensors.items() if n.startswith(BUFFER)}
    return grads, bufs or None


class StepLogLink(LogConnection):
    """The entries (`stage`, `ship`, `encode`) and their acknowledgements (`poll`, `confirm`, `wait`) over the
    connection it is (connection.py: `send`, `replies`, `late`, `moved`)."""

    def __init__(self, ctx: ServiceContext, zctx: zmq.Context, term: int, shard: int = 0) -> None:
        super().__init__(ctx, zctx, term, shard)
        self.pending: tuple[int, dict[str, Any], dict[str, torch.Tensor]] | None = None  # until acknowledged:
        # (step, the entry's fields, its tensors: views of a slot, or the kept buffers)
        self.staging = Staging(ctx.run, shard, ctx.cfg.cluster.checksum)  # where `stage` copies an entry to
        self.slotted: dict[int, tuple[list[list[Any]], dict[str, Any], dict[str, torch.Tensor]]] = {}  # a shard's
        # kept entries in slots, until acknowledged: step -> (their messages, fields, tensors: views of the slot)
        self.framed = 0  # a shard's entries sent as frames on this host: no slot free within `keep_wait_s`
        self.slots_used = 0  # a shard's entries sent through its slots
        self.entries = self.entry_bytes = self.encoded_entries = 0  # entries shipped, their tensors' bytes, how many
        # were the step's encoded gradients (frames.py)
        self.states = StateSpool(ctx.run_dir / "steplog" / f"states-{shard}") if \
            ctx.cfg.train.local_steps and ctx.cfg.checkpoint.step_log_spool else None  # local steps: statespool.py

    def stage(self, grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
              extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A copy of a step's inputs (`tensors_of`'s names, and `extra`'s: local steps' replica states, replicas.py),
        taken before its optimizer step changes them in place (staging.py: into a slot on this host, else kept
        buffers). Called only once the previous entry is acknowledged (the checkpointer holds its own copy of it by
        then)."""
        src = {GRAD + n: _plain(g) for n, g in (grads or {}).items()}
        src.update({BUFFER + n: _plain(b) for n, b in (buffer_sum or {}).items()})
        src.update({n: _plain(t) for n, t in (extra or {}).items()})
        if self.sock is None:
            self.connect()
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
                    loss: float, evals: dict[str, Any] | None = None, replicas: list[Any] | None = None,
                    encoded: dict[str, Any] | None = None) -> None:
        """`ship` of what `stage` copied (`tensors`; `skip`: the step's gradient is None; `replicas`: local steps'
        replica states' metadata, replicas.py; `encoded`: the entry is the step's encoded gradients as they came, frames.py)."""
        fields = {"step": step, "term": self.term, "shard": self.shard, "skip": skip, "loss": float(loss),
                  "partials": partials, "evals": evals, "replicas": replicas, "encoded": encoded}
        self.count(tensors.values(), encoded)
        self.pending = (step, fields, tensors)
        self.send(self._messages())

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

    # a shard k > 0 ships without waiting for acks and keeps its entries for a resend (steplog/shard.py): on this host
    # each in a slot of its own, written again only once acknowledged (staging.py `keep`); else as frames
    def encode(self, step: int, grads: dict[str, torch.Tensor] | None, buffer_sum: dict[str, torch.Tensor] | None,
               partials: list[float] | None, loss: float, replicas: list[Any] | None = None,
               states: dict[str, torch.Tensor] | None = None,
               encoded: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None) -> list[list[Any]]:
        """Step `step`'s entry, encoded (`ship`'s arguments; the tensors copied; `replicas`, `states`: the
        replicas' states the step makes current, of a shard that keeps some: replicas.py; `encoded`: the step's
        encoded gradients as they came (field, tensors), sent instead of `grads`, frames.py): a slot's descriptor where the checkpointer is on
        this host and a slot is free, else frames."""
        field = encoded[0] if encoded is not None else None
        fields = {"step": step, "term": self.term, "shard": self.shard, "skip": grads is None, "loss": float(loss),
                  "partials": partials, "evals": None, "replicas": replicas, "encoded": field}
        if encoded is not None:
            grads, states = None, {**(states or {}), **encoded[1]}
        self.count([*(grads or {}).values(), *(buffer_sum or {}).values(), *(states or {}).values()], field)
        if self.sock is None:
            self.connect()
        if self.local and self._slot_free(step, _nbytes(grads, states)):
            if self.slots_used == 0:
                self.ctx.log.info("step log: this shard's entries go through its shared-memory slots", shard=self.shard)
            self.slots_used += 1
            views = self.staging.keep(step, {**tensors_of(grads, buffer_sum, copy=False), **(states or {})})
            msgs = self._encoded({**fields, "shm": self.staging.desc}, {})
            self.slotted[step] = (msgs, fields, views)
            return msgs
        return self._encoded(fields, {**tensors_of(grads, buffer_sum), **(states or {})})

    def count(self, tensors: Iterable[torch.Tensor], encoded: dict[str, Any] | None) -> None:
        """An entry shipped: its tensors' bytes (summary.json's `step_log_bytes`), and whether it was the step's encoded
        gradients (`encoded`, its field)."""
        self.entries += 1
        self.entry_bytes += limits.nbytes(tensors)
        self.encoded_entries += encoded is not None

    def _encoded(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
        try:
            return transfer.messages("step_log", self.ctx.run, fields, self.cap, tensors, self.ctx.cfg.cluster.checksum)
        except transfer.TooBig as exc:
            self.ctx.fatal(f"aggregator: {exc}")

    def _slot_free(self, step: int, nbytes: int) -> bool:
        """May step `step`'s kept entry (`nbytes`) go into a slot? Its acks read first (and left for the caller to
        read too); if the slot still holds one not acknowledged, its ack is waited for up to `keep_wait_s` (it is on
        its way unless the checkpointer is gone: the leader's next step needs that entry held too) or until a
        `log_gap` says it will not come, then the entry goes as frames (counted in `framed`, the `step_log_framed` event and the `cmemi_step_log_framed` metric)."""
        start = time.monotonic()
        deadline = start + keep_wait_s(self.ctx.cfg.cluster, nbytes)
        read: list[protocol.Message] = []
        wait_ms = 0
        free = False
        while True:
            got = self.replies(wait_ms)  # (the backlog first: every reply read stays for the caller)
            read += got
            left = deadline - time.monotonic()
            if (free := self.staging.can_keep()) or left <= 0 or self.sock is None or self._refused(got):
                break
            wait_ms = max(1, int(left * 1000))
        self.backlog = read
        if free:
            return True
        self.framed += 1
        metrics.STEP_LOG_FRAMED.inc()
        waited = round(time.monotonic() - start, 3)
        self.ctx.emit("step_log_framed", step=step, shard=self.shard, held=sorted(self.staging.held), waited_s=waited)
        if self.framed <= 3 or self.framed % 100 == 0:
            self.ctx.log.warning("step log: no slot free (an entry not acknowledged in it); this one goes as frames",
                                 step=step, held=sorted(self.staging.held), framed=self.framed, waited_s=waited)
        self.staging.forget_before(step - 1)  # (the shard keeps none before step - 1 either)
        for s in [s for s in self.slotted if s < step - 1]:
            del self.slotted[s]
        return False

    def _refused(self, replies: list[protocol.Message]) -> bool:
        """Did the checkpointer answer an entry in the slot `log_gap` (it restarted and lost its log: no `logged`
        comes for it until the shard sends it again, steplog/shard.py)?"""
        return any(m.type == "log_gap" and m.header["step"] in self.staging.held for m in replies)

    def replies(self, timeout_ms: int = 0) -> list[protocol.Message]:
        """`LogConnection.replies`; a `logged` frees its entry's slot (a shard's kept entries)."""
        out = super().replies(timeout_ms)
        if self.staging.held:
            for msg in out:
                if msg.type == "logged" and self.staging.free(msg.header["step"]):
                    self.slotted.pop(msg.header["step"], None)
        return out

    def send(self, msgs: list[list[Any]]) -> None:
        """`LogConnection.send`; a kept entry's slot descriptor goes as frames (read from its slot) to a
        checkpointer that is not on this host (it restarted elsewhere)."""
        if not self.local and self.slotted:
            kept = next((k for k in self.slotted.values() if k[0] is msgs), None)
            if kept is not None:
                msgs = self._encoded(kept[1], dict(kept[2]))
        super().send(msgs)

    @property
    def unacknowledged(self) -> int | None:
        """The step whose entry was shipped and not acknowledged yet (None: every entry is)."""
        return self.pending[0] if self.pending is not None else None

    def poll(self, on_gap: Callable[[int], None]) -> bool | None:
        """`confirm` without waiting: None while the pending entry's acknowledgement has not come."""
        assert self.pending is not None, "poll without ship"
        step = self.pending[0]
        for msg in self.replies():
            if self._acks(msg, step):
                return self._settled(msg, on_gap)
        if self.late():  # lost with a connection a cut or a stopped checkpointer ended: again
            self.send(self._messages())
        return None

    def confirm(self, on_gap: Callable[[int], None]) -> bool:
        """Wait until the checkpointer holds the pending entry. `on_gap(step)`: it cannot (it restarted since the
        last checkpoint and lost the log): the caller makes the state after `step` durable at once (a checkpoint);
        True then."""
        assert self.pending is not None, "confirm without ship"
        step = self.pending[0]
        msg = self.wait(lambda m: self._acks(m, step), lambda: self.send(self._messages()),
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
            replies = self.replies(int(RECHECK_S * 1000) if waited else 10)
            for i, msg in enumerate(replies):
                if accept(msg):
                    self.backlog = replies[i + 1:]  # (a replay's next entry, read with this one)
                    return msg
            waited += 1
            if waited > 1 and self.connect():  # the checkpointer restarted (or was not known yet): again, to it
                resend()
            elif again_when_late and self.late():
                resend()
            elif self.sock is None:
                time.sleep(0.05)
        self.ctx.fatal(f"the checkpointer did not answer {what} within {ACK_TIMEOUT_S:g}s; is `cmemi checkpointer` "
                       "running and reachable? (checkpoint.step_log: false trains without the step log)")

    def close(self) -> None:
        super().close()
        self.staging.close()
        if self.states is not None:
            self.states.close()

