"""Prometheus metrics (`metrics.enabled`): each service serves /metrics and advertises the URL in its
Redis member record (`metrics_url`). Metrics are declared once here; each process updates its own."""

from __future__ import annotations

from typing import Any

from cmemi.shared.config.extras import require
from cmemi.shared.config.schema import Config

try:
    from prometheus_client import Counter, Gauge, Histogram
except ImportError:  # the 'prometheus' extra is optional: without it every metric is a no-op

    class _NoMetric:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def labels(self, *args: Any) -> _NoMetric:
            return self

        def inc(self, amount: float = 1) -> None:
            pass

        def set(self, value: float) -> None:
            pass

        def observe(self, value: float) -> None:
            pass

    Counter = Gauge = Histogram = _NoMetric  # type: ignore[misc,assignment]

STEPS = Counter("cmemi_steps", "Global steps applied by the aggregator")
STEP_SECONDS = Histogram("cmemi_step_seconds", "Wall time of a global step",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
BYTES_IN = Counter("cmemi_bytes_in", "Gradient bytes the aggregator received from workers")
BYTES_OUT = Counter("cmemi_bytes_out", "Parameter bytes the aggregator sent to workers")
LIVE_WORKERS = Gauge("cmemi_live_workers", "Workers the aggregator currently admits")
STEP = Gauge("cmemi_step", "The newest global step applied (a restarted leader goes on from its checkpoint's)")
LOSS = Gauge("cmemi_loss", "Training loss of the newest global step")
ACCEPTED = Counter("cmemi_accepted_microbatches", "Microbatches whose gradients the leader accepted, by worker",
                   ["worker"])
DROPPED = Counter("cmemi_dropped_messages", "Messages dropped, by reason", ["reason"])
DEATHS = Counter("cmemi_deaths", "Processes declared dead by the coordinator, by role", ["role"])
RESTARTS = Counter("cmemi_restarts", "Processes restarted by the coordinator, by role", ["role"])
STEP_LOG_FRAMED = Counter("cmemi_step_log_framed", "A shard's step log entries sent as frames to a checkpointer on its "
                          "host: the entry before still in its slot, not acknowledged within the wait")
CHECKPOINT_SECONDS = Histogram("cmemi_checkpoint_write_seconds", "Checkpoint write time (checkpointer)")
CHECKPOINT_STALL = Histogram("cmemi_checkpoint_stall_seconds", "Training stall per snapshot (aggregator)",
                             buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1))


def serve(cfg: Config) -> str | None:
    """Start the /metrics endpoint if enabled; returns its URL (for the member record)."""
    if not cfg.metrics.enabled:
        return None
    prometheus = require("prometheus_client", "prometheus", "config field 'metrics.enabled: true'")
    server, _thread = prometheus.start_http_server(cfg.metrics.port, addr=cfg.metrics.host)
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/metrics"
