"""Gradient codecs: compress a worker's microbatch gradient for the wire, decode it on the aggregator.

A codec turns `dict[name, grad]` into `(info, frames)`: `info[name]` is a small msgpack-able dict
(codec tag, original shape and dtype, codec parameters) and `frames` a flat dict of contiguous CPU
payload tensors named `f"{name}#{part}"`, sent as raw frames by `shared.protocol`. `decode` turns
them back into one dense float32 gradient per name and treats everything it reads as hostile:
anything malformed raises `CodecError` (a `ValueError` with a short `reason` for drop counters).

Codecs (per tensor; small, empty and, for powersgd, 1-D tensors always go dense fp32, tag "raw"):

- none      dense fp32, zero copies (the frame is the gradient tensor itself).
- fp16/bf16 cast; decode casts back. A tensor that overflows fp16 goes dense instead.
- int8      per-chunk absmax scale (fp32, one per `int8_chunk` elements), round to nearest.
- topk      the k = max(1, ceil(ratio * numel)) largest magnitudes (fp32 values + ascending int32
            indices; ties go to the lowest index), with error feedback.
- powersgd  rank-r P @ Q^T of the gradient viewed as (shape[0], -1), one power iteration per step
            warm-started from the previous step's Q, with error feedback.
- sign      scaled sign, 1 bit per element (EF-signSGD, Karimireddy et al. 2019; 1-bit Adam): per chunk of
            `int8_chunk` elements the signs (packed 8 to a byte) and one fp32 scale, the chunk's mean magnitude
            (the scale with the least squared error); with error feedback.

Error feedback (topk, powersgd, sign) keeps per-worker state: what was not sent this step is added to the
next step's gradient of the same tensor. Such codecs are not `deterministic`: what a worker sends for
a microbatch depends on that worker's history, not only on the microbatch.

A gradient that is not finite (NaN/inf) is never compressed: it goes dense as it is (and the
tensor's error-feedback state is dropped, so one bad step does not poison the following ones), and
`decode` rejects it with reason "nonfinite" unless the codec was built with `check_finite=False`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgpack
import torch
from cmemi.shared.config.schema import CODECS, CompressionConfig, _fail
from cmemi.shared.errors import WireError
from cmemi.shared.wire.layout import Layout, LayoutError

# Largest tensor decode will build when the caller does not pass the expected shapes (int32 indices).
MAX_NUMEL = (1 << 31) - 1
_MAX_DIMS = 8
_FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}
_QSEED = 0x5EED_C0DE  # PowerSGD initial Q: fixed seed, mixed with the tensor name
_SAMPLE = 1 << 14     # topk: sample size for the threshold estimate on big tensors


class CodecError(WireError, ValueError):
    """A compressed gradient is malformed; `reason` is a short label for drop counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@runtime_checkable
