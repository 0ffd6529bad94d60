"""Start-up phases: when this process reached each stage of its start, as wall-clock times.

A process marks phases as it goes (`mark("imported")`), before it can reach Redis; once it can, it
sends them as one `startup` event to the run's event stream (`report`). `cmemi up --verbose` prints them
and RUN_DIR/startup.json keeps them (cmemi/launcher/startup_report.py). Every process's first phase, `spawned`,
is the kernel's record of when it was forked (/proc/self/stat), so interpreter start-up counts too.
Nothing here imports more than the standard library: marking must not change what it measures.
"""

from __future__ import annotations

import os
import time
from typing import Any

_marks: dict[str, float] = {}


def spawned_at() -> float | None:
    """Wall-clock time this process was forked (10 ms resolution), or None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def mark(phase: str) -> None:
    """This process reached `phase` now (the first time only: a restart of a loop does not move it)."""
    _marks.setdefault(phase, time.time())


def phases() -> dict[str, float]:
    """Every phase marked so far, `spawned` first, in the order they were reached."""
    start = spawned_at()
    return {**({"spawned": start} if start is not None else {}), **_marks}


def report(client: Any, keys: Any, role: str, ident: str) -> None:
    """Send the phases marked so far as one `startup` event (never raises: see membership.emit), with the CPU
    seconds this process has used: a figure the machine's load does not stretch, unlike the wall-clock times."""
    from cmemi.shared.coordination.membership import emit

    emit(client, keys, "startup", role=role, id=ident, pid=os.getpid(), phases=phases(),
         cpu_s=round(time.process_time(), 3))
