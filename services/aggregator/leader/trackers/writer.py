"""One tracker's writer, in the trackers' process (child.py): a bounded queue and a daemon thread that makes every
call on the tracker, so what feeds it only ever does a `put_nowait`.

A tracker that is slow fills its queue, and then what does not fit is dropped and counted (summary.json
`trackers_dropped`): a step never waits for it. One that raises is disabled with one warning line (what it
wrote before stays). One that hangs is abandoned at the end after `metrics.logger_timeout`: its thread is a
daemon, so the process still exits (summary.json `trackers_abandoned`)."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import structlog
from cmemi.services.aggregator.leader.trackers.base import Tracker
from cmemi.services.aggregator.leader.trackers.written import Written
from cmemi.shared.config.schema import Config

BATCH = 256  # records handed to a tracker between two flushes


class TrackerWriter:
    def __init__(self, tracker: Tracker, run_dir: Path, cfg: Config, params: dict[str, Any],
                 log: structlog.stdlib.BoundLogger) -> None:
        self.tracker, self.log = tracker, log
        self.where = tracker.location(run_dir)  # until `open` says where it went
        self.queue: queue.Queue[tuple[Any, ...]] = queue.Queue(cfg.metrics.logger_queue)
        self.dropped = 0
        self.failed: str | None = None
        self.closing = threading.Event()  # set: write what is queued, then close
        self.written = Written(run_dir, tracker.name)
        self.thread = threading.Thread(target=self._run, args=(run_dir, cfg, params), name=f"tracker-{tracker.name}",
                                       daemon=True)
        self.thread.start()

    def put(self, *record: Any) -> None:
        """Queue a call (`"scalars", step, values, t` or `"event", step, kind, text, count, stream id`); never
        blocks."""
        if self.failed is not None:
            return
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> None:
        try:
            t0 = time.monotonic()
            self.where = self.tracker.open(run_dir, cfg, params)
            self.log.info("tracker open", tracker=self.tracker.name, where=self.where,
                          seconds=round(time.monotonic() - t0, 3))
            while True:
                try:
                    record = self.queue.get(timeout=0.1)  # a bounded wait: `closing` is seen within 0.1 s
                except queue.Empty:
                    if self.closing.is_set():
                        break
                    continue
                self._call(record)
                for _ in range(BATCH):  # what else is queued now, then one flush (MLflow: one transaction)
                    try:
                        record = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    self._call(record)
                self.tracker.flush()
                self.written.keep()
            t0 = time.monotonic()
            self.tracker.close()
            self.written.keep(force=True)
            self.log.info("tracker closed", tracker=self.tracker.name, seconds=round(time.monotonic() - t0, 3))
        except Exception as exc:  # noqa: BLE001 - any error of a tracker's package disables it, never the run
            self.failed = f"{type(exc).__name__}: {exc}"
            self.log.warning("tracker disabled: it raised; the run goes on without it", tracker=self.tracker.name,
                             error=self.failed)

    def _call(self, record: tuple[Any, ...]) -> None:
        if self.written.fresh(record):  # not a replayed line or event the tracker wrote before (written.py)
            args = record[1:5] if record[0] == "event" else record[1:]  # an event's stream id is written.py's
            getattr(self.tracker, record[0])(*args)
            self.written.note(record)

    def finish(self, deadline: float) -> bool:
        """Wait until `deadline` (monotonic) for what is queued to be written and the tracker closed (`closing` was
        set for every writer first, so they finish together); False: abandoned, still busy."""
        self.closing.set()
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()


def finish_all(writers: list[TrackerWriter], timeout: float, log: structlog.stdlib.BoundLogger) -> dict[str, Any]:
    """Every writer finished together (the wait is the slowest one's, at most `timeout`); summary.json's fields."""
    deadline = time.monotonic() + timeout
    for w in writers:
        w.closing.set()
    abandoned = [w.tracker.name for w in writers if not w.finish(deadline)]
    if abandoned:
        log.warning("trackers abandoned: still busy at the end of the run", trackers=abandoned, timeout_s=timeout)
    return {"trackers": {w.tracker.name: w.where for w in writers},
            "trackers_dropped": {w.tracker.name: w.dropped for w in writers},
            "trackers_failed": {w.tracker.name: w.failed for w in writers if w.failed is not None},
            "trackers_abandoned": abandoned}
