"""The sections that say what to train: run, model, data, optimizer (inner and outer), scheduler, train, eval.

Each is a dataclass whose fields carry their docstrings (scripts/config_reference.py turns them into the
manual's table, docs/reference/config.md) and whose `__post_init__` rejects a bad value with an error
naming the field and the fix (checks.py).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cmemi.shared.config.checks import fail, import_path, positive


@dataclass
class RunConfig:
    name: str = "cmemi"
    """Run name: namespaces Redis keys and names the default run directory runs/<name>."""
    dir: str | None = None
    """Run directory (config.yaml, metrics.jsonl, events.jsonl, summary.json, checkpoints/). Default runs/<name>."""
    seed: int = 0
    """Seed for initial weights, data order and per-microbatch RNG (dropout)."""

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " /:{}"):
            fail("run.name", self.name, "must be non-empty without spaces, '/', ':' or braces", "use e.g. 'digits-1'")

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


@dataclass
class ModelConfig:
    factory: str = ""
    """Import path of a function returning a torch.nn.Module, e.g. 'cmemi.examples.digits:make_model'."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the model factory."""
    buffers: Literal["mean", "frozen"] = "mean"
    """Buffers (BatchNorm running stats, counters): mean folds each step's microbatch buffers into the model
    (floating: tree sum / M; integer counters: advanced as one process would); frozen keeps the initial ones."""
    init_from: str | None = None
    """Start from these weights instead of the factory's: a .safetensors file (a run's model.safetensors, `cmemi
    checkpoints export`), a .pt state_dict, a checkpoint directory, another run's directory (its model.safetensors,
    else its latest checkpoint) or a Hugging Face save_pretrained directory (sharded or not; tied weights written once
    are accepted). Loaded by the parameter servers only; null: the factory's initial weights."""
    init_strict: bool = True
    """With model.init_from: every name and shape must match (one line per mismatch). false: load what matches, keep
    the factory's weights for the rest (a new head, say) and list what was skipped in the aggregator's log."""

    def __post_init__(self) -> None:
        import_path("model.factory", self.factory)
        if self.init_from is not None and not str(self.init_from).strip():
            fail("model.init_from", self.init_from, "is empty", "give a path, or null for the factory's weights")
        if self.buffers not in ("mean", "frozen"):
            fail("model.buffers", self.buffers, "must be mean or frozen",
                  "use mean (train BatchNorm statistics) or frozen (keep the initial buffers)")


@dataclass
class DataConfig:
    factory: str = ""
    """Import path of a function returning the training dataset (map-style: __len__ and __getitem__ -> (x, y))."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the dataset factory."""
    workers: int = 0
    """Loader processes per worker reading and collating the next microbatches ahead (0: read in the worker)."""

    def __post_init__(self) -> None:
        import_path("data.factory", self.factory)
        if not 0 <= self.workers <= 32:
            fail("data.workers", self.workers, "must be between 0 and 32",
                  "use 0 to read data in the worker, or 1-2 loader processes for a dataset that augments")


