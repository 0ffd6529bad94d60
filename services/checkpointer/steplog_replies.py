"""The step log's messages at the checkpointer: an entry held and acknowledged, a replay answered in order.

- `step_log` -> `logged` (held: the server's step may commit) or `log_gap` (it would leave a gap in the log: this
  process restarted since the server's last checkpoint; the server takes one at once, which rebases the log).
- `log_req` (a restarted server, after restoring step `after`) -> `log_entry` of step after + 1, or `log_end`.
  With `cut` (its replay stopped at `after`: a step's replicas' states were not in its state spool, a double fault,
  services/aggregator/steplog/statespool.py) every shard's entries past `after` go, and `log_end` answers: those
  steps are computed again, and their new entries take the place of the old.
  Each answer is one entry, or with `count` > 1 (a same-host replay: reading.py) that many consecutive entries in one
  `log_entries` and one slot; a replay keeps two requests out, so it holds at most two answers in flight on either
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

from cmemi.services.checkpointer.steplog import Entry, StepLog
from cmemi.shared.wire import limits, protocol

FIELDS = ("step", "skip", "loss", "partials", "evals")
CARRIED = ("replicas", "encoded")  # held and served back as is: the leader's replicas' states' metadata (local steps);
# an entry's encoded gradients as they came (its tensors are their frames: aggregator/steplog/frames.py), never decoded here
DECIDED = ("skip", "loss", "partials")  # the leader's decision of a step, which a shard's replay applies
MAX_BATCH = limits.STEP_LOG_BATCH  # entries in one `log_entries` at most (the asker bounds its count by bytes)


class LogReplies:
    TYPES = ("step_log", "log_req")

    def __init__(self, log: StepLog, reply: Callable[..., None], emit: Callable[..., None], shards: int = 1,
                 slotted: Callable[[bytes, int | None, list[tuple[dict, Entry]], bool], bool] | None = None) -> None:
        """`reply(identity, type, fields, tensors=None)`: the checkpointer's. `shards`: cluster.shards. `slotted(identity,
        after, [(fields, entry)], end)`: a replay's `log_entry` (after None) or `log_entries` read from the log straight
        into the asker's slot (logserver.py), False where it goes as frames (then `reply` sends the entries loaded)."""
        self.log, self.reply, self.emit, self.shards, self.slotted = log, reply, emit, shards, slotted
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
        if not self.log.add(shard, fields, msg.tensors):  # (not copied: a same-host entry's is `Landed`, steplog.py)
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
        run: list[tuple[dict, Entry]] = []
        while len(run) < _count(h):
            entry = self.log.entry(0, after + len(run) + 1)
            if entry is None or not self.whole(after + len(run) + 1):
                if self.shards > 1:  # the leader's log end: a step past it was never committed
                    self.log.truncate(after + len(run))
                    self.waiting.clear()
                break
            run.append(({**entry.fields, "term": h["term"], "shard": 0}, entry))
        self._answer(identity, h, run)

    def _shard_replay(self, identity: bytes, h: dict) -> None:
        """A shard k > 0 replays its own entries, each with the leader's decision, to the leader's log end. (Only
        the leader's replay cuts a log: a shard restored an older checkpoint than the log's base only within a term
        whose leader restored it long ago; it then replays nothing, and its join rolls the cluster back.)"""
        shard, after = h["shard"], h["after"]
        self._started(h)
        run: list[tuple[dict, Entry]] = []
        while after >= self.log.base_of(shard) and len(run) < _count(h):
            own, leader = self.log.entry(shard, after + len(run) + 1), self.log.entry(0, after + len(run) + 1)
            if own is None or leader is None:
                break
            run.append(({**own.fields, **{k: leader.fields[k] for k in DECIDED}, "term": h["term"], "shard": shard},
                        own))
        self._answer(identity, h, run)

    def _answer(self, identity: bytes, h: dict, run: list[tuple[dict, Entry]]) -> None:
        """The entries after h["after"] the log holds (`run`, at most the count asked): none, `log_end`; asked one at
        a time, a `log_entry`; else one `log_entries` holding them all, which says whether the log ends there."""
        if not run:
            self.reply(identity, "log_end", {"after": h["after"]})
        elif _count(h) == 1:
            self._serve(identity, *run[0])
        else:
            end = len(run) < _count(h)
            if self.slotted is None or not self.slotted(identity, h["after"], run, end):
                self.reply(identity, "log_entries", {"after": h["after"], "entries": [f for f, _ in run], "end": end},
                           {f"{i}/{n}": t for i, (_, e) in enumerate(run) for n, t in e.loaded().items()})

    def _serve(self, identity: bytes, fields: dict, entry: Entry) -> None:
        """A replay's `log_entry`: into the asker's slot where it has one (no copy of it on the way), else as frames."""
        if self.slotted is None or not self.slotted(identity, None, [(fields, entry)], False):
            self.reply(identity, "log_entry", fields, entry.loaded())


def _count(h: dict) -> int:
    """The entries a `log_req` asks for, at most MAX_BATCH (a header built without its defaults, as in the unit
    tests, asks for one)."""
    return min(h.get("count", 1), MAX_BATCH)
