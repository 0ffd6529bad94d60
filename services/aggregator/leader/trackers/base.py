"""What a tracker is: the calls the leader's writer threads make on it (writer.py), and the config as flat
hyperparameters. A tracker of your own (`metrics.loggers: ['package.module:Class']`) subclasses `Tracker`.

Every call is made on the tracker's own thread, never on the training loop's, so a tracker may block, be slow
or raise: the writer drops what does not fit its queue, disables one that raises and abandons one that hangs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cmemi.shared.config.schema import Config
from cmemi.shared.runtime import atomic


class Tracker:
    """One experiment tracker. `location` is known before `open` (summary.json names it even if `open` hangs)."""

    name = "tracker"

    def location(self, run_dir: Path) -> str:
        """Where it writes (a directory or a URI), worked out without importing the tracker's package."""
        return str(run_dir)

    def open(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> str:
        """Start the tracker's run with the config as hyperparameters; returns where it writes."""
        return self.location(run_dir)

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        """One logged step's scalars (or an evaluation's, keys `eval/<name>`), at wall time `t`."""

    def event(self, step: int, kind: str, text: str, count: int) -> None:
        """A run event (a death, a fence, a restart, a checkpoint): its text and how many of its kind so far."""

    def flush(self) -> None:
        """Write what the calls since the last flush kept back (the writer calls it once the queue is empty, or
        every writer.BATCH records)."""

    def close(self) -> None:
        """Finish the tracker's run (everything written)."""


def state_file(run_dir: Path, name: str) -> Path:
    """RUN_DIR/trackers/NAME.json: what a restarted leader's trackers carry on from — each tracker's run id (its
    `open` keeps it, under the tracker's name), and the events already handed to the trackers (hub.py keeps the
    stream cursor and counts, under `events`). One file per writer, so no two processes ever write one file."""
    return run_dir / "trackers" / f"{name}.json"


def read_state(run_dir: Path, name: str) -> dict[str, Any]:
    try:
        state = json.loads(state_file(run_dir, name).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def keep_state(run_dir: Path, name: str, state: dict[str, Any]) -> None:
    """The state file replaced atomically: the old one or the new one, never half."""
    state_file(run_dir, name).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(state_file(run_dir, name), json.dumps(state, sort_keys=True))


def hyperparameters(cfg: Config) -> dict[str, Any]:
    """The config as one flat mapping 'section.field' -> value (str, int, float or bool; others as text), the
    form every tracker's hyperparameter table takes."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (str, int, float, bool)):
            out[prefix] = value
        else:
            out[prefix] = "null" if value is None else str(value)

    walk("", dataclasses.asdict(cfg))
    return out


def scalars_of(line: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line (a step's, or an evaluation's as `eval/<name>`), without step and t."""
    out: dict[str, float] = {}
    for k, v in line.items():
        if k in ("step", "t"):
            continue
        if k == "eval" and isinstance(v, dict):
            out.update({f"eval/{n}": float(x) for n, x in v.items() if isinstance(x, (int, float))})
        elif isinstance(v, (int, float)):  # a bool (fp16's `skipped`) as 0/1
            out[k] = float(v)
    return out
