"""Wire-size accounting of an encoded gradient: what the compression ratio reports and the benchmarks compare."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import torch


def wire_bytes(frames: Mapping[str, torch.Tensor], info: Mapping[str, Any] | None = None) -> int:
    """Payload bytes of `frames` (plus the msgpack size of `info` when given)."""
    n = sum(t.numel() * t.element_size() for t in frames.values())
    return n + (len(msgpack.packb(info)) if info is not None else 0)


def dense_bytes(grads: Mapping[str, torch.Tensor]) -> int:
    """Bytes of `grads` sent as dense fp32."""
    return sum(t.numel() * 4 for t in grads.values())


def ratio(grads: Mapping[str, torch.Tensor], frames: Mapping[str, torch.Tensor],
          info: Mapping[str, Any] | None = None) -> float:
    """Compression ratio: dense fp32 bytes over wire bytes (inf for an empty payload)."""
    sent = wire_bytes(frames, info)
    return dense_bytes(grads) / sent if sent else math.inf
