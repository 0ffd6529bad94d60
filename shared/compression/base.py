"""The codec contract and the driver every codec shares: encode tensor by tensor, decode hostile input.

A codec turns `dict[name, grad]` into `(info, frames)`: `info[name]` is a small msgpack-able dict
(codec tag, original shape and dtype, codec parameters) and `frames` a flat dict of contiguous CPU
payload tensors named `f"{name}#{part}"`, sent as raw frames by `shared.wire.protocol`. `decode` turns
them back into one dense float32 gradient per name and treats everything it reads as hostile:
anything malformed raises `CodecError` (a `ValueError` with a short `reason` for drop counters).

Small, empty and (for powersgd) 1-D tensors always go dense fp32, tag "raw". A gradient that is not
finite (NaN/inf) is never compressed: it goes dense as it is (and the tensor's error-feedback state is
dropped, so one bad step does not poison the following ones), and `decode` rejects it with reason
"nonfinite" unless the codec was built with `check_finite=False`.

Each codec family (dense.py, int8.py, lowbit.py, sparse2.py, topk.py, powersgd.py, sign.py) subclasses `Codec` with its
`_encode` for one tensor and its `decoder` for one tag; registry.py picks one by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from cmemi.shared.config.system import CompressionConfig
from cmemi.shared.errors import WireError

# Largest tensor decode will build when the caller does not pass the expected shapes (int32 indices).
MAX_NUMEL = (1 << 31) - 1
MAX_DIMS = 8
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}
# Every tag a decoder exists for: an entry with another tag is "unknown_codec", one with a known tag this side does
# not run is "wrong_codec" (tests/test_codecs.py checks this set against the registry's codecs).
TAGS = frozenset({"raw", "fp16", "bf16", "int8", "topk", "powersgd", "sign", "int4", "int2", "sparse2"})


class CodecError(WireError, ValueError):
    """A compressed gradient is malformed; `reason` is a short label for drop counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


Info = dict[str, dict[str, Any]]
Frames = dict[str, torch.Tensor]


