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
