"""A restarted server's replay of the step log: the entries after its checkpoint's step, read in order over its
link (link.py) with two requests out at a time, so the checkpointer reads and sends one while this server applies
the other; each reply's tensors are copied into buffers kept for the replay (from the checkpointer's slot, on this
host) before the next request may reuse that slot — or, where the trainer only reads the gradients it is given
(`lend`), lent in place from the slot and the next request sent only once the entry was applied (issue 47: the copy
was a third of the leader's CPU per replayed entry)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NoReturn

import torch
from cmemi.services.aggregator.steplog.link import GRAD, StepLogLink
from cmemi.services.aggregator.steplog.staging import kept_copy
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.wire import limits, protocol, transfer
from cmemi.shared.wire.header import PROTOCOL_VERSION

AHEAD = 2  # a replay's requests out: the checkpointer's two slots (one being read here, one written)
BATCH_BYTES = 16 << 20  # a same-host replay asks for as many entries at once as fit in this (one slot; two in its ring)


def batch_of(entry_bytes: int) -> int:
    """How many entries of `entry_bytes` a same-host replay asks for in one request: what fits in BATCH_BYTES, at least
    one and at most the checkpointer's limits.STEP_LOG_BATCH."""
    return max(1, min(limits.STEP_LOG_BATCH, BATCH_BYTES // max(1, entry_bytes)))


class LogEntries:
    def __init__(self, link: StepLogLink) -> None:
        self.link = link
        self.reader: shm_reader.Reader | None = None  # the checkpointer's slots, on this host

    def entries(self, after: int, lend: bool = False, count: int = 1) -> Iterator[protocol.Message]:
        """The log's entries after step `after`, in order, until it ends (a restarted server's replay). `AHEAD`
        requests are out at a time; an entry's tensors are copied into buffers kept for the replay (reused by the
        next entry: the trainer keeps no reference to a gradient it applied) before the next request goes out.
        `lend` (the trainer only reads the gradient it is given and keeps no reference: `Trainer.reads_grads_only`, no
        local steps): an entry's gradient that came through the checkpointer's slot is handed over as views of that
        slot, read-only (the rest copied as before),
        and the request that would reuse the slot goes out only once the caller is done with it (the next `next`);
        the slot is then checked unchanged (a slot written while read ends the replay: its state is not the log's).
        The checkpointer still reads and sends the other request's entry while this one is applied. `count` > 1 (with
        `lend`, on this host): each request asks for that many entries, answered in one `log_entries` in one slot — a
        request, an answer and a slot per `count` entries, not per entry (issue 47: each message's wake-ups of four
        threads cost as much as a small model's optimizer step on a loaded 2-core machine)."""
        asked: deque[int] = deque()
        into: dict[str, torch.Tensor] = {}

        # a same-host server's replay is answered through the checkpointer's slots, a ring of its own per shard
        # (checkpointer/logserver.py): a shard's entries over frames paid CurveZMQ's CPU on both sides, about twice
        # the leader's time per entry (bench/recovery.py --parts steplog, a leader's kill at K = 2, issue 47)
        def ask(a: int) -> None:
            asked.append(a)
            fields = {"term": self.link.term, "after": a, "shard": self.link.shard, "shm": self.link.local,
                      **({"count": batch} if batch > 1 else {})}
            self.link.send(transfer.messages("log_req", self.link.ctx.run, fields, self.link.cap))

        def again() -> None:  # a restarted checkpointer, or requests lost with a connection: every one still out
            for a in list(asked):
                asked.popleft()
                ask(a)

        if self.link.sock is None:
            self.link.moved()  # (connects)
        batch = max(1, min(count, limits.STEP_LOG_BATCH)) if lend and self.link.local else 1
        # asked again when an answer is late (a request or its answer lost with a connection the link options gave up:
        # issue 47's soak, "did not answer the step log's entry after step 921"), except where answers come through
        # the checkpointer's slots: a same-host ipc:// link loses nothing while both ends live, and every answer
        # asked twice would take one more slot of a ring sized for the requests out
        slotted = self.link.local
        for k in range(AHEAD):
            ask(after + k * batch)
        while asked:
            a = asked[0]
            msg = self.link.wait(lambda m: _answers(m, asked[0], batch), again, f"the step log's entry after step {a}",
                                 again_when_late=not slotted)
            asked.popleft()
            if msg.type == "log_end":
                return
            if msg.type == "log_entries":
                n = 0
                for one in self._batch(msg, into):
                    n += 1
                    yield one  # (applied from the slot; only then may the next request reuse it)
                if "shm" in msg.header:
                    self._intact(msg)
                if msg.header["end"]:
                    return
                if n != batch:
                    self.link.ctx.fatal(f"aggregator: the checkpointer answered {n} step log entries after step {a}, "
                                        f"asked {batch}, and not the log's end")
                ask(a + AHEAD * batch)
                continue
            if lend and "shm" in msg.header:
                # (the gradient alone: the buffer sum is divided in place as it is folded, shared/core/buffers.py)
                msg.tensors = {n: v if n.startswith(GRAD) else kept_copy(into, n, v) for n, v in self._lent(msg).items()}
                yield msg  # (applied from the slot; only then may the next request reuse it)
                self._intact(msg)
                msg.tensors = {}
                ask(a + AHEAD)
                continue
            msg.tensors = self._kept(msg, into)
            ask(a + AHEAD)
            yield msg

    def cut(self, after: int) -> None:
        """The log past `after` dropped at the checkpointer (this server's replay stopped there: a step's replicas'
        states were not in its state spool), once its `log_end` says so; the answers still out are dropped."""
        def send() -> None:  # (again to a restarted checkpointer)
            self.link.send(transfer.messages("log_req", self.link.ctx.run, {"term": self.link.term, "after": after,
                                                                            "shard": self.link.shard, "cut": True},
                                             self.link.cap))
        send()
        self.link.wait(lambda m: m.type == "log_end" and m.header["after"] == after, send,
                       f"the step log's cut after step {after}")

    def _kept(self, msg: protocol.Message, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A replayed entry's tensors, copied into `into`'s buffers: out of the checkpointer's slot, or its frames."""
        if "shm" not in msg.header:
            return {n: kept_copy(into, n, t) for n, t in msg.tensors.items()}
        out = {n: kept_copy(into, n, v) for n, v in self._lent(msg).items()}
        self._intact(msg)
        return out

    def _batch(self, msg: protocol.Message, into: dict[str, torch.Tensor]) -> Iterator[protocol.Message]:
        """A `log_entries`' entries, each a `log_entry` as one answer alone would be (its fields checked as one), in
        step order; each gradient lent from the slot, the rest copied into `into` as the entry comes up."""
        tensors = self._lent(msg) if "shm" in msg.header else msg.tensors
        each: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            k, _, n = name.partition("/")
            each.setdefault(int(k) if k.isdigit() else -1, {})[n] = t
        for i, fields in enumerate(msg.header["entries"]):
            try:
                header, _ = protocol.check_header({**(fields if isinstance(fields, dict) else {}), "type": "log_entry",
                                                   "proto": PROTOCOL_VERSION, "run": self.link.ctx.run, "tensors": []},
                                                  self.link.ctx.run)
                if header["step"] != msg.header["after"] + i + 1:
                    raise protocol.ProtocolError("bad_field", f"entry {i} is of step {header['step']}")
            except protocol.ProtocolError as exc:
                self._unreadable(protocol.Message({"step": msg.header["after"] + i + 1}, {}), exc)
            mine = each.get(i, {})
            yield protocol.Message(header, {n: t if n.startswith(GRAD) and "shm" in msg.header else kept_copy(into, n, t)
                                            for n, t in mine.items()})

    def _lent(self, msg: protocol.Message) -> dict[str, torch.Tensor]:
        """A replayed entry's tensors as views of the checkpointer's slot (read-only)."""
        if self.reader is None:
            self.reader = shm_reader.Reader(self.link.ctx.run, self.link.ctx.cfg.cluster.checksum, limit=4,
                                            bound=max(limits.logical_bytes(self.link.ctx.cfg), BATCH_BYTES))
        try:
            return self.reader.views(msg.header["shm"])
        except protocol.ProtocolError as exc:
            self._unreadable(msg, exc)

    def _intact(self, msg: protocol.Message) -> None:
        """The entry's slot was not written again while it was read (its sequence unchanged); else the replay ends."""
        desc = msg.header["shm"]
        assert self.reader is not None, "an entry's slot checked before it was read"
        if not self.reader.intact(desc):
            self._unreadable(msg, shm.ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: written while read"))

    def _unreadable(self, msg: protocol.Message, exc: protocol.ProtocolError) -> NoReturn:
        self.link.ctx.fatal(f"aggregator: the step log's entry of step {msg.header['step']} could not be read from the "
                            f"checkpointer's shared memory ({exc}); set cluster.transport: tcp to replay over tcp://")


def _answers(msg: protocol.Message, after: int, batch: int = 1) -> bool:
    """Is `msg` the checkpointer's answer to the replay's request for the entry (`batch` > 1: entries) after `after`?"""
    if batch > 1:
        return msg.type in ("log_entries", "log_end") and msg.header["after"] == after
    return (msg.type == "log_entry" and msg.header["step"] == after + 1) or \
        (msg.type == "log_end" and msg.header["after"] == after)
