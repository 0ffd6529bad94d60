"""Streaming DiLoCo's fragments (`train.fragments`, docs/design.md §10): which pieces of the chunk grid each fragment
holds, which fragment a step of the servers syncs, and how a replica merges a fragment's outer result.

Fragments are contiguous runs of the grid's pieces (shared/shards.py) with about equal bytes: the grid is the same at
any cluster.shards, so are the fragments, and every shard steps its own pieces of the step's fragment. Step s of the
servers syncs fragment s mod F; replica r merges it at the start of its segment s + 2 (one segment of overlap: the
segment in between is computed while the step is collected).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from cmemi.shared.config import ConfigError
from cmemi.shared.shards import Piece


def split(pieces: Sequence[Piece], fragments: int) -> list[list[str]]:
    """The piece names of each of `fragments` contiguous runs of `pieces` (grid order) with about equal bytes: fragment
    k ends at the first piece whose running total reaches (k + 1) / F of all bytes, and none is empty."""
    if not 1 <= fragments <= len(pieces):
        raise ConfigError(f"config field 'train.fragments' = {fragments}: needs at least as many pieces of the chunk grid "
                          f"(this model has {len(pieces)}); use at most {len(pieces)} fragments")
    total = sum(p.nbytes for p in pieces)
    out: list[list[str]] = [[] for _ in range(fragments)]
    done, k = 0, 0
    for i, p in enumerate(pieces):
        left = len(pieces) - i  # pieces still to place, one at least for each fragment after k
        if out[k] and (done >= (k + 1) * total / fragments or left <= fragments - 1 - k):
            k += 1
        out[k].append(p.name)
        done += p.nbytes
    return out


def synced(step: int, fragments: int) -> int:
    """The fragment that step `step` of the servers syncs."""
    return step % fragments


def merged(segment: int, fragments: int) -> int | None:
    """The fragment whose outer result replica segment `segment` merges at its start (synced by step segment − 2),
    or None in the first two segments."""
    return None if segment < 2 else (segment - 2) % fragments


def merge(local: Mapping[str, torch.Tensor], outer: Mapping[str, torch.Tensor], names: Sequence[str],
          alpha: float) -> None:
    """local ← α·local + (1 − α)·outer on the pieces `names`, in place (α = 0: take the outer result)."""
    with torch.no_grad():
        for n in names:
            if alpha == 0:
                local[n].copy_(outer[n])
            else:
                local[n].mul_(alpha).add_(outer[n], alpha=1 - alpha)


def snapshot_period(fragments: int, buffers: bool) -> int:
    """Every how many segments a replica's state goes up (docs/design.md §10): F − 1, so that a replay from the last
    one merges only fragments the lease's version still holds as they were merged; every segment for a model with
    travelling buffers (BatchNorm statistics), whose segments start from the step's buffers, which a replay at a later
    version no longer has."""
    return 1 if buffers else max(1, fragments - 1)


def ships_state(segment: int, period: int) -> bool:
    """Does the replica's state after segment `segment` go up beside its change? After the first, always: a replay
    from the fresh state would need the parameters of version 0."""
    return segment == 0 or (segment + 1) % period == 0
