"""What a tracker has written for sure, kept in RUN_DIR/trackers/NAME-written.json: the newest logged step, the
newest evaluation's step and the newest event's stream id it flushed. A restarted leader's trackers are handed the
run's metrics.jsonl and its events again (hub.py), and each writer skips what its tracker had written before: so a leader's death loses no line
for a tracker and writes none twice — but for the steps' lines flushed in the last `EVERY` seconds before the
death, which the file does not yet say were written, and which the tracker then shows twice (at the same step, with
the same value: a replayed step is bitwise the same step). Events are kept at once after each flush that wrote one:
they are rare, and one written twice would read as a second death."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cmemi.services.aggregator.leader.trackers.base import keep_state, read_state

EVERY = 1.0  # seconds between two writes of the file: a fast run flushes many times a second


def sid(text: object) -> tuple[int, int]:
    """A Redis stream id, comparable: "1796540564703-0" -> (1796540564703, 0)."""
    ms, _, seq = str(text).partition("-")
    return int(ms), int(seq or 0)


def is_eval(values: dict[str, float]) -> bool:
    return any(k.startswith("eval/") for k in values)


@dataclass
class Mark:
    """How far a tracker got: the newest step, evaluation step and event stream id it wrote."""
    step: int = 0
    eval_step: int = 0
    event: tuple[int, int] = (0, 0)


class Written:
    def __init__(self, run_dir: Path, name: str) -> None:
        self.run_dir, self.name = run_dir, f"{name}-written"
        state = read_state(run_dir, self.name)
        # a previous leader's trackers' mark: what this process skips
        self.before = Mark(int(state.get("step", 0)), int(state.get("eval_step", 0)), sid(state.get("event", "0-0")))
        self.now = replace(self.before)
        self.kept = replace(self.before)
        self.kept_at = 0.0

    def fresh(self, record: tuple[Any, ...]) -> bool:
        """False for a record the tracker wrote before this process started (a replayed line or event)."""
        if record[0] == "event":
            return sid(record[5]) > self.before.event
        return int(record[1]) > (self.before.eval_step if is_eval(record[2]) else self.before.step)

    def note(self, record: tuple[Any, ...]) -> None:
        if record[0] == "event":
            self.now.event = max(self.now.event, sid(record[5]))
        elif is_eval(record[2]):
            self.now.eval_step = max(self.now.eval_step, int(record[1]))
        else:
            self.now.step = max(self.now.step, int(record[1]))

    def keep(self, force: bool = False) -> None:
        """After a flush: the file says so, at most every EVERY seconds (and at the end, `force`)."""
        if self.now == self.kept:
            return
        events = self.now.event != self.kept.event  # rare, and a duplicate event would read as a second death: at once
        if not (force or events) and time.monotonic() - self.kept_at < EVERY:
            return
        ms, seq = self.now.event
        keep_state(self.run_dir, self.name, {"step": self.now.step, "eval_step": self.now.eval_step,
                                             "event": f"{ms}-{seq}"})
        self.kept, self.kept_at = replace(self.now), time.monotonic()
