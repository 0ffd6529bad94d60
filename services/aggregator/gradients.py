"""A gradient (or a shard's slice of one) as every parameter server takes it: decoded by the run's codec with the
tensors checked against the model's before anything is allocated, and its losses numbers. One rule for the
leader and every shard; what is wrong is the drop reason."""

from __future__ import annotations

import time
from typing import Any

import torch
from cmemi.services.aggregator.trainer import Trainer
from cmemi.shared.codecs import CodecError, GradientCodec


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
    """Owned copies of borrowed gradients (views of a worker's shared-memory slot, which it writes again later),
    in buffers kept from step to step: a fresh allocation's pages would be faulted in on every step (a copy into a
    new 21 MB tensor costs twice one into a kept one). What `own` hands out is a step's accumulator until that
    step's optimizer step is done, so `reclaim` comes only after it (Leasing.new_step); at most `KEEP` spares of
    each tensor shape wait."""

    KEEP = 2

    def __init__(self) -> None:
        self.free: dict[tuple[str, torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self.lent: list[tuple[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor]] = []

    def own(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for n, g in grads.items():
                key = (n, g.dtype, tuple(g.shape))
                kept = self.free.get(key)
                t = kept.pop() if kept else torch.empty(g.shape, dtype=g.dtype)
                out[n] = t.copy_(g)
                self.lent.append((key, t))
        return out

    def reclaim(self) -> None:
        """Everything `own` handed out is free again (the step it was summed for is over, or abandoned)."""
        for key, t in self.lent:
            kept = self.free.setdefault(key, [])
            if len(kept) < self.KEEP:
                kept.append(t)
        self.lent.clear()