@dataclass
class OptimizerConfig:
    SECTION: typing.ClassVar[str] = "optimizer"
    name: str = "SGD"
    """Any torch.optim class name (SGD, AdamW, ...) or an import path 'module:Class' for a custom optimizer."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 0.1})
    """Keyword arguments for the optimizer constructor (lr, momentum, weight_decay, ...)."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Per-group options: [{match: REGEX, weight_decay: 0.0, ...}]; a parameter joins the first group whose regex
    matches its name (re.search), the rest form the default group with `kwargs`."""

    def __post_init__(self) -> None:
        for i, group in enumerate(self.param_groups):
            if not isinstance(group, dict) or not isinstance(group.get("match"), str):
                fail(f"{self.SECTION}.param_groups[{i}]", group, "must be a mapping with a 'match' regex",
                      "write e.g. {match: 'bias$', weight_decay: 0.0}")
            try:
                re.compile(group["match"])
            except re.error as exc:
                fail(f"{self.SECTION}.param_groups[{i}].match", group["match"], f"is not a valid regex ({exc})",
                      "fix the regular expression")


OUTER_DEFAULT_KWARGS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@dataclass
class OuterOptimizerConfig(OptimizerConfig):
    """With train.local_steps, the servers' optimizer: its defaults are DiLoCo's outer step."""

    SECTION: typing.ClassVar[str] = "outer_optimizer"

    kwargs: dict[str, Any] = field(default_factory=lambda: dict(OUTER_DEFAULT_KWARGS))
    """Keyword arguments for the outer optimizer (default DiLoCo's: SGD with lr 0.7 and Nesterov momentum 0.9);
    set them whenever you change the name."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name != "SGD" and self.kwargs == OUTER_DEFAULT_KWARGS:
            fail("outer_optimizer.kwargs", self.kwargs, f"are the defaults for SGD, not for {self.name}",
                  f"set outer_optimizer.kwargs for {self.name}, e.g. {{lr: 0.7}}")



@dataclass
class SchedulerConfig:
    name: str | None = None
    """Any torch.optim.lr_scheduler class name (CosineAnnealingLR, OneCycleLR, ...) or 'module:Class'; null for none."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the scheduler constructor (the optimizer is passed first)."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Number of global optimizer steps (with local_steps: inner steps of every replica, a multiple of local_steps)."""
    global_batch: int = 64
    """Samples per global step, over all microbatches."""
    microbatches: int = 4
    """M: microbatches per global step. Fixed for the run; independent of the number of workers."""
    loss: str = "torch.nn.functional:cross_entropy"
    """Import path of the loss function loss(output, target) -> scalar tensor (mean over the microbatch)."""
    log_every: int = 1
    """Write a metrics.jsonl line every this many steps."""
    clip_grad_norm: float | None = None
    """Clip the averaged gradient to this global L2 norm on the aggregator (torch.nn.utils.clip_grad_norm_); with
    local_steps, each replica's gradient at each inner step, on the worker."""
    local_steps: int = 0
    """H: local steps (DiLoCo). 0: synchronous, one optimizer step of the servers per global batch. H > 0: every
    round, each of train.replicas replicas takes H inner steps (optimizer, scheduler) from the round's parameters on
    its own data, and the servers apply outer_optimizer to the mean of their changes (docs/design.md §10)."""
    replicas: int = 0
    """R (with local_steps): logical replicas, fixed for the run and independent of the worker count; a lease is one
    replica's round, and each inner step of a replica takes global_batch / R samples. 0: train.microbatches."""
    fragments: int = 1
    """F (with local_steps, Streaming DiLoCo): the model's pieces in F fragments of about equal bytes, fragment p synced
    at the inner steps = (p + 1)·H/F (mod H); a server step is then H/F inner steps and moves one fragment. 1: every
    parameter synced at the end of each round."""
    fragment_mix: float = 0.5
    """α (fragments > 1): a fragment's outer result is merged into each replica one segment later (so the sync may overlap
    the next segment's compute) as α·local + (1 − α)·global."""
    inner_states: str = "shards"
    """Where the servers keep the replicas' inner states (with local_steps, cluster.shards > 1): `shards`, replica r's
    on shard r mod K (the leader is shard 0), so each server's link carries 1/K of them (docs/design/local-steps.md);
    `leader`, every one on the leader, the placement before issue 48, kept as the baseline to measure against."""
    state_every: int = 1
    """D (with local_steps, whole rounds): replica r's inner state goes up beside its change only after rounds t with
    (t + r) mod D = 0 (and round 0), not every round. The trade-off: a server's link takes 1/D of the states' bytes
    (the largest share of a round's bytes once Δ and θ are coded), and a worker's death costs up to D rounds of its
    replica, recomputed bitwise from the last snapshot, for which the servers keep D versions of their pieces
    (docs/design/local-steps.md, "Snapshotted every D rounds"). 1: every round (a death costs one round)."""

    def __post_init__(self) -> None:
        if self.local_steps < 0:
            fail("train.local_steps", self.local_steps, "must be >= 0", "use 0 for synchronous steps, or e.g. 50")
        if self.replicas < 0:
            fail("train.replicas", self.replicas, "must be >= 0", "use e.g. 4, or 0 for train.microbatches")
        if self.replicas and not self.local_steps:
            fail("train.replicas", self.replicas, "counts the replicas of local steps, but train.local_steps is 0",
                  "set train.local_steps (e.g. 50), or leave train.replicas out")
        if self.local_steps and self.replicas:  # a replica's round is one lease: one leaf of the reduction tree
            self.microbatches = self.replicas
        positive("train.steps", self.steps, "set train.steps to the number of optimizer steps, e.g. 100")
        positive("train.global_batch", self.global_batch, "set train.global_batch to e.g. 64")
        positive("train.microbatches", self.microbatches, "set train.microbatches to e.g. 4")
        positive("train.log_every", self.log_every, "set train.log_every to e.g. 1")
        if self.clip_grad_norm is not None:
            positive("train.clip_grad_norm", self.clip_grad_norm, "use e.g. 1.0, or null for no clipping")
        if self.global_batch % self.microbatches:
            fail("train.global_batch", self.global_batch,
                  f"must be divisible by train.microbatches={self.microbatches}",
                  f"use a multiple of {self.microbatches}, e.g. {self.microbatches * max(1, self.global_batch // self.microbatches)}")
        import_path("train.loss", self.loss)
        if self.inner_states not in ("shards", "leader"):
            fail("train.inner_states", self.inner_states, "must be shards or leader",
                  "use shards (replica r's state on shard r mod K), or leader (all on the leader: the old baseline)")
        if self.fragments < 1:
            fail("train.fragments", self.fragments, "must be >= 1", "use 1 for whole rounds, or e.g. 4")
        if self.fragments > 1 and (not self.local_steps or self.local_steps % self.fragments):
            fail("train.fragments", self.fragments, f"must divide train.local_steps={self.local_steps}",
                  "set train.local_steps to a multiple of it (e.g. 4 fragments of a 100-step round)")
        self._check_state_every()
        if not 0 <= self.fragment_mix <= 1:
            fail("train.fragment_mix", self.fragment_mix, "must be in [0, 1]", "use e.g. 0.5")
        if self.local_steps and self.steps % self.local_steps:
            fail("train.steps", self.steps, f"must be a multiple of train.local_steps={self.local_steps} (whole rounds)",
                  f"use e.g. {self.local_steps * max(1, round(self.steps / self.local_steps))}")

    def _check_state_every(self) -> None:
        """`state_every` where a replay from a snapshot D rounds old can be exact: whole rounds of local steps."""
        if self.state_every < 1:
            fail("train.state_every", self.state_every, "must be >= 1", "use 1 (a state every round) or e.g. 8")
        if self.state_every == 1:
            return
        if not self.local_steps:
            fail("train.state_every", self.state_every, "counts rounds of local steps, but train.local_steps is 0",
                 "set train.local_steps (e.g. 200), or leave train.state_every out")
        if self.fragments > 1:
            fail("train.state_every", self.state_every, "applies to whole rounds; streaming sends a replica's state "
                 "every F - 1 segments so that a replay needs no history (fragments.snapshot_period)",
                 "use 1 with train.fragments > 1")

    @property
    def rounds(self) -> int:
        """The servers' steps: train.steps, or with local_steps the rounds (train.steps / local_steps)."""
        return self.steps // self.segment if self.local_steps else self.steps

    @property
    def segment(self) -> int:
        """Inner steps per step of the servers with local_steps: H, or H / fragments (Streaming DiLoCo)."""
        return self.local_steps // self.fragments

    @property
    def samples_per_round(self) -> int:
        """Samples trained per step of the servers: global_batch, or with local_steps that × its inner steps."""
        return self.global_batch * max(1, self.segment)


@dataclass
class EvalConfig:
    fn: str | None = None
    """Import path of evaluate(model) -> dict[str, float], run on the aggregator's parameters; null for none."""
    every_steps: int = 0
    """Evaluate every this many steps during training, in the background on a copy of the weights (0: only at the end)."""
    early_stop_metric: str | None = None
    """Stop training early when this eval metric (a key evaluate() returns) stops improving; null: never."""
    early_stop_mode: Literal["max", "min"] = "max"
    """Whether a larger (max) or smaller (min) early_stop_metric is better."""
    patience: int = 3
    """Periodic evaluations without improvement before stopping early."""

    def __post_init__(self) -> None:
        import_path("eval.fn", self.fn, optional=True)
        if self.every_steps < 0:
            fail("eval.every_steps", self.every_steps, "must be >= 0", "use 0 to evaluate only at the end")
        if self.early_stop_metric is not None and (self.fn is None or self.every_steps == 0):
            fail("eval.early_stop_metric", self.early_stop_metric, "needs periodic evaluation",
                  "set eval.fn and eval.every_steps > 0, or early_stop_metric: null")
        if self.patience < 1:
            fail("eval.patience", self.patience, "must be >= 1", "use e.g. 3")
