"""The replicas' inner optimizer states (`train.local_steps`, DiLoCo), kept by the leader between rounds
(docs/design.md §10).

A replica's round ends with its inner optimizer's and scheduler's state, which the next round of that replica starts
from. The worker that computed it keeps it too (so the same worker's next round needs none sent), but the leader's
copy is what makes a worker's death cost at most the replica's current round: whoever takes the round again gets the
state it started from. It travels beside Δ_r in the `grad` message (header `inner`: the state's metadata, tensors
named `inner.…`: shared/core/innerstate.py) and back in an `inner` message before the `work` of a worker that does not hold
it (`Holdings`: what each worker says it holds).

With `train.inner_states: shards` (issue 48) each server keeps only its replicas' states, replica r on shard r mod K
(`owned`; the leader is shard 0): the same checks, keeping and checkpoints at each, so no server's link carries more
than ⌈R / K⌉ of them; a worker asks shard k for a state it lacks (a `pull` naming the replica, services/aggregator/shard/inner.py).

`current[r]`: replica r's state at the start of the round being collected (None: fresh, round 0); `next[r]`: what
its accepted round ended with, which becomes current when the round is applied. `current` is in every checkpoint of
the leader (a snapshot is taken after a round is applied, when `next` has become current). A received state is checked against
the layout of a real one (tensor names, dtypes, shapes and the metadata's skeleton: `signature`) before it is kept, so a malformed one is a drop,
never a worker that cannot load it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from cmemi.shared.core.innerstate import PREFIX, Signature, from_wire, signature, to_wire
from cmemi.shared.wire import state


class InnerStates:
    def __init__(self, replicas: int, owned: list[int] | None = None) -> None:
        """`owned`: the replicas whose states this server keeps (`innerstate.owned`: shard r mod K with
        `train.inner_states: shards`); None: every one."""
        self.R = replicas
        self.owned = frozenset(range(replicas) if owned is None else owned)
        self.current: dict[int, dict[str, Any] | None] = dict.fromkeys(sorted(self.owned))
        self.next: dict[int, dict[str, Any] | None] = {}
        self.layout: Signature | None = None  # of a state after a round (`expect`: `layout_of` this model)

    def expect(self, layout: Signature) -> None:
        self.layout = layout

    def owns(self, r: int) -> bool:
        return r in self.owned

    def take(self, r: int, meta: Any, tensors: dict[str, torch.Tensor], due: bool) -> tuple[Any, bool, str | None]:
        """A gradient's state for replica r, as this server sees it: (the state, whether it is kept once the change is
        accepted, the drop reason). `due`: the round ships one (streaming: `fragments.ships_state`). A state where none
        is due, or for a replica another server keeps, is as malformed as a bad one: the same rule at every server."""
        if not due or not self.owns(r):
            return None, False, "bad_inner" if meta or tensors else None
        inner, bad = self.parse(r, meta, tensors)
        return inner, True, bad

    def parse(self, r: int, meta: Any, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any] | None, str | None]:
        """Replica r's state at the end of a round, as received: (the state, None), or (None, the drop reason) when it
        is malformed. Checked before the round's change is accepted; kept (`keep`) once it is."""
        if r not in self.owned or not isinstance(meta, dict) or not meta:
            return None, "bad_inner"
        if not all(n.startswith(PREFIX + ".") for n in tensors):
            return None, "bad_inner"
        if self.layout is not None and signature(meta, tensors) != self.layout:
            return None, "bad_inner"
        if not all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()):
            return None, "bad_inner"
        try:
            return from_wire(meta, tensors), None
        except state.StateError:
            return None, "bad_inner"

    def keep(self, r: int, inner: dict[str, Any] | None) -> None:
        """Replica r's accepted round ended with `inner`: its next round starts from it."""
        self.next[r] = inner

    def advance(self) -> None:
        """The round is applied: each replica's next round starts from the state it ended this one with."""
        self.current.update(self.next)
        self.next = {}

    def start(self, r: int) -> dict[str, Any] | None:
        """Replica r's state at the start of the current round (None: fresh)."""
        return self.current.get(r)

    def wire(self, r: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Replica r's state at the start of the current round, for an `inner` message."""
        return to_wire(self.current.get(r))

    def state_dict(self) -> dict[int, Any]:
        return {r: s for r, s in self.current.items() if s is not None}

    def load_state_dict(self, sd: dict[Any, Any] | None) -> None:
        self.current = {r: (sd or {}).get(r) for r in sorted(self.owned)}  # (a merged one holds others' too)
        self.next = {}


class Holdings:
    """Which (replica, round) inner states each worker connection holds, as its last `want` or `grad` said (`holds`):
    the leader leases a worker the replicas it holds first, and sends a state only to one that lacks it."""

    def __init__(self, replicas: int, keeper: Callable[[int], int] = lambda r: 0) -> None:
        self.R, self.keeper = replicas, keeper  # keeper(r): the server that keeps replica r's state
        self.by: dict[bytes, set[tuple[int, int]]] = {}
        self.heard: dict[bytes, float] = {}  # identity -> when its last `holds` came (monotonic)
        self.near: dict[bytes, set[int]] = {}  # identity -> the replicas whose keeper is on that worker's host

    def note(self, identity: bytes, held: list[Any] | None, admitted: Callable[[bytes], bool],
             near: Any = None) -> None:
        """`held`: the header's `holds` (a list of [replica, round]; None: not said, and a malformed entry is
        ignored); `near`: a `want`'s servers on the worker's host (a list of shard numbers; anything else: none).
        The entries of connections no longer admitted (departed, fenced, replaced) go."""
        if held is None:
            return
        for gone in [i for i in self.by if i != identity and not admitted(i)]:
            del self.by[gone]
            self.heard.pop(gone, None)
            self.near.pop(gone, None)
        if isinstance(near, list):
            shards = {k for k in near[:64] if type(k) is int}
            self.near[identity] = {r for r in range(self.R) if self.keeper(r) in shards}
        self.by[identity] = {(int(x[0]), int(x[1])) for x in held[:self.R]
                             if isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x)}
        self.heard[identity] = time.monotonic()

    def prefer(self, identity: bytes, rnd: int) -> set[int]:
        """The replicas whose round `rnd` this worker can start without a state sent."""
        return {r for r, t in self.by.get(identity, ()) if t == rnd}

    def nearby(self, identity: bytes, rnd: int) -> set[int]:
        """The replicas whose state a server on this worker's host keeps and no other worker holds for round `rnd`:
        preferred beside its own, so that their states go up and down within the host, off the links."""
        mine = self.near.get(identity)
        if not mine:
            return set()
        return mine - {r for i, held in self.by.items() if i != identity for r, t in held if t == rnd}

    def elsewhere(self, identity: bytes, rnd: int, admitted: Callable[[bytes], bool], fair: int,
                  patience: float) -> set[int]:
        """The replicas whose round `rnd` another admitted worker, heard from within `patience` seconds (one that
        hangs while it heartbeats lets them go, as an overdue lease does), can start without a state sent; for a
        worker that holds fewer than its `fair` share, but for the others' extras beyond theirs (each holder's highest:
        it computes its lowest first), so that workers that joined late get replicas too."""
        short = len(self.prefer(identity, rnd)) < fair
        now = time.monotonic()
        out: set[int] = set()
        for i, held in self.by.items():
            if i != identity and admitted(i) and now - self.heard.get(i, now) <= patience:
                theirs = sorted(r for r, t in held if t == rnd)
                out.update(theirs[:fair] if short else theirs)
        return out

    def has(self, identity: bytes, r: int, rnd: int) -> bool:
        return (r, rnd) in self.by.get(identity, ())
