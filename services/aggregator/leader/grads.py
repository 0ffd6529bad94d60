"""A worker's gradient at the leader, in the order its checks cost: what is cheap first (docs/design.md §2, §10).

1. `_unpacked`: the buffers and the inner state the message carries are taken out of it (copied if they are views
   of the worker's slot: read, never kept; intake.py);
2. `_refusal`: a gradient of another step or version, or for a node the collector does not want from this holder,
   is dropped before a byte is decoded (injection costs little);
3. `_inner_state`: local steps, the state the replica's round ended with (checked, kept only once accepted);
   streaming, a segment that ships no state must carry none;
4. decoding, then the model's buffers, then the collector's offer; a slot written while it was summed means the
   step's sum is unknown, so the step is collected again;
5. `_accepted`: the counters, the worker's first accepted gradient, and the step once it is complete.

A gradient that does not fit goes through `misfit`: dropped, and the worker's LIMIT-th in a row gets a fatal
reject (misfits.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.aggregator.common import gradients
from cmemi.services.aggregator.common.admission import WorkerInfo
from cmemi.services.aggregator.leader.parts import LeaderParts
from cmemi.services.aggregator.leader.stepping import Stepper
from cmemi.services.aggregator.steplog import frames
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.wire import limits


class GradIntake:
    def __init__(self, parts: LeaderParts, stepper: Stepper, serve_parked: Callable[[], None]) -> None:
        self.p, self.stepper, self.serve_parked = parts, stepper, serve_parked
        self.contributed: set[tuple[str, int]] = set()  # (worker, incarnation)s whose first gradient was accepted
        # the step log's entry may be the step's gradients as they came (steplog/frames.py): each kept, as it came
        self.keeps = parts.steplog is not None and frames.in_use(parts.codec, parts.trainer)
        self.dense = limits.nbytes(parts.trainer.pieces.values())  # (kept while fewer bytes than this: frames.room)

    def take(self, identity: bytes, info: WorkerInfo, h: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        p, collector = self.p, self.p.leasing.collector
        where = f"{info.wid}: step {h['step']} microbatches [{h['lo']}, {h['hi']})"
        borrowed = p.intake.lent is not None  # views of the worker's slot: read, never kept (intake.py)
        produced, inner_tensors = self._unpacked(tensors, borrowed)
        if (refused := self._refusal(info, h, where)) is not None:
            p.drops(*refused)
            return
        inner, keep, bad = self._inner_state(h, inner_tensors)
        if bad is not None:
            self.misfit(identity, info, bad, where)
            return
        codec = p.checking_codec if collector.strict else p.codec
        kept = frames.received(h, tensors) if self.keeps and frames.room(collector.kept, self.dense) else None
        # (taken before the decode: its results may alias the frames)
        grads, bad, seconds = gradients.decode(codec, p.trainer, h, tensors, p.trainer.expected(h["step"]))
        # a borrowed gradient is copied where it is kept, but the one microbatch of M = 1 under an optimizer that only
        # reads it: stepped from the slot (its worker writes that slot again only after work sent past this step)
        own = p.intake.spares.own if borrowed and not (collector.M == 1 and p.trainer.reads_grads_only) else None
        node = (h["lo"], h["hi"])
        if bad is not None:
            self.misfit(identity, info, bad, where)
        elif p.report_buffers and not p.trainer.valid_buffers(produced):  # model.buffers: mean
            self.misfit(identity, info, "bad_buffers", f"{info.wid}: buffers do not match the model or are not finite")
        elif (reason := collector.offer(node, grads, h["losses"], (info.wid, info.inc),
                                        produced if p.report_buffers else None, own=own, keep=kept)) is not None:
            p.drops(reason, where)
        elif not p.intake.intact():  # the slot was written while summed: this step's sum is unknown, so again
            p.drops("shm_overwritten", f"{where}: its slot was written while read; collecting the step again")
            p.leasing.new_step(collector.step, strict=collector.strict)
            self.serve_parked()
        else:
            self._accepted(identity, info, h, inner, keep, seconds)

    @staticmethod
    def _unpacked(tensors: dict[str, torch.Tensor], borrowed: bool) -> tuple[dict[str, torch.Tensor],
                                                                           dict[str, torch.Tensor]]:
        """(the model's buffers, the inner state's tensors), taken out of `tensors`: what is left is the gradient."""
        produced = {k[len(PREFIX):]: tensors.pop(k).clone() if borrowed else tensors.pop(k)
                    for k in [k for k in tensors if k.startswith(PREFIX)]}
        inner = {k: tensors.pop(k).clone() if borrowed else tensors.pop(k)
                 for k in [k for k in tensors if k.startswith(innerstate.PREFIX + ".")]}
        return produced, inner

    def _refusal(self, info: WorkerInfo, h: dict[str, Any], where: str) -> tuple[str, str] | None:
        """(reason, detail) of a gradient dropped before decoding, or None."""
        collector = self.p.leasing.collector
        if h["step"] != collector.step or h["version"] != self.p.trainer.step:
            return "stale_step", f"{info.wid}: step {h['step']} v{h['version']}, current {collector.step}"
        if (reason := collector.check((h["lo"], h["hi"]), (info.wid, info.inc))) is not None:
            return reason, where
        return None

    def _inner_state(self, h: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[Any, bool, str | None]:
        """(the replica's inner state, whether it is kept once the gradient is accepted, why it does not fit)."""
        trainer = self.p.trainer
        if trainer.inner is None:
            return None, False, None
        # local steps: the state the replica's round ended with, kept once accepted; none where the round ships none
        # (streaming) or another shard keeps the replica's (train.inner_states: shards)
        due = (fragmenting.ships_state(h["step"], trainer.snapshot_every, h["lo"]) if trainer.fragments
               else innerstate.due(h["step"], h["lo"], trainer.cfg.train.state_every))  # (train.state_every)
        return trainer.inner.take(h["lo"], h["inner"], tensors, due)

    def misfit(self, identity: bytes, info: WorkerInfo, reason: str, detail: str) -> None:
        """Drop a gradient that does not fit (misfits.py); the worker's LIMIT-th in a row gets a fatal reject."""
        self.p.drops(reason, detail)
        if (why := self.p.misfits.reject(identity, info.wid, reason, detail, "the aggregator")) is not None:
            self.p.outbox.send(identity, "reject", fatal=True, reason=why)

    def _accepted(self, identity: bytes, info: WorkerInfo, h: dict[str, Any], inner: Any, keep: bool,
                  seconds: float) -> None:
        """`keep`: `inner` is the replica's state its next round starts from (local steps)."""
        p, microbatches = self.p, h["hi"] - h["lo"]
        p.misfits.forget(identity)
        if keep and p.trainer.inner is not None:
            p.trainer.inner.keep(h["lo"], inner)
        p.reporter.codec_s += seconds + float(h["encode_s"])
        if p.trainer.inner is not None:  # local steps: when this worker's replicas land (pace.py)
            p.leasing.pace.accepted(info.wid, bool(h["ahead"]), time.monotonic())
        if h["ahead"]:  # streaming: computed before its lease, so its time says nothing of compute's
            p.totals.segments_ahead += 1
        else:
            p.leasing.reissue.accepted(info, time.monotonic(), microbatches)
        p.reporter.accepted(info.wid, info.inc, microbatches)
        if (info.wid, info.inc) not in self.contributed:
            self.contributed.add((info.wid, info.inc))
            p.ctx.emit("first_grad_accepted", worker=info.wid, incarnation=info.inc, step=h["step"],
                       lo=h["lo"], hi=h["hi"])
        if p.leasing.collector.complete:
            self.stepper.apply()
