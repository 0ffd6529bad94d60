"""The leader's trackers (`metrics.loggers`): every logged step and evaluation, the config, and the run's events
(deaths, fences, restarts, checkpoints: the Redis stream events.jsonl is copied from) go to the trackers' own
process (child.py), which hands them to each tracker's writer (writer.py).

The loop's cost is one `put_nowait` per logged step into a bounded queue; a feeder thread writes the queue to
the process's stdin, and the events are read from Redis on a thread of their own, never on the loop. If the
process cannot keep up the queue fills, and what does not fit is dropped and counted for every tracker; if it
does not answer at the end, it is killed and every tracker counted abandoned."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import redis
from cmemi.services.aggregator.leader.trackers import registry
from cmemi.services.aggregator.leader.trackers.base import hyperparameters, scalars_of
from cmemi.shared.coordination.membership import read_events
from cmemi.shared.errors import UserError
from cmemi.shared.runtime.service import ServiceContext

SKIPPED_EVENTS = ("eval",)  # logged as scalars already (`Trackers.line`)
CHILD = "cmemi.services.aggregator.leader.trackers.child"


class Trackers:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.names = list(cfg.metrics.loggers)
        self.summary: dict[str, Any] | None = None  # once closed
        if not self.names:
            return
        try:  # `cmemi up` checked before any service started; a leader started on its own checks here
            registry.check(cfg)
        except UserError as exc:
            ctx.fatal(str(exc))
        self.planned = {n: registry.make(n).location(ctx.run_dir) for n in self.names}
        self.queue: queue.Queue[list[Any]] = queue.Queue(cfg.metrics.logger_queue)
        self.dropped = 0  # records the process could not take in time (every tracker misses them)
        self.step = 0  # the newest step logged: events are logged at it
        # every event of the run, from the stream's start: a restarted leader's trackers carry on the same runs
        # (each keeps its run id in RUN_DIR/trackers/: base.state_file) and skip the events they wrote before
        # (written.py, by stream id), so each event is written once whichever leader handed it over
        self.counts: Counter[str] = Counter()  # events so far, by kind
        self.cursor = "0-0"
        metrics = ctx.run_dir / "metrics.jsonl"
        # a restarted (or resumed) leader: the lines written before it, handed to the trackers again (written.py
        # skips, per tracker, what it wrote already); read on the feeder thread, up to where the file ends now
        self.replay = (metrics, metrics.stat().st_size) if metrics.exists() else None
        self.proc = subprocess.Popen([sys.executable, "-m", CHILD, str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        first = {"config": dataclasses.asdict(cfg), "run_dir": str(ctx.run_dir), "params": hyperparameters(cfg)}
        self._feeder = threading.Thread(target=self._feed, args=(json.dumps(first),), name="tracker-feed", daemon=True)
        self._feeder.start()
        self._lock = threading.Lock()  # the events thread and the final tail both read from the cursor
        self._stop = threading.Event()
        self._events = threading.Thread(target=self._tail_events, name="tracker-events", daemon=True)
        self._events.start()

    def _put(self, record: list[Any]) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def line(self, line: dict[str, Any]) -> None:
        """A metrics.jsonl line: a logged step's, or an evaluation's (with an `eval` dict)."""
        if not self.names:
            return
        self.step = max(self.step, int(line["step"]))
        self._put(["scalars", int(line["step"]), scalars_of(line), float(line.get("t", time.time()))])

    def _feed(self, first: str) -> None:
        """The queue to the process's stdin, until `close` (or the process is gone): only this thread waits on it."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(first + "\n")
            for record in self._replayed():
                self.proc.stdin.write(json.dumps(record) + "\n")
            while True:
                record = self.queue.get()
                self.proc.stdin.write(json.dumps(record) + "\n")
                if record[0] == "close":
                    break
                if self.queue.empty():
                    self.proc.stdin.flush()
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the process died: what follows is dropped; close() reports it

    def _replayed(self) -> list[list[Any]]:
        """The lines a previous leader logged, each (step, evaluation or not) once."""
        if self.replay is None:
            return []
        path, size = self.replay
        with path.open("rb") as f:
            text = f.read(size).decode(errors="replace")
        seen, out = set(), []
        for raw in text.splitlines():
            try:
                line = json.loads(raw)
                key = (int(line["step"]), "eval" in line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the death
            if key not in seen:
                seen.add(key)
                out.append(["scalars", key[0], scalars_of(line), float(line.get("t", 0.0))])
        return out

    def _tail(self) -> None:
        with self._lock:
            try:
                entries = read_events(self.ctx.redis, self.ctx.keys, self.cursor)
            except (redis.RedisError, ValueError):
                return
            for entry_id, event in entries:
                self.cursor = entry_id
                kind = str(event.get("kind", "?"))
                if kind in SKIPPED_EVENTS:
                    continue
                self.counts[kind] += 1
                self._put(["event", self.step, kind, json.dumps(event, sort_keys=True), self.counts[kind], entry_id])

    def _tail_events(self) -> None:
        while not self._stop.is_set():
            self._tail()
            self._stop.wait(0.5)  # events are rare; half a second late is soon enough for a tracker

    def close(self, timeout: float) -> dict[str, Any]:
        """The last events, then every tracker finished (each abandoned past `timeout`); what summary.json says.
        Once: a second call returns the first's answer."""
        if not self.names:
            return {}
        if self.summary is not None:
            return self.summary
        self._stop.set()
        self._events.join(timeout=2)
        self._tail()
        deadline = time.monotonic() + timeout + 5  # the process's own wait is `timeout`; then it answers
        try:
            self.queue.put(["close", timeout], timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        answer = self._answer(deadline)
        if answer is None:
            self.ctx.log.warning("trackers' process did not answer: killed, every tracker abandoned",
                                 timeout_s=timeout)
            answer = {"trackers": self.planned, "trackers_dropped": {n: 0 for n in self.names},
                      "trackers_failed": {}, "trackers_abandoned": list(self.names)}
        self.proc.kill()  # it exits by itself once it answered; a hung one is killed here
        self.proc.wait()
        self._feeder.join(timeout=2)  # its next write fails now that the process is gone
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass  # a pipe whose reader is gone may fail to flush: nothing is left to tell it
        answer["trackers_dropped"] = {n: d + self.dropped for n, d in answer["trackers_dropped"].items()}
        self.summary = answer
        return answer

    def _answer(self, deadline: float) -> dict[str, Any] | None:
        """The process's one line of summary, if it comes by `deadline`."""
        assert self.proc.stdout is not None
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                return dict(json.loads(line)) if line.strip() else None
        return None
