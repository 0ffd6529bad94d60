"""The start-up timeline of one `cmemi up`, from `cmemi up` itself to the run's first step.

Every process sends its phases as a `startup` event (shared/runtime/startup.py); the run's first gradient is the
aggregator's `first_grad_accepted` event and its first step the first line of RUN_DIR/metrics.jsonl written
after `cmemi up` started. All are real timestamps, shown as seconds since `cmemi up` was forked. Once the
first step and every process have reported, the timeline is written to RUN_DIR/startup.json (and printed
under `--verbose`); a run that ends sooner writes what it has.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import redis

from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import read_events
from cmemi.shared.runtime import atomic

FILE = "startup.json"


class StartupReport:
    def __init__(self, run_dir: Path, client: redis.Redis, keys: Keys, workers: int, own: dict[str, float]) -> None:
        self.run_dir, self.client, self.keys = run_dir, client, keys
        self.t0 = own.get("spawned", min(own.values()))
        self.processes: dict[str, dict[str, float]] = {"cmemi up": dict(own)}
        self.cpu_s: dict[str, float | None] = {}  # CPU seconds each process had used when it reported
        self.expected = {"coordinator", "checkpointer", "aggregator", *(f"worker w{i}" for i in range(workers))}
        self.run: dict[str, float] = {}
        self.cursor = "0-0"
        self.done = False

    def poll(self) -> bool:
        """Read what arrived since the last call; True (once) when the timeline is complete and written."""
        if self.done:
            return False
        try:
            events = read_events(self.client, self.keys, self.cursor)
        except redis.RedisError:
            return False
        for entry_id, event in events:
            self.cursor = entry_id
            if event.get("t", 0) < self.t0:
                continue
            if event["kind"] == "startup":
                name = event["role"] if event["role"] != "worker" else f"worker {event['id']}"
                self.processes.setdefault(name, event["phases"])
                self.cpu_s.setdefault(name, event.get("cpu_s"))
            elif event["kind"] == "first_grad_accepted":
                self.run.setdefault("first_gradient", event["t"])
        self._first_step()
        if "first_step" in self.run and self.expected <= self.processes.keys():
            self.write()
            return True
        return False

    def _first_step(self) -> None:
        if "first_step" in self.run:
            return
        try:
            with open(self.run_dir / "metrics.jsonl") as f:
                for line in f:
                    try:
                        t = json.loads(line)["t"]
                    except (ValueError, KeyError):
                        continue  # a line being written
                    if t >= self.t0:
                        self.run["first_step"] = t
                        return
        except OSError:
            return

    def as_dict(self) -> dict[str, Any]:
        def rel(phases: dict[str, float]) -> dict[str, float]:
            return {k: round(v - self.t0, 3) for k, v in sorted(phases.items(), key=lambda kv: kv[1])}

        return {"t0": self.t0, "load_avg": [round(x, 2) for x in os.getloadavg()],
                "first_step_s": round(self.run["first_step"] - self.t0, 3) if "first_step" in self.run else None,
                "processes": {name: rel(p) for name, p in self.processes.items()}, "run": rel(self.run),
                "cpu_s": {"cmemi up": round(time.process_time(), 3), **self.cpu_s}}

    def write(self) -> None:
        self.done = True
        atomic.write_text(self.run_dir / FILE, json.dumps(self.as_dict(), indent=1))

    def format(self) -> str:
        d = self.as_dict()
        first = f"{d['first_step_s']:.2f} s" if d["first_step_s"] is not None else "no step"
        lines = [f"cmemi: start-up: first step after {first} (seconds since `cmemi up` started; load average "
                 f"{' '.join(str(x) for x in d['load_avg'])}; {self.run_dir / FILE})"]
        for name, phases in [*d["processes"].items(), ("run", d["run"])]:
            cpu = d["cpu_s"].get(name)
            lines.append(f"  {name:<14}" + "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
                         + (f"  (cpu {cpu:.2f} s)" if cpu is not None else ""))
        return "\n".join(lines)
