"""The sections that say how a run is carried out: cluster, checkpoints, metrics, security and compression.

Each is a dataclass whose fields carry their docstrings (scripts/config_reference.py turns them into the
manual's table, docs/reference/config.md) and whose `__post_init__` rejects a bad value with an error
naming the field and the fix (checks.py).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from cmemi.shared.config.checks import fail, positive


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
    pace_replicas: bool = True
    """Local steps (train.local_steps): the leader measures when each worker's replicas land in a step and, when one
    worker holds the step up and another would finish one more replica sooner, leases the slow one fewer replicas (as
    few as none), so a faster one takes one with its state (docs/design/local-steps.md, "Slow host"). Only who
    computes a replica changes, never the result. false: a replica stays with its holder whatever its pace."""
    spare_workers: int = 1
    """Warm spare worker processes `cmemi up` keeps ready (torch imported, data loaded) to replace a dead worker fast; started once the first step is done (until then they would compete with it for the CPU)."""
    max_restarts: int = 10
    """Restarts in a row per process (each within 60 s of the last start) before the coordinator gives up on it and reports it."""
    start_timeout: float = 180.0
    """A started process that has not registered in Redis within this many seconds is taken for hung, killed and restarted."""
    zygote_imports: bool = True
    """`cmemi up`'s zygote imports the modules the config names (model.factory, data.factory, ...) once, before it
    forks the services, so no process imports them again (the factories: cluster.zygote_data). false: each service
    imports them itself (a module that starts threads, opens a GPU or a connection at import time)."""
    zygote_data: bool = True
    """With cluster.zygote_imports, the zygote also builds the training dataset once (data.factory, called as a worker
    calls it: after model.factory with run.seed, one intra-op thread) before it forks the services, and the workers
    share it copy-on-write instead of building it again, with the global random generators left as their own build
    would leave them. Not with cluster.threads_per_worker > 1 (a thread pool in the zygote hangs forked children;
    one line says so). false: each worker calls data.factory itself (a factory with side effects: files,
    connections, a GPU)."""
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

    def message_cap(self) -> int:
        """max_message_bytes once derived: null in the file, it is filled in when a service builds its model (or, in
        the checkpointer, which builds none, at its start: shared/wire/limits.py), before any socket is made."""
        if self.max_message_bytes is None:
            raise RuntimeError("cluster.max_message_bytes is not derived yet (shared/wire/limits.py)")
        return self.max_message_bytes

    def __post_init__(self) -> None:
        if self.workers < 1:
            fail("cluster.workers", self.workers, "must be >= 1", "set cluster.workers to the number of worker processes, e.g. 2")
        if self.threads_per_worker < 1:
            fail("cluster.threads_per_worker", self.threads_per_worker, "must be >= 1", "use 1 (the default)")
        for name in ("aggregator_port", "checkpointer_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                fail(f"cluster.{name}", port, "must be a TCP port 0..65535", "use 0 for a free port")
        positive("cluster.heartbeat_interval", self.heartbeat_interval, "use e.g. 0.2")
        if self.dead_after <= 2 * self.heartbeat_interval:
            fail("cluster.dead_after", self.dead_after,
                  f"must be more than twice cluster.heartbeat_interval={self.heartbeat_interval}",
                  f"use at least {3 * self.heartbeat_interval:g}")
        positive("cluster.lease_timeout", self.lease_timeout, "use e.g. 30")
        if self.spare_workers < 0:
            fail("cluster.spare_workers", self.spare_workers, "must be >= 0", "use 1 (or 0 to save memory)")
        if self.max_restarts < 0:
            fail("cluster.max_restarts", self.max_restarts, "must be >= 0", "use e.g. 10")
        positive("cluster.start_timeout", self.start_timeout, "use e.g. 180")
        if self.max_message_bytes is not None and self.max_message_bytes < 1 << 16:
            fail("cluster.max_message_bytes", self.max_message_bytes, "must be >= 65536", "use e.g. 2147483648")
        if not 1 <= self.shards <= 64:
            fail("cluster.shards", self.shards, "must be 1..64", "use 1, or one shard per host")
        if not 0 <= self.pipeline_stages <= 64:
            fail("cluster.pipeline_stages", self.pipeline_stages, "must be 0..64", "use 0, or e.g. 4")
        if self.pipeline_stages and self.shards < 2:
            fail("cluster.pipeline_stages", self.pipeline_stages, "pipelines the steps of 2 or more shards",
                  "set cluster.shards >= 2 (the leader and at least one shard), or cluster.pipeline_stages: 0")
        if self.transport not in ("auto", "tcp", "shm"):
            fail("cluster.transport", self.transport, "must be one of auto, tcp, shm",
                  "use auto (same-host peers over ipc://, remote ones over CurveZMQ tcp://), or tcp")
        if self.redis is not None and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            fail("cluster.redis", self.redis, "must be a redis:// or rediss:// URL", "e.g. redis://:password@10.0.0.5:6379/0, or null")


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Snapshot every this many steps (0: only the final model)."""
    keep_last: int = 5
    """How many of the newest checkpoints to keep."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones); 0 for none."""
    step_log: bool = True
    """Ship each step's reduced gradient and decisions to the checkpointer before it commits, so a restarted
    aggregator replays the steps since the last checkpoint instead of redoing them (docs/design.md §11); false: a
    server's death goes back to the last checkpoint and the workers redo the steps since."""
    step_log_memory_mb: int = 256
    """The checkpointer holds the step log in memory up to this many MiB; past it, entries are spooled to disk. A
    same-host server's entries with `step_log_spool` on are never held in memory (written from its slot to disk)."""
    step_log_spool: bool = True
    """Write every step log entry through to a file in the run directory before it is acknowledged, so a restarted
    checkpointer reads its log back and a server's death after that restart redoes no step (docs/design/step-log.md);
    false: a checkpointer's restart loses the log and the servers checkpoint at once. With train.local_steps each
    server also writes the replicas' states a step makes current to its own state spool (RUN_DIR/steplog/states-K/)
    and the entry carries references, so they never cross the checkpointer's link; false: they travel in the entry."""

    def __post_init__(self) -> None:
        if self.step_log_memory_mb < 0:
            fail("checkpoint.step_log_memory_mb", self.step_log_memory_mb, "must be >= 0",
                 "use e.g. 256 (0: every entry spooled to disk)")
        if self.every_steps < 0:
            fail("checkpoint.every_steps", self.every_steps, "must be >= 0", "use 0 for final-only")
        if self.keep_last < 1:
            fail("checkpoint.keep_last", self.keep_last, "must be >= 1", "use e.g. 5")
        if self.keep_every < 0:
            fail("checkpoint.keep_every", self.keep_every, "must be >= 0", "use 0 for no milestones")


