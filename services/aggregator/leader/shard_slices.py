"""The slices the shards k > 0 send the leader (docs/design.md §4): their pieces at an evaluation step (`shard_eval`)
and after the last step (`shard_final`, with the shard's totals and, compression.downlink, its mirror's hashes),
placed into the whole model's tensors once every shard's are here, each checked against the model's shapes first.

Its own job beside the roster (roster.py: who the shards of this term are, and the step barrier): a slice arrives
only from a shard the roster knows (`ShardRoster.member`), and is kept on that shard's `ShardInfo` until placed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from cmemi.services.aggregator.leader.roster import ShardRoster


class ShardSlices:
    def __init__(self, roster: ShardRoster) -> None:
        self.roster = roster

    def eval_pieces(self, identity: bytes, h: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if (info := self.roster.member(identity, h)) is not None:
            info.eval = (h["step"], tensors)

    def place_eval(self, step: int, weights: dict[str, torch.Tensor]) -> bool:
        """Every shard's pieces of evaluation step `step` into `weights`, once all are here; True then."""
        shards = self.roster.shards
        if not self.roster.complete:  # (a replayed leader's evaluation: the shards' pieces come as they join)
            return False
        if any(info.eval is None or info.eval[0] != step for info in shards.values()):
            return False
        for k, info in shards.items():
            assert info.eval is not None
            self.place(k, info.eval[1], weights)
            info.eval = None
        return True

    def final(self, identity: bytes, h: dict[str, Any], tensors: dict[str, torch.Tensor], step: int) -> None:
        if (info := self.roster.member(identity, h)) is not None and h["step"] == step:
            info.final = tensors
            mirror = h["mirror"]
            info.mirror = {str(k): str(v) for k, v in mirror.items()} if mirror is not None else {}
            reported = {"bytes_sent_via_slots": h.get("slot_in"), "bytes_received_via_slots": h.get("slot_out"),
                        "changes_sent": h.get("changes_sent"), "mirrors_sent": h.get("mirrors_sent"),
                        "inner_states_sent": h.get("inner_states_sent"),
                        "inner_rounds_replayed": h.get("inner_rounds_replayed")}  # ABSENT-able
            info.totals = {"bytes_sent": h["bytes_in"], "bytes_received": h["bytes_out"],
                           **{k: v for k, v in reported.items() if v is not None},
                           "dropped_messages": {str(k): v for k, v in h["drops"].items() if isinstance(v, int)}}

    def mirror_hashes(self) -> dict[str, str]:
        """Every other shard's mirror pieces' SHA-256 (compression.downlink), from their final slices."""
        return {n: h for info in self.roster.shards.values() for n, h in (info.mirror or {}).items()}

    def gather(self, shapes: Mapping[str, torch.Size], pump: Callable[[], None],
               timeout: float = 120) -> dict[int, dict[str, torch.Tensor]]:
        """Every shard's pieces after the last step, checked against the whole model's tensor `shapes` (`pump`
        receives one message). They come on their own once a shard applied the last commit."""
        shards = self.roster.shards
        deadline = time.monotonic() + timeout
        while any(info.final is None for info in shards.values()):
            if time.monotonic() > deadline:
                missing = sorted(k for k, info in shards.items() if info.final is None)
                raise RuntimeError(f"shards {missing} did not send their final slice within {timeout:g} s")
            pump()
        meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        out = {}
        for k, info in shards.items():
            assert info.final is not None
            self._check(k, info.final, self.roster.partition.views(meta, k))
            out[k], info.final = info.final, {}
        return out

    def place(self, k: int, pieces: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
        """Shard k's pieces (its evaluation slice) into the whole model's tensors `into`."""
        views = self.roster.partition.views(into, k)
        self._check(k, pieces, views)
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(pieces[name])

    def _check(self, k: int, pieces: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
        if pieces.keys() != views.keys() or any(pieces[n].shape != v.shape for n, v in views.items()):
            self.roster.ctx.fatal(f"shard {k}'s slice does not fit this model: use the same model.factory, "
                                  "model.kwargs and cluster.shards for every shard")

    def total(self, field: str) -> int:
        """A field of every shard's totals, summed (bytes in and out over the run)."""
        return sum(int((info.totals or {}).get(field, 0)) for info in self.roster.shards.values())

    def summary(self) -> list[dict[str, Any]]:
        """Each shard's totals, in shard order (summary.json's `shards`)."""
        return [{"shard": k, **(self.roster.shards[k].totals or {})} for k in sorted(self.roster.shards)]
