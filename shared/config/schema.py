"""The one config schema of a CMEMI run: the root `Config`, its sections and the checks that span sections.

Its sections live by concern in training.py (what to train) and system.py (how the run is carried out);
loading.py builds a `Config` from YAML, `CMEMI__*` environment overrides and `--set a.b=c` overrides, the single
source of truth, and saves the effective config with the run (`dump_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from cmemi.shared.config.checks import fail
from cmemi.shared.config.system import (
    CheckpointConfig,
    ClusterConfig,
    CompressionConfig,
    MetricsConfig,
    SecurityConfig,
)
from cmemi.shared.config.training import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimizerConfig,
    OuterOptimizerConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
)


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
            fail("device", self.device, "must be auto, cpu, cuda or cuda:N", "use auto")
        if self.cluster.shards > 1 and not self.train.local_steps:  # (local steps: the outer one, _check_local)
            if self.optimizer.name not in ELEMENTWISE_OPTIMIZERS:
                fail("optimizer.name", self.optimizer.name, "is not known to update each element on its own, so "
                      f"cluster.shards: {self.cluster.shards} could change its result",
                      f"use one of {', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}, or cluster.shards: 1")
        if self.train.local_steps:
            self._check_local()
        elif self.compression.codec == "sparse2" and self.compression.error_feedback:
            fail("compression.codec", self.compression.codec, "keeps its residual in a replica's state, which only "
                  "train.local_steps has", "use topk for synchronous steps, or compression.error_feedback: false")
        if self.cluster.pipeline_stages:  # a pipelined stage is stepped before the step's global quantities exist
            if self.train.clip_grad_norm is not None:
                fail("train.clip_grad_norm", self.train.clip_grad_norm, "needs the whole step's gradient norm, "
                      "so it cannot be used with cluster.pipeline_stages", "set cluster.pipeline_stages: 0")
            if self.precision == "fp16":
                fail("precision", self.precision, "skips a step when any gradient overflows, so it cannot be used "
                      "with cluster.pipeline_stages", "use bf16 or fp32, or cluster.pipeline_stages: 0")
            if self.compression.downlink != "none":
                fail("compression.downlink", self.compression.downlink, "sends each version's change once it is "
                      "whole, so it cannot be used with cluster.pipeline_stages",
                      "set compression.downlink: none, or cluster.pipeline_stages: 0")

    def _check_local(self) -> None:
        """What local steps (train.local_steps) cannot be combined with."""
        if self.precision == "fp16":
            fail("precision", self.precision, "skips a step on overflow with a loss scale the servers keep, which "
                  "replicas stepping on their own do not have", "use bf16 or fp32 with train.local_steps")
        if self.cluster.pipeline_stages:
            fail("cluster.pipeline_stages", self.cluster.pipeline_stages, "pipelines steps of the servers, of which "
                  "local steps take one a round", "set cluster.pipeline_stages: 0 with train.local_steps")
        if self.compression.downlink != "none" and self.train.fragments > 1:
            # whole rounds start from the mirror m_t (docs/design.md §10); a segment's parameters are the replica's
            # own, merged with the global fragment (s − 2) mod F, which a mirror would have to carry per fragment
            fail("compression.downlink", self.compression.downlink, "is built for whole rounds, not streaming: a "
                  "segment already takes only the changed fragment down (1/F of the parameters)",
                  "set compression.downlink: none with train.fragments > 1, or train.fragments: 1")
        if self.compression.codec in ("topk", "powersgd", "sign") and self.compression.error_feedback:
            fail("compression.codec", self.compression.codec, "keeps a residual per worker, but a replica's round "
                  "may go to any worker", "use sparse2 (its residual is the replica's), or none, bf16, int8, int4 or "
                  "int2, or compression.error_feedback: false")
        if self.outer_optimizer.name not in ELEMENTWISE_OPTIMIZERS and self.cluster.shards > 1:
            fail("outer_optimizer.name", self.outer_optimizer.name, "is not known to update each element on its own, "
                  f"so cluster.shards: {self.cluster.shards} could change its result",
                  f"use one of {', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}, or cluster.shards: 1")


# torch.optim classes whose update of an element depends only on that element's gradient and state (and the step,
# LR): a shard can step its slice alone. Not: LBFGS (a line search over all), Adafactor (row/column statistics).
ELEMENTWISE_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                                    "RAdam", "RMSprop", "Rprop"})
