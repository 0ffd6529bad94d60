"""Local supervision: start the services as child processes, notice deaths and hangs, restart with backoff.

Each child's command line shows its role (`python -m cmemi worker --worker-id w1 ...`), so an
operator or a chaos script can find it. Children die with the supervisor (PR_SET_PDEATHSIG), so a
killed `cmemi up` leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    role: str
    ident: str
    argv: list[str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0  # backoff: not before this monotonic time
    wanted: bool = True  # False once scaled away or after the run ended
    given_up: bool = False
    deaths: list[float] = field(default_factory=list)
    pidfd: int | None = None  # readable once the process exits (Linux >= 5.3), so waiting costs no polling

    @property
    def name(self) -> str:
        return f"{self.role}:{self.ident}"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(self.argv, preexec_fn=_die_with_parent, env=env)
        self.started_at = time.monotonic()
        self.close_pidfd()
        try:
            self.pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # not Linux, or an old kernel: wait_for_exit polls instead
            self.pidfd = None

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def kill(self) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.kill()  # hung or fenced: no grace
            self.popen.wait()


def service_argv(role: str, config: str, *extra: str) -> list[str]:
    """No secret here: argv is readable by every local user (`ps`); the Redis URL travels in the environment."""
    return [sys.executable, "-m", "cmemi", role, "--config", config, *extra]


def stop_all(children: list[Child], grace: float) -> None:
    """SIGTERM everyone, wait up to `grace` seconds, then SIGKILL whoever is left."""
    for c in children:
        if c.alive:
            assert c.popen is not None
            c.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        if c.popen is None:
            continue
        try:
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.popen.kill()
            c.popen.wait()


def wait_for_exit(children: list[Child], timeout: float, poll_interval: float = 0.02) -> None:
    """Return when one of the running `children` exits, or after `timeout` seconds. Children already seen
    to have exited (returncode set) are not waited on; without pidfds this falls back to polling."""
    fds = []
    for c in children:
        if c.popen is None or c.popen.returncode is not None:
            c.close_pidfd()
        elif c.pidfd is None:
            timeout = min(timeout, poll_interval)
        else:
            fds.append(c.pidfd)
    select.select(fds, [], [], max(0.0, timeout))


HEALTHY_AFTER_S = 60.0  # a process that ran this long since its last start was healthy: its restart count resets


def backoff(restarts: int) -> float:
    """0 for the first restart (a fault should cost as little as possible), then 0.5 s doubling to 10 s."""
    return 0.0 if restarts <= 1 else min(10.0, 0.5 * 2 ** (restarts - 2))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
