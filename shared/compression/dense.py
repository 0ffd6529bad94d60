"""The dense codecs: `none` (fp32 as it is, a small model's gradient as one flat frame) and `fp16`/`bf16` (a cast).

- none      dense fp32, zero copies (the frame is the gradient tensor itself), or one copy into a flat frame.
- fp16/bf16 cast; decode casts back. A tensor that overflows fp16 goes dense instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from cmemi.shared.compression.base import (
    Codec,
    CodecError,
    Frames,
    Info,
    Reader,
    all_finite,
    finite,
    short,
    to_cpu,
)
from cmemi.shared.config.system import CompressionConfig
from cmemi.shared.wire.layout import Layout, LayoutError

FLAT = "*flat"  # the info key of a gradient sent as one flat fp32 frame (shared/wire/layout.py)
LAYOUTS = 256   # layouts a NoneCodec keeps (a worker encodes one slice per shard)


class NoneCodec(Codec):
    """Dense fp32. A small model's gradient is one flat frame in the layout of its parameters
    (shared/wire/layout.py: one copy, no per-tensor frames or header entries); a big one's frames are the
    gradient tensors themselves (CPU fp32 contiguous: zero copies)."""

    def __init__(self, cfg: CompressionConfig | None = None, *, flat: bool = True, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.flat = flat  # encode small models flat (decode takes both forms)
        self._layouts: dict[tuple[tuple[str, tuple[int, ...]], ...], Layout] = {}

    def _layout(self, shapes: Iterable[tuple[str, Sequence[int]]]) -> Layout:
        key = tuple((n, tuple(s)) for n, s in shapes)
        if key not in self._layouts:  # one per shard's slice at most, on an honest path
            if len(self._layouts) >= LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = Layout({n: torch.empty(s, dtype=torch.float32, device="meta") for n, s in key})
        return self._layouts[key]

    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[Info, Frames]:
        info: Info = {}
        frames: Frames = {}
        layout = self._layout((n, g.shape) for n, g in grads.items()) if self.flat else None
        if layout is not None and layout.flat and grads and all(g.dtype == torch.float32 and g.device.type == "cpu" for g in grads.values()):
            frames = layout.pack(grads)  # a fresh buffer: the last one may still be on its way (zero-copy)
            return {FLAT: {"codec": "flat", "layout": layout.digest}}, frames
        for name, g in grads.items():
            self._raw(name, g.detach() if g.requires_grad else g, info, frames)
        return info, frames

    def decode(self, info: Info, frames: Frames,
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        if not isinstance(info, Mapping) or FLAT not in info:
            return super().decode(info, frames, shapes)
        meta = info[FLAT]
        if len(info) != 1 or not isinstance(meta, Mapping) or meta.get("codec") != "flat" or shapes is None:
            raise CodecError("bad_info", "a flat gradient is one entry, decoded against the model's shapes")
        layout = self._layout(shapes.items())
        if meta.get("layout") != layout.digest or not layout.flat:
            raise CodecError("bad_layout", f"flat layout {short(meta.get('layout'))}, this model's is {layout.digest}")
        if not isinstance(frames, Mapping) or not all(isinstance(t, torch.Tensor) for t in frames.values()):
            raise CodecError("bad_frames", "frames is not a mapping of tensors")
        try:
            out = layout.views(frames)
        except LayoutError as exc:
            raise CodecError("bad_layout", str(exc)) from None
        if self.check_finite and not all_finite(frames.values()):  # one pass per flat buffer (padding is zeros)
            raise CodecError("nonfinite", "NaN or inf in the gradient")
        return out


def decode_cast(dtype: torch.dtype) -> Callable[[str, Mapping[str, Any], tuple[int, ...], int, Reader], torch.Tensor]:
    """The decoder of a cast to `dtype`: the one frame, cast back to fp32."""
    def dec(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
        return rd.take(name, "v", dtype, shape).float()
    return dec


class CastCodec(Codec):
    """fp16 or bf16 cast. A tensor whose cast is not finite (fp16 overflows above 65504) goes dense."""

    per_microbatch = True

    def __init__(self, cfg: CompressionConfig | None = None, *, dtype: torch.dtype = torch.float16, **kw: Any) -> None:
        self.name = self.tag = "fp16" if dtype == torch.float16 else "bf16"
        self.dtype = dtype
        self.decoder = decode_cast(dtype)
        super().__init__(cfg, **kw)

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        h = g.to(self.dtype)
        if not finite(h):
            return False
        info[name] = self._meta(self.tag, g)
        frames[f"{name}#v"] = to_cpu(h)
        return True
