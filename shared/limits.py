"""The default message cap (`cluster.max_message_bytes: null`), derived from the model's size.

The largest honest message is the aggregator's snapshot to the checkpointer: parameters, optimizer
state (Adam keeps two more copies) and buffers; gradients, even with the index tensors of sparse
codecs, and parameters are smaller. So: 4 x (parameter + buffer bytes) + 16 MiB for headers and
small tensors. The model is built on PyTorch's `meta` device: sizes only, no memory, no RNG touched.
ZeroMQ applies the same number to every frame (MAXMSGSIZE: a bigger frame disconnects the peer) and
the services to every whole message.
"""

from __future__ import annotations

import torch
from cmemi.shared.config import Config
from cmemi.shared.plugins import build_model

MARGIN = 16 << 20
FALLBACK = 1 << 31  # the model cannot be built on the meta device: the old fixed cap


def model_bytes(cfg: Config) -> int:
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(cfg)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def derive_max_message_bytes(cfg: Config) -> int:
    """Fill in cluster.max_message_bytes when it is null; returns the effective value."""
    if cfg.cluster.max_message_bytes is None:
        try:
            cfg.cluster.max_message_bytes = 4 * model_bytes(cfg) + MARGIN
        except Exception:  # a factory that needs real memory or a device: the service reports real errors itself
            cfg.cluster.max_message_bytes = FALLBACK
    return cfg.cluster.max_message_bytes
