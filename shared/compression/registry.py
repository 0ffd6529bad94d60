"""Gradient codecs by name: compress a worker's microbatch gradient for the wire, decode it on the aggregator.

Codecs (per tensor; small, empty and, for powersgd, 1-D tensors always go dense fp32, tag "raw"):

- none      dense fp32, zero copies (dense.py).
- fp16/bf16 cast; decode casts back. A tensor that overflows fp16 goes dense instead (dense.py).
- int8      per-chunk absmax scale (fp32, one per `int8_chunk` elements), round to nearest (int8.py).
- topk      the k = max(1, ceil(ratio * numel)) largest magnitudes, with error feedback (topk.py).
- powersgd  rank-r P @ Q^T of the gradient viewed as (shape[0], -1), one warm-started power iteration per step,
            with error feedback (powersgd.py).
- sign      scaled sign, 1 bit per element, one fp32 scale per chunk; with error feedback (sign.py).
- int4/int2 per-chunk absmax scale (one per `lowbit_chunk` elements), 4 or 2 bits per element (lowbit.py).
- sparse2   per chunk the top-k magnitudes at 2 bits and an fp32 scale; stateless: with train.local_steps its error
            feedback lives in each replica's state (sparse2.py).

The contract every codec keeps (info and frames, hostile decoding, non-finite gradients) is base.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.compression.dense import CastCodec, NoneCodec
from cmemi.shared.compression.int8 import Int8Codec
from cmemi.shared.compression.lowbit import Int2Codec, Int4Codec
from cmemi.shared.compression.powersgd import PowerSGDCodec
from cmemi.shared.compression.sign import SignCodec
from cmemi.shared.compression.sparse2 import Sparse2Codec
from cmemi.shared.compression.topk import TopKCodec
from cmemi.shared.config.checks import fail
from cmemi.shared.config.system import CODECS, CompressionConfig


def make_codec(cfg: CompressionConfig, **kw: Any) -> GradientCodec:
    """The codec `cfg.codec` names. Keyword arguments: check_finite (default True), max_numel; for `none`, flat
    (default True: a small model's gradient as one flat frame)."""
    if cfg.codec == "none":
        return NoneCodec(cfg, **kw)
    if cfg.codec in ("fp16", "bf16"):
        return CastCodec(cfg, dtype=torch.float16 if cfg.codec == "fp16" else torch.bfloat16, **kw)
    if cfg.codec == "int8":
        return Int8Codec(cfg, **kw)
    if cfg.codec == "int4":
        return Int4Codec(cfg, **kw)
    if cfg.codec == "int2":
        return Int2Codec(cfg, **kw)
    if cfg.codec == "sparse2":
        return Sparse2Codec(cfg, **kw)
    if cfg.codec == "topk":
        return TopKCodec(cfg, **kw)
    if cfg.codec == "powersgd":
        return PowerSGDCodec(cfg, **kw)
    if cfg.codec == "sign":
        return SignCodec(cfg, **kw)
    fail("compression.codec", cfg.codec, f"must be one of {', '.join(CODECS)}", "use e.g. 'topk'")
