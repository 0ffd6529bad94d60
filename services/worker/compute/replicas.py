"""train.local_steps: the replicas' inner states this worker holds, and the rounds it computed ahead (streaming).

A lease is a replica's round (services/worker/compute/local.py). The worker keeps the inner state each replica's next
round starts from, for the last few it computed or was sent (`inner` messages): a lease of a replica held needs no
state on the wire, and every `want` and `grad` says which are held (`holds`). The oldest round goes first, never the
one just kept.

Streaming: with no other lease of a step coming (its last lease said so, or the leader parked us after our
gradient), the next step's segment of each replica held for it is computed while the step is collected (the model's
version gives the same bits), lowest replica first (the leader leases a held replica's lowest first); it stops as
soon as a message waits: a lease goes first. A lease computed ahead from the very state it names is sent as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.worker.compute.block import BlockComputer
from cmemi.services.worker.compute.local import LocalRound
from cmemi.shared.config.schema import Config
from cmemi.shared.core import innerstate
from cmemi.shared.core.innerstate import InnerState
from cmemi.shared.wire import protocol

Held = tuple[int, InnerState | None]  # (the round a replica's state starts, the state)


class Replicas:
    def __init__(self, cfg: Config, local: LocalRound | None, compute: BlockComputer,
                 fatal: Callable[[str], None]) -> None:
        self.cfg, self.local, self.compute, self.fatal = cfg, local, compute, fatal
        self.held: dict[int, Held] = {}  # replica -> its state
        # train.state_every > 1: the versions a held snapshot's replay starts its rounds from, by version and piece
        # (shared/core/history.py): the leader's pieces sent beside the snapshot (or alone, `only_past`, when shard k
        # keeps the replica), each shard k > 0's pulled (`add_past`); `shards_of`: whose pieces of a version are here.
        # `replayed`: (replica, first, round) of each replay
        self.past: dict[int, dict[str, torch.Tensor]] = {}
        self.shards_of: dict[int, set[int]] = {}
        self.replayed: list[tuple[int, int, int]] = []
        self.ahead: dict[tuple[int, int], tuple[Held, Any]] = {}  # (step, replica) -> (the state it started from, result)
        self.hold_at_most = 1 + -(-cfg.train.microbatches // max(1, cfg.cluster.workers))
        self.wid = "?"

    def holds(self) -> list[list[int]] | None:
        """Which replicas' next rounds need no state sent (None: not local steps)."""
        return None if self.local is None else [[r, t] for r, (t, _) in self.held.items()]

    def hold(self, msg: protocol.Message) -> None:
        """A replica's inner state from the server that keeps it (`inner`), for the work that follows."""
        h = msg.header
        tensors, past = innerstate.split_past(dict(msg.tensors))
        for u, pieces in past.items():
            self.add_past(0, u, pieces)
        if h["only_past"]:  # (no state: the shard that keeps the replica sends it)
            return
        try:
            inner = innerstate.from_wire(h["meta"], tensors)
        except ValueError as exc:  # the leader checked it: a bug or another config, not a transient fault
            self.fatal(f"worker {self.wid}: replica {h['replica']}'s inner state from the aggregator cannot be "
                       f"read ({exc}); use the same optimizer and model on every host")
        self.keep(h["replica"], h["round"], inner)

    def add_past(self, k: int, version: int, pieces: dict[str, torch.Tensor]) -> None:
        """Server k's pieces of an older `version` (copied: what they landed in is the link's)."""
        self.past.setdefault(version, {}).update({n: t.clone() for n, t in pieces.items()})
        self.shards_of.setdefault(version, set()).add(k)

    def lacking(self, first: int, step: int) -> list[int]:
        """Whole rounds: the versions first … step − 1 a replay needs of which some shard k > 0's pieces are not here
        yet (none at K = 1: the leader's `inner` brings every piece)."""
        if self.local is None or self.local.fragments:
            return []
        every = set(range(self.cfg.cluster.shards))
        return [u for u in range(first, step) if not self.shards_of.get(u, set()) >= every]

    def forget(self, r: int) -> None:
        """Replica r's state held is of no use (a version its replay needs cannot be had): the leader sends it again."""
        self.held.pop(r, None)

    def keeper(self, r: int) -> int:
        """The server that keeps replica r's state (0: the leader, which sends it ahead of the work; k > 0: shard k,
        which the worker asks: train.inner_states, shared/core/innerstate.py `owner`)."""
        return innerstate.owner(r, self.cfg.cluster.shards, self.cfg.train.inner_states)

    def keep(self, r: int, rnd: int, inner: InnerState | None) -> None:
        self.held[r] = (rnd, inner)
        # the oldest round goes, never the one just kept, nor one of the last two rounds: a worker the leader gave more
        # than its share (a slow host's replicas: services/aggregator/common/pace.py) needs each of them next step
        newest = max(t for t, _ in self.held.values())
        while len(self.held) > self.hold_at_most:
            old = [x for x in self.held if x != r and self.held[x][0] < newest - 1]
            if not old:
                return
            del self.held[min(old, key=lambda x: self.held[x][0])]

    def state_for(self, r: int, step: int) -> Held | None:
        """Replica r's state for its round at `step` (streaming: one from the last snapshot period will do, the
        segments since are computed again); None, and forgotten, when none held will do."""
        assert self.local is not None
        if (held := self.held.get(r)) is None or not 0 <= step - held[0] < self.local.window or (
                not self.local.fragments and not all(0 in self.shards_of.get(u, ()) for u in range(held[0], step))):
            # (whole rounds: a state from before `step` needs the leader's pieces of the versions since, for a replay;
            # the other shards' are pulled: `lacking`)
            self.held.pop(r, None)
            return None
        return held

    def compute_ahead(self, step: int, version: int, waiting: Callable[[], bool]) -> None:
        """Streaming: the next step's segments of the replicas held for it, while step `step` (our `version`) is
        collected; stops when a message waits."""
        local, nxt = self.local, step + 1
        if local is None or not local.ahead or version != step or nxt >= self.cfg.train.rounds:
            return
        for r in sorted(self.held):
            held = self.held[r]
            if held[0] != nxt or (nxt, r) in self.ahead:
                continue
            if waiting():
                return
            self.ahead[(nxt, r)] = (held, self.compute.local_round(local, nxt, r, *held))

    def lease(self, step: int, r: int, held: Held) -> tuple[Any, bool]:
        """A replica's lease: computed ahead from this very state if it was, else now; and whether it was ahead."""
        ahead = self.ahead.pop((step, r), None)
        self.ahead = {k: v for k, v in self.ahead.items() if k[0] >= step}
        if ahead is not None and ahead[0] is held:
            return ahead[1], True
        assert self.local is not None
        if self.local.fragments or held[0] == step:
            return self.compute.local_round(self.local, step, r, *held), False
        # train.state_every > 1: a snapshot, its rounds up to `step` replayed from the versions sent with it
        out = self.compute.local_round(self.local, step, r, *held, self.past.__getitem__)
        self.replayed.append((r, held[0], step))
        needed = min((t for x, (t, _) in self.held.items() if x != r and t < step), default=step)
        self.past = {u: v for u, v in self.past.items() if u >= needed}
        self.shards_of = {u: v for u, v in self.shards_of.items() if u >= needed}
        return out, False
