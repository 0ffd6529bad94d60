"""What leaves a server's state: the parameters as they go out to workers (with compression.downlink, their mirror;
streaming, only the pieces changed), and the result's hashes. A mixin of `Trainer`: the same object, its own job."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.downlink import Mirror
from cmemi.shared.core import buffers as buffer_rule
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core.grid import Partition


class Outward:
    """Needs the trainer's `params`, `pieces`, `buffers`, `partition`, `shard`, `mirror`, `fragments` and `step`."""

    params: dict[str, torch.Tensor]
    pieces: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    partition: Partition
    shard: int
    mirror: Mirror | None
    fragments: list[list[str]]
    step: int

    def params_sha256(self, others: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> str:
        """SHA-256 of the parameters' bytes (sorted by name), then the travelling buffers' (sorted by name):
        trained statistics are part of the result. A model without buffers hashes its parameters only.
        Sharded (the leader at the end), the other shards' final pieces are `others` (as `materialize` takes them):
        each tensor's rows are hashed piece by piece, in row order, from whichever shard holds them, which gives
        the bytes of the whole tensor without building it."""
        h = hashlib.sha256()
        rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
        if others is not None:
            for p in self.partition.pieces:
                k = self.partition.owner[p.name]
                rows.setdefault(p.param, []).append((p.lo, self.pieces[p.name] if k == self.shard else others[k][p.name]))
        for group in (self.params, self.buffers):
            for n in sorted(group):
                for _, t in sorted(rows.get(n, [(0, group[n])]), key=lambda r: r[0]):
                    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
        return h.hexdigest()

    def wire_state(self) -> dict[str, torch.Tensor]:
        """What goes out with a new parameter version: this shard's pieces — with compression.downlink, their mirror,
        which is what workers compute on — and (shard 0) the step's buffers."""
        pieces = self.pieces if self.mirror is None else self.mirror.tensors
        if not self.buffers:
            return pieces
        return {**pieces, **self.wire_buffers()}

    def changed_since(self, base: Any, version: int) -> dict[str, torch.Tensor] | None:
        """Streaming: what moves a worker's copy of this shard's slice from version `base` to `version`, the current
        one: the pieces the steps since changed (each syncs its fragment) and the step's buffers (live tensors); None
        where that is not known to be less than the whole slice (fragments.changed)."""
        names = fragmenting.changed(base, version, self.fragments) if version == self.step else None
        if names is None:
            return None
        return {**{n: p for n, p in self.pieces.items() if n in names}, **self.wire_buffers()}

    def wire_buffers(self) -> dict[str, torch.Tensor]:
        """The step's buffers as they travel (shard 0; empty elsewhere)."""
        return {buffer_rule.PREFIX + n: b for n, b in self.buffers.items()}

    def mirror_hashes(self) -> dict[str, str]:
        """compression.downlink: SHA-256 of each of this shard's mirror pieces (empty without a mirror)."""
        if self.mirror is None:
            return {}
        return {n: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).hexdigest()
                for n, t in self.mirror.tensors.items()}

    def mirror_sha256(self, others: Mapping[str, str] | None = None) -> str | None:
        """SHA-256 of the workers' mirror (compression.downlink): over every piece's SHA-256 in grid order, the same
        at any cluster.shards; `others`: the other shards' `mirror_hashes`. None without a mirror."""
        if self.mirror is None:
            return None
        hashes = {**(others or {}), **self.mirror_hashes()}
        return hashlib.sha256("".join(hashes[p.name] for p in self.partition.pieces).encode()).hexdigest()
