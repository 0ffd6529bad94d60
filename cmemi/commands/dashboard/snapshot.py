"""What the dashboard's endpoints answer about one run directory.

- the status report: `cmemi status --json`'s, built by its own code (`cmemi.commands.status`: from the run's
  Redis while it runs, else from its files), at most every `status_every` seconds whatever the number of pages open;
- the curves: metrics.jsonl's step and evaluation lines, and the events timeline: events.jsonl's faults,
  restarts and checkpoints, both read from their last offset (`tail`);
- the checkpoints on disk: RUN_DIR/checkpoints/step-N, listed from the directory.

The Target (cluster.json) is read again at each report: a run started again (`cmemi up --resume`) has a new
Redis, and the dashboard may start before the run does.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cmemi.commands.dashboard.tail import JsonlTail
from cmemi.commands.status.report import collect
from cmemi.commands.status.target import StatusError, Target
from cmemi.commands.status.values import FINAL_STATES

# the fields of a metrics line the curves use (the others are dropped: a long run keeps many rows)
CURVE_FIELDS = ("step", "t", "loss", "lr", "samples_per_s", "step_time_s", "live_workers", "eval")
# the events the timeline shows: faults, what recovers from them, checkpoints and the run's end
TIMELINE_KINDS = frozenset({
    "fault_injected", "died", "fenced", "restarted", "gave_up", "worker_admitted", "worker_left", "scaled",
    "aggregator_started", "coordinator_started", "shard_restarted", "checkpoint_saved", "checkpoint_restored",
    "checkpoint_damaged", "counters_restored", "run_completed", "run_failed",
})
RUN_FILES = ("cluster.json", "summary.json", "metrics.jsonl", "events.jsonl")
FILES_RECHECK_S = 10.0  # a report from the files of a run that did not end, kept this long while they do not change


def curve_point(row: dict[str, Any]) -> dict[str, Any] | None:
    """A metrics.jsonl line as the curves read it (a step line or an evaluation line), None for anything else."""
    if "step" not in row or not ("loss" in row or isinstance(row.get("eval"), dict)):
        return None
    return {k: row[k] for k in CURVE_FIELDS if k in row}


def timeline_event(row: dict[str, Any]) -> dict[str, Any] | None:
    return row if row.get("kind") in TIMELINE_KINDS and "t" in row else None


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no NaN (a diverged loss is one), and JSON.parse refuses it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """RUN_DIR/checkpoints/step-N (the layout of services/checkpointer/store.py), oldest first; listed here rather
    than with CheckpointStore, which imports torch (seconds, and hundreds of MB, for a page that reads files)."""
    out = []
    try:
        entries = list(os.scandir(run_dir / "checkpoints"))
    except OSError:
        return []
    for entry in entries:
        head, _, tail = entry.name.partition("-")
        if head != "step" or not tail.isdigit() or not entry.is_dir():
            continue  # `.tmp-step-...`: still being written
        try:
            files = [f.stat() for f in os.scandir(entry.path) if f.is_file()]
            mtime = entry.stat().st_mtime
        except OSError:
            continue  # removed by retention meanwhile
        out.append({"step": int(tail), "bytes": sum(s.st_size for s in files), "mtime": mtime, "path": entry.path})
    return sorted(out, key=lambda c: c["step"])


def signature(run_dir: Path) -> tuple[tuple[int, int], ...]:
    """(mtime, size) of the run's files: unchanged means a report built from them would be the same."""
    out = []
    for name in RUN_FILES:
        try:
            st = os.stat(run_dir / name)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((0, -1))
    return tuple(out)


class Dashboard:
    """The data of one run directory, shared by every request (one lock: the server answers on threads)."""

    def __init__(self, run_dir: Path, n_events: int = 8, status_every: float = 0.5,
                 report: Callable[[Target, int], dict[str, Any]] = collect,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir, self.n_events, self.status_every = run_dir, n_events, status_every
        self.report, self.clock = report, clock
        self.metrics = JsonlTail(run_dir / "metrics.jsonl", keep=curve_point)
        self.events = JsonlTail(run_dir / "events.jsonl", keep=timeline_event)
        self.lock = threading.Lock()
        self._status: dict[str, Any] = {"report": None, "error": "not read yet"}
        self._status_at = -math.inf
        self._status_files: tuple[tuple[int, int], ...] | None = None

    def status(self) -> dict[str, Any]:
        """{"report": `cmemi status --json`'s object or None, "error": why there is none or None}."""
        with self.lock:
            return self._fresh_status()

    def state(self, metrics_from: int = 0, metrics_generation: int | None = None, events_from: int = 0,
              events_generation: int | None = None) -> dict[str, Any]:
        """Everything the page shows, with only the curve points and events the page has not seen yet."""
        with self.lock:
            self.metrics.read()
            self.events.read()
            return finite({
                "run_dir": str(self.run_dir), "time": time.time(), "status": self._fresh_status(),
                "checkpoints": checkpoints(self.run_dir),
                "metrics": self.metrics.since(metrics_from, metrics_generation),
                "events": self.events.since(events_from, events_generation),
            })

    def rows(self, which: str, start: int = 0, generation: int | None = None) -> dict[str, Any]:
        """New rows of "metrics" or "events" alone."""
        tail = self.metrics if which == "metrics" else self.events
        with self.lock:
            tail.read()
            return finite(tail.since(start, generation))

    def _fresh_status(self) -> dict[str, Any]:
        """The last report while it is fresh. One built from the files is kept while they do not change: it reads
        metrics.jsonl whole (`cmemi status`'s from_files), 0.49 s for a 50,000-step run; for good once the run
        ended, else re-read every FILES_RECHECK_S (its Redis may answer again with nothing written meanwhile)."""
        now = self.clock()
        age = now - self._status_at
        if age < self.status_every:
            return self._status
        files = signature(self.run_dir)
        last = self._status["report"]
        if (last is not None and last.get("source") == "files" and files == self._status_files
                and (last.get("state") in FINAL_STATES or age < FILES_RECHECK_S)):
            return self._status
        try:
            self._status = {"report": finite(self.report(Target(self.run_dir), self.n_events)), "error": None}
        except StatusError as exc:
            self._status = {"report": None, "error": str(exc)}
        self._status_at, self._status_files = now, files
        return self._status
