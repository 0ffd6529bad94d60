"""The `sign` codec: scaled sign, 1 bit per element (EF-signSGD, Karimireddy et al. 2019; 1-bit Adam): per chunk of
`int8_chunk` elements the signs (packed 8 to a byte) and one fp32 scale, the chunk's mean magnitude (the scale with
the least squared error); with error feedback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.base import MAX_NUMEL, Frames, Info, Reader, finite, int_param, to_cpu
from cmemi.shared.compression.feedback import ErrorFeedbackCodec
from cmemi.shared.config.system import CompressionConfig

BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit j of a byte is element 8i + j


def decode_sign(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
    c = int_param(meta, "chunk", name, 1, MAX_NUMEL)
    nf, rem = divmod(numel, c)
    b = rd.take(name, "b", torch.uint8, ((numel + 7) // 8,))
    s = rd.take(name, "s", torch.float32, (nf + (rem > 0),))
    out = (b[:, None] & BIT).ne_(0).view(-1)[:numel].float().mul_(2.0).sub_(1.0)  # the bits as +-1
    if nf:
        out[: nf * c].view(nf, c).mul_(s[:nf, None])
    if rem:
        out[nf * c:].mul_(s[nf])
    return out.view(shape)


class SignCodec(ErrorFeedbackCodec):
    """The sign of grad (+ residual), 1 bit per element, times one fp32 scale per chunk: the chunk's mean magnitude.
    A chunk of zeros decodes to zeros (its scale is 0), so a frozen tensor sends nothing that moves it."""

    name = tag = "sign"
    decoder = staticmethod(decode_sign)

    def __init__(self, cfg: CompressionConfig | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.deterministic = not self.cfg.error_feedback

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        n, c, ef = g.numel(), self.cfg.int8_chunk, self.cfg.error_feedback
        m = self._residual(name, g, (n,)) if ef else g.reshape(-1).float()
        if not finite(m):
            self._drop(name)
            return False
        nf, rem = divmod(n, c)
        s = torch.empty(nf + (rem > 0), dtype=torch.float32, device=m.device)
        if nf:
            torch.mean(m[: nf * c].view(nf, c).abs(), 1, out=s[:nf])
        if rem:
            s[nf:] = m[nf * c:].abs().mean()
        pos = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=m.device)
        torch.ge(m, 0, out=pos[:n].view(torch.bool))
        b = (pos.view(-1, 8) * BIT.to(m.device)).sum(1, dtype=torch.uint8)  # 8 signs to a byte, disjoint bits
        info[name] = self._meta(self.tag, g, chunk=c)
        if ef:  # the residual: what the scaled signs did not carry (decoded where m is)
            m.sub_(decode_sign(name, info[name], (n,), n, Reader({f"{name}#b": b, f"{name}#s": s})))
            self._bufs["err"][name] = m
        frames[f"{name}#b"] = to_cpu(b)
        frames[f"{name}#s"] = to_cpu(s)
        return True
