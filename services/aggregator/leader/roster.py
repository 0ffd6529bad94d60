"""The leader's side of sharding (docs/design.md §4): the shards k > 0 of this term and the step barrier.

A shard joins the leader's term (`shard_join`) and is welcomed with the run's dataset fingerprint and this
term's lease-seal key, so it admits workers and checks their leases by the leader's rule
(services/aggregator/common/admission.py). Workers are admitted only once every shard joined. While its step is
incomplete a shard says which microbatches it holds (`shard_have`); what it lacks of a step complete here is
leased again. Each shard reports its complete step (`shard_ready`: its pieces' partial norms, its overflow
flag); once all did, the leader commits the step on every shard with every shard's share (`shard_commit`).
A shard that restarts within a term (SIGKILLed, its replacement a higher incarnation of the same shard number)
restores its slice of the checkpoint and replays its own step log entries (services/aggregator/steplog/shard.py);
at the leader's step, it takes its dead incarnation's place in this term (`Restarts`): no other server restores or
replays, and the workers find its new address in its Redis record (services/worker/links/shard_addrs.py). Before
issue 47 every shard's restart started a new term, whose leader and every shard restored and replayed again: shard
1 SIGKILLed at `checkpoint.every_steps` 1000 cost 6.21 s to the next new step on a quiet machine
(bench/recovery.py --parts steplog --quick --checkpoint-every 1000). Short of the leader's step (the leader's entry
of its last step still on its way), it is told that step (`shard_behind`) and replays on to it; it stays short only
if the log lacks its entries (the checkpointer died too: a double fault; or its own entry of the leader's last step,
shipped with its `shard_ready`, died in its socket with it: 1 of 3 kills in one loaded run of the bench below), and
once it has joined `CATCH_UP_S` without moving, the cluster goes back to the last complete checkpoint under a new
term, as before (and always without the step log). A lower incarnation than the one joined is a stale process (back from SIGSTOP): fenced,
told to leave, and nothing it says counts (`member` checks the incarnation). One whose link was cut and dialled
again is the same shard under a new connection identity (`redialled`). The pieces a shard sends at each evaluation
step (`shard_eval`) and after the last step (`shard_final`) are shard_slices.py's job: it takes them only from a
shard `member` names.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.outbox import Outbox
from cmemi.shared.core.grid import Partition
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext

CATCH_UP_S = 1.5  # a restarted shard told the leader's step that has not moved this long (joins said each second): roll back


class Rejoin(enum.Enum):
    ACCEPT = "accept"  # at the leader's step: it takes the place of its dead incarnation within this term
    BEHIND = "behind"  # short of the leader's step: told to replay on to it (`shard_behind`)
    STALE = "stale"  # an older incarnation than the one joined: fenced
    ROLL_BACK = "roll_back"  # the log cannot bring it to the leader's step: a new term from the last checkpoint


@dataclass
class CatchingUp:
    """A restarted shard told the leader's step: its incarnation, the step it had reached, since when."""
    inc: int
    step: int
    since: float


class Restarts:
    def __init__(self) -> None:
        self.catching: dict[int, CatchingUp] = {}  # shard k -> its new incarnation catching up

    def decide(self, k: int, joined_inc: int | None, inc: int, its_step: int, step: int, now: float,
               can_replay: bool = True) -> Rejoin:
        """A join of shard k's incarnation `inc` at `its_step`, the leader at `step` and shard k joined this term
        as `joined_inc` (None: not yet, which is the term's start: only the same step may join). `can_replay`:
        the step log is in use (services/aggregator/steplog/shard.py `in_use`)."""
        if joined_inc is None:
            return Rejoin.ACCEPT if its_step == step else Rejoin.ROLL_BACK
        if inc < joined_inc:
            return Rejoin.STALE
        if not can_replay:  # (the step log's replay alone makes it the leader's state: else as before issue 47)
            return Rejoin.ROLL_BACK
        if its_step == step:
            self.catching.pop(k, None)
            return Rejoin.ACCEPT
        if its_step > step:
            return Rejoin.ROLL_BACK
        seen = self.catching.get(k)
        if seen is None or seen.inc != inc or its_step > seen.step:  # told first, or it moved since: told again
            self.catching[k] = CatchingUp(inc, its_step, now)
            return Rejoin.BEHIND
        return Rejoin.BEHIND if now - seen.since < CATCH_UP_S else Rejoin.ROLL_BACK


