"""Process lifetimes: die with `cmemi up`, not with the coordinator (`hold`); die with the parent (`die_with_parent`);
what stopping a process needs of it (`Stoppable`).

`cmemi up` exports CMEMI_UP_PID to everything it starts. Services started by the coordinator must
survive a coordinator restart (the new one adopts them), so they cannot use PR_SET_PDEATHSIG on
their parent; instead a daemon thread waits on a pidfd of `cmemi up` and kills this process the
moment `cmemi up` is gone, whatever killed it (SIGKILL included).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from typing import Protocol


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int | None = None) -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when the thread that forked it exits. Runs in the child (between
    fork and exec, or after a bare fork). With `parent`, a child whose parent died before the prctl took effect
    exits at once."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def hold() -> None:
    """Start the lifeline if this process runs under `cmemi up`; no-op otherwise."""
    value = os.environ.get("CMEMI_UP_PID")
    if not value:
        return
    try:
        fd = os.pidfd_open(int(value))
    except ProcessLookupError:
        _die()  # `cmemi up` is already gone
        return
    except (AttributeError, OSError, ValueError):
        return  # no pidfds here (old kernel): the orphans are stopped by `cmemi up` on a clean exit only

    def watch() -> None:
        select.select([fd], [], [])
        _die()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


class Stoppable(Protocol):
    """What stopping a process needs of it: a Popen, or a process we did not start but hold a pidfd of
    (cmemi/launcher/zygote_up.py Forked)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
