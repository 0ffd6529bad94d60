"""A sharded server's rows: after start-up each shard keeps only the rows it owns; the leader builds the whole
model again at the end (docs/design.md, "Memory"). A mixin of `Trainer`: the same object, its own job."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from cmemi.shared.core.grid import Partition


class OwnRows:
    """Needs the trainer's `params`, `pieces`, `partition`, `shard`, `dropped` and `model`."""

    params: dict[str, torch.Tensor]
    pieces: dict[str, torch.Tensor]
    partition: Partition
    shard: int
    dropped: dict[str, torch.Size]
    model: torch.nn.Module

    @property
    def sharded(self) -> bool:
        return self.partition.shards > 1

    def keep_own_rows(self) -> None:
        """Sharded, after start-up (restore, the evaluation probe): keep only this shard's rows. Each owned piece of
        a tensor shared with other shards gets storage of its own (the same Parameter, so the optimizer and its
        state are untouched), and every trained tensor not wholly owned here gives its storage up (an empty tensor
        in the model; its shape kept in `dropped`). The leader rebuilds the whole model at the end (`materialize`)."""
        if not self.sharded:
            return
        with torch.no_grad():
            for n, piece in self.pieces.items():
                if piece is not self.params.get(n):
                    piece.data = piece.detach().clone()
            for n, p in self.params.items():
                if self.pieces.get(n) is not p:
                    self.dropped[n] = p.shape
                    p.data = torch.empty(0, dtype=p.dtype)

    def state_copy(self) -> dict[str, torch.Tensor]:
        """A copy of the model's state (for an evaluation); sharded, the rows of other shards are left for their
        slices to fill (`ShardSlices.place`)."""
        out = {k: torch.empty(self.dropped[k], dtype=v.dtype) if k in self.dropped else v.clone()
               for k, v in self.model.state_dict().items()}
        self._own_rows_into(out)
        return out

    @property
    def whole_shapes(self) -> dict[str, torch.Size]:
        """Each trained tensor's shape in the whole model (also of those whose rows live on other shards)."""
        return {n: self.dropped.get(n, p.shape) for n, p in self.params.items()}

    def materialize(self, others: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """The whole model again (the leader, at the end), from its own pieces and the other shards' final ones
        (`others`: shard -> piece name -> tensor, checked to fit). A tensor another shard owned whole takes the
        received tensor as its storage; one split between shards is allocated and filled; each own piece moves into
        its rows and aliases them again, as before `keep_own_rows`. No second copy of any row is left."""
        with torch.no_grad():
            for n, shape in self.dropped.items():
                whole = others.get(self.partition.owner.get(n, -1), {}).get(n)  # a piece named as its tensor: whole
                p = self.params[n]
                p.data = whole if whole is not None and whole.dtype == p.dtype else torch.empty(shape, dtype=p.dtype)
            self.dropped = {}
            for k, pieces in others.items():
                for name, view in self.partition.views(self.params, k).items():
                    if view.data_ptr() != pieces[name].data_ptr():
                        view.copy_(pieces[name])
            for name, view in self.partition.views(self.params, self.shard).items():
                if (piece := self.pieces[name]) is not view:
                    view.copy_(piece)
                    piece.data = view

    def _own_rows_into(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.sharded:
            with torch.no_grad():
                for name, view in self.partition.views({n: tensors[n] for n in self.params}, self.shard).items():
                    if view is not self.pieces[name]:
                        view.copy_(self.pieces[name])
