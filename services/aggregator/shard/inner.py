"""A shard's replicas' inner states (`train.local_steps` with `train.inner_states: shards`, issue 48;
docs/design/local-steps.md, "Where the replicas' states go on slow links").

Replica r's state is kept by shard r mod K (the leader is shard 0, which keeps its own through the leader's path:
leader/grads.py, leader/handout.py). Kept on the leader alone, every replica's state crosses the leader's link once
a round (streaming: a snapshot every F − 1 segments), n − 1 states for every one slice of the others; spread, each
server takes 1/K of them. Everything the leader did with them, a shard k does with its own, by the same rules
(`InnerStates`, services/aggregator/common/replicas.py):

- `take`: a gradient's slice carries its replica's state (header `inner`, tensors `.inner.…`) when this shard keeps
  the replica and the round ships one; checked against the layout of a real one (`layout_of`: names, dtypes, shapes;
  finite) before the change is decoded, malformed or misplaced -> dropped as `bad_inner` (a misfit, as at the leader);
- `accepted`: kept only once its change is accepted (the first complete copy of the microbatch, as every shard's
  rule: a reissued lease recomputes the same bits), current once the step is committed (`Trainer.apply`);
- `pull`: a worker that lacks a replica's state asks this shard (a `pull` naming it), answered with `inner` once this shard
  holds the lease's version (what the leader's `inner` message carried before); with `train.state_every` = D > 1, the
  snapshot and the round it starts (a `replay` event when that is before the current round, as at the leader);
- `past` (train.state_every > 1, any `train.inner_states`): a worker about to replay a replica's rounds s … t − 1 asks
  every shard k > 0 for its pieces of each version u in s … t − 1 (a `pull` with `past`), answered at once from this
  shard's history (`Trainer.history`, shared/core/history.py) with a `slice` marked `past`, or, outside the window,
  one that names why (`refused`, no tensors): never other bits;
- the states are in this shard's snapshots (section `inner`, snapshots/contents.py) and its step log entries (the
  states its step makes current, steplog/replicas.py), so a shard's death restores them as it restores its slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.wire import protocol


class ShardStates:
    def __init__(self, trainer: Trainer, send: Callable[..., int], totals: RunTotals, checksum: Any,
                 emit: Callable[..., None] | None = None) -> None:
        """`send(identity, mtype, encoded, **fields)`: the bytes sent (the shard's outbox; counted in `bytes_out`);
        `emit(kind, **fields)`: a run event (`replay`)."""
        self.trainer, self.send, self.totals, self.checksum = trainer, send, totals, checksum
        self.emit = emit or (lambda kind, **fields: None)
        self.inner: InnerStates | None = trainer.inner
        self.waiting: list[tuple[bytes, int, int]] = []  # pulls of a version not here yet: (identity, replica, version)
        if self.inner is not None:  # what a replica's state must look like (the leader's rule: leader/parts.py)
            self.inner.expect(innerstate.layout_of(trainer.cfg, {n: (s, trainer.params[n].dtype)
                                                                 for n, s in trainer.whole_shapes.items()}))

    def take(self, h: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[Any, bool, str | None]:
        """(the state, whether it is kept once the change is accepted, the drop reason) of a gradient's slice; its
        state's tensors are taken out of `tensors` (copied: a slot's views are read, never kept), leaving the change."""
        own = {n: tensors.pop(n).clone() for n in [n for n in tensors if n.startswith(innerstate.PREFIX + ".")]}
        if self.inner is None:
            return None, False, "bad_inner" if h["inner"] or own else None
        t = self.trainer
        due = (fragmenting.ships_state(h["step"], t.snapshot_every, h["lo"]) if t.fragments
               else innerstate.due(h["step"], h["lo"], t.cfg.train.state_every))  # (train.state_every)
        return self.inner.take(h["lo"], h["inner"], own, due)

    def accepted(self, r: int, state: Any, keep: bool) -> None:
        if keep and self.inner is not None:
            self.inner.keep(r, state)

    def pull(self, identity: bytes, h: dict[str, Any]) -> None:
        """A worker's pull of a replica's state: answered now if this shard holds the lease's version (or is past it: the worker
        then finds the state too new for that lease and asks the leader again), else once it does (`answer`). A pull
        marked `past` asks for an older version of this shard's pieces instead (`past`)."""
        if h["past"]:
            self.past(identity, int(h["version"]))
            return
        r = h["replica"]
        if self.inner is None or not self.inner.owns(r):
            self.send(identity, "reject", fatal=False, reason=f"shard {self.trainer.shard} keeps no state of replica "
                      f"{r}; say hello again")
            return
        self.waiting.append((identity, r, int(h["version"])))
        self.answer()

    def answer(self) -> None:
        """The waiting pulls of a version this shard holds now."""
        ready = [w for w in self.waiting if w[2] <= self.trainer.step]
        self.waiting = [w for w in self.waiting if w[2] > self.trainer.step][-64:]
        for identity, r, _ in ready:
            assert self.inner is not None
            meta, tensors = self.inner.wire(r)
            step = self.trainer.step
            if self.trainer.fragments:  # streaming: the snapshot's own segment (the worker computes the ones since)
                step = (self.inner.start(r) or {}).get("start", 0)
            elif self.trainer.history.on:  # train.state_every > 1: the round the snapshot starts (leader/handout.py)
                step = innerstate.snapshot_start(step, r, self.trainer.cfg.train.state_every)
                self.totals.replayed(self.emit, r, step, self.trainer.step)  # the rounds its new holder computes again
            self.totals.inner_states_sent += bool(meta)
            self.totals.bytes_out += self.send(identity, "inner", (protocol.encode_tensors(tensors, self.checksum),
                                                                   None), replica=r, round=step, meta=meta)

    def past(self, identity: bytes, version: int) -> None:
        """This shard's pieces of an older `version` from its history, for a replay; outside the window, the reason."""
        pieces, why = self.trainer.history.get(version)
        encoded = protocol.encode_tensors(pieces, self.checksum) if pieces is not None else ([], [])
        self.totals.bytes_out += self.send(identity, "slice", (encoded, None), version=version, asked=version,
                                           shard=self.trainer.shard, past=True, refused=why)
