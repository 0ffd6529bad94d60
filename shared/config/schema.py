"""The one config schema of a CMEMI run: typed sections, validated on load, errors that name the fix.

`load_config(path, overrides)` is the single source of truth: YAML file, then `CMEMI_*`
environment overrides, then `--set a.b=c` overrides, then validation. The effective config is
saved with the run (`dump_config`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from cmemi.shared.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is missing, malformed or inconsistent; the message names the field and the fix."""


def _fail(path: str, value: Any, why: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"config field '{path}' = {value!r}: {why}; {fix}")


def _positive(path: str, value: float, fix: str) -> None:
    if value <= 0:
        _fail(path, value, "must be > 0", fix)


def _import_path(path: str, value: str | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or ":" not in value:
        _fail(path, value, "must be an import path 'package.module:attribute'", f"set {path} to e.g. 'cmemi.examples.digits:make_model'")


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
            _fail("run.name", self.name, "must be non-empty without spaces, '/', ':' or braces", "use e.g. 'digits-1'")

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
    checkpoints export`), a .pt state_dict, a checkpoint directory or another run's directory (its model.safetensors,
    else its latest checkpoint). Loaded by the parameter servers only; null: the factory's initial weights."""
    init_strict: bool = True
    """With model.init_from: every name and shape must match (one line per mismatch). false: load what matches, keep
    the factory's weights for the rest (a new head, say) and list what was skipped in the aggregator's log."""

    def __post_init__(self) -> None:
        _import_path("model.factory", self.factory)
        if self.init_from is not None and not str(self.init_from).strip():
            _fail("model.init_from", self.init_from, "is empty", "give a path, or null for the factory's weights")
        if self.buffers not in ("mean", "frozen"):
            _fail("model.buffers", self.buffers, "must be mean or frozen",
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
        _import_path("data.factory", self.factory)
        if not 0 <= self.workers <= 32:
            _fail("data.workers", self.workers, "must be between 0 and 32",
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
                _fail(f"{self.SECTION}.param_groups[{i}]", group, "must be a mapping with a 'match' regex",
                      "write e.g. {match: 'bias$', weight_decay: 0.0}")
            try:
                re.compile(group["match"])
            except re.error as exc:
                _fail(f"{self.SECTION}.param_groups[{i}].match", group["match"], f"is not a valid regex ({exc})",
                      "fix the regular expression")


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
            _fail("outer_optimizer.kwargs", self.kwargs, f"are the defaults for SGD, not for {self.name}",
                  f"set outer_optimizer.kwargs for {self.name}, e.g. {{lr: 0.7}}")


OUTER_DEFAULT_KWARGS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


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

    def __post_init__(self) -> None:
        if self.local_steps < 0:
            _fail("train.local_steps", self.local_steps, "must be >= 0", "use 0 for synchronous steps, or e.g. 50")
        if self.replicas < 0:
            _fail("train.replicas", self.replicas, "must be >= 0", "use e.g. 4, or 0 for train.microbatches")
        if self.replicas and not self.local_steps:
            _fail("train.replicas", self.replicas, "counts the replicas of local steps, but train.local_steps is 0",
                  "set train.local_steps (e.g. 50), or leave train.replicas out")
        if self.local_steps and self.replicas:  # a replica's round is one lease: one leaf of the reduction tree
            self.microbatches = self.replicas
        _positive("train.steps", self.steps, "set train.steps to the number of optimizer steps, e.g. 100")
        _positive("train.global_batch", self.global_batch, "set train.global_batch to e.g. 64")
        _positive("train.microbatches", self.microbatches, "set train.microbatches to e.g. 4")
        _positive("train.log_every", self.log_every, "set train.log_every to e.g. 1")
        if self.clip_grad_norm is not None:
            _positive("train.clip_grad_norm", self.clip_grad_norm, "use e.g. 1.0, or null for no clipping")
        if self.global_batch % self.microbatches:
            _fail("train.global_batch", self.global_batch,
                  f"must be divisible by train.microbatches={self.microbatches}",
                  f"use a multiple of {self.microbatches}, e.g. {self.microbatches * max(1, self.global_batch // self.microbatches)}")
        _import_path("train.loss", self.loss)
        if self.fragments < 1:
            _fail("train.fragments", self.fragments, "must be >= 1", "use 1 for whole rounds, or e.g. 4")
        if self.fragments > 1 and (not self.local_steps or self.local_steps % self.fragments):
            _fail("train.fragments", self.fragments, f"must divide train.local_steps={self.local_steps}",
                  "set train.local_steps to a multiple of it (e.g. 4 fragments of a 100-step round)")
        if not 0 <= self.fragment_mix <= 1:
            _fail("train.fragment_mix", self.fragment_mix, "must be in [0, 1]", "use e.g. 0.5")
        if self.local_steps and self.steps % self.local_steps:
            _fail("train.steps", self.steps, f"must be a multiple of train.local_steps={self.local_steps} (whole rounds)",
                  f"use e.g. {self.local_steps * max(1, round(self.steps / self.local_steps))}")

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
        _import_path("eval.fn", self.fn, optional=True)
        if self.every_steps < 0:
            _fail("eval.every_steps", self.every_steps, "must be >= 0", "use 0 to evaluate only at the end")
        if self.early_stop_metric is not None and (self.fn is None or self.every_steps == 0):
            _fail("eval.early_stop_metric", self.early_stop_metric, "needs periodic evaluation",
                  "set eval.fn and eval.every_steps > 0, or early_stop_metric: null")
        if self.patience < 1:
            _fail("eval.patience", self.patience, "must be >= 1", "use e.g. 3")


@dataclass
class ClusterConfig:
    workers: int = 2
    """Number of worker processes `cmemi up` starts."""
    redis: str | None = None
    """Redis URL (redis://[:password@]host:port/db). Null: `cmemi up` starts a private redis-server."""
    host: str = "127.0.0.1"
    """Address the aggregator and checkpointer bind to and advertise. Never 0.0.0.0 unless you mean it."""
    aggregator_port: int = 0
    """Aggregator port (0: a free port, advertised through Redis)."""
    checkpointer_port: int = 0
    """Checkpointer port (0: a free port, advertised through Redis)."""
    threads_per_worker: int = 1
    """torch intra-op threads per worker (and aggregator). Same value everywhere keeps results bitwise identical."""
    heartbeat_interval: float = 0.2
    """Seconds between heartbeats."""
    dead_after: float = 2.0
    """A process whose heartbeat is older than this many seconds is declared dead, fenced and replaced."""
    lease_timeout: float = 30.0
    """A lease not returned within this many seconds per microbatch it holds goes back to the queue, as single microbatches."""
    spare_workers: int = 1
    """Warm spare worker processes `cmemi up` keeps ready (torch imported, data loaded) to replace a dead worker fast; started once the first step is done (until then they would compete with it for the CPU)."""
    max_restarts: int = 10
    """Restarts in a row per process (each within 60 s of the last start) before the coordinator gives up on it and reports it."""
    start_timeout: float = 180.0
    """A started process that has not registered in Redis within this many seconds is taken for hung, killed and restarted."""
    zygote_imports: bool = True
    """`cmemi up`'s zygote imports the modules the config names (model.factory, data.factory, ...) once, before it
    forks the services, so no process imports them again (import only: no factory is called). false: each service
    imports them itself (a module that starts threads, opens a GPU or a connection at import time)."""
    max_message_bytes: int | None = None
    """Largest ZeroMQ message (and frame) sent or accepted; bigger messages travel in parts of at most this size.
    null: 4 x the model's parameter + buffer bytes + 16 MiB, at most 64 MiB."""
    checksum: bool = True
    """Verify an xxh3 checksum of every tensor frame on receipt."""
    shards: int = 1
    """Parameter-server shards: the parameters, cut on a fixed chunk grid, are split over this many aggregator
    processes, balanced by bytes; each steps its own slice (see docs/guides/scaling-out.md). Any value gives the
    same params_sha256."""
    pipeline_stages: int = 0
    """With cluster.shards > 1: 0 steps every slice at once, after the whole step is in (two-phase, any
    train.clip_grad_norm or precision). S > 0 pipelines: the leader (shard 0) only leases and commits and holds no
    parameters, shards 1..K-1 cut their slice into S stages, step each stage as soon as every microbatch's copy of it
    is in and send it back at once, while later stages still arrive (for dedicated server hosts; needs no
    train.clip_grad_norm and no fp16). The same params_sha256 either way."""
    transport: str = "auto"
    """How workers reach the aggregator and its shards. auto: a server on this host over ipc:// (a Unix socket in a
    0700 directory, same uid and a worker key checked, no encryption), with the tensors in shared-memory slots for a
    model of at most 64 MiB of parameters (only descriptors cross the socket), a remote one over CurveZMQ tcp://;
    tcp: CurveZMQ tcp:// everywhere; shm: same-host servers only (a remote one is refused with one line)."""
    require_same_environment: bool = True
    """Refuse a worker whose torch version, thread count, CPU instruction set or device differs (bitwise
    equality needs them equal); false admits it with a warning."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            _fail("cluster.workers", self.workers, "must be >= 1", "set cluster.workers to the number of worker processes, e.g. 2")
        if self.threads_per_worker < 1:
            _fail("cluster.threads_per_worker", self.threads_per_worker, "must be >= 1", "use 1 (the default)")
        for name in ("aggregator_port", "checkpointer_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                _fail(f"cluster.{name}", port, "must be a TCP port 0..65535", "use 0 for a free port")
        _positive("cluster.heartbeat_interval", self.heartbeat_interval, "use e.g. 0.2")
        if self.dead_after <= 2 * self.heartbeat_interval:
            _fail("cluster.dead_after", self.dead_after,
                  f"must be more than twice cluster.heartbeat_interval={self.heartbeat_interval}",
                  f"use at least {3 * self.heartbeat_interval:g}")
        _positive("cluster.lease_timeout", self.lease_timeout, "use e.g. 30")
        if self.spare_workers < 0:
            _fail("cluster.spare_workers", self.spare_workers, "must be >= 0", "use 1 (or 0 to save memory)")
        if self.max_restarts < 0:
            _fail("cluster.max_restarts", self.max_restarts, "must be >= 0", "use e.g. 10")
        _positive("cluster.start_timeout", self.start_timeout, "use e.g. 180")
        if self.max_message_bytes is not None and self.max_message_bytes < 1 << 16:
            _fail("cluster.max_message_bytes", self.max_message_bytes, "must be >= 65536", "use e.g. 2147483648")
        if not 1 <= self.shards <= 64:
            _fail("cluster.shards", self.shards, "must be 1..64", "use 1, or one shard per host")
        if not 0 <= self.pipeline_stages <= 64:
            _fail("cluster.pipeline_stages", self.pipeline_stages, "must be 0..64", "use 0, or e.g. 4")
        if self.pipeline_stages and self.shards < 2:
            _fail("cluster.pipeline_stages", self.pipeline_stages, "pipelines the steps of 2 or more shards",
                  "set cluster.shards >= 2 (the leader and at least one shard), or cluster.pipeline_stages: 0")
        if self.transport not in ("auto", "tcp", "shm"):
            _fail("cluster.transport", self.transport, "must be one of auto, tcp, shm",
                  "use auto (same-host peers over ipc://, remote ones over CurveZMQ tcp://), or tcp")
        if self.redis is not None and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            _fail("cluster.redis", self.redis, "must be a redis:// or rediss:// URL", "e.g. redis://:password@10.0.0.5:6379/0, or null")


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Snapshot every this many steps (0: only the final model)."""
    keep_last: int = 5
    """How many of the newest checkpoints to keep."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones); 0 for none."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            _fail("checkpoint.every_steps", self.every_steps, "must be >= 0", "use 0 for final-only")
        if self.keep_last < 1:
            _fail("checkpoint.keep_last", self.keep_last, "must be >= 1", "use e.g. 5")
        if self.keep_every < 0:
            _fail("checkpoint.keep_every", self.keep_every, "must be >= 0", "use 0 for no milestones")


@dataclass
class MetricsConfig:
    enabled: bool = False
    """Serve Prometheus metrics at http://HOST:PORT/metrics from every service."""
    host: str = "127.0.0.1"
    """Address the /metrics endpoints bind to."""
    port: int = 0
    """Port of the /metrics endpoint (0: a free port per service, advertised in its Redis member record as metrics_url)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            _fail("metrics.port", self.port, "must be a TCP port 0..65535", "use 0 for a free port per service")


@dataclass
class SecurityConfig:
    curve: bool = True
    """Encrypt and authenticate every ZeroMQ connection with CurveZMQ, one key per role; false only on a trusted network."""
    keys_dir: str | None = None
    """Key directory from `cmemi keys DIR` (a host needs its role's *.key_secret and the public *.key files); null: `cmemi up` makes RUN_DIR/keys."""


CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "sign")
DOWNLINKS = ("none", "bf16", "int8", "topk", "powersgd", "sign")


@dataclass
class CompressionConfig:
    codec: str = "none"
    """Gradient codec: none, fp16, bf16, int8, topk, powersgd or sign (worker encodes, aggregator decodes)."""
    topk_ratio: float = 0.01
    """topk: fraction of each tensor's entries sent, k = max(1, ceil(ratio * numel)); 0 < ratio <= 1."""
    powersgd_rank: int = 2
    """powersgd: rank of the per-tensor low-rank approximation P @ Q^T."""
    int8_chunk: int = 1024
    """int8 and sign: elements per fp32 scale (int8: the chunk's absmax, sign: its mean magnitude)."""
    min_compress_numel: int = 1024
    """Tensors with fewer elements (biases, norms) are sent dense fp32."""
    warmup_steps: int = 0
    """Global steps < warmup_steps send dense fp32 gradients whatever the codec, and (with downlink) their parameter
    changes raw fp32 too."""
    error_feedback: bool = True
    """topk, powersgd and sign: keep what was not sent and add it to the next step's gradient (per worker)."""
    downlink: str = "none"
    """Parameters sent to workers: none (dense, as they are), or the change of a mirror of them through bf16, int8,
    topk, powersgd or sign (same options as above); the servers keep what was not sent (docs/design.md §9)."""

    @property
    def whole_pieces(self) -> bool:
        """powersgd either way with a downlink that sends a few percent of the parameters (powersgd, sign or topk): the
        chunk grid's pieces are whole tensors up to 4 MiB (shared/core/grid.py), so matrices are factored whole. Not with
        dense, bf16 or int8 parameters down: K shards must share those bytes evenly."""
        return "powersgd" in (self.codec, self.downlink) and self.downlink in ("powersgd", "sign", "topk")

    def __post_init__(self) -> None:
        if self.downlink not in DOWNLINKS:
            _fail("compression.downlink", self.downlink, f"must be one of {', '.join(DOWNLINKS)}",
                  "use 'none' for dense parameters, or e.g. 'powersgd'")
        if self.codec not in CODECS:
            _fail("compression.codec", self.codec, f"must be one of {', '.join(CODECS)}",
                  "use 'none' for dense fp32 gradients, or e.g. 'topk'")
        if not 0 < self.topk_ratio <= 1:
            _fail("compression.topk_ratio", self.topk_ratio, "must be in (0, 1]", "use e.g. 0.01")
        if self.powersgd_rank < 1:
            _fail("compression.powersgd_rank", self.powersgd_rank, "must be >= 1", "use e.g. 2")
        if self.int8_chunk < 1:
            _fail("compression.int8_chunk", self.int8_chunk, "must be >= 1", "use e.g. 1024")
        if self.min_compress_numel < 0:
            _fail("compression.min_compress_numel", self.min_compress_numel, "must be >= 0", "use e.g. 1024")
        if self.warmup_steps < 0:
            _fail("compression.warmup_steps", self.warmup_steps, "must be >= 0", "use 0 for no warmup")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """With train.local_steps: the servers' optimizer, stepped once a round on the mean change of the replicas'
    parameters (DiLoCo's outer step; default SGD with Nesterov momentum 0.9 and lr 0.7, as the paper); `optimizer`
    and `scheduler` are then each replica's inner ones. Unused without local steps."""
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Workers' forward/backward precision: fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling
    coordinated by the aggregator, like torch.amp.GradScaler). Master weights and optimizer state stay fp32."""
    device: str = "auto"
    """Where workers compute: auto (a GPU if torch sees one, else cpu), cpu, cuda (one GPU per worker: w0 on
    cuda:0, w1 on cuda:1, ... modulo the host's GPU count) or cuda:N. The aggregator's optimizer runs on its CPU."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            _fail("device", self.device, "must be auto, cpu, cuda or cuda:N", "use auto")
        if self.cluster.shards > 1 and not self.train.local_steps:  # (local steps: the outer one, _check_local)
            if self.optimizer.name not in ELEMENTWISE_OPTIMIZERS:
                _fail("optimizer.name", self.optimizer.name, "is not known to update each element on its own, so "
                      f"cluster.shards: {self.cluster.shards} could change its result",
                      f"use one of {', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}, or cluster.shards: 1")
        if self.train.local_steps:
            self._check_local()
        if self.cluster.pipeline_stages:  # a pipelined stage is stepped before the step's global quantities exist
            if self.train.clip_grad_norm is not None:
                _fail("train.clip_grad_norm", self.train.clip_grad_norm, "needs the whole step's gradient norm, "
                      "so it cannot be used with cluster.pipeline_stages", "set cluster.pipeline_stages: 0")
            if self.precision == "fp16":
                _fail("precision", self.precision, "skips a step when any gradient overflows, so it cannot be used "
                      "with cluster.pipeline_stages", "use bf16 or fp32, or cluster.pipeline_stages: 0")
            if self.compression.downlink != "none":
                _fail("compression.downlink", self.compression.downlink, "sends each version's change once it is "
                      "whole, so it cannot be used with cluster.pipeline_stages",
                      "set compression.downlink: none, or cluster.pipeline_stages: 0")

    def _check_local(self) -> None:
        """What local steps (train.local_steps) cannot be combined with."""
        if self.precision == "fp16":
            _fail("precision", self.precision, "skips a step on overflow with a loss scale the servers keep, which "
                  "replicas stepping on their own do not have", "use bf16 or fp32 with train.local_steps")
        if self.cluster.pipeline_stages:
            _fail("cluster.pipeline_stages", self.cluster.pipeline_stages, "pipelines steps of the servers, of which "
                  "local steps take one a round", "set cluster.pipeline_stages: 0 with train.local_steps")
        if self.compression.downlink != "none":
            _fail("compression.downlink", self.compression.downlink, "is not built for local steps yet",
                  "set compression.downlink: none with train.local_steps")
        if self.compression.codec in ("topk", "powersgd", "sign") and self.compression.error_feedback:
            _fail("compression.codec", self.compression.codec, "keeps a residual per worker, but a replica's round "
                  "may go to any worker", "use none, bf16 or int8 for the replicas' changes, or "
                  "compression.error_feedback: false")
        if self.outer_optimizer.name not in ELEMENTWISE_OPTIMIZERS and self.cluster.shards > 1:
            _fail("outer_optimizer.name", self.outer_optimizer.name, "is not known to update each element on its own, "
                  f"so cluster.shards: {self.cluster.shards} could change its result",
                  f"use one of {', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}, or cluster.shards: 1")


# torch.optim classes whose update of an element depends only on that element's gradient and state (and the step,
# LR): a shard can step its slice alone. Not: LBFGS (a line search over all), Adafactor (row/column statistics).
ELEMENTWISE_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                                    "RAdam", "RMSprop", "Rprop"})


# ---------------------------------------------------------------- building from plain data

def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        _fail(prefix or "<root>", data, "must be a mapping", f"write {prefix or 'the file'} as 'key: value' lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"config: unknown key '{_join(prefix, unknown[0])}' in {where}; "
                          f"valid keys are: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = _join(prefix, name)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, {} if value is None else value, path)
        elif not _type_ok(value, tp):
            _fail(path, value, f"expected {_type_name(tp)}, got {type(value).__name__}", f"set {path} to a {_type_name(tp)}")
        else:
            kwargs[name] = float(value) if tp is float else value
    return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set cluster.workers=3")
    key, text = item.split("=", 1)
    value = yaml.load(text, Loader=_Loader) if text else None
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: '{part}' is not a section")
    node[parts[-1]] = value


ENV_PREFIX = "CMEMI__"


def env_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """`CMEMI__CLUSTER__REDIS=redis://...` becomes the override `cluster.redis=redis://...`."""
    environ = dict(os.environ) if environ is None else environ
    return [f"{k[len(ENV_PREFIX):].lower().replace('__', '.')}={v}"
            for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIX)]


def config_from_dict(raw: dict[str, Any], overrides: list[str] = ()) -> Config:
    raw = _deepcopy(raw)
    for item in overrides:
        _apply_override(raw, item)
    return _build(Config, raw, "")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 3e-3 as a string; read it as the float every user means (as YAML 1.2 does)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_config(path: str | Path, overrides: list[str] = (), environ: dict[str, str] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass the path of a YAML file, e.g. examples/digits.yaml")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from None
    return config_from_dict(raw, [*env_overrides(environ), *overrides])


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _deepcopy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deepcopy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deepcopy(v) for v in raw]
    return raw
