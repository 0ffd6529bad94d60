"""A step's entry as the encoded gradients it was reduced from (docs/design/step-log.md, "The entry as encoded
gradients").

With a compressing codec (`powersgd` at a low rank, `int8`, ...) the gradients a server receives for a step are far
smaller than the reduced slice it would log: at K = N shards on N hosts every shard's dense entry crossed its host's
link into the checkpointer's host each step (issue 47). So a server keeps each accepted contribution as it came —
its node of the reduction tree, its finite flag, its losses, its codec info and a copy of its encoded tensors
(`received`: copied before the decode, whose results may alias them and which the tree then sums into) — and the
entry carries those (`entry`: the `encoded` field, tensors named `f<i>.<frame name>`) instead of the reduced slice,
whenever their bytes are fewer (`smaller`, decided per entry). A replay (`reduce`) decodes them with the run's
codec and offers them to a `StepCollector` of the same step: the same decode, the same fixed reduction tree and the
same division as the live step, so the mean gradient — and all that follows from it, the optimizer step, the
downlink mirror and its codec state — is bitwise the dead server's. The buffer sum stays reduced in the entry (`b.`
names): it is small and the live step applied that sum.

The checkpointer holds an entry as it holds any: fields and tensors, never decoded there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.gradients import decode
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.compression.base import GradientCodec
from cmemi.shared.wire import limits

FRAME = "f"  # an entry's tensor f"f{i}.{name}": frame `name` of its i-th contribution


class EntryError(ValueError):
    """A logged entry's frames do not decode or do not make a complete step (a log of another config, or damaged)."""


@dataclass(frozen=True)
class Received:
    """One accepted contribution to a step, as it came: node [lo, hi), finite flag, losses, codec info, frames."""
    lo: int
    hi: int
    finite: bool
    losses: list[float]
    codec: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return limits.nbytes(self.tensors.values())


def received(h: dict[str, Any], frames: dict[str, torch.Tensor]) -> Received:
    """A copy of a gradient message's encoded part (`frames`: its tensors without the buffers and inner state) and
    the header fields its decode and offer read, taken before it is decoded."""
    losses = h["losses"]
    return Received(int(h["lo"]), int(h["hi"]), bool(h["finite"]),
                    [float(x) for x in (losses if isinstance(losses, list) else [losses])], h["codec"],
                    {n: t.detach().clone() for n, t in frames.items()})


def room(got: Sequence[Received], dense: int) -> bool:
    """Is the step's next gradient worth keeping: what is kept of it is still fewer bytes than its dense slice
    (`dense`)? Past that the entry is the slice anyway; so a server keeps at most one slice and one gradient more."""
    return sum(r.nbytes for r in got) < dense


def smaller(got: Sequence[Received], grads: dict[str, torch.Tensor] | None, microbatches: int) -> bool:
    """Does the step's entry go as its encoded gradients `got`: they cover its `microbatches` and are fewer bytes
    than its reduced slice `grads`?"""
    if grads is None or sum(r.hi - r.lo for r in got) != microbatches:
        return False
    return sum(r.nbytes for r in got) < limits.nbytes(grads.values())


def entry(got: Sequence[Received], microbatches: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the entry's `encoded` field, its tensors) for the contributions `got` of a step of `microbatches`."""
    parts = [[r.lo, r.hi, r.finite, r.losses, r.codec] for r in got]
    tensors = {f"{FRAME}{i}.{n}": t for i, r in enumerate(got) for n, t in r.tensors.items()}
    return {"microbatches": microbatches, "parts": parts}, tensors


def reduce(codec: GradientCodec, trainer: Trainer, step: int, field: Any,
           tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The mean gradient of a logged step from its entry's `encoded` field and tensors (None: it overflowed), by the
    live step's decode and reduction; `step`: the step's collection (the trainer's step before it). The tensors may
    be a slot's views: they are copied first (a decoded piece may alias its frame, and the tree sums into it)."""
    if not isinstance(field, dict) or not isinstance(field.get("parts"), list) or \
            not isinstance(field.get("microbatches"), int) or field["microbatches"] < 1:
        raise EntryError("its encoded field is malformed")
    split: list[dict[str, torch.Tensor]] = [{} for _ in field["parts"]]
    for name, t in tensors.items():
        index, dot, rest = name[len(FRAME):].partition(".")
        if name.startswith(FRAME) and dot and index.isdigit() and int(index) < len(split):
            split[int(index)][rest] = t.clone()
    collector = StepCollector(step, field["microbatches"], leased=False)
    for i, part in enumerate(field["parts"]):
        if not isinstance(part, list) or len(part) != 5 or not all(type(x) is int for x in part[:2]) or \
                not isinstance(part[3], list):
            raise EntryError(f"its frame part {i} is malformed")
        lo, hi, finite, losses, info = part
        h = {"finite": finite, "codec": info, "losses": losses}
        grads, bad, _ = decode(codec, trainer, h, split[i], trainer.expected(step))
        if bad is not None:
            raise EntryError(f"its frame part {i} does not decode ({bad})")
        if (why := collector.offer((lo, hi), grads, losses, None)) is not None:
            raise EntryError(f"its frame part {i}, microbatches [{lo}, {hi}), is not taken ({why})")
    if not collector.complete:
        raise EntryError(f"its frames cover {len(collector.received)} of {collector.M} microbatches")
    return collector.mean()[0]


def in_use(codec: GradientCodec, trainer: Trainer) -> bool:
    """May a server's entries be the steps' encoded gradients: a codec that encodes (not `none`), and no local steps (their entry is the
    replicas' mean change, not a reduced gradient)?"""
    return codec.name != "none" and not trainer.local
