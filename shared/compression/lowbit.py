"""The `int4` and `int2` codecs: per-chunk absmax scales (fp32, one per `lowbit_chunk` elements), values rounded to
nearest on 2·L + 1 levels (int4: L = 7, int2: L = 1, zero included) and packed 8 / bits to a byte.

Meant for local steps' outer changes Δ (Streaming DiLoCo sends them in 4 bits at no loss of quality): the encoding is a
pure function of its input (elementwise products, a round half to even, the chunk's exact absmax, no randomness), so
any worker encoding the same Δ sends the same bits and `cmemi reference` decodes what the cluster does. Small chunks
(128 by default, not int8's 1024) because one outlier sets a chunk's scale: at 4 bits it flattens the chunk's other
values to a 7th of it, at 2 bits to zero. Bytes per element: bits / 8 + 4 / chunk (int4 at 128: 0.53, int2: 0.28).
`pack` and `unpack` are shared with sparse2.py's 2-bit values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from cmemi.shared.compression.base import (
    MAX_NUMEL,
    Codec,
    CodecError,
    Frames,
    Info,
    Reader,
    finite,
    int_param,
    short,
    to_cpu,
)

LEVELS = {"int4": 7, "int2": 1}  # L: codes 0 .. 2L stand for -L .. L
BITS = {"int4": 4, "int2": 2}


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each < 2**bits) packed 8 / bits to a byte, element j of a byte in bits j·bits.. (little end
    first); the last byte padded with zeros."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8)
    padded[:n] = codes.reshape(-1)
    lanes = padded.view(-1, per)
    out = lanes[:, 0].clone()
    for j in range(1, per):
        out |= lanes[:, j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """`pack`'s codes back: the first n, as uint8."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & mask).view(-1)[:n]


def chunk_scales(flat: torch.Tensor, c: int) -> tuple[torch.Tensor, int, int]:
    """Each chunk's absmax of the 1-D `flat` (the last chunk may be short): (amax, full chunks, remainder)."""
    nf, rem = divmod(flat.numel(), c)
    parts = []
    if nf:
        parts.append(flat[: nf * c].view(nf, c).abs().amax(1))
    if rem:
        parts.append(flat[nf * c:].abs().amax().view(1))
    return torch.cat(parts), nf, rem


def per_element(s: torch.Tensor, c: int, n: int) -> torch.Tensor:
    """A chunk's value repeated for each of its elements (n of them, chunks of c; never more than n built, whatever a
    hostile c says)."""
    return s[torch.arange(n) // c]


def decode_lowbit(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
    tag = meta.get("codec")
    bits, L = BITS[str(tag)], LEVELS[str(tag)]
    c = int_param(meta, "chunk", name, 1, MAX_NUMEL)
    nf, rem = divmod(numel, c)
    q = rd.take(name, "q", torch.uint8, (-(-numel * bits // 8),))
    s = rd.take(name, "s", torch.float32, (nf + (rem > 0),))
    codes = unpack(q, bits, numel)
    if bool((codes > 2 * L).any()):
        raise CodecError("bad_code", f"{short(name)}: a code above {2 * L}")
    return codes.float().sub_(L).mul_(per_element(s, c, numel)).view(shape)


class LowBitCodec(Codec):
    """Per-chunk absmax at `bits` bits: q = round(x · L / absmax) in [-L, L], scale = absmax / L, decode q · scale."""

    per_microbatch = True
    decoder = staticmethod(decode_lowbit)
    bits: ClassVar[int]
    levels: ClassVar[int]

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        if not finite(g):
            return False
        flat = g.reshape(-1).to("cpu", torch.float32)
        c, L = self.cfg.lowbit_chunk, self.levels
        amax, _, _ = chunk_scales(flat, c)
        inv = torch.where(amax > 0, L / amax, 0.0)
        q = (flat * per_element(inv, c, flat.numel())).round_().clamp_(-L, L)
        info[name] = self._meta(self.tag, g, chunk=c)
        frames[f"{name}#q"] = pack(q.add_(L).to(torch.uint8), self.bits)
        frames[f"{name}#s"] = to_cpu(amax / L)
        return True


class Int4Codec(LowBitCodec):
    name = tag = "int4"
    bits, levels = BITS["int4"], LEVELS["int4"]


class Int2Codec(LowBitCodec):
    name = tag = "int2"
    bits, levels = BITS["int2"], LEVELS["int2"]