class GradientCodec(Protocol):
    name: str
    deterministic: bool
    per_microbatch: bool

    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
        ...

    def decode(self, info: dict[str, dict], frames: dict[str, torch.Tensor],
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        ...

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        ...

    def reset(self) -> None:
        ...


# ---------------------------------------------------------------- sizes

def wire_bytes(frames: Mapping[str, torch.Tensor], info: Mapping[str, Any] | None = None) -> int:
    """Payload bytes of `frames` (plus the msgpack size of `info` when given)."""
    n = sum(t.numel() * t.element_size() for t in frames.values())
    return n + (len(msgpack.packb(info)) if info is not None else 0)


def dense_bytes(grads: Mapping[str, torch.Tensor]) -> int:
    """Bytes of `grads` sent as dense fp32."""
    return sum(t.numel() * 4 for t in grads.values())


def ratio(grads: Mapping[str, torch.Tensor], frames: Mapping[str, torch.Tensor],
          info: Mapping[str, Any] | None = None) -> float:
    """Compression ratio: dense fp32 bytes over wire bytes (inf for an empty payload)."""
    sent = wire_bytes(frames, info)
    return dense_bytes(grads) / sent if sent else math.inf


# ---------------------------------------------------------------- helpers

def _finite(t: torch.Tensor) -> bool:
    # One vectorised reduction, no temporaries: a NaN or inf anywhere makes the sum non-finite.
    # (It also rejects finite values whose sum overflows fp32, ~1e38, which no usable gradient reaches.)
    return t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float32)))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Exactly whether every element is finite: a sum per tensor (no temporaries), and the elementwise
    test only where a sum is not finite (a NaN/inf, or finite values whose sum overflows)."""
    return all(_finite(t) or bool(torch.isfinite(t).all()) for t in tensors)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu").contiguous()


def _short(name: Any) -> str:
    return repr(name)[:60]


def _topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest entries of the 1-D finite non-negative `a`.

    Ties at the threshold go to the lowest indices, so the result does not depend on torch.topk's
    internal order. Big tensors first keep only the candidates above a threshold estimated from a
    strided sample (exact: used only when at least k entries pass it), which is several times faster
    than torch.topk over the whole tensor.
    """
    n = a.numel()
    cand = None
    if n >= 4 * _SAMPLE and 8 * k < n:
        s = a[:: n // _SAMPLE]
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


def _outer(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
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


# ---------------------------------------------------------------- decoding (stateless, hostile input)

class _Reader:
    """Takes the frames of one message by name and checks each one's dtype and shape."""

    def __init__(self, frames: Mapping[str, Any]) -> None:
        if not isinstance(frames, Mapping):
            raise CodecError("bad_frames", f"frames is a {type(frames).__name__}, not a mapping")
        self.frames = frames
        self.used = 0

    def take(self, name: str, part: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.frames.get(f"{name}#{part}")
        if not isinstance(t, torch.Tensor):
            raise CodecError("missing_frame", f"{_short(name)}: no payload {part!r}")
        self.used += 1
        if t.dtype != dtype:
            raise CodecError("bad_dtype", f"{_short(name)}#{part}: {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise CodecError("bad_size", f"{_short(name)}#{part}: shape {tuple(t.shape)}, expected {shape}")
        return t.contiguous()  # received frames already are: no copy


def _int(meta: dict, key: str, name: str, lo: int, hi: int) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CodecError("bad_param", f"{_short(name)}: {key}={_short(v)}, expected an int in [{lo}, {hi}]")
    return v


def _dec_raw(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
    return rd.take(name, "v", torch.float32, shape)


def _dec_cast(dtype: torch.dtype):
    def dec(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
        return rd.take(name, "v", dtype, shape).float()
    return dec


def _dec_int8(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
    c = _int(meta, "chunk", name, 1, MAX_NUMEL)
    nf, rem = divmod(numel, c)
    q = rd.take(name, "q", torch.int8, (numel,))
    s = rd.take(name, "s", torch.float32, (nf + (rem > 0),))
    out = q.float()  # then scale in place (a mixed-dtype mul with out= is ~20x slower)
    if nf:
        out[: nf * c].view(nf, c).mul_(s[:nf, None])
    if rem:
        out[nf * c:].mul_(s[nf])
    return out.view(shape)


def _dec_topk(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
    k = _int(meta, "k", name, 1, max(1, numel))
    v = rd.take(name, "v", torch.float32, (k,))
    i = rd.take(name, "i", torch.int32, (k,))
    if int(i[0]) < 0 or int(i[-1]) >= numel:
        raise CodecError("bad_index", f"{_short(name)}: index out of range [0, {numel})")
    if k > 1 and not bool((i[1:] > i[:-1]).all()):
        raise CodecError("bad_index", f"{_short(name)}: indices not strictly increasing")
    out = torch.zeros(numel, dtype=torch.float32)
    out.index_put_((i.long(),), v)
    return out.view(shape)


def _dec_powersgd(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
    if len(shape) < 2 or numel == 0:
        raise CodecError("bad_shape", f"{_short(name)}: powersgd needs a non-empty tensor of >= 2 dims")
    n = shape[0]
    m = numel // n
    r = _int(meta, "rank", name, 1, min(n, m))
    p = rd.take(name, "p", torch.float32, (n, r))
    qt = rd.take(name, "q", torch.float32, (r, m))
    return _outer(p, qt).view(shape)


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # sign: bit j of a byte is element 8i + j


def _dec_sign(name: str, meta: dict, shape: tuple[int, ...], numel: int, rd: _Reader) -> torch.Tensor:
    c = _int(meta, "chunk", name, 1, MAX_NUMEL)
    nf, rem = divmod(numel, c)
    b = rd.take(name, "b", torch.uint8, ((numel + 7) // 8,))
    s = rd.take(name, "s", torch.float32, (nf + (rem > 0),))
    out = (b[:, None] & _BIT).ne_(0).view(-1)[:numel].float().mul_(2.0).sub_(1.0)  # the bits as +-1
    if nf:
        out[: nf * c].view(nf, c).mul_(s[:nf, None])
    if rem:
        out[nf * c:].mul_(s[nf])
    return out.view(shape)


_DECODERS = {"raw": _dec_raw, "fp16": _dec_cast(torch.float16), "bf16": _dec_cast(torch.bfloat16),
             "int8": _dec_int8, "topk": _dec_topk, "powersgd": _dec_powersgd, "sign": _dec_sign}


def _shape(name: str, meta: dict, expected: Mapping[str, Sequence[int]] | None, max_numel: int) -> tuple[int, ...]:
    shape = meta.get("shape")
    if (not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= max_numel for d in shape)):
        raise CodecError("bad_shape", f"{_short(name)}: shape {_short(shape)}")
    shape = tuple(shape)
    if expected is not None:
        if tuple(expected[name]) != shape:
            raise CodecError("bad_shape", f"{_short(name)}: shape {shape}, model has {tuple(expected[name])}")
    elif math.prod(shape) > max_numel:
        raise CodecError("bad_shape", f"{_short(name)}: {math.prod(shape)} elements, limit {max_numel}")
    return shape


# ---------------------------------------------------------------- codecs

class _Codec:
    """Shared encode/decode driver; subclasses implement `_encode` for one compressible tensor."""

    name = "none"
    tag = "raw"            # the info["codec"] of compressed tensors
    deterministic = True
    stateful = False
    # Rounds each gradient it encodes in a way the result must repeat (deterministic and lossy): it is applied to
    # every microbatch, as the single-process reference does, so leases are single microbatches, never blocks.
    per_microbatch = False

    def __init__(self, cfg: CompressionConfig | None = None, *, check_finite: bool = True,
                 max_numel: int = MAX_NUMEL) -> None:
        self.cfg = cfg if cfg is not None else CompressionConfig(codec=self.name)
        self.check_finite = check_finite
        self.max_numel = max_numel
        self._allowed = {"raw", self.tag}

    # -- worker side
    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
        info: dict[str, dict] = {}
        frames: dict[str, torch.Tensor] = {}
        dense = step < self.cfg.warmup_steps
        for name, g in grads.items():
            g = g.detach() if g.requires_grad else g
            if dense or g.numel() == 0 or g.numel() < self.cfg.min_compress_numel or not self._encode(name, g, info, frames):
                self._raw(name, g, info, frames)
        return info, frames

    def _meta(self, tag: str, g: torch.Tensor, **params: Any) -> dict:
        return {"codec": tag, "shape": list(g.shape), "dtype": _DTYPE_NAMES.get(g.dtype, "float32"), **params}

    def _raw(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> None:
        info[name] = self._meta("raw", g)
        frames[f"{name}#v"] = self._dense(name, g)

    def _dense(self, name: str, g: torch.Tensor) -> torch.Tensor:
        return g.to("cpu", torch.float32).contiguous()

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        """Encode one tensor (numel >= max(1, min_compress_numel)); False: send it dense instead."""
        return False

    # -- aggregator side
    def decode(self, info: dict[str, dict], frames: dict[str, torch.Tensor],
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        """Dense float32 gradients. Pass `shapes` (the model's parameter shapes) on a server: it rejects
        unknown names and wrong shapes before anything is allocated. Results may alias the frames."""
        if not isinstance(info, Mapping):
            raise CodecError("bad_info", f"info is a {type(info).__name__}, not a mapping")
        if shapes is not None and info.keys() != shapes.keys():
            missing, extra = sorted(set(shapes) - set(info))[:1], sorted(map(str, set(info) - set(shapes)))[:1]
            raise CodecError("bad_names", f"missing {missing}, unexpected {[_short(e) for e in extra]}")
        rd = _Reader(frames)
        out: dict[str, torch.Tensor] = {}
        for name, meta in info.items():
            if not isinstance(name, str) or not isinstance(meta, Mapping):
                raise CodecError("bad_info", f"entry {_short(name)} is not name -> map")
            tag = meta.get("codec")
            if not isinstance(tag, str) or tag not in _DECODERS:
                raise CodecError("unknown_codec", f"{_short(name)}: codec {_short(tag)}")
            if tag not in self._allowed:
                raise CodecError("wrong_codec", f"{_short(name)}: codec {tag!r}, this side runs {self.name!r}")
            dtype = meta.get("dtype")
            if not isinstance(dtype, str) or dtype not in _FLOAT_DTYPES:
                raise CodecError("bad_dtype", f"{_short(name)}: dtype {_short(dtype)}")
            shape = _shape(name, meta, shapes, self.max_numel)
            g = _DECODERS[tag](name, meta, shape, math.prod(shape), rd)
            if self.check_finite and not _finite(g):
                raise CodecError("nonfinite", f"{_short(name)}: NaN or inf in the gradient")
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


FLAT = "*flat"  # the info key of a gradient sent as one flat fp32 frame (shared/wire/layout.py)


_LAYOUTS = 256  # layouts a NoneCodec keeps (a worker encodes one slice per shard)


class NoneCodec(_Codec):
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
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = Layout({n: torch.empty(s, dtype=torch.float32, device="meta") for n, s in key})
        return self._layouts[key]

    def encode(self, grads: dict[str, torch.Tensor], step: int) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
        info: dict[str, dict] = {}
        frames: dict[str, torch.Tensor] = {}
        layout = self._layout((n, g.shape) for n, g in grads.items()) if self.flat else None
        if layout is not None and layout.flat and grads and all(g.dtype == torch.float32 and g.device.type == "cpu" for g in grads.values()):
            frames = layout.pack(grads)  # a fresh buffer: the last one may still be on its way (zero-copy)
            return {FLAT: {"codec": "flat", "layout": layout.digest}}, frames
        for name, g in grads.items():
            self._raw(name, g.detach() if g.requires_grad else g, info, frames)
        return info, frames

    def decode(self, info: dict[str, dict], frames: dict[str, torch.Tensor],
               shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        if not isinstance(info, Mapping) or FLAT not in info:
            return super().decode(info, frames, shapes)
        meta = info[FLAT]
        if len(info) != 1 or not isinstance(meta, Mapping) or meta.get("codec") != "flat" or shapes is None:
            raise CodecError("bad_info", "a flat gradient is one entry, decoded against the model's shapes")
        layout = self._layout(shapes.items())
        if meta.get("layout") != layout.digest or not layout.flat:
            raise CodecError("bad_layout", f"flat layout {_short(meta.get('layout'))}, this model's is {layout.digest}")
        if not isinstance(frames, Mapping) or not all(isinstance(t, torch.Tensor) for t in frames.values()):
            raise CodecError("bad_frames", "frames is not a mapping of tensors")
        try:
            out = layout.views(frames)
        except LayoutError as exc:
            raise CodecError("bad_layout", str(exc)) from None
        if self.check_finite and not all_finite(frames.values()):  # one pass per flat buffer (padding is zeros)
            raise CodecError("nonfinite", "NaN or inf in the gradient")
        return out


class CastCodec(_Codec):
    """fp16 or bf16 cast. A tensor whose cast is not finite (fp16 overflows above 65504) goes dense."""

    per_microbatch = True

    def __init__(self, cfg: CompressionConfig | None = None, *, dtype: torch.dtype = torch.float16, **kw: Any) -> None:
        self.name = self.tag = "fp16" if dtype == torch.float16 else "bf16"
        self.dtype = dtype
        super().__init__(cfg, **kw)

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        h = g.to(self.dtype)
        if not _finite(h):
            return False
        info[name] = self._meta(self.tag, g)
        frames[f"{name}#v"] = _cpu(h)
        return True


class Int8Codec(_Codec):
    """Per-chunk absmax int8: q = round(x * 127 / absmax), scale = absmax / 127, decode q * scale."""

    name = tag = "int8"
    per_microbatch = True

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        if not _finite(g):
            return False
        flat = g.reshape(-1).float()
        n, c = flat.numel(), self.cfg.int8_chunk
        nf, rem = divmod(n, c)
        q = torch.empty(n, dtype=torch.int8, device=flat.device)
        s = torch.empty(nf + (rem > 0), dtype=torch.float32, device=flat.device)
        if nf:
            self._quantise(flat[: nf * c].view(nf, c), q[: nf * c].view(nf, c), s[:nf])
        if rem:
            self._quantise(flat[nf * c:].view(1, rem), q[nf * c:].view(1, rem), s[nf:])
        info[name] = self._meta(self.tag, g, chunk=c)
        frames[f"{name}#q"] = _cpu(q)
        frames[f"{name}#s"] = _cpu(s)
        return True

    @staticmethod
    def _quantise(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
        amax = x.abs().amax(1)
        torch.div(amax, 127.0, out=s)
        inv = torch.where(amax > 0, 127.0 / amax, 0.0)
        q.copy_((x * inv[:, None]).round_())  # |x * inv| <= 127 up to rounding: no clamp needed


class _EFCodec(_Codec):
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
        return _cpu(err.view(g.shape).add_(g))

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
                raise CodecError("bad_state", f"codec {self.name!r}: unexpected state entry {_short(key)}")
            bufs[kind][name] = t.detach().clone()
        self._bufs = bufs

    def reset(self) -> None:
        """Drop all worker state (residuals, and PowerSGD's warm-start Q)."""
        self._bufs = {k: {} for k in self._state}


class TopKCodec(_EFCodec):
    """The k largest magnitudes of grad (+ residual): fp32 values and ascending int32 indices."""

    name = tag = "topk"

    def __init__(self, cfg: CompressionConfig | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.deterministic = not self.cfg.error_feedback

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        n = g.numel()
        k = min(n, max(1, math.ceil(self.cfg.topk_ratio * n)))
        if 2 * k >= n:  # values + indices would be as big as the dense tensor
            return False
        ef = self.cfg.error_feedback
        m = self._residual(name, g, (n,)) if ef else g.reshape(-1).float()
        if not _finite(m):
            self._drop(name)
            return False
        idx = _topk_indices(m.abs(), k)
        vals = m[idx]
        if ef:
            m.index_fill_(0, idx, 0.0)
            self._bufs["err"][name] = m
        info[name] = self._meta(self.tag, g, k=k)
        frames[f"{name}#v"] = _cpu(vals)
        frames[f"{name}#i"] = _cpu(idx.to(torch.int32))
        return True


class PowerSGDCodec(_EFCodec):
    """Rank-r P @ Q^T of grad (+ residual) viewed as (shape[0], -1); one warm-started power iteration."""

    name = tag = "powersgd"
    _state = ("err", "q")

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        if g.dim() < 2:
            return False
        n = g.shape[0]
        m = g.numel() // n
        r = min(self.cfg.powersgd_rank, n, m)
        if r * (n + m) >= n * m:  # P and Q would be as big as the dense matrix
            return False
        ef = self.cfg.error_feedback
        mat = self._residual(name, g, (n, m)) if ef else g.reshape(n, m).float()
        if not _finite(mat):
            self._drop(name)
            return False
        qt = self._bufs["q"].get(name)  # Q^T, (r, m): row-major Q^T makes both products fast
        if qt is None or tuple(qt.shape) != (r, m) or qt.device != g.device or not bool(qt.any()):
            gen = torch.Generator().manual_seed(_QSEED ^ zlib.crc32(name.encode()))
            qt = torch.randn(r, m, generator=gen).to(g.device)
        p = torch.linalg.qr(mat @ qt.T).Q  # (n, r), orthonormal columns
        qt = p.T @ mat                      # (M^T P)^T
        if ef:
            _outer(p, qt, out=mat, alpha=-1.0)
            self._bufs["err"][name] = mat
        self._bufs["q"][name] = qt
        info[name] = self._meta(self.tag, g, rank=r)
        frames[f"{name}#p"] = _cpu(p)
        frames[f"{name}#q"] = _cpu(qt)
        return True


class SignCodec(_EFCodec):
    """The sign of grad (+ residual), 1 bit per element, times one fp32 scale per chunk: the chunk's mean magnitude.
    A chunk of zeros decodes to zeros (its scale is 0), so a frozen tensor sends nothing that moves it."""

    name = tag = "sign"

    def __init__(self, cfg: CompressionConfig | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.deterministic = not self.cfg.error_feedback

    def _encode(self, name: str, g: torch.Tensor, info: dict, frames: dict) -> bool:
        n, c, ef = g.numel(), self.cfg.int8_chunk, self.cfg.error_feedback
        m = self._residual(name, g, (n,)) if ef else g.reshape(-1).float()
        if not _finite(m):
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
        b = (pos.view(-1, 8) * _BIT.to(m.device)).sum(1, dtype=torch.uint8)  # 8 signs to a byte, disjoint bits
        info[name] = self._meta(self.tag, g, chunk=c)
        if ef:  # the residual: what the scaled signs did not carry (decoded where m is)
            m.sub_(_dec_sign(name, info[name], (n,), n, _Reader({f"{name}#b": b, f"{name}#s": s})))
            self._bufs["err"][name] = m
        frames[f"{name}#b"] = _cpu(b)
        frames[f"{name}#s"] = _cpu(s)
        return True


def make_codec(cfg: CompressionConfig, **kw: Any) -> GradientCodec:
    """The codec `cfg.codec` names. Keyword arguments: check_finite (default True), max_numel; for `none`, flat
    (default True: a small model's gradient as one flat frame)."""
    if cfg.codec == "none":
        return NoneCodec(cfg, **kw)
    if cfg.codec in ("fp16", "bf16"):
        return CastCodec(cfg, dtype=torch.float16 if cfg.codec == "fp16" else torch.bfloat16, **kw)
    if cfg.codec == "int8":
        return Int8Codec(cfg, **kw)
    if cfg.codec == "topk":
        return TopKCodec(cfg, **kw)
    if cfg.codec == "powersgd":
        return PowerSGDCodec(cfg, **kw)
    if cfg.codec == "sign":
        return SignCodec(cfg, **kw)
    _fail("compression.codec", cfg.codec, f"must be one of {', '.join(CODECS)}", "use e.g. 'topk'")
