"""A gradient (or a shard's slice of one) as every parameter server takes it: decoded by the run's codec with the
tensors checked against the model's before anything is allocated, and its losses numbers. One rule for the
leader and every shard; what is wrong is the drop reason."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.compression.base import CodecError, GradientCodec
from cmemi.shared.wire import protocol


def decode(codec: GradientCodec, trainer: Trainer, h: dict[str, Any], tensors: dict[str, torch.Tensor],
           names: list[str] | None = None) -> tuple[dict[str, torch.Tensor] | None, str | None, float]:
    """(gradients or None for an fp16 overflow, the drop reason or None, decode seconds). `names`: the pieces a
    shard's stage holds (None: the whole model)."""
    grads = None
    t0 = time.perf_counter()
    if h["finite"] or not trainer.scaler.enabled:
        shapes = trainer.shapes if names is None else {n: trainer.shapes[n] for n in names}
        try:
            grads = codec.decode(h["codec"], tensors, shapes=shapes)
        except CodecError as exc:
            return None, f"codec_{exc.reason}", 0.0
    seconds = time.perf_counter() - t0
    if grads is not None and (bad := trainer.check_grads(grads, names)) is not None:
        return None, bad, seconds
    if not all(isinstance(x, (int, float)) for x in h["losses"]):
        return None, "bad_losses", seconds
    return grads, None, seconds


class Spares:
    """Gradient buffers kept from step to step: a server receives (or copies out of a worker's shared-memory slot)
    each step's gradients into the buffers of the step before, instead of fresh allocations, whose pages the kernel
    must fault in again on every step (113 M parameters: ~0.4 s per gradient on this machine; a freed tensor that big
    goes straight back to the kernel). What `take` hands out is lent until nothing needs it any more: `give_back`
    (after each gradient message) frees again, for the step's next gradient, what no partial sum holds and no transfer
    is still arriving in (a gradient dropped as a duplicate or stale, the right operand of an add), so a reissued
    lease's duplicate does not make the step's last gradient land in a third buffer; `reclaim` (the step's optimizer
    step done, or its collection abandoned) frees all of it but `busy`, and keeps as many spares as the step used. At
    most `limit` bytes are lent at once (the server's two gradients' worth): past it (a duplicate arriving beside the
    others, a third worker, a hostile flood) a buffer is a plain allocation, freed as soon as its message is done
    with, as before."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: dict[tuple[str, torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self.lent: list[tuple[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor]] = []
        self.lent_bytes = 0
        self.used: set[int] = set()  # ids of the kept buffers lent in this step (those given back stay kept)

    def take(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        key = (name, dtype, tuple(shape))
        kept = self.free.get(key)
        if not kept and self.lent_bytes >= self.limit:
            return torch.empty(shape, dtype=dtype)  # not kept: freed with its message
        t = kept.pop() if kept else torch.empty(shape, dtype=dtype)
        self.lent.append((key, t))
        self.lent_bytes += t.numel() * t.element_size()
        self.used.add(id(t))
        return t

    def own(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of borrowed gradients, in spares (one foreach copy: the leader makes it every step, issue 45)."""
        out = {n: self.take(n, g.dtype, tuple(g.shape)) for n, g in grads.items()}
        if out:  # (a foreach call refuses an empty list: an overflowed microbatch's gradient is {})
            with torch.no_grad():
                torch._foreach_copy_(list(out.values()), list(grads.values()))
        return out

    def lend(self, metas: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Spares for the tensors of a gradient about to arrive (`metas`: its validated tensor entries)."""
        out: dict[str, torch.Tensor] = {}
        for m in metas:
            dtype, shape, _ = protocol.tensor_spec(m)
            out[m["name"]] = self.take(m["name"], dtype, tuple(shape))
        return out

    def give_back(self, needed: Iterable[torch.Tensor]) -> None:
        """Mid-step, after a gradient message was handled: what was lent and shares no storage with `needed` (the
        step's partial sums, the transfers still arriving) is free again for the step's next gradient."""
        if not self.lent:
            return
        needed = list(needed)
        same = {id(t) for t in needed}  # a partial sum is normally the lent tensor itself: no storage to look up
        held: set[int] | None = None  # (issue 45: 12 storage look-ups a step, for a gradient of 6 tensors)
        lent = []
        for key, t in self.lent:
            if id(t) in same:
                lent.append((key, t))
                continue
            if held is None:
                held = {_storage(x) for x in needed}
            if _storage(t) in held:
                lent.append((key, t))
            else:
                self.free.setdefault(key, []).append(t)
                self.lent_bytes -= t.numel() * t.element_size()
        self.lent = lent

    def reclaim(self, busy: Iterable[torch.Tensor] = ()) -> None:
        """The step is over: what was lent is free again, but `busy`; spares the step did not use go."""
        held = {_storage(t) for t in busy}
        free: dict[tuple[str, torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        for key, kept in self.free.items():  # given back in this step: used, kept
            for t in kept:
                if id(t) in self.used:
                    free.setdefault(key, []).append(t)
        lent = []
        for key, t in self.lent:
            (lent.append((key, t)) if held and _storage(t) in held else free.setdefault(key, []).append(t))
        self.free, self.lent = free, lent
        self.lent_bytes = sum(t.numel() * t.element_size() for _, t in lent)
        self.used = {id(t) for _, t in lent}

    def clear(self) -> None:
        """No gradient comes any more: the spares go (what is lent goes with its last user)."""
        self.free, self.lent, self.lent_bytes, self.used = {}, [], 0, set()


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's bytes live: a view of a buffer (a decoded gradient) is the buffer."""
    return t.untyped_storage().data_ptr()
