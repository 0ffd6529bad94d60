"""The step log's messages at the checkpointer: an entry held and acknowledged, a replay answered one entry at a time.

- `step_log` -> `logged` (held: the server's step may commit) or `log_gap` (it would leave a gap in the log: this
  process restarted since the server's last checkpoint; the server takes one at once, which rebases the log).
- `log_req` (a restarted server, after restoring step `after`) -> `log_entry` of step after + 1, or `log_end`.
  Each answer is one entry; a replay keeps two requests out, so it holds at most two entries in flight on either
  side, however long the log.
"""

from __future__ import annotations

from collections.abc import Callable

from cmemi.services.checkpointer.steplog import StepLog
from cmemi.shared.wire import protocol

FIELDS = ("step", "skip", "loss", "partials", "evals")


class LogReplies:
    TYPES = ("step_log", "log_req")

    def __init__(self, log: StepLog, reply: Callable[..., None], emit: Callable[..., None]) -> None:
        """`reply(identity, type, fields, tensors=None)`: the checkpointer's."""
        self.log, self.reply, self.emit = log, reply, emit
        self.replaying: set[tuple[int, int]] = set()  # (term, shard) whose replay started (one event each)

    def handle(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        if msg.type == "step_log":
            fields = {k: h[k] for k in FIELDS}
            if self.log.add(h["shard"], fields, dict(msg.tensors)):
                self.reply(identity, "logged", {"step": h["step"]})
            else:
                self.reply(identity, "log_gap", {"step": h["step"], "base": self.log.base_of(h["shard"])})
            return
        shard, after = h["shard"], h["after"]
        if (h["term"], shard) not in self.replaying:
            self.replaying.add((h["term"], shard))
            base = self.log.base_of(shard)
            self.log.restart_at(shard, after)
            if after < base:
                self.emit("step_log_cut", shard=shard, restored=after, base=base, term=h["term"])
        entry = self.log.entry(shard, after + 1)
        if entry is None:
            self.reply(identity, "log_end", {"after": after})
        else:
            self.reply(identity, "log_entry", {**entry.fields, "term": h["term"], "shard": shard}, entry.loaded())
