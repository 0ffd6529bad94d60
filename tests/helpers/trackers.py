"""Test-only trackers, named in `metrics.loggers` by import path: one that blocks forever on its first step (a
hung tracker's server), one that raises on its first step, and one that records in memory (unit tests)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from cmemi.services.aggregator.leader.trackers.base import Tracker
from cmemi.shared.config.schema import Config

NEVER = threading.Event()  # never set: a blocked call stays blocked until the process exits


class Blocking(Tracker):
    """Opens, then blocks forever in its first `scalars` call: its queue fills, and it is abandoned at the end."""

    def location(self, run_dir: Path) -> str:
        return str(run_dir / "blocking")

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        NEVER.wait()


class Raising(Tracker):
    """Raises in its first `scalars` call: disabled with one warning, the run goes on."""

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        raise RuntimeError("injected tracker failure")


class Recording(Tracker):
    """Keeps every call in memory (`calls`), each on the writer's thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()

    def open(self, run_dir: Path, cfg: Config, params: dict[str, Any]) -> str:
        self.calls.append(("open", params))
        self.threads.add(threading.current_thread().name)
        return "recorded"

    def scalars(self, step: int, values: dict[str, float], t: float) -> None:
        self.calls.append(("scalars", step, values))
        self.threads.add(threading.current_thread().name)

    def event(self, step: int, kind: str, text: str, count: int) -> None:
        self.calls.append(("event", step, kind, count))

    def close(self) -> None:
        self.calls.append(("close",))
