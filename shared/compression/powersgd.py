"""The `powersgd` codec: rank-r P @ Q^T of the gradient viewed as (shape[0], -1), one power iteration per step
warm-started from the previous step's Q, with error feedback (1-D tensors go dense)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.base import CodecError, Frames, Info, Reader, finite, int_param, short, to_cpu
from cmemi.shared.compression.feedback import ErrorFeedbackCodec

QSEED = 0x5EED_C0DE  # the initial Q: fixed seed, mixed with the tensor name


def outer(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    """out + alpha * p @ qt (or p @ qt when out is None). For small rank, r rank-1 updates are several
    times faster than a BLAS gemm with an inner dimension of 1..8 (and just as deterministic)."""
    r = p.shape[1]
    if r > 8:
        return p @ qt if out is None else out.addmm_(p, qt, alpha=alpha)
    if out is None:
        out = torch.mul(p[:, :1], qt[:1])
        start = 1
    else:
        start = 0
    for j in range(start, r):  # a loop over the rank, not over elements
        out.addcmul_(p[:, j:j + 1], qt[j:j + 1], value=alpha)
    return out


def decode_powersgd(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int,
                    rd: Reader) -> torch.Tensor:
    if len(shape) < 2 or numel == 0:
        raise CodecError("bad_shape", f"{short(name)}: powersgd needs a non-empty tensor of >= 2 dims")
    n = shape[0]
    m = numel // n
    r = int_param(meta, "rank", name, 1, min(n, m))
    p = rd.take(name, "p", torch.float32, (n, r))
    qt = rd.take(name, "q", torch.float32, (r, m))
    return outer(p, qt).view(shape)


class PowerSGDCodec(ErrorFeedbackCodec):
    """Rank-r P @ Q^T of grad (+ residual) viewed as (shape[0], -1); one warm-started power iteration."""

    name = tag = "powersgd"
    decoder = staticmethod(decode_powersgd)
    _state = ("err", "q")

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        if g.dim() < 2:
            return False
        n = g.shape[0]
        m = g.numel() // n
        r = min(self.cfg.powersgd_rank, n, m)
        if r * (n + m) >= n * m:  # P and Q would be as big as the dense matrix
            return False
        ef = self.cfg.error_feedback
        mat = self._residual(name, g, (n, m)) if ef else g.reshape(n, m).float()
        if not finite(mat):
            self._drop(name)
            return False
        qt = self._bufs["q"].get(name)  # Q^T, (r, m): row-major Q^T makes both products fast
        if qt is None or tuple(qt.shape) != (r, m) or qt.device != g.device or not bool(qt.any()):
            gen = torch.Generator().manual_seed(QSEED ^ zlib.crc32(name.encode()))
            qt = torch.randn(r, m, generator=gen).to(g.device)
        p = torch.linalg.qr(mat @ qt.T).Q  # (n, r), orthonormal columns
        qt = p.T @ mat                      # (M^T P)^T
        if ef:
            outer(p, qt, out=mat, alpha=-1.0)
            self._bufs["err"][name] = mat
        self._bufs["q"][name] = qt
        info[name] = self._meta(self.tag, g, rank=r)
        frames[f"{name}#p"] = to_cpu(p)
        frames[f"{name}#q"] = to_cpu(qt)
        return True
