"""One replica's round of local steps (`train.local_steps`, DiLoCo): the worker's computation of a lease when the run
takes local steps, shared with `cmemi reference` so both compute the same bits (docs/design.md §10).

Replica r of round t starts from the round's parameters θ_t and buffers, loads its inner optimizer and scheduler state
(the state it ended round t − 1 with; round 0: fresh), and takes H inner steps: step h reads microbatch r of the
virtual step t·H + h with M = R microbatches (shared/core/data.py: a pure function of the seed, so any worker reads the same
samples), computes its gradient as a synchronous microbatch is computed (services/worker/compute/microbatch.py: the same seeding,
the same user-code errors), clips it (train.clip_grad_norm), and steps the inner optimizer and scheduler. Its buffers
carry on from one inner step to the next. The result is Δ_r = θ_t − θ_r, the buffers it ended with (as a contribution
to the round's buffer sum, shared/core/buffers.py), the mean of its inner losses, and its new inner state. The model is
left holding θ_t again, so another replica of the same round needs no new parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.compression.base import all_finite
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.compression.sparse2 import feedback_step
from cmemi.shared.config.plugins import build_optimizer, build_scheduler
from cmemi.shared.config.schema import Config
from cmemi.shared.core import buffers as buffer_rule
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.core.grid import Partition
from cmemi.shared.core.innerstate import InnerState
from cmemi.shared.errors import WireError

READ_AHEAD = 4  # inner steps whose batches a loader reads ahead (data.workers > 0)


class InnerStateError(WireError, ValueError):
    """A replica's inner state does not fit this model's optimizer (another config, or a malformed message)."""


class LocalRound:
    def __init__(self, cfg: Config, runner: MicrobatchRunner, partition: Partition | None = None) -> None:
        """`partition`: the chunk grid, which `lease` gives the change by piece of (and, streaming, whose pieces form
        the fragments)."""
        self.cfg, self.runner = cfg, runner
        self.optimizer = build_optimizer(cfg, runner.params)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.fresh = copy.deepcopy(self.state())  # round 0's: before any inner step
        self.views = partition.views if partition is not None else None
        # streaming (train.fragments > 1): the grid's pieces in fragments, as the servers split them (Trainer), and
        # every how many segments a replica's state goes up (docs/design.md §10)
        self.fragments = (fragmenting.split(partition.pieces, cfg.train.fragments)
                          if partition is not None and cfg.train.fragments > 1 else [])
        self.snapshot_every = fragmenting.snapshot_period(cfg.train.fragments, bool(runner.step_buffers)
                                                          or cfg.compression.replica_residual)
        # sparse2's error feedback: the residual is the replica's (its state's `residual`), so it moves and is replayed
        # with the replica, and any worker sends the same bits (shared/compression/sparse2.py)
        self.feedback = make_codec(cfg.compression) if cfg.compression.replica_residual else None

    def lease(self, step: int, r: int, first: int, state: InnerState | None,
              start_of: Callable[[int], Mapping[str, torch.Tensor]] | None = None) -> tuple[
            float, dict[str, torch.Tensor], dict[str, torch.Tensor] | None, InnerState]:
        """A lease of replica r at server step `step`, from its state at the start of step `first`: its round (`run`),
        or streaming its segment, replayed from a snapshot when `first` < `step` (`replay`; whole rounds with
        train.state_every > 1: `catch_up`, from the versions `start_of` gives); the change by piece of the grid."""
        if self.fragments:
            return self.replay(first, step, r, state)
        if first < step:
            assert start_of is not None
            state = self.catch_up(first, step, r, state, start_of)
        assert self.views is not None
        loss, delta, contribution, new = self.run(step, r, state)
        return loss, self.with_feedback(step, self.views(delta), state, new), contribution, new

    def ships_state(self, step: int, r: int) -> bool:
        """Does replica r's state after this step's lease go up beside its change? (Whole rounds: after the rounds
        `innerstate.due` names, every round with train.state_every = 1.)"""
        if self.fragments:
            return fragmenting.ships_state(step, self.snapshot_every, r)
        return innerstate.due(step, r, self.cfg.train.state_every)

    @property
    def ahead(self) -> bool:
        """Can a replica's next lease be computed before it comes (streaming, docs/design.md §10)? Segment s + 1 merges
        the fragment step s − 1 synced and sends the change of fragment s + 1, neither of which step s changes, so
        version s gives the bits version s + 1 would. Not with travelling buffers (BatchNorm): a segment starts from
        the step's buffers, which step s does change."""
        return bool(self.fragments) and not self.runner.step_buffers

    @property
    def window(self) -> int:
        """How many steps before the leased one a held state may start (the rest is replayed): streaming, the snapshot
        period; whole rounds, train.state_every (a state from before the leased round is replayed: `catch_up`)."""
        return self.snapshot_every if self.fragments else self.cfg.train.state_every

    def state(self) -> InnerState:
        """The inner optimizer's and scheduler's state as they are (their live tensors: the next `load` replaces them,
        so what is handed out is never written again)."""
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load(self, state: InnerState | None) -> None:
        """A replica's state (None: a fresh one, round 0), copied: the one given stays as it is (kept by the leader or
        the reference, or tried again after user code raised)."""
        state = copy.deepcopy(self.fresh if state is None else state)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise InnerStateError(f"a replica's inner state does not fit {self.cfg.optimizer.name} over this model "
                                  f"({type(exc).__name__}: {str(exc)[:200]})") from None

    def run(self, rnd: int, r: int, state: InnerState | None) -> tuple[float, dict[str, torch.Tensor],
                                                                       dict[str, torch.Tensor] | None, InnerState]:
        """Replica r's round `rnd` from the model's parameters (θ) and the step buffers: (mean inner loss, Δ = θ − θ_r,
        buffer contribution or None, the replica's new inner state). Raises UserCodeError as a microbatch does."""
        H = self.cfg.train.local_steps
        self.load(state)
        params = self.runner.params
        start = {n: p.detach().clone() for n, p in params.items()}
        try:
            losses = self._inner_steps(rnd * H, H, r)
            with torch.no_grad():
                delta = {n: start[n].sub(p) for n, p in params.items()}
        finally:
            with torch.no_grad():
                for n, p in params.items():  # θ again, for the next replica of this round
                    p.copy_(start[n])
        return self._finish(rnd, r, losses, delta, self.state())

    def segment(self, seg: int, r: int, state: InnerState | None) -> tuple[float, dict[str, torch.Tensor],
                                                                          dict[str, torch.Tensor] | None, InnerState]:
        """Streaming (train.fragments = F > 1): replica r's segment `seg` of H / F inner steps. The replica's own
        parameters θ_r carry on from its last segment (its state's `params`; the first segment: the model's, θ_0);
        fragment `merged(seg)` is first merged with the model's (the global parameters at this version), and the
        change of fragment `synced(seg)` against them comes back as Δ (by piece of the grid: `views`). The model is left
        holding the global parameters."""
        cfg, L, F, views, fragments = self.cfg, self.cfg.train.segment, self.cfg.train.fragments, self.views, self.fragments
        assert views is not None
        self.load(state)
        params = self.runner.params
        start = {n: p.detach().clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                if state is not None:
                    for n, p in params.items():
                        p.copy_(state["params"][n])
                if (k := fragmenting.merged(seg, F)) is not None:
                    fragmenting.merge(views(params), views(start), fragments[k], cfg.train.fragment_mix)
            losses = self._inner_steps(seg * L, L, r)
            with torch.no_grad():
                local, outer = views(params), views(start)
                delta = {n: outer[n].sub(local[n]) for n in fragments[fragmenting.synced(seg, F)]}
                own = {n: p.detach().clone() for n, p in params.items()}
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(start[n])
        new = {**self.state(), "params": own, "start": seg + 1}
        return self._finish(seg, r, losses, self.with_feedback(seg, delta, state, new), new)

    def with_feedback(self, step: int, delta: dict[str, torch.Tensor], state: InnerState | None,
                      new: InnerState) -> dict[str, torch.Tensor]:
        """sparse2 with error feedback: the change to send, Δ + the replica's residual (by piece of the grid), and
        the residual left after its encoding into `new` (by parameter, as `params`); the residual starts at zero.
        Other codecs: Δ as it is."""
        if self.feedback is None:
            return delta
        assert self.views is not None
        old = state.get("residual") if state is not None else None
        residual = ({n: t.clone() for n, t in old.items()} if old is not None
                    else {n: torch.zeros_like(p, device="cpu") for n, p in self.runner.params.items()})
        new["residual"] = residual
        return feedback_step(self.feedback, delta, self.views(residual), step)

    def replay(self, first: int, seg: int, r: int, state: InnerState | None) -> tuple[
            float, dict[str, torch.Tensor], dict[str, torch.Tensor] | None, InnerState]:
        """Segment `seg` of replica r from its state at the start of segment `first` (a snapshot): the segments in
        between computed again first, at the model's version, which holds every fragment they merge as it was
        (fragments.snapshot_period), so the result is the same bits."""
        for s in range(first, seg):
            state = self.segment(s, r, state)[3]
        return self.segment(seg, r, state)

    def catch_up(self, first: int, rnd: int, r: int, state: InnerState | None,
                 start_of: Callable[[int], Mapping[str, torch.Tensor]]) -> InnerState | None:
        """Whole rounds with train.state_every = D > 1: replica r's state at the start of round `rnd`, from its snapshot
        `state` that starts round `first` (at most D − 1 rounds before): rounds first … rnd − 1 computed again, each from
        the parameters it started from (`start_of(u)`: θ_u by piece of the grid, or with compression.downlink the
        mirror m_u; with travelling buffers, the round's buffers by name too), its own microbatches and, sparse2, its
        residual, as the first run computed them; their changes were summed already and are dropped. The model is left
        holding what it held (θ_rnd and its buffers), for the lease itself."""
        assert self.views is not None
        params, buffers = self.runner.params, self.runner.step_buffers
        held = {n: p.detach().clone() for n, p in {**params, **buffers}.items()}
        try:
            for u in range(first, rnd):
                with torch.no_grad():
                    theta = start_of(u)
                    for n, p in {**self.views(params), **buffers}.items():
                        p.copy_(theta[n])
                _, delta, _, new = self.run(u, r, state)
                if self.feedback is not None:  # the residual advances by the change the round sent
                    self.with_feedback(u, self.views(delta), state, new)
                state = new
        finally:
            with torch.no_grad():
                for n, p in {**params, **buffers}.items():
                    p.copy_(held[n])
        return state

    def _inner_steps(self, first: int, count: int, r: int) -> list[float]:
        """`count` inner steps of replica r from virtual step `first` on: microbatch r of each, its gradient clipped
        (train.clip_grad_norm), the inner optimizer and scheduler stepped. The step buffers carry on."""
        runner, clip = self.runner, self.cfg.train.clip_grad_norm
        params = runner.params
        runner.reset_buffers()
        loader = runner.loader
        if loader is not None:
            loader.want(first, [r])
            for v in range(first + 1, first + min(count, READ_AHEAD)):
                loader.guess(v, [r])
        losses = []
        for h in range(count):
            v = first + h
            if loader is not None and h + READ_AHEAD < count:
                loader.guess(v + READ_AHEAD, [r])
            loss, grads, _ = runner.run_on(v, r)
            for n, p in params.items():
                p.grad = grads[n]
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
        return losses

    def _finish(self, rnd: int, r: int, losses: list[float], delta: dict[str, torch.Tensor],
                state: InnerState) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor] | None, InnerState]:
        runner = self.runner
        produced = ({n: b.detach().to("cpu", copy=True) for n, b in runner.buffers.items()}
                    if runner.report_buffers else None)
        contribution = buffer_rule.contribution(runner.step_buffers, produced) if produced is not None else None
        runner.reset_buffers()
        loss = sum(losses) / len(losses)
        if not all_finite(delta.values()):
            raise FloatingPointError(f"replica {r}'s change in round {rnd} is not finite (mean inner loss {loss}); the "
                                     "run diverged: lower optimizer.kwargs.lr or set train.clip_grad_norm")
        return loss, delta, contribution, state
