"""The step log's messages at the checkpointer: an entry held and acknowledged, a replay answered one entry at a time.

- `step_log` -> `logged` (held: the server's step may commit) or `log_gap` (it would leave a gap in the log: this
  process restarted since the server's last checkpoint; the server takes one at once, which rebases the log).
- `log_req` (a restarted server, after restoring step `after`) -> `log_entry` of step after + 1, or `log_end`.
  With `cut` (its replay stopped at `after`: a step's replicas' states were not in its state spool, a double fault,
  services/aggregator/steplog/statespool.py) every shard's entries past `after` go, and `log_end` answers: those
  steps are computed again, and their new entries take the place of the old.
  Each answer is one entry; a replay keeps two requests out, so it holds at most two entries in flight on either
  side, however long the log.

Sharded (`cluster.shards` K > 1, docs/design/step-log.md): a step is held only once every shard's entry of it is.
Each shard k > 0 ships its slice's entry with its `shard_ready`; the leader's entry (shard 0) records the commit's
decision (every shard's norm partials, the skip) and its `logged` waits until every shard's entry of that step is
here — so the leader's ack means the whole step is held, and the shards need no ack before they apply the commit
(theirs only frees the copy they keep for a resend). A replay ends at the leader's log end, the last step every
shard's log holds: the leader replays to it, and a shard's `log_entry` carries its own tensors with the leader's
decision of that step. The leader's `log_end` drops every entry past it (never committed: computed again).
"""

from __future__ import annotations

from collections.abc import Callable

from cmemi.services.checkpointer.steplog import StepLog
from cmemi.shared.wire import protocol

FIELDS = ("step", "skip", "loss", "partials", "evals")
CARRIED = ("replicas",)  # the leader's, with local steps: the replicas' states' metadata, held and served back as is
DECIDED = ("skip", "loss", "partials")  # the leader's decision of a step, which a shard's replay applies


class LogReplies:
    TYPES = ("step_log", "log_req")

    def __init__(self, log: StepLog, reply: Callable[..., None], emit: Callable[..., None], shards: int = 1) -> None:
        """`reply(identity, type, fields, tensors=None)`: the checkpointer's. `shards`: cluster.shards."""
        self.log, self.reply, self.emit, self.shards = log, reply, emit, shards
        self.replaying: set[tuple[int, int]] = set()  # (term, shard) whose replay started (one event each)
        self.waiting: dict[int, bytes] = {}  # the leader's steps held but not every shard's entry yet: its identity

    def whole(self, step: int) -> bool:
        """Does every shard's log hold `step`?"""
        return all(self.log.holds(k, step) for k in range(self.shards))

    def handle(self, identity: bytes, msg: protocol.Message) -> None:
        h = msg.header
        if msg.type == "step_log":
            self._entry(identity, h, msg)
        elif h.get("cut"):  # (a header built without the default: the unit tests)
            self.log.truncate(h["after"])
            self.waiting.clear()
            self.emit("step_log_cut", shard=h["shard"], restored=h["after"], term=h["term"],
                      reason="a server's state spool lost a step's replicas' states")
            self.reply(identity, "log_end", {"after": h["after"]})
        elif h["shard"] == 0:
            self._leader_replay(identity, h)
        else:
            self._shard_replay(identity, h)

    def _entry(self, identity: bytes, h: dict, msg: protocol.Message) -> None:
        shard, step = h["shard"], h["step"]
        fields = {**{k: h[k] for k in FIELDS}, **{k: h.get(k) for k in CARRIED}}
        if not self.log.add(shard, fields, dict(msg.tensors)):
            self.reply(identity, "log_gap", {"step": step, "base": self.log.base_of(shard)})
            return
        if shard == 0 and not self.whole(step):
            self.waiting[step] = identity  # acknowledged once the shards' entries of it are in
            return
        self.reply(identity, "logged", {"step": step})
        for s in [s for s in self.waiting if self.whole(s)]:
            self.reply(self.waiting.pop(s), "logged", {"step": s})

    def _started(self, h: dict) -> bool:
        """The first log_req of this (term, shard): True once (its replay starts)."""
        if (h["term"], h["shard"]) in self.replaying:
            return False
        self.replaying.add((h["term"], h["shard"]))
        return True

    def _leader_replay(self, identity: bytes, h: dict) -> None:
        after = h["after"]
        if self._started(h):
            base = self.log.base_of(0)
            self.log.restart_at(0, after)
            if after < base:
                self.emit("step_log_cut", shard=0, restored=after, base=base, term=h["term"])
        entry = self.log.entry(0, after + 1)
        if entry is None or not self.whole(after + 1):
            if self.shards > 1:  # the leader's log end: a step past it was never committed
                self.log.truncate(after)
                self.waiting.clear()
            self.reply(identity, "log_end", {"after": after})
        else:
            self.reply(identity, "log_entry", {**entry.fields, "term": h["term"], "shard": 0}, entry.loaded())

    def _shard_replay(self, identity: bytes, h: dict) -> None:
        """A shard k > 0 replays its own entries, each with the leader's decision, to the leader's log end. (Only
        the leader's replay cuts a log: a shard restored an older checkpoint than the log's base only within a term
        whose leader restored it long ago; it then replays nothing, and its join rolls the cluster back.)"""
        shard, after = h["shard"], h["after"]
        self._started(h)
        own, leader = self.log.entry(shard, after + 1), self.log.entry(0, after + 1)
        if own is None or leader is None or after < self.log.base_of(shard):
            self.reply(identity, "log_end", {"after": after})
            return
        fields = {**own.fields, **{k: leader.fields[k] for k in DECIDED}, "term": h["term"], "shard": shard}
        self.reply(identity, "log_entry", fields, own.loaded())
