"""The chunk grid and its partition over K parameter-server shards (docs/design.md §3 and §4).

The grid depends on the model alone: every trainable tensor, in `named_parameters()` order, is cut
along its first dimension into pieces of at most `chunk_bytes(model bytes)` — a 64th of the model,
between 64 KiB and `CHUNK` = 4 MiB, so that even a model of a few MB spreads over 8 shards (a tensor
whose rows fit is one piece, named as the tensor; the pieces of a bigger one are `name#0`, `name#1`,
...). Gradients are summed, averaged, clipped and stepped piece by piece, at every K and in the
single-process reference, so vectorised and tail arithmetic cover the same elements whoever owns a piece.

A low-rank codec (`powersgd`) factors each piece on its own, and a thin piece factors badly: rank r of a piece of
`rows` rows costs r·(rows + columns) numbers, so 20-row pieces of a 784-column matrix send ~10× fewer bytes than dense
where the whole matrix sends ~150× fewer. With it both ways (`compression.downlink: powersgd`, `Partition(...,
whole=True)`) every piece is as big as CHUNK allows: whole tensors up to 4 MiB, the same grid at any K still (every
byte either way is then few, so K shards' balance matters less than the factors' size). With it up only the dense
parameters still go down, and the fine grid spreads those bytes evenly over K shards' links.

Shard k of K owns a contiguous run of pieces, the runs balanced by bytes; shard 0 (the leader) also
owns the travelling buffers and hands out the leases. A shard may own no piece (more shards than
pieces): it still takes part in every step, its optimizer holding one empty tensor for the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

CHUNK = 4 << 20  # bytes, the largest piece (shared/wire/transfer.py's transfer chunk)
MIN_CHUNK = 64 << 10  # bytes, the smallest: below it, per-piece work would cost more than balance gains
PIECES = 64  # a model is cut into about this many pieces, when CHUNK and MIN_CHUNK allow


def chunk_bytes(model_bytes: int) -> int:
    return max(MIN_CHUNK, min(CHUNK, model_bytes // PIECES // 64 * 64))


@dataclass(frozen=True)
class Piece:
    name: str  # the piece's own name: the tensor's, or tensor#i
    param: str  # the tensor it is a run of rows of
    lo: int  # first row (dim 0)
    hi: int  # one past the last row
    nbytes: int


def grid(shapes: Mapping[str, tuple[tuple[int, ...], int]], whole: bool = False) -> list[Piece]:
    """The pieces of tensors given as name -> (shape, element size), in order; `whole`: pieces of CHUNK bytes."""
    out = []
    chunk = CHUNK if whole else chunk_bytes(sum(int(torch.Size(shape).numel()) * itemsize
                                               for shape, itemsize in shapes.values()))
    for name, (shape, itemsize) in shapes.items():
        rows = shape[0] if shape else 1
        row_bytes = max(1, (int(torch.Size(shape).numel()) // rows if rows else 0) * itemsize)
        per = max(1, chunk // row_bytes)
        if rows <= per:
            out.append(Piece(name, name, 0, rows, rows * row_bytes if shape else itemsize))
            continue
        for i, lo in enumerate(range(0, rows, per)):
            hi = min(rows, lo + per)
            out.append(Piece(f"{name}#{i}", name, lo, hi, (hi - lo) * row_bytes))
    return out


def assign(pieces: list[Piece], shards: int, first: int = 0) -> list[int]:
    """Shard of each piece: contiguous runs over shards first..K-1, cut where the running byte count crosses
    each one's share of the total."""
    total, n = sum(p.nbytes for p in pieces) or 1, shards - first
    out, seen = [], 0
    for p in pieces:
        middle = seen + p.nbytes / 2  # a piece goes to the shard its middle byte falls in
        out.append(first + min(n - 1, int(middle * n // total)))
        seen += p.nbytes
    return out


def cut(pieces: list[Piece], stages: int) -> list[list[Piece]]:
    """A shard's run of pieces in `stages` runs of about equal bytes, in grid order (a piece goes to the stage its
    middle byte falls in; a stage may be empty when the shard has fewer pieces than stages)."""
    out: list[list[Piece]] = [[] for _ in range(stages)]
    for p, g in zip(pieces, assign(pieces, stages), strict=True):
        out[g].append(p)
    return out


class Partition:
    """The grid of a model's trainable tensors and which shard owns what. `stages` (cluster.pipeline_stages, K > 1):
    the leader owns no piece, shards 1..K-1 share them all, and each one's run is cut into that many stages
    (docs/design.md §4, "Pipelined steps"). `whole`: the coarse grid of a low-rank codec (`whole_pieces`)."""

    def __init__(self, params: Mapping[str, torch.Tensor], shards: int = 1, stages: int = 0,
                 whole: bool = False) -> None:
        self.shards = shards
        self.stages = stages if shards > 1 else 0
        self.whole = whole
        self.pieces = grid({n: (tuple(p.shape), p.element_size()) for n, p in params.items()}, whole)
        owners = assign(self.pieces, shards, first=1 if self.stages else 0)
        self.owner = dict(zip((p.name for p in self.pieces), owners, strict=True))
        self.split = any(p.name != p.param for p in self.pieces)  # some tensor is cut into several pieces
        self._staged: dict[int, list[list[str]]] = {}

    def owned(self, shard: int) -> list[Piece]:
        return [p for p in self.pieces if self.owner[p.name] == shard]

    def staged(self, shard: int) -> list[list[str]]:
        """Shard k's piece names stage by stage (one stage, all of them, when steps are not pipelined)."""
        if shard not in self._staged:
            self._staged[shard] = [[p.name for p in run] for run in cut(self.owned(shard), max(1, self.stages))]
        return self._staged[shard]

    def bytes_of(self, shard: int) -> int:
        return sum(p.nbytes for p in self.owned(shard))

    def views(self, tensors: Mapping[str, torch.Tensor], shard: int | None = None) -> dict[str, torch.Tensor]:
        """Piece name -> a view of its rows of `tensors` (by tensor name); only shard `shard`'s if given."""
        pieces = self.pieces if shard is None else self.owned(shard)
        return {p.name: tensors[p.param] if p.name == p.param else tensors[p.param].narrow(0, p.lo, p.hi - p.lo)
                for p in pieces}

    def partials(self, grads: Mapping[str, torch.Tensor], shard: int | None = None) -> list[float]:
        """One squared L2 norm per piece (float64), in grid order: combined in that order they give the global
        gradient norm the same way at any K (docs/design.md §3, "partial reductions")."""
        pieces = self.pieces if shard is None else self.owned(shard)
        return [float(torch.linalg.vector_norm(grads[p.name].reshape(-1), 2, dtype=torch.float64)) ** 2
                for p in pieces]

    def describe(self) -> dict[str, list[Any]]:
        """A checkpoint's map from piece to (tensor, rows): enough to put pieces back together without the model."""
        return {p.name: [p.param, p.lo, p.hi] for p in self.pieces}


def clip_coefficient(partials: list[float], max_norm: float) -> tuple[float, float]:
    """(global norm, factor to multiply every gradient by): partials summed in grid order, as
    torch.nn.utils.clip_grad_norm_ scales (max_norm / (norm + 1e-6), at most 1)."""
    total = 0.0
    for x in partials:
        total += x
    norm = total ** 0.5
    return norm, min(1.0, max_norm / (norm + 1e-6))


def join(pieces: Mapping[str, list[Any]], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from pieces (`describe()`'s map, pieces by name); tensors not cut pass through."""
    out = dict(tensors)
    by_param: dict[str, list[tuple[int, str]]] = {}
    for name, (param, lo, _hi) in pieces.items():
        if name != param:
            by_param.setdefault(param, []).append((int(lo), name))
    for param, parts in by_param.items():
        if all(name in tensors for _, name in parts):
            out[param] = torch.cat([tensors[name] for _, name in sorted(parts)])
            for _, name in parts:
                out.pop(name)
    return out
