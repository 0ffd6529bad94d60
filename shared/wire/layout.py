"""Flat buffers (docs/design.md §3): named tensors laid out in one contiguous buffer per dtype.

The order is the order of the mapping (the model's `named_parameters()`, then its travelling buffers), and
every tensor starts at a multiple of 64 bytes. Both ends of a message build the layout from their own
model, so a message carries one frame per dtype (`flat.float32`, ...) plus the layout's digest, and the
receiver checks the digest before it reads a byte: a small model is one frame each way, and nothing on
the hot path loops over tensors in Python to send or receive them.

A model whose tensors add up to more than `FLAT_MAX_BYTES` keeps one frame per tensor: its per-tensor
overhead is nothing beside its bytes, and packing would cost a copy of every byte each way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from cmemi.shared.errors import WireError

ALIGN = 64  # bytes
FLAT_MAX_BYTES = 16 << 20
PREFIX = "flat."  # frame names: flat.float32, flat.int64, ...


class LayoutError(WireError, ValueError):
    """Frames that do not match this side's layout."""


class Layout:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []  # name, dtype, shape, element offset
        self.sizes: dict[torch.dtype, int] = {}  # elements per dtype buffer (padding included)
        for name, t in tensors.items():
            at = self.sizes.get(t.dtype, 0)
            step = max(1, ALIGN // t.element_size())
            self.entries.append((name, t.dtype, tuple(t.shape), at))
            self.sizes[t.dtype] = (at + t.numel() + step - 1) // step * step
        self._slices = [(name, self.frame_name(dtype), at, at + math.prod(shape), shape)
                        for name, dtype, shape, at in self.entries]
        # the padding of each buffer (element ranges no tensor covers), zeroed by `pack`
        ends: dict[str, int] = {}
        self._gaps: list[tuple[str, int, int]] = []
        for _name, frame, lo, hi, _shape in self._slices:
            if lo > ends.get(frame, 0):
                self._gaps.append((frame, ends.get(frame, 0), lo))
            ends[frame] = hi
        self._gaps += [(self.frame_name(d), ends.get(self.frame_name(d), 0), n) for d, n in self.sizes.items()
                       if ends.get(self.frame_name(d), 0) < n]
        self.nbytes = sum(n * torch.empty((), dtype=d).element_size() for d, n in self.sizes.items())
        self.flat = self.nbytes <= FLAT_MAX_BYTES
        h = hashlib.blake2b(digest_size=8)
        for name, dtype, shape, at in self.entries:
            h.update(f"{name}|{dtype}|{shape}|{at};".encode())
        self.digest = h.hexdigest()

    @staticmethod
    def frame_name(dtype: torch.dtype) -> str:
        return PREFIX + str(dtype).removeprefix("torch.")

    def empty(self, pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """Zeroed flat buffers, one per dtype, named as their frames."""
        return {self.frame_name(d): torch.zeros(n, dtype=d, pin_memory=pin_memory) for d, n in self.sizes.items()}

    def views(self, flats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor as a view into the flat buffers (raises LayoutError when they do not fit the layout)."""
        for d, n in self.sizes.items():
            f = flats.get(self.frame_name(d))
            if f is None or f.dtype != d or f.dim() != 1 or f.numel() != n:
                raise LayoutError(f"frame {self.frame_name(d)} missing or not {n} elements of {d}")
        if len(flats) != len(self.sizes):
            raise LayoutError(f"{len(flats)} flat frames, the layout has {len(self.sizes)}")
        return {name: flats[frame][lo:hi].view(shape) for name, frame, lo, hi, shape in self._slices}

    def pack(self, tensors: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
        """Copy `tensors` (the layout's names) into flat buffers (`out`, reused, or new ones: written once, the
        tensors' bytes copied and only the padding between them zeroed)."""
        if out is None:
            out = {self.frame_name(d): torch.empty(n, dtype=d) for d, n in self.sizes.items()}
            for frame, lo, hi in self._gaps:
                out[frame][lo:hi].zero_()
        views = self.views(out)
        with torch.no_grad():  # one foreach copy, not a dispatch per tensor (a worker packs every gradient: issue 45)
            if views:  # (a foreach call refuses an empty list)
                torch._foreach_copy_(list(views.values()), [tensors[name] for name in views])
        return out
