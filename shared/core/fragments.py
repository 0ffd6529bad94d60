"""Streaming DiLoCo's fragments (`train.fragments`, docs/design.md §10): which pieces of the chunk grid each fragment
holds, which fragment a step of the servers syncs, and how a replica merges a fragment's outer result.

Fragments are contiguous runs of the grid's pieces (shared/core/grid.py) with about equal bytes: the grid is the same at
any cluster.shards, so are the fragments, and every shard steps its own pieces of the step's fragment. Step s of the
servers syncs fragment s mod F; replica r merges it at the start of its segment s + 2 (one segment of overlap: the
segment in between is computed while the step is collected).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.core.grid import Piece
from cmemi.shared.wire import protocol

PIECES = "pieces"  # a work or slice message's `downlink`: the pieces changed since version `base`, as they are now


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
    one merges only fragments the lease's version still holds as they were merged; every segment (`buffers`) for a
    model with travelling buffers (BatchNorm statistics), whose segments start from the step's buffers, which a replay at
    a later version no longer has, and with a per-replica residual (sparse2), whose every update needs that segment's
    change against the global fragment of its own version, which a replay at a later version no longer has either."""
    return 1 if buffers else max(1, fragments - 1)


def ships_state(segment: int, period: int, replica: int = 0) -> bool:
    """Does replica `replica`'s state after segment `segment` go up beside its change? After the first, always (a
    replay from the fresh state would need the parameters of version 0); then every `period` segments, staggered by
    replica, so that the servers' links take about R / period states a step instead of all R in one."""
    return segment == 0 or (segment + 1 + replica) % period == 0


def changed(base: Any, version: int, fragments: Sequence[Sequence[str]]) -> set[str] | None:
    """The pieces the steps from version `base` to `version` changed (step s syncs fragment s mod F alone), or None
    where that is not known to be fewer than all: no fragments, or `base` not one of the F − 1 versions before."""
    F = len(fragments)
    if F < 2 or type(base) is not int or not max(-1, version - F) < base < version:
        return None
    return {n for s in range(base, version) for n in fragments[synced(s, F)]}


def encoded(pieces: Mapping[str, torch.Tensor], checksum: bool) -> Any:
    """A `PIECES` message's tensors, encoded from copies: the next step changes the live pieces in place while the
    frames may still be queued for a slow link."""
    return protocol.encode_tensors({n: t.detach().clone() for n, t in pieces.items()}, checksum)


def land(received: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], required: Iterable[str]) -> bool:
    """A `PIECES` message into `targets` (a worker's pieces of a server's slice, and the step's buffers): True once
    copied; False, and nothing copied, unless every tensor is one of the targets' with its dtype and shape, finite,
    and the `required` ones are there (the step's buffers)."""
    if not set(required) <= received.keys() or not received.keys() <= targets.keys():
        return False
    for n, t in received.items():
        want = targets[n]
        if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape) or \
                (t.is_floating_point() and not bool(torch.isfinite(t).all())):
            return False
    with torch.no_grad():
        for n, t in received.items():
            if t.data_ptr() != targets[n].data_ptr():  # (what landed in place is there)
                targets[n].copy_(t)
    return True
