"""The aggregator's model, optimizer and LR scheduler: one optimizer.step() and scheduler.step() per global step.

The step and the schedule live here; a sharded server's rows (rows.py) and what goes out of the state (outward.py)
are mixins beside it, each its own job, on the same object (callers keep one `Trainer`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.aggregator.common.trainer.outward import Outward
from cmemi.services.aggregator.common.trainer.rows import OwnRows
from cmemi.services.aggregator.common.trainer.scaler import LossScaler
from cmemi.shared.compression.downlink import Mirror
from cmemi.shared.config import initweights
from cmemi.shared.config.plugins import build_model, build_optimizer, build_scheduler
from cmemi.shared.config.schema import Config
from cmemi.shared.core import buffers as buffer_rule
from cmemi.shared.core import fragments as fragmenting
from cmemi.shared.core import innerstate
from cmemi.shared.core.grid import Partition, clip_coefficient
from cmemi.shared.core.history import Versions
from cmemi.shared.memory import allocator
from cmemi.shared.wire import limits


class Trainer(OwnRows, Outward):
    def __init__(self, cfg: Config, shard: int = 0, shards: int | None = None) -> None:
        """Shard `shard` of `shards` (default cluster.shards) steps the pieces of the chunk grid it owns
        (shared/core/grid.py); the whole model is built everywhere (the same initial weights), and shard 0 also
        owns the travelling buffers. One shard, and no tensor over a chunk: the pieces are the parameters."""
        self.cfg, self.shard = cfg, shard
        self.model = build_model(cfg)
        if cfg.model.init_from:  # the servers alone load it: one canonical copy, sent to the workers (shared/config/initweights.py)
            initweights.load_into(self.model, cfg.model.init_from, cfg.model.init_strict)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.partition = Partition(self.params, cfg.cluster.shards if shards is None else shards,
                                   cfg.cluster.pipeline_stages, cfg.compression.whole_pieces)
        owned = self.partition.views(self.params, shard)
        # the optimizer's parameters: the owned pieces, each a leaf aliasing its rows of the model's tensor
        self.pieces: dict[str, torch.Tensor] = {n: v if v is self.params.get(n) else torch.nn.Parameter(v)
                                                for n, v in owned.items()}  # each a Parameter
        # a shard that owns no piece (more shards than pieces) still keeps the LR schedule, on an empty tensor.
        # With train.local_steps the servers' optimizer is the outer one, stepped once a round (no schedule), and the
        # leader keeps the replicas' inner states (services/aggregator/common/replicas.py)
        self.local = bool(cfg.train.local_steps)
        self.optimizer_section = "outer_optimizer" if self.local else "optimizer"
        self.optimizer = build_optimizer(cfg, self.pieces or [torch.nn.Parameter(torch.zeros(0))],
                                         self.optimizer_section)
        self.scheduler = None if self.local else build_scheduler(cfg, self.optimizer)
        # (train.inner_states: shards, K > 1: shard k keeps the states of replicas r ≡ k mod K, innerstate.owner)
        spread = cfg.train.inner_states == "shards" and self.partition.shards > 1
        self.inner = (InnerStates(cfg.train.microbatches, innerstate.owned(cfg.train.microbatches, shard,
                                                                            self.partition.shards,
                                                                            cfg.train.inner_states))
                      if self.local and (shard == 0 or spread) else None)
        # streaming (train.fragments > 1): the grid's pieces in fragments; step s steps fragment s mod F alone
        self.fragments = (fragmenting.split(self.partition.pieces, cfg.train.fragments)
                          if self.local and cfg.train.fragments > 1 else [])
        self.snapshot_every = fragmenting.snapshot_period(cfg.train.fragments, bool(buffer_rule.travelling(self.model))
                                                          or cfg.compression.replica_residual)
        self.scaler = LossScaler(cfg.precision == "fp16")
        self.step = 0  # number of global steps consumed == parameter version
        self.skipped = 0  # steps whose optimizer.step() was skipped (fp16 overflow)
        self.last_grad_norm: float | None = None  # before clipping, when train.clip_grad_norm is set
        self.shapes = {n: tuple(p.shape) for n, p in self.pieces.items()}  # of the gradients this shard receives
        self.buffers = buffer_rule.travelling(self.model) if shard == 0 else {}  # empty for most MLPs
        self.dropped: dict[str, torch.Size] = {}  # trained tensors whose rows live on other shards (keep_own_rows)
        # compression.downlink: the workers' mirror of these pieces (shared/compression/downlink.py), moved after every step
        self.mirror = Mirror(cfg.compression, self.pieces) if cfg.compression.downlink != "none" else None
        self.model.train()  # as on the workers (evaluation switches to eval() and back)
        # called before an optimizer step changes the live tensors in place: what still sends them (a snapshot's
        # unsent parts, parameters queued zero-copy for a worker) copies or moves them first
        self.before_change: list[Callable[[], None]] = []
        self._trims = allocator.worth_trimming(limits.nbytes(self.params.values()))
        # train.state_every = D > 1 (whole rounds): what each round of the window started from, for a moved replica's
        # replay (shared/core/history.py); with D = 1 nothing is kept
        self.history = Versions(cfg.train.microbatches, cfg.train.state_every if self.local and not self.fragments
                                else 1)
        self.history.keep(0, self.wire_state())

    @property
    def reads_grads_only(self) -> bool:
        """Does a step only read the gradients it is given (no clipping, no loss scaling, one of torch's own optimizers,
        which compute out of place)? Then a single microbatch's gradient may be stepped from where it lies."""
        return ((self.cfg.train.clip_grad_norm is None or self.local) and not self.scaler.enabled
                and type(self.optimizer).__module__.startswith("torch.optim."))

    def drop_optimizer_state(self) -> None:
        """The run is over and its final checkpoint written: the optimizer's state is not needed any more."""
        self.optimizer.state.clear()

    def release_heap(self) -> None:
        """After a step, its gradient sum freed: the heap's free pages go back to the kernel (a model of 64 MiB or
        more, shared/memory/allocator.py), so that freed gradient pieces do not raise the next step's peak."""
        if self._trims:
            allocator.trim()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def expected(self, step: int, names: list[str] | None = None) -> list[str] | None:
        """The pieces (of `names`, default all of this shard's: None) whose gradients step `step` takes: streaming
        (train.fragments > 1), those of the fragment it syncs; otherwise `names` as given."""
        if not self.fragments:
            return names
        synced = set(self.fragments[fragmenting.synced(step, len(self.fragments))])
        return [n for n in (self.pieces if names is None else names) if n in synced]

    def check_grads(self, grads: dict[str, torch.Tensor], names: list[str] | None = None) -> str | None:
        """Why gradients for this shard's pieces (or those `names`: a pipelined stage's) would be dropped, or None."""
        if grads.keys() != (self.pieces.keys() if names is None else set(names)):
            return "grad_names"
        for n, g in grads.items():
            if tuple(g.shape) != self.shapes[n] or g.dtype != torch.float32:
                return "grad_shape"
        return None

    def valid_buffers(self, reported: dict[str, torch.Tensor]) -> bool:
        """Do reported buffers (or a buffer contribution) match the model and are they finite? (Honest workers
        stop the run before sending anything else.)"""
        return buffer_rule.check(reported, self.buffers) and all(
            bool(torch.isfinite(b).all()) for b in reported.values() if b.is_floating_point())

    def contribution(self, produced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A microbatch's produced buffers as a term of the step's buffer sum; None if they are not valid."""
        return buffer_rule.contribution(self.buffers, produced) if self.valid_buffers(produced) else None

    def partials(self, mean_grads: dict[str, torch.Tensor] | None) -> list[float]:
        """This shard's share of the global gradient norm: one squared norm per owned piece, in grid order
        (empty without train.clip_grad_norm, or for a skipped step)."""
        if mean_grads is None or self.cfg.train.clip_grad_norm is None or self.local:
            return []
        return self.partition.partials(mean_grads, self.shard)

    def apply(self, mean_grads: dict[str, torch.Tensor] | None,
              buffer_sum: dict[str, torch.Tensor] | None = None, partials: list[float] | None = None) -> None:
        """One global step of this shard's pieces. `None` (a microbatch overflowed): skip optimizer.step() as
        GradScaler.step() would, but step the scheduler, as the usual AMP loop does, so the schedule stays aligned.
        `buffer_sum` (model.buffers: mean): the tree sum of the microbatches' buffer contributions.
        Clipping (train.clip_grad_norm): the global norm is the sum of one squared norm per piece of the grid, in
        grid order (`partials`: every shard's, in shard order; default: this shard's own, all of them at K = 1),
        and every piece is scaled by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ scales."""
        for hook in self.before_change:
            hook()
        if buffer_sum is not None:
            buffer_rule.fold(self.buffers, buffer_sum, self.cfg.train.microbatches)
        if mean_grads is not None:  # (streaming: only the step's fragment has gradients; the rest is not stepped)
            for n, g in mean_grads.items():
                self.pieces[n].grad = g
            if (max_norm := self.cfg.train.clip_grad_norm) is not None and not self.local:  # of the summed gradient
                self.last_grad_norm, coef = clip_coefficient(self.partials(mean_grads) if partials is None
                                                             else partials, max_norm)
                for g in mean_grads.values():
                    g.mul_(coef)
            self.optimizer.step()
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.end_step(overflow=mean_grads is None)

    def apply_stage(self, mean_grads: dict[str, torch.Tensor]) -> None:
        """A pipelined step's stage (cluster.pipeline_stages: no clipping, no loss scaling): optimizer.step() over
        these pieces alone, at the step's LR. The optimizers allowed at K > 1 step each piece on its own, so the
        stages of a step give bitwise what one call over all pieces gives; `end_step` then steps the schedule."""
        for hook in self.before_change:
            hook()
        for n, g in mean_grads.items():  # (none: a stage or shard without pieces; the schedule wants a step)
            self.pieces[n].grad = g
        self.optimizer.step()
        for n in mean_grads:
            self.pieces[n].grad = None

    def end_step(self, overflow: bool = False) -> None:
        """After the step's optimizer.step() (a pipelined step's: after its last stage): the loss scale, the LR
        schedule, the version."""
        self.scaler.update(overflow=overflow)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        if self.inner is not None:
            self.inner.advance()
        if self.mirror is not None:
            self.mirror.advance(self.pieces, self.step)
        if self.history.on:  # (train.state_every > 1 only: wire_state builds the step's buffers' dict every step)
            self.history.keep(self.step, self.wire_state())