LOGGERS = ("tensorboard", "mlflow", "wandb")  # metrics.loggers' names (each its pip extra of the same name)


@dataclass
class MetricsConfig:
    enabled: bool = False
    """Serve Prometheus metrics at http://HOST:PORT/metrics from every service."""
    host: str = "127.0.0.1"
    """Address the /metrics endpoints bind to."""
    port: int = 0
    """Port of the /metrics endpoint (0: a free port per service, advertised in its Redis member record as metrics_url)."""
    loggers: list[str] = field(default_factory=list)
    """Experiment trackers the leader logs to, off the training path: any of tensorboard (RUN_DIR/tensorboard/),
    mlflow (RUN_DIR/mlruns, or $MLFLOW_TRACKING_URI) and wandb (offline under RUN_DIR/wandb/ unless logged in), each
    its pip extra (cmemi[tensorboard], ...), or an import path 'package.module:Class' of your own (docs/guides/trackers.md)."""
    logger_queue: int = 10000
    """Records each tracker's queue holds; a tracker that falls this far behind has new records dropped and counted
    (summary.json `trackers_dropped`), so it never holds up a step."""
    logger_timeout: float = 60.0
    """Seconds the leader waits at the end of the run (after the final checkpoint) for the trackers to write what
    they have queued; one still busy then is abandoned (summary.json `trackers_abandoned`). Opening MLflow's SQLite
    store takes seconds of CPU (the leader's log says how long: `tracker open`), so a short run ends waiting for it."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            fail("metrics.port", self.port, "must be a TCP port 0..65535", "use 0 for a free port per service")
        for name in self.loggers:
            if name not in LOGGERS and (not isinstance(name, str) or ":" not in name):
                close = difflib.get_close_matches(str(name), LOGGERS, n=1)
                fail("metrics.loggers", self.loggers, f"{name!r} is not a tracker"
                     + (f" (did you mean {close[0]!r}?)" if close else ""),
                     f"use any of {', '.join(LOGGERS)}, or an import path 'package.module:Class'")
        if len(set(self.loggers)) != len(self.loggers):
            fail("metrics.loggers", self.loggers, "names a tracker twice", "list each tracker once")
        if self.logger_queue < 1:
            fail("metrics.logger_queue", self.logger_queue, "must be >= 1", "use e.g. 10000")
        positive("metrics.logger_timeout", self.logger_timeout, "use e.g. 10")


@dataclass
class SecurityConfig:
    curve: bool = True
    """Encrypt and authenticate every ZeroMQ connection with CurveZMQ, one key per role; false only on a trusted network."""
    keys_dir: str | None = None
    """Key directory from `cmemi keys DIR` (a host needs its role's *.key_secret and the public *.key files); null: `cmemi up` makes RUN_DIR/keys."""


CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "sign", "int4", "int2", "sparse2")
DOWNLINKS = ("none", "bf16", "int8", "topk", "powersgd", "sign", "int4", "int2")


