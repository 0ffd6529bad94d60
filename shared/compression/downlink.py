"""Compressed downlink (`compression.downlink`): workers compute on a mirror of the parameters (docs/design.md §9).

Each server keeps, beside its master pieces θ, the mirror m of them that every worker holds. After step t it sends
the change d = θ_t − m_{t−1} through a codec (bf16, int8, topk, powersgd of shared/compression/, without their own
error feedback: m remembers what was sent, so d already holds everything not sent yet — the residual is implicit)
and moves its mirror by what the message decodes to: m_t = m_{t−1} + decode(C(d)). A worker at version t−1 applies
the same message with the same function (`apply`), so every mirror is the same bits. The server keeps the last
`KEPT` changes: a worker a few versions behind (it sat out a step or two: no lease came its way) gets the chain of
them, applied one by one in the order the server applied them, so its mirror is again the same bits; any other
worker (new, replaced, further behind, or when the chain would be bigger than the mirror) is sent the dense mirror
m_t once. `cmemi reference` runs the same `Mirror`.

Everything here is per piece of the chunk grid (shared/core/grid.py), named as the pieces: the same at any
cluster.shards. PowerSGD's warm-start Q is the codec's only state, kept per piece on the server (`state_dict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from cmemi.shared.compression.base import CodecError, GradientCodec
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.system import CompressionConfig

DELTA, DENSE = "delta", "dense"  # a work or slice message's `downlink`: the change from `base`, or the mirror whole
KEPT = 8  # changes a server keeps: a worker up to this many versions behind gets them instead of the whole mirror
LINK = "|"  # a chain's frame names: f"{i}{LINK}{frame}" for its i-th change (no codec frame name holds one)


def codec(cfg: CompressionConfig) -> GradientCodec:
    """The downlink's codec: `cfg.downlink` with the uplink's options, no error feedback (the mirror is it). Its
    warm-up is the uplink's (`compression.warmup_steps`): the changes to versions below it go raw fp32, like DDP's
    PowerSGD hook's `start_powerSGD_iter` (early steps are the ones a compressed exchange hurts most). Decoding checks
    that every value is finite (a hostile frame never reaches a mirror)."""
    return make_codec(dataclasses.replace(cfg, codec=cfg.downlink, error_feedback=False))


def apply(decoder: GradientCodec, mirror: Mapping[str, torch.Tensor], info: Any, frames: Any,
          shapes: Mapping[str, Sequence[int]]) -> None:
    """m += decode(message), for the server and every worker alike: the one function that makes them equal. A
    chain (`info` a list: `chain`) adds its changes one by one, oldest first, as the server did. A malformed message
    raises `CodecError` before any piece of the mirror changes (every change of a chain is decoded first)."""
    if isinstance(info, list):
        if not 1 <= len(info) <= KEPT or not isinstance(frames, Mapping):
            raise CodecError("bad_chain", f"a chain of {len(info)} changes (1 to {KEPT})")
        parts: list[dict[str, Any]] = [{} for _ in info]
        for key, t in frames.items():
            i, sep, frame = str(key).partition(LINK)
            if not sep or not i.isdigit() or int(i) >= len(info):
                raise CodecError("extra_frame", f"frame {str(key)[:60]!r} is in no change of the chain")
            parts[int(i)][frame] = t
        steps = [decoder.decode(i, f, shapes=shapes) for i, f in zip(info, parts, strict=True)]
    else:
        steps = [decoder.decode(info, frames, shapes=shapes)]
    if any(d.keys() != mirror.keys() for d in steps):
        raise CodecError("bad_names", "the downlink's pieces are not this mirror's")
    with torch.no_grad():
        for decoded in steps:
            for name, m in mirror.items():
                m.add_(decoded[name].to(m.device))


def chain(changes: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> tuple[Any, dict[str, torch.Tensor]]:
    """One message of consecutive changes, oldest first (one change is itself)."""
    if len(changes) == 1:
        return changes[0]
    return ([info for info, _ in changes],
            {f"{i}{LINK}{k}": t for i, (_, frames) in enumerate(changes) for k, t in frames.items()})


def _nbytes(frames: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in frames.values())


class SentChanges:
    """A server's changes of the current version as sent, by base: each encoded once (a chain per base)."""

    def __init__(self) -> None:
        self.version = -1
        self.by_base: dict[int, Any] = {}

    def get(self, version: int, base: int, encode: Callable[[], Any]) -> Any:
        if version != self.version:
            self.version, self.by_base = version, {}
        if base not in self.by_base:
            self.by_base[base] = encode()
        return self.by_base[base]


class Mirror:
    """A server's mirror of its pieces, the downlink codec's state, and the newest change sent."""

    def __init__(self, cfg: CompressionConfig, pieces: Mapping[str, torch.Tensor]) -> None:
        self.codec = codec(cfg)
        self.reset(pieces, 0)

    def reset(self, pieces: Mapping[str, torch.Tensor], version: int) -> None:
        """The mirror is the pieces themselves (a fresh run: every worker starts from θ_0), no codec state."""
        self.tensors = {n: p.detach().clone() for n, p in pieces.items()}
        self.shapes = {n: tuple(p.shape) for n, p in pieces.items()}
        self.codec.reset()
        self.version = version
        self.deltas: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}  # v -> the change from v − 1 to v

    def advance(self, pieces: Mapping[str, torch.Tensor], version: int) -> None:
        """After the step to `version`: encode θ − m, and move m by what the message decodes to."""
        with torch.no_grad():
            change = {n: pieces[n].detach() - m for n, m in self.tensors.items()}
        # the change is step (version − 1)'s: warm-up counts steps, as the uplink's does
        info, frames = self.codec.encode(change, version - 1) if change else ({}, {})
        apply(self.codec, self.tensors, info, frames, self.shapes)
        if version != self.version + 1:  # (not the next version: the kept changes lead elsewhere)
            self.deltas.clear()
        self.deltas[version], self.version = (info, frames), version
        self.deltas.pop(version - KEPT, None)

    def change(self, base: int) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """The message that moves a mirror at `base` to the current version: the change, or the chain of them, if this
        server kept them all and they are smaller than the mirror; else None (send the mirror whole)."""
        if type(base) is not int or base < 0 or not self.version - KEPT <= base < self.version:
            return None
        if any(v not in self.deltas for v in range(base + 1, self.version + 1)):
            return None
        changes = [self.deltas[v] for v in range(base + 1, self.version + 1)]
        if len(changes) > 1 and sum(_nbytes(f) for _, f in changes) >= _nbytes(self.tensors):
            return None
        return chain(changes)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """For a checkpoint: the mirror and the codec's state (PowerSGD's Q), by piece (the live tensors)."""
        return {"mirror": dict(self.tensors), "codec": self.codec.state_dict()}

    def load_state_dict(self, sd: Mapping[str, Mapping[str, torch.Tensor]], version: int) -> None:
        """From a checkpoint (only this server's pieces are taken: a resharded restore passes every old shard's)."""
        mirror = sd["mirror"]
        missing = [n for n in self.tensors if n not in mirror]
        if missing:
            raise ValueError(f"the checkpoint's downlink mirror lacks pieces {missing[:3]}")
        for n, m in self.tensors.items():
            if tuple(mirror[n].shape) != tuple(m.shape):
                raise ValueError(f"the checkpoint's downlink mirror of {n} has shape {tuple(mirror[n].shape)}")
            m.copy_(mirror[n])
        self.codec.load_state_dict({k: v for k, v in sd.get("codec", {}).items()
                                    if k.partition("/")[2] in self.tensors})
        self.version, self.deltas = version, {}
