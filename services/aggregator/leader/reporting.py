"""What the leader reports while it trains: one `metrics.jsonl` line per logged step (and per evaluation), the
same lines to the experiment trackers (`metrics.loggers`, off the loop: trackers/), the step's traffic and codec
time, the Prometheus gauges, and the progress `cmemi up` and `cmemi status` show (written to Redis off the loop
at most every 0.1 s: services/aggregator/leader/progress.py)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from cmemi.services.aggregator.common.metricsfile import MetricsFile
from cmemi.services.aggregator.common.totals import RunTotals
from cmemi.services.aggregator.leader.progress import ProgressWriter
from cmemi.services.aggregator.leader.throughput import Throughput
from cmemi.services.aggregator.leader.trackers.hub import Trackers
from cmemi.shared.config.schema import Config
from cmemi.shared.runtime import metrics
from cmemi.shared.runtime.service import ServiceContext

STOPPED_WAIT_S = 3.0  # the most a stopped leader waits for its trackers


class Reporter:
    def __init__(self, ctx: ServiceContext, cfg: Config, totals: RunTotals, term: int) -> None:
        self.ctx, self.cfg, self.totals, self.term = ctx, cfg, totals, term
        self.metrics = MetricsFile(ctx.run_dir / "metrics.jsonl", term)  # a step's line once, whoever writes it
        self.progress = ProgressWriter(ctx.redis, ctx.keys)
        self.trackers = Trackers(ctx)
        self.throughput = Throughput(cfg.train.samples_per_round)  # the progress line's samples/s
        self.unpublished_mb: Counter[str] = Counter()  # accepted microbatches per "wid:incarnation", not yet in Redis
        self.accepted_by: dict[str, Any] = {}  # wid -> its ACCEPTED child: `labels()` takes a lock and checks every call
        self.bytes_in = self.bytes_out = 0  # this step's
        self.codec_s = 0.0  # encode (reported by workers) + decode time of this step's accepted gradients
        self.t_step = time.monotonic()
        self._next_progress = 0.0

    def grad_bytes(self, size: int) -> None:
        """Gradient bytes workers sent, accepted or not."""
        metrics.BYTES_IN.inc(size)
        self.totals.bytes_in += size
        self.bytes_in += size

    def work_bytes(self, size: int) -> None:
        metrics.BYTES_OUT.inc(size)
        self.totals.bytes_out += size
        self.bytes_out += size

    def accepted(self, wid: str, inc: int, microbatches: int) -> None:
        self.unpublished_mb[f"{wid}:{inc}"] += microbatches
        child = self.accepted_by.get(wid)
        if child is None:
            if len(self.accepted_by) >= 4096:  # (worker ids churn in a long elastic run: the cache stays bounded)
                self.accepted_by.clear()
            child = self.accepted_by[wid] = metrics.ACCEPTED.labels(wid)
        child.inc(microbatches)  # per-worker throughput in Grafana (docker/grafana/)

    def started(self, now: float) -> None:
        """The first lease of the run (or of this restart): the first step's time counts from here."""
        if self.totals.started(now):
            self.t_step = now

    def step_done(self, step: int, loss: float, lr: float, live_workers: int,
                  scaler: Any, skipped: bool) -> tuple[float, int, dict[str, Any] | None]:
        """A step was applied: (its seconds, its bytes, its metrics line or None if not logged); counters reset."""
        now = time.monotonic()
        dt, self.t_step = now - self.t_step, now
        self.totals.final_loss = loss
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(dt)
        metrics.LIVE_WORKERS.set(live_workers)
        metrics.STEP.set(step)
        metrics.LOSS.set(loss)
        line = None
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.rounds:
            line = {"step": step, "loss": loss, "lr": lr, "step_time_s": dt,
                    **({"loss_scale": scaler.scale, "skipped": skipped} if scaler.enabled else {}),
                    "samples_per_s": self.cfg.train.samples_per_round / dt if dt > 0 else None,
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "codec_s": self.codec_s,
                    "live_workers": live_workers, "term": self.term, "t": time.time()}
        nbytes = self.bytes_in + self.bytes_out
        self.bytes_in = self.bytes_out = 0
        self.codec_s = 0.0
        return dt, nbytes, line

    def replayed_line(self, step: int, loss: float, lr: float) -> None:
        """The line of a step its leader committed but died before logging, written by the leader that replayed it
        (steplog/replay.py); its times and bytes died with the process that knew them (`replayed` says so)."""
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.rounds:
            line = {"step": step, "loss": loss, "lr": lr, "replayed": True, "term": self.term, "t": time.time()}
            if self.metrics.append(line, replayed=True):  # not if its deposed leader logged it meanwhile
                self.trackers.line(line)

    def write(self, line: dict[str, Any]) -> None:
        if self.metrics.append(line):  # not a step a newer term's leader logged already (common/metricsfile.py)
            self.trackers.line(line)

    def close_trackers(self) -> dict[str, Any]:
        """Each tracker finished, or abandoned after metrics.logger_timeout: summary.json's `trackers*` fields."""
        return self.trackers.close(self.cfg.metrics.logger_timeout)

    def eval(self, entry: dict[str, Any]) -> None:
        self.write({**entry, "t": time.time()})
        self.ctx.emit("eval", step=entry["step"], **entry["eval"])

    def progress_due(self, force: bool) -> bool:
        now = time.monotonic()
        if now < self._next_progress and not force:
            return False
        self._next_progress = now + 0.1  # enough for status and the progress bar; spares Redis
        return True

    def publish(self, step: int, loss: float, lr: float, bytes_s: float, live_workers: int, done: bool) -> None:
        """Progress for `cmemi up`'s bar and `cmemi status`, written off the loop."""
        self.progress.put({
            "step": step, "total": self.cfg.train.rounds, "loss": f"{loss:.6g}", "lr": f"{lr:.6g}",
            "samples_s": f"{self.throughput.rate(step, self.totals.wall_s(), whole_run=done):.1f}",
            "bytes_s": f"{bytes_s:.0f}", "live_workers": live_workers, "term": self.term, "t": time.time(),
            **({"local_steps": self.cfg.train.segment} if self.cfg.train.local_steps else {})},
            self.unpublished_mb)
        self.unpublished_mb.clear()

    def flush(self, timeout: float) -> None:
        self.progress.flush(timeout)

    def close(self) -> None:
        # a leader stopped before the end: its trackers write what they have queued, within the coordinator's stop
        # grace (services/coordinator/coordinator.py: SIGKILL after 5 s); after the end, closed already
        self.trackers.close(min(self.cfg.metrics.logger_timeout, STOPPED_WAIT_S))
        self.progress.close()
        self.metrics.close()
