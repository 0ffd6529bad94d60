"""The `sparse2` codec (SparseLoCo's recipe for outer changes): per chunk of `sparse_chunk` elements the
k = ceil(topk_ratio · chunk) largest magnitudes, their values at 2 bits (codes 0..3 for ±s/3, ±s, s the chunk's
absmax: the kept values are the chunk's largest, so no level is spent on zero) and their positions in the chunk
(int16), with one fp32 scale per chunk. Bytes per element at 1 %: about 0.01 · (2 + 1/4) + 4 / chunk.

The encoding is a pure function of its input: the selection is a stable sort of the magnitudes (ties to the lowest
position, whatever torch.topk's internal order), then elementwise rounding. So any worker encoding the same input sends
the same bits. The codec itself keeps no state: error feedback (what was not sent, added to the next change) is kept
per replica, in the replica's inner state, by `feedback_step` (services/worker/compute/local.py calls it), so a replica
that moves to another worker, or is recomputed from its snapshot after a death, carries its residual and `cmemi
reference` gives the same bits at any worker count. A per-worker residual could not: which replica's change a worker
encodes next depends on the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.base import (
    Codec,
    CodecError,
    Frames,
    GradientCodec,
    Info,
    Reader,
    finite,
    int_param,
    short,
    to_cpu,
)
from cmemi.shared.compression.lowbit import pack, unpack

MAX_CHUNK = 1 << 15  # positions in a chunk are int16
BITS = 2


def kept(c: int, ratio: float) -> int:
    """k for a chunk of c elements."""
    return min(c, max(1, math.ceil(ratio * c)))


def select(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the k largest magnitudes in each row of x (rows, c): ties to the lowest position."""
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def decode_sparse2(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
    c = int_param(meta, "chunk", name, 1, MAX_CHUNK)
    k = int_param(meta, "k", name, 1, c)
    nf, rem = divmod(numel, c)
    kr = int_param(meta, "kr", name, 1 if rem else 0, rem)
    total = nf * k + kr
    pos = rd.take(name, "i", torch.int16, (total,))
    q = rd.take(name, "q", torch.uint8, (-(-total * BITS // 8),))
    s = rd.take(name, "s", torch.float32, (nf + (rem > 0),))
    lengths = torch.tensor([c] * nf + ([rem] if rem else []), dtype=torch.int64)
    per = torch.tensor([k] * nf + ([kr] if rem else []), dtype=torch.int64)
    chunk_of = torch.arange(nf + (rem > 0)).repeat_interleave(per)
    p = pos.long()
    if bool(((p < 0) | (p >= lengths[chunk_of])).any()):
        raise CodecError("bad_index", f"{short(name)}: a position outside its chunk")
    if total > 1 and bool(((p[1:] <= p[:-1]) & (chunk_of[1:] == chunk_of[:-1])).any()):
        raise CodecError("bad_index", f"{short(name)}: positions not strictly increasing in a chunk")
    values = unpack(q, BITS, total).float().mul_(2.0).sub_(3.0).mul_(s[chunk_of] / 3.0)
    out = torch.zeros(numel, dtype=torch.float32)
    out.index_put_((chunk_of * c + p,), values)
    return out.view(shape)


class Sparse2Codec(Codec):
    """Top-k per chunk with 2-bit values and an fp32 scale per chunk; stateless (error feedback: `feedback_step`)."""

    name = tag = "sparse2"
    per_microbatch = True
    decoder = staticmethod(decode_sparse2)

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        if not finite(g):
            return False
        flat = g.reshape(-1).to("cpu", torch.float32)
        c, ratio = self.cfg.sparse_chunk, self.cfg.topk_ratio
        nf, rem = divmod(flat.numel(), c)
        rows = ([flat[: nf * c].view(nf, c)] if nf else []) + ([flat[nf * c:].view(1, rem)] if rem else [])
        positions, codes, scales = [], [], []
        for x in rows:
            pos = select(x, kept(x.shape[1], ratio))
            vals = torch.gather(x, 1, pos)
            amax = vals.abs().amax(1)
            inv = torch.where(amax > 0, 3.0 / amax, 0.0)
            code = vals.mul_(inv[:, None]).add_(3.0).div_(2.0).round_().clamp_(0, 3)  # (2·code − 3)·amax/3 ≈ value
            positions.append(pos.reshape(-1).to(torch.int16))
            codes.append(code.reshape(-1).to(torch.uint8))
            scales.append(amax)
        info[name] = self._meta(self.tag, g, chunk=c, k=kept(c, ratio), kr=kept(rem, ratio) if rem else 0)
        frames[f"{name}#i"] = to_cpu(torch.cat(positions))
        frames[f"{name}#q"] = pack(torch.cat(codes), BITS)
        frames[f"{name}#s"] = to_cpu(torch.cat(scales))
        return True


def feedback_step(codec: GradientCodec, delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor],
                  step: int) -> dict[str, torch.Tensor]:
    """Error feedback for one replica's change: e = Δ + residual (by name), whose encoding is what goes on the wire
    (returned: the caller sends e through the same codec, which gives the same bits); `residual[name]` is overwritten
    in place with e − decode(encode(e)) for each name in Δ. Names not in Δ (streaming: other fragments) keep theirs."""
    with torch.no_grad():
        e = {n: d.add(residual[n].to(d.device)) for n, d in delta.items()}
        info, frames = codec.encode(e, step)
        sent = codec.decode(info, {k: v.clone() for k, v in frames.items()})
        for n, x in e.items():
            residual[n].copy_(x.sub(sent[n].view(x.shape).to(x.device)))
    return e
