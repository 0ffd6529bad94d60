"""The `topk` codec: the k = max(1, ceil(ratio * numel)) largest magnitudes (fp32 values + ascending int32 indices;
ties go to the lowest index), with error feedback, and the selection of those k that does not depend on torch.topk's
internal order."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.compression.base import CodecError, Frames, Info, Reader, finite, int_param, short, to_cpu
from cmemi.shared.compression.feedback import ErrorFeedbackCodec
from cmemi.shared.config.system import CompressionConfig

SAMPLE = 1 << 14  # sample size for the threshold estimate on big tensors


def topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest entries of the 1-D finite non-negative `a`.

    Ties at the threshold go to the lowest indices, so the result does not depend on torch.topk's
    internal order. Big tensors first keep only the candidates above a threshold estimated from a
    strided sample (exact: used only when at least k entries pass it), which is several times faster
    than torch.topk over the whole tensor.
    """
    n = a.numel()
    cand = None
    if n >= 4 * SAMPLE and 8 * k < n:
        s = a[:: n // SAMPLE]
        ks = min(s.numel(), math.ceil(1.5 * k * s.numel() / n) + 8)
        t = torch.topk(s, ks, sorted=False).values.min()
        if t > 0:
            cand = (a >= t).nonzero().squeeze(1)  # ascending
            if cand.numel() < k:  # the sample overestimated the threshold: use the whole tensor
                cand = None
    sub = a if cand is None else a[cand]
    top = torch.topk(sub, k, sorted=False)
    sel = top.indices
    thr = top.values.min()
    eq = sub == thr
    if int(torch.count_nonzero(eq)) > int(torch.count_nonzero(top.values == thr)):
        gt = (sub > thr).nonzero().squeeze(1)
        sel = torch.cat([gt, eq.nonzero().squeeze(1)[: k - gt.numel()]])
    idx = sel if cand is None else cand[sel]
    return idx.sort().values


def decode_topk(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
    k = int_param(meta, "k", name, 1, max(1, numel))
    v = rd.take(name, "v", torch.float32, (k,))
    i = rd.take(name, "i", torch.int32, (k,))
    if int(i[0]) < 0 or int(i[-1]) >= numel:
        raise CodecError("bad_index", f"{short(name)}: index out of range [0, {numel})")
    if k > 1 and not bool((i[1:] > i[:-1]).all()):
        raise CodecError("bad_index", f"{short(name)}: indices not strictly increasing")
    out = torch.zeros(numel, dtype=torch.float32)
    out.index_put_((i.long(),), v)
    return out.view(shape)


class TopKCodec(ErrorFeedbackCodec):
    """The k largest magnitudes of grad (+ residual): fp32 values and ascending int32 indices."""

    name = tag = "topk"
    decoder = staticmethod(decode_topk)

    def __init__(self, cfg: CompressionConfig | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.deterministic = not self.cfg.error_feedback

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        n = g.numel()
        k = min(n, max(1, math.ceil(self.cfg.topk_ratio * n)))
        if 2 * k >= n:  # values + indices would be as big as the dense tensor
            return False
        ef = self.cfg.error_feedback
        m = self._residual(name, g, (n,)) if ef else g.reshape(-1).float()
        if not finite(m):
            self._drop(name)
            return False
        idx = topk_indices(m.abs(), k)
        vals = m[idx]
        if ef:
            m.index_fill_(0, idx, 0.0)
            self._bufs["err"][name] = m
        info[name] = self._meta(self.tag, g, k=k)
        frames[f"{name}#v"] = to_cpu(vals)
        frames[f"{name}#i"] = to_cpu(idx.to(torch.int32))
        return True
