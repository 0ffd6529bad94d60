"""Error feedback, the state topk, powersgd and sign keep per worker: what was not sent this step is added to the
next step's gradient of the same tensor. Such codecs are not `deterministic`: what a worker sends for a microbatch
depends on that worker's history, not only on the microbatch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.base import Codec, CodecError, short, to_cpu
from cmemi.shared.config.system import CompressionConfig


class ErrorFeedbackCodec(Codec):
    """A codec with per-tensor error feedback residuals (and whatever else `_state` names)."""

    deterministic = False
    stateful = True
    _state: tuple[str, ...] = ("err",)

    def __init__(self, cfg: CompressionConfig | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self._bufs: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self._state}

    def _residual(self, name: str, g: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """M = grad + residual, built in the residual buffer itself (which becomes the new residual)."""
        err = self._bufs["err"].get(name)
        gv = g.reshape(shape)
        if err is None or tuple(err.shape) != shape or err.device != g.device:
            return gv.to(torch.float32, copy=True)
        return err.add_(gv)

    def _dense(self, name: str, g: torch.Tensor) -> torch.Tensor:
        err = self._bufs["err"].pop(name, None)  # a tensor sent dense flushes its residual
        if err is None or err.numel() != g.numel() or err.device != g.device:
            return super()._dense(name, g)
        return to_cpu(err.view(g.shape).add_(g))

    def _drop(self, name: str) -> None:
        for bufs in self._bufs.values():
            bufs.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Worker state, `f"{kind}/{name}"` -> tensor (references, not copies)."""
        return {f"{kind}/{name}": t for kind, bufs in self._bufs.items() for name, t in bufs.items()}

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        bufs: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self._state}
        for key, t in sd.items():
            kind, _, name = str(key).partition("/")
            if kind not in bufs or not name or not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise CodecError("bad_state", f"codec {self.name!r}: unexpected state entry {short(key)}")
            bufs[kind][name] = t.detach().clone()
        self._bufs = bufs

    def reset(self) -> None:
        """Drop all worker state (residuals, and PowerSGD's warm-start Q)."""
        self._bufs = {k: {} for k in self._state}