@runtime_checkable
class GradientCodec(Protocol):
    name: str
    deterministic: bool
    stateful: bool  # per-worker state (error feedback's residuals) that a step changes
    per_microbatch: bool

    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[Info, Frames]:
        ...

    def decode(self, info: Info, frames: Frames,
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        ...

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        ...

    def reset(self) -> None:
        ...


# ---------------------------------------------------------------- helpers

def finite(t: torch.Tensor) -> bool:
    """Whether `t` has no NaN or inf: one vectorised reduction, no temporaries (a NaN or inf anywhere makes the sum
    non-finite; it also rejects finite values whose sum overflows fp32, ~1e38, which no usable gradient reaches).
    The sum is tested as a Python float: `torch.isfinite` of the 0-d sum cost ~16 us of dispatch per tensor, about
    20 us a tensor in all against ~5 us now, and the leader tests the step's mean this way before it publishes
    (issue 45's small-step floor: cnn1d's six tensors, ~0.1 ms a step)."""
    return t.numel() == 0 or math.isfinite(t.sum(dtype=torch.float32).item())


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Exactly whether every element is finite: a sum per tensor (no temporaries), and the elementwise
    test only where a sum is not finite (a NaN/inf, or finite values whose sum overflows)."""
    return all(finite(t) or bool(torch.isfinite(t).all()) for t in tensors)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor (no copy when `t` already is one): what a frame must be."""
    return t.to("cpu").contiguous()


def short(name: Any) -> str:
    """A hostile name or value cut to a length an error message can carry."""
    return repr(name)[:60]


# ---------------------------------------------------------------- decoding (stateless, hostile input)

class Reader:
    """Takes the frames of one message by name and checks each one's dtype and shape."""

    def __init__(self, frames: Mapping[str, Any]) -> None:
        if not isinstance(frames, Mapping):
            raise CodecError("bad_frames", f"frames is a {type(frames).__name__}, not a mapping")
        self.frames = frames
        self.used = 0

    def take(self, name: str, part: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.frames.get(f"{name}#{part}")
        if not isinstance(t, torch.Tensor):
            raise CodecError("missing_frame", f"{short(name)}: no payload {part!r}")
        self.used += 1
        if t.dtype != dtype:
            raise CodecError("bad_dtype", f"{short(name)}#{part}: {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise CodecError("bad_size", f"{short(name)}#{part}: shape {tuple(t.shape)}, expected {shape}")
        return t.contiguous()  # received frames already are: no copy


# A decoder of one tag: (name, meta, shape, numel, reader) -> the dense float32 tensor.
Decoder = Callable[[str, Mapping[str, Any], tuple[int, ...], int, Reader], torch.Tensor]


def int_param(meta: Mapping[str, Any], key: str, name: str, lo: int, hi: int) -> int:
    """The codec parameter `meta[key]`, checked to be an int in [lo, hi]."""
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CodecError("bad_param", f"{short(name)}: {key}={short(v)}, expected an int in [{lo}, {hi}]")
    return v


def decode_raw(name: str, meta: Mapping[str, Any], shape: tuple[int, ...], numel: int, rd: Reader) -> torch.Tensor:
    return rd.take(name, "v", torch.float32, shape)


def check_shape(name: str, meta: Mapping[str, Any], expected: Mapping[str, Sequence[int]] | None,
                max_numel: int) -> tuple[int, ...]:
    """The entry's shape, checked against the model's (`expected`) or, without it, against `max_numel`."""
    shape = meta.get("shape")
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= max_numel for d in shape)):
        raise CodecError("bad_shape", f"{short(name)}: shape {short(shape)}")
    dims = tuple(shape)
    if expected is not None:
        if tuple(expected[name]) != dims:
            raise CodecError("bad_shape", f"{short(name)}: shape {dims}, model has {tuple(expected[name])}")
    elif math.prod(dims) > max_numel:
        raise CodecError("bad_shape", f"{short(name)}: {math.prod(dims)} elements, limit {max_numel}")
    return dims


# ---------------------------------------------------------------- the driver

class Codec:
    """Shared encode/decode driver; subclasses implement `_encode` for one compressible tensor and `decoder`."""

    name = "none"
    tag = "raw"            # the info["codec"] of compressed tensors
    deterministic = True
    stateful = False
    # Rounds each gradient it encodes in a way the result must repeat (deterministic and lossy): it is applied to
    # every microbatch, as the single-process reference does, so leases are single microbatches, never blocks.
    per_microbatch = False
    decoder: Decoder = staticmethod(decode_raw)  # decodes `tag`

    def __init__(self, cfg: CompressionConfig | None = None, *, check_finite: bool = True,
                 max_numel: int = MAX_NUMEL) -> None:
        self.cfg = cfg if cfg is not None else CompressionConfig(codec=self.name)
        self.check_finite = check_finite
        self.max_numel = max_numel
        self._allowed = {"raw", self.tag}

    # -- worker side
    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[Info, Frames]:
        info: Info = {}
        frames: Frames = {}
        dense = step < self.cfg.warmup_steps
        for name, g in grads.items():
            g = g.detach() if g.requires_grad else g
            if dense or g.numel() == 0 or g.numel() < self.cfg.min_compress_numel or not self._encode(name, g, info, frames):
                self._raw(name, g, info, frames)
        return info, frames

    def _meta(self, tag: str, g: torch.Tensor, **params: Any) -> dict[str, Any]:
        return {"codec": tag, "shape": list(g.shape), "dtype": DTYPE_NAMES.get(g.dtype, "float32"), **params}

    def _raw(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> None:
        info[name] = self._meta("raw", g)
        frames[f"{name}#v"] = self._dense(name, g)

    def _dense(self, name: str, g: torch.Tensor) -> torch.Tensor:
        return g.to("cpu", torch.float32).contiguous()

    def _encode(self, name: str, g: torch.Tensor, info: Info, frames: Frames) -> bool:
        """Encode one tensor (numel >= max(1, min_compress_numel)); False: send it dense instead."""
        return False

    # -- aggregator side
    def decode(self, info: Info, frames: Frames,
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        """Dense float32 gradients. Pass `shapes` (the model's parameter shapes) on a server: it rejects
        unknown names and wrong shapes before anything is allocated. Results may alias the frames."""
        if not isinstance(info, Mapping):
            raise CodecError("bad_info", f"info is a {type(info).__name__}, not a mapping")
        if shapes is not None and info.keys() != shapes.keys():
            missing, extra = sorted(set(shapes) - set(info))[:1], sorted(map(str, set(info) - set(shapes)))[:1]
            raise CodecError("bad_names", f"missing {missing}, unexpected {[short(e) for e in extra]}")
        rd = Reader(frames)
        out: dict[str, torch.Tensor] = {}
        for name, meta in info.items():
            if not isinstance(name, str) or not isinstance(meta, Mapping):
                raise CodecError("bad_info", f"entry {short(name)} is not name -> map")
            tag = meta.get("codec")
            if not isinstance(tag, str) or tag not in TAGS:
                raise CodecError("unknown_codec", f"{short(name)}: codec {short(tag)}")
            if tag not in self._allowed:
                raise CodecError("wrong_codec", f"{short(name)}: codec {tag!r}, this side runs {self.name!r}")
            dtype = meta.get("dtype")
            if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
                raise CodecError("bad_dtype", f"{short(name)}: dtype {short(dtype)}")
            shape = check_shape(name, meta, shapes, self.max_numel)
            decoder = decode_raw if tag == "raw" else self.decoder
            g = decoder(name, meta, shape, math.prod(shape), rd)
            if self.check_finite and not finite(g):
                raise CodecError("nonfinite", f"{short(name)}: NaN or inf in the gradient")
            out[name] = g
        if rd.used != len(frames):
            raise CodecError("extra_frame", f"{len(frames) - rd.used} frames not named by the info")
        return out

    # -- worker state
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        if sd:
            raise CodecError("bad_state", f"codec {self.name!r} has no state, got {len(sd)} entries")

    def reset(self) -> None:
        pass
