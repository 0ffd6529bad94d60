"""How a child's exit is read: a user error ends the run, a clean exit is not a death, anything else is one."""

from __future__ import annotations

import enum

import redis
from cmemi.services.coordinator.supervisor import Child
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.runtime.exits import Exit


class ExitKind(enum.Enum):
    FATAL = "fatal"  # a user error (config, user code, data): restarting will not help, the run fails
    NORMAL = "normal"  # exit 0 (or its record says stopped): finished its part, or left when told to
    DIED = "died"  # a crash, a kill, a fence: declared dead and replaced


def exit_kind(child: Child, rc: int, client: redis.Redis, keys: Keys) -> ExitKind:
    """An adopted process's exit code cannot be read: its own Redis record and the run's error decide."""
    if rc == Exit.FATAL:
        return ExitKind.FATAL
    if rc in (0, Exit.REJOIN):  # Exit.REJOIN: a shard left a term that went back to a checkpoint
        return ExitKind.NORMAL
    if rc == Exit.UNKNOWN:
        record, error = client.hgetall(keys.member(child.role, child.ident)), client.get(keys.error)
        if error:
            return ExitKind.FATAL
        if record.get("pid") == str(child.pid) and record.get("state") == "stopped":
            return ExitKind.NORMAL
    return ExitKind.DIED
