"""The leader's trackers (`metrics.loggers`): every logged step and evaluation, the config, and the run's events
(deaths, fences, restarts, checkpoints: the Redis stream events.jsonl is copied from) go to each tracker's writer
(writer.py). The loop's cost is a `put_nowait` per tracker per logged step; the events are read from Redis on a
thread of their own, never on the loop."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import redis
from cmemi.services.aggregator.leader.trackers import registry
from cmemi.services.aggregator.leader.trackers.base import hyperparameters, scalars_of
from cmemi.services.aggregator.leader.trackers.writer import TrackerWriter
from cmemi.shared.coordination.membership import read_events
from cmemi.shared.errors import UserError
from cmemi.shared.runtime.service import ServiceContext

SKIPPED_EVENTS = ("eval",)  # logged as scalars already (`Trackers.line`)


class Trackers:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        try:  # `cmemi up` checked before any service started; a leader started on its own checks here
            registry.check(cfg)
        except UserError as exc:
            ctx.fatal(str(exc))
        params = hyperparameters(cfg) if cfg.metrics.loggers else {}
        self.writers = [TrackerWriter(registry.make(name), ctx.run_dir, cfg, params, ctx.log)
                        for name in cfg.metrics.loggers]
        self.step = 0  # the newest step logged: events are logged at it
        self.counts: Counter[str] = Counter()  # events so far, by kind
        # every event of the run, from its first: a restarted leader's trackers start a run of their own, whole
        self.cursor = "0-0"
        self._lock = threading.Lock()  # the events thread and the final tail both read from the cursor
        self._stop = threading.Event()
        self._events = threading.Thread(target=self._tail_events, name="tracker-events", daemon=True)
        self.summary: dict[str, Any] | None = None  # once closed
        if self.writers:
            self._events.start()

    def line(self, line: dict[str, Any]) -> None:
        """A metrics.jsonl line: a logged step's, or an evaluation's (with an `eval` dict)."""
        if not self.writers:
            return
        self.step = max(self.step, int(line["step"]))
        values, t = scalars_of(line), float(line.get("t", time.time()))
        for w in self.writers:
            w.put("scalars", int(line["step"]), values, t)

    def _tail(self, block_ms: int | None) -> None:
        with self._lock:
            try:
                entries = read_events(self.ctx.redis, self.ctx.keys, self.cursor, block_ms=block_ms)
            except (redis.RedisError, ValueError):
                return
            for entry_id, event in entries:
                self.cursor = entry_id
                kind = str(event.get("kind", "?"))
                if kind in SKIPPED_EVENTS:
                    continue
                self.counts[kind] += 1
                text = json.dumps(event, sort_keys=True)
                for w in self.writers:
                    w.put("event", self.step, kind, text, self.counts[kind])

    def _tail_events(self) -> None:
        while not self._stop.is_set():
            self._tail(block_ms=None)
            self._stop.wait(0.5)  # events are rare; half a second late is soon enough for a tracker

    def close(self, timeout: float) -> dict[str, Any]:
        """The last events, then every writer finished (each abandoned past `timeout`); what summary.json says.
        Once: a second call returns the first's answer."""
        if not self.writers:
            return {}
        if self.summary is not None:
            return self.summary
        self._stop.set()
        self._events.join(timeout=2)
        self._tail(block_ms=None)
        deadline = time.monotonic() + timeout
        for w in self.writers:  # all at once: the wait is the slowest tracker's, not their sum
            w.closing.set()
        abandoned = [w.tracker.name for w in self.writers if not w.finish(deadline)]
        if abandoned:
            self.ctx.log.warning("trackers abandoned: still busy at the end of the run", trackers=abandoned,
                                 timeout_s=timeout)
        self.summary = {"trackers": {w.tracker.name: w.where for w in self.writers},
                "trackers_dropped": {w.tracker.name: w.dropped for w in self.writers},
                "trackers_failed": {w.tracker.name: w.failed for w in self.writers if w.failed is not None},
                        "trackers_abandoned": abandoned}
        return self.summary