@dataclass
class ShardInfo:
    """A shard k > 0 as the leader knows it (services/aggregator/shard/server.py)."""
    identity: bytes
    inc: int
    addr: str
    ready: tuple[int, list[float], bool] | None = None  # (step, partials, overflow) of its last complete step
    final: dict[str, torch.Tensor] | None = None  # its pieces after the last step
    totals: dict[str, Any] | None = None  # with them: its bytes in and out over the run, its dropped messages
    mirror: dict[str, str] | None = None  # and (compression.downlink) its mirror pieces' SHA-256
    eval: tuple[int, dict[str, torch.Tensor]] | None = None  # its pieces at an evaluation step (eval.every_steps)
    taken_at: int | None = None  # a restarted incarnation: the step it was taken in at (`have`: leased again at once)
    relet: bool = False  # its first report of that step was answered (what it lacked went back at once)


class ShardRoster:
    def __init__(self, ctx: ServiceContext, partition: Partition, term: int, outbox: Outbox,
                 drop: Callable[[str, str], None], welcome: Callable[[], dict[str, Any]], replays: bool = False) -> None:
        self.ctx, self.partition, self.term, self.outbox, self.drop = ctx, partition, term, outbox, drop
        self.welcome = welcome  # what a joining shard is told: the run's fingerprint, the lease-seal key
        self.shards: dict[int, ShardInfo] = {}  # k > 0, once joined this term
        self.last_commit: dict[str, Any] | None = None  # the shard_commit fields of the last step sent
        self.announced: dict[str, Any] | None = None  # the welcome every joined shard was sent last
        self.fences: dict[str, int] = {}  # worker id -> the highest incarnation fenced this term (said again: redialled)
        self.restarts = Restarts()  # a joined shard's new incarnation: taken in this term, or rolled back
        self.replays = replays  # a restarted shard replays the step log (steplog/shard.py `in_use`): taken in the term
        self.moves = 0  # shards restarted and taken in this term: a worker told fewer is told where they are (`news`)
        self.told: dict[bytes, int] = {}  # worker connection -> `moves` when its last lease said where the shards are

    @property
    def complete(self) -> bool:
        """Has every shard joined this term (workers are admitted only then)?"""
        return len(self.shards) == self.partition.shards - 1

    def addrs(self) -> list[str]:
        return [self.shards[k].addr for k in sorted(self.shards)]

    def news(self, identity: bytes) -> list[list[Any]] | None:
        """[[k, incarnation, address], ...] of every shard, for a lease to this worker connection when a shard was
        taken in since it was last told (None: nothing new). A worker then relinks before it pulls or pushes, so a
        re-leased slice never goes into the dead incarnation's link (it learned the address from the shard's Redis
        record, read every 0.25 s off its loop: a re-lease that came first was lost there). Told at most once per
        restart: a lease carries no addresses otherwise (the bytes goal of bench/cluster.py counts every byte)."""
        if self.told.get(identity, 0) >= self.moves:
            return None
        if len(self.told) > 4096:  # connections of workers gone: forgetting them only tells a live one again
            self.told.clear()
        self.told[identity] = self.moves
        return [[k, self.shards[k].inc, self.shards[k].addr] for k in sorted(self.shards)]

    def join(self, identity: bytes, h: dict[str, Any], step: int) -> bool:
        """A shard joins this term at `step`; True when it is the last one to join."""
        k, known = h["shard"], self.shards.get(h["shard"])
        if h["term"] != self.term or not 0 < k < self.partition.shards:
            self.drop("stale_shard", f"shard {k} of term {h['term']}")
            self.outbox.send(identity, "reject", fatal=False, reason=f"term {self.term} started: join it")
            return False
        if known is not None and known.inc == h["inc"]:  # said again: a slow link, or a join lost on a cut one
            if known.identity != identity:
                self.redialled(k, known, identity)  # welcomes it there
            else:
                self.outbox.send(identity, "shard_welcome", term=self.term, **self.welcome())
            return False
        decision = self.restarts.decide(k, None if known is None else known.inc, h["inc"], h["step"], step,
                                        time.monotonic(), self.replays)
        if decision is Rejoin.STALE:  # a dead incarnation back (SIGSTOP): fenced, nothing it says counts
            self.drop("stale_shard", f"shard {k}/{h['inc']}, {known.inc if known else -1} joined")
            self.outbox.send(identity, "reject", fatal=False, reason=f"shard {k} has a newer incarnation")
        elif decision is Rejoin.BEHIND:  # it replays on to the leader's step, and joins again
            self.outbox.send(identity, "shard_behind", term=self.term, step=step)
        elif decision is Rejoin.ROLL_BACK:
            # its slice went back to the checkpoint and the log cannot bring it here: the cluster goes back with it
            self.ctx.emit("shard_restarted", shard=k, step=step, restored=h["step"], term_kept=False)
            self.ctx.log.warning("a shard restarted; the cluster restarts from the last complete checkpoint", shard=k,
                                 its_step=h["step"], step=step)
            raise SystemExit(Exit.REJOIN)
        else:
            return self.admit(k, identity, h, restarted=known is not None)
        return False

    def admit(self, k: int, identity: bytes, h: dict[str, Any], restarted: bool) -> bool:
        """Shard k joins at the leader's step: at the term's start, or restarted within it (in its dead
        incarnation's place, told this term's fences); True when it is the last one to join."""
        self.shards[k] = ShardInfo(identity, h["inc"], h["addr"], taken_at=h["step"] if restarted else None)
        self.outbox.send(identity, "shard_welcome", term=self.term, **self.welcome())
        if restarted:
            self.moves += 1
            self.ctx.emit("shard_restarted", shard=k, step=h["step"], restored=h["step"], term_kept=True, inc=h["inc"])
            self.ctx.log.warning("a shard restarted; taken in this term at the leader's step", shard=k,
                                 addr=h["addr"], step=h["step"])
            for wid, inc in self.fences.items():
                self.outbox.send(identity, "shard_fence", term=self.term, wid=wid, inc=inc)
            return False
        self.ctx.log.info("shard joined", shard=k, addr=h["addr"], step=h["step"])
        return self.complete

    def announce(self) -> None:
        """Welcome every joined shard again if what it is told changed (the run's fingerprint, set by the first
        admitted worker: the leader reads no data)."""
        if (welcome := self.welcome()) != self.announced:
            self.announced = welcome
            for info in self.shards.values():
                self.outbox.send(info.identity, "shard_welcome", term=self.term, **welcome)

    def member(self, identity: bytes, h: dict[str, Any]) -> ShardInfo | None:
        """The joined shard a message comes from, or None (dropped: `unknown_shard`). Its incarnation of this term
        is that shard on whichever connection it comes (`redialled`)."""
        info = self.shards.get(h["shard"])
        if info is None or info.inc != h["inc"] or h["term"] != self.term:
            self.drop("unknown_shard", f"shard {h['shard']}/{h['inc']}")
            return None
        if info.identity != identity:
            self.redialled(h["shard"], info, identity)
        return info

    def redialled(self, k: int, info: ShardInfo, identity: bytes) -> None:
        """Shard k's link was given up and dialled again (a cut longer than its timeout, shared/runtime/links.py):
        answer it on the new connection, and say again what went to the old one since the last message it sent.

        The leader's ROUTER names each connection anew (the shard's DEALER sets no routing id), so a joined shard
        comes back under another identity. Keyed by identity alone (before issue 47's fix) its every `shard_have`
        and `shard_ready` was dropped as `unknown_shard` and every commit went to the dead connection: shard 1 cut
        from the leader for 4 s (tests/test_partitions.py) stalled the run for good, every worker saying hello
        again every 10 s. A fixed routing id would not do instead: a ROUTER ignores a connection whose id the old
        one still holds until it gives the old one up. Who it is stays checked: its shard number, incarnation and
        term, under CurveZMQ a key of the aggregator role (intake.py). What may have been lost is said again: the
        welcome (the run's fingerprint: `announce` may have sent it only to the old connection) and this term's
        fences; a lost commit goes again when the shard reports that step ready once more (`ready`)."""
        self.ctx.emit("shard_redialled", shard=k, inc=info.inc)
        self.ctx.log.warning("a shard's link was dialled again; answering it there", shard=k, inc=info.inc)
        info.identity = identity
        self.outbox.send(identity, "shard_welcome", term=self.term, **self.welcome())
        for wid, inc in self.fences.items():
            self.outbox.send(identity, "shard_fence", term=self.term, wid=wid, inc=inc)

    def have(self, identity: bytes, h: dict[str, Any], collector: StepCollector, grace: float) -> bool:
        """A shard's microbatches of its incomplete step: what it lacks of a step complete here goes back to the
        queue after `grace` (its worker died between its sends); True if some did.

        A restarted incarnation, in the step it was taken in at, lost every slice its dead one held or was sent:
        what it lacks of what is here is leased again at once at its first report, complete here or not. Every lease
        handed out after it was taken in says where it is (`news`), so a worker relinks before it pushes and the
        re-leased slices reach it. Before that, the worker learned the address only from the shard's Redis record
        (read every 0.25 s off its loop): a re-lease that came first went into the dead link, and a repeat at each
        report (every 0.5 s) bounded the loss, at the price of a whole step's compute again for a long step. What it
        still lacks after that first report goes back after `grace`, as for any shard (a worker that died between
        its sends). A re-lease is safe: a duplicate is dropped, the first copy wins."""
        if self.member(identity, h) is None or h["step"] != collector.step:
            return False
        if not all(isinstance(m, int) for m in h["have"]):
            self.drop("bad_have", f"shard {h['shard']}")
            return False
        info = self.shards[h["shard"]]
        restarted = info.taken_at == collector.step
        first, info.relet = restarted and not info.relet, info.relet or restarted
        if lacking := collector.reopen(h["have"], time.monotonic(), grace=0.0 if first else grace, early=restarted):
            self.ctx.emit("leases_reopened", step=collector.step, shard=h["shard"], microbatches=lacking)
            self.ctx.log.warning("a shard lacks microbatches this step holds; leasing them again", shard=h["shard"],
                                 microbatches=lacking)
        return bool(lacking)

    def is_shard(self, identity: bytes) -> bool:
        return any(info.identity == identity for info in self.shards.values())

    def ready(self, identity: bytes, h: dict[str, Any], step: int) -> bool:
        """A shard's step is complete; True if this is news for the current step (the leader may apply it)."""
        if (info := self.member(identity, h)) is None:
            return False
        if not all(isinstance(x, (int, float)) for x in h["partials"]):
            self.drop("bad_partials", f"shard {h['shard']}")
            return False
        if h["step"] < step:  # applied already: its commit was lost on the way
            if self.last_commit is not None and self.last_commit["step"] == h["step"]:
                self.outbox.send(identity, "shard_commit", **self.last_commit)
            return False
        info.ready = (h["step"], [float(x) for x in h["partials"]], h["overflow"])
        return True

    def others_ready(self, step: int) -> tuple[list[float], bool] | None:
        """Every shard k > 0's share of `step` (partials in shard order, any overflow), once all reported."""
        partials, overflow = [], False
        for k in range(1, self.partition.shards):
            ready = self.shards[k].ready if k in self.shards else None
            if ready is None or ready[0] != step:
                return None
            partials += ready[1]
            overflow |= ready[2]
        return partials, overflow

    def commit(self, **fields: Any) -> None:
        """Tell every shard to apply the step (skip: an overflow; last: the run ends; snapshot: checkpoint it)."""
        self.last_commit = {"term": self.term, **fields}
        for info in self.shards.values():
            self.outbox.send(info.identity, "shard_commit", **self.last_commit)

    def fence(self, wid: str, inc: int) -> None:
        """A fence the leader verified, passed on to every shard (they admit workers by the same rule)."""
        self.fences[wid] = max(inc, self.fences.get(wid, 0))
        for info in self.shards.values():
            self.outbox.send(info.identity, "shard_fence", term=self.term, wid=wid, inc=inc)

    def snapshot_now(self, step: int) -> None:
        """Every shard checkpoints the state after `step` now (the step log's forced checkpoint: stepping.py)."""
        for info in self.shards.values():
            self.outbox.send(info.identity, "shard_snapshot", term=self.term, step=step)
