"""The run's state in Redis as the coordinator reads and ends it: running, completed or failed.

The key holds a plain string (every service reads it); `RunPhase` names its values once for the coordinator.
A restarted coordinator must never reopen a run that completed, and a Redis that restarted empty does not
end a run: a missing state reads as still running (the coordinator writes it back).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cmemi.shared.coordination.membership import text
from cmemi.shared.runtime.service import ServiceContext


class RunPhase(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"  # written by the aggregator once the last step's checkpoint is on disk
    FAILED = "failed"  # written by the coordinator (`RunState.fail`): a fatal error or a crash loop


def phase_of(state: str | None) -> RunPhase | None:
    """A value no CMEMI version writes reads as running: the coordinator goes on supervising."""
    if state is None:
        return None
    try:
        return RunPhase(state)
    except ValueError:
        return RunPhase.RUNNING


class Supervise(enum.Enum):
    """Who restarts a dead process (`--supervise`)."""

    LOCAL = "local"  # the coordinator: every service is its child (or adopted from an earlier coordinator)
    NONE = "none"  # an orchestrator; the coordinator still detects, fences and frees leases


@dataclass(frozen=True)
class Control:
    """What the rest of the cluster asks of the coordinator, read in one round trip."""

    phase: RunPhase | None  # None: Redis restarted empty
    error: str | None  # a service's fatal (user-fixable) error
    scale: str | None  # the worker count asked for by `cmemi scale`


class RunState:
    """Reads and ends the run. `exit_code` stays None while the coordinator should go on supervising."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.exit_code: int | None = None

    def open(self) -> bool:
        """Mark a new run running; False when it completed already (then nothing may be started again)."""
        self.ctx.redis.set(self.ctx.keys.state, RunPhase.RUNNING.value, nx=True)
        return not self.completed()

    def completed(self) -> bool:
        return self.ctx.redis.get(self.ctx.keys.state) == RunPhase.COMPLETED.value

    def control(self) -> Control:
        """Run state, fatal error and the requested worker count; a state lost with Redis's data is written back."""
        k = self.ctx.keys
        state, error, scale = map(text, self.ctx.redis.mget(k.state, k.error, k.scale))
        if state is None:
            self.ctx.redis.set(k.state, RunPhase.RUNNING.value)
        return Control(phase_of(state), error, scale)

    def fail(self, message: str) -> None:
        """End the run: a fatal error or a process that keeps dying. Every service stops when it reads this."""
        self.ctx.redis.set(self.ctx.keys.error, message)
        self.ctx.redis.set(self.ctx.keys.state, RunPhase.FAILED.value)
        self.ctx.emit("run_failed", error=message)
        self.ctx.log.error("run failed", error=message)
        self.exit_code = 1
