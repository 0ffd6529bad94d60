"""A restarted server's replay of the step log: the entries after its checkpoint's step, read in order over its
link (link.py) with two requests out at a time, so the checkpointer reads and sends one while this server applies
the other; each reply's tensors are copied into buffers kept for the replay (from the checkpointer's slot, on this
host) before the next request may reuse that slot."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from cmemi.services.aggregator.steplog.link import StepLogLink
from cmemi.services.aggregator.steplog.staging import kept_copy
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.wire import limits, protocol, transfer

AHEAD = 2  # a replay's entries requested ahead: the checkpointer's two slots (one being read here, one written)


class LogEntries:
    def __init__(self, link: StepLogLink) -> None:
        self.link = link
        self.reader: shm_reader.Reader | None = None  # the checkpointer's slots, on this host

    def entries(self, after: int) -> Iterator[protocol.Message]:
        """The log's entries after step `after`, in order, until it ends (a restarted server's replay). `AHEAD`
        requests are out at a time; an entry's tensors are copied into buffers kept for the replay (reused by the
        next entry: the trainer keeps no reference to a gradient it applied) before the next request goes out."""
        asked: deque[int] = deque()
        into: dict[str, torch.Tensor] = {}

        # a same-host server's replay is answered through the checkpointer's slots, a ring of its own per shard
        # (checkpointer/logserver.py): a shard's entries over frames paid CurveZMQ's CPU on both sides, about twice
        # the leader's time per entry (bench/recovery.py --parts steplog, a leader's kill at K = 2, issue 47)
        def ask(a: int) -> None:
            asked.append(a)
            self.link.send(transfer.messages("log_req", self.link.ctx.run, {"term": self.link.term, "after": a, "shard": self.link.shard,
                                                                   "shm": self.link.local}, self.link.cap))

        def again() -> None:  # a restarted checkpointer, or requests lost with a connection: every one still out
            for a in list(asked):
                asked.popleft()
                ask(a)

        if self.link.sock is None:
            self.link.moved()  # (connects)
        # asked again when an answer is late (a request or its answer lost with a connection the link options gave up:
        # issue 47's soak, "did not answer the step log's entry after step 921"), except where answers come through
        # the checkpointer's slots: a same-host ipc:// link loses nothing while both ends live, and every answer
        # asked twice would take one more slot of a ring sized for the requests out
        slotted = self.link.local
        for a in range(after, after + AHEAD):
            ask(a)
        while asked:
            a = asked[0]
            msg = self.link.wait(lambda m: _answers(m, asked[0]), again, f"the step log's entry after step {a}",
                                 again_when_late=not slotted)
            asked.popleft()
            if msg.type == "log_end":
                return
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
        if self.reader is None:
            self.reader = shm_reader.Reader(self.link.ctx.run, self.link.ctx.cfg.cluster.checksum, limit=4,
                                            bound=limits.logical_bytes(self.link.ctx.cfg))
        desc = msg.header["shm"]
        try:
            out = {n: kept_copy(into, n, v) for n, v in self.reader.views(desc).items()}
            if not self.reader.intact(desc):
                raise shm.ShmError("shm_overwritten", f"{desc['seg']} slot {desc['slot']}: written while read")
        except protocol.ProtocolError as exc:
            self.link.ctx.fatal(f"aggregator: the step log's entry of step {msg.header['step']} could not be read from the "
                           f"checkpointer's shared memory ({exc}); set cluster.transport: tcp to replay over tcp://")
        return out


def _answers(msg: protocol.Message, after: int) -> bool:
    """Is `msg` the checkpointer's answer to the replay's request for the entry after step `after`?"""
    return (msg.type == "log_entry" and msg.header["step"] == after + 1) or \
        (msg.type == "log_end" and msg.header["after"] == after)
