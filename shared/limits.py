"""Message size limits: the cap on one ZeroMQ message, and the bound on one logical message.

`cluster.max_message_bytes` caps every ZeroMQ message (and, as MAXMSGSIZE, every frame: a bigger
frame disconnects the peer). A logical message bigger than the cap travels in parts under it
(shared/transfer.py), so the cap bounds memory per message, not model size. Its default
(`null`) is the model's logical bound, capped at DEFAULT_CAP: small models send everything in one
message as before, big ones in parts of at most 64 MiB.

The logical bound (`logical_bytes`) is what a receiver accepts for one reassembled message. The
largest honest one is the aggregator's snapshot to the checkpointer: parameters, optimizer state
(Adam keeps two more copies) and buffers; gradients, even with the index tensors of sparse codecs,
and parameters are smaller. So: 4 x (parameter + buffer bytes) + 16 MiB for headers and small
tensors, and never less than the cap. The model is built on PyTorch's `meta` device: sizes only, no
memory, no RNG touched.
"""

from __future__ import annotations

import torch
from cmemi.shared.config import Config
from cmemi.shared.plugins import build_model

MARGIN = 16 << 20
DEFAULT_CAP = 64 << 20  # cluster.max_message_bytes: null never means more than this
FALLBACK = 1 << 31  # logical bound when the model cannot be built on the meta device


def model_bytes(cfg: Config) -> int:
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(cfg)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _derived(cfg: Config) -> int:
    try:
        return 4 * model_bytes(cfg) + MARGIN
    except Exception:  # a factory that needs real memory or a device: the service reports real errors itself
        return FALLBACK


def derive_max_message_bytes(cfg: Config) -> int:
    """Fill in cluster.max_message_bytes when it is null; returns the effective value."""
    if cfg.cluster.max_message_bytes is None:
        cfg.cluster.max_message_bytes = min(_derived(cfg), DEFAULT_CAP)
    return cfg.cluster.max_message_bytes


def logical_bytes(cfg: Config) -> int:
    """The most bytes of tensors a receiver accepts in one logical message (reassembled from parts)."""
    return max(_derived(cfg), derive_max_message_bytes(cfg))