@dataclass
class CompressionConfig:
    codec: str = "none"
    """Gradient codec: none, fp16, bf16, int8, topk, powersgd, sign, int4, int2 or sparse2 (worker encodes, aggregator
    decodes). With train.local_steps it encodes each replica's outer change Δ: int4 and int2 (per-chunk scales) and
    sparse2 (SparseLoCo's top-k with 2-bit values, its residual kept in the replica's state) are built for that."""
    topk_ratio: float = 0.01
    """topk: fraction of each tensor's entries sent, k = max(1, ceil(ratio * numel)); sparse2: of each chunk's
    (sparse_chunk), SparseLoCo's 1-3 %; 0 < ratio <= 1."""
    powersgd_rank: int = 2
    """powersgd: rank of the per-tensor low-rank approximation P @ Q^T."""
    int8_chunk: int = 1024
    """int8 and sign: elements per fp32 scale (int8: the chunk's absmax, sign: its mean magnitude)."""
    lowbit_chunk: int = 128
    """int4 and int2: elements per fp32 scale (the chunk's absmax; small, since one outlier flattens its chunk)."""
    sparse_chunk: int = 4096
    """sparse2: elements per chunk, of which the topk_ratio largest magnitudes go (at most 32768: int16 positions)."""
    min_compress_numel: int = 1024
    """Tensors with fewer elements (biases, norms) are sent dense fp32."""
    warmup_steps: int = 0
    """Global steps < warmup_steps send dense fp32 gradients whatever the codec, and (with downlink) their parameter
    changes raw fp32 too."""
    error_feedback: bool = True
    """topk, powersgd and sign: keep what was not sent and add it to the next step's gradient (per worker); sparse2
    (train.local_steps only): to the replica's next change, the residual kept in the replica's state."""
    downlink: str = "none"
    """Parameters sent to workers: none (dense, as they are), or the change of a mirror of them through bf16, int8,
    topk, powersgd, sign, int4 or int2 (same options as above: int4/int2 at lowbit_chunk); the servers keep what was
    not sent (docs/design.md §9). With train.local_steps (whole rounds, not streaming) each round starts from that
    mirror (§10)."""

    @property
    def whole_pieces(self) -> bool:
        """powersgd either way with a downlink that sends a few percent of the parameters (powersgd, sign or topk): the
        chunk grid's pieces are whole tensors up to 4 MiB (shared/core/grid.py), so matrices are factored whole. Not with
        dense, bf16, int8, int4 or int2 parameters down: K shards must share those bytes evenly."""
        return "powersgd" in (self.codec, self.downlink) and self.downlink in ("powersgd", "sign", "topk")

    @property
    def replica_residual(self) -> bool:
        """sparse2 with error feedback: with train.local_steps, each replica keeps its residual in its inner state."""
        return self.codec == "sparse2" and self.error_feedback

    def __post_init__(self) -> None:
        if self.downlink not in DOWNLINKS:
            fail("compression.downlink", self.downlink, f"must be one of {', '.join(DOWNLINKS)}",
                  "use 'none' for dense parameters, or e.g. 'powersgd'")
        if self.codec not in CODECS:
            fail("compression.codec", self.codec, f"must be one of {', '.join(CODECS)}",
                  "use 'none' for dense fp32 gradients, or e.g. 'topk'")
        if not 0 < self.topk_ratio <= 1:
            fail("compression.topk_ratio", self.topk_ratio, "must be in (0, 1]", "use e.g. 0.01")
        if self.powersgd_rank < 1:
            fail("compression.powersgd_rank", self.powersgd_rank, "must be >= 1", "use e.g. 2")
        if self.int8_chunk < 1:
            fail("compression.int8_chunk", self.int8_chunk, "must be >= 1", "use e.g. 1024")
        if self.lowbit_chunk < 1:
            fail("compression.lowbit_chunk", self.lowbit_chunk, "must be >= 1", "use e.g. 128")
        if not 1 <= self.sparse_chunk <= 1 << 15:
            fail("compression.sparse_chunk", self.sparse_chunk, "must be in [1, 32768] (positions are int16)",
                  "use e.g. 4096")
        if self.min_compress_numel < 0:
            fail("compression.min_compress_numel", self.min_compress_numel, "must be >= 0", "use e.g. 1024")
        if self.warmup_steps < 0:
            fail("compression.warmup_steps", self.warmup_steps, "must be >= 0", "use 0 for no warmup")
