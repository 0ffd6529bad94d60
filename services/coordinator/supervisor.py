"""Local supervision: start the services as child processes, notice deaths and hangs, restart with backoff.

Each child's command line shows its role (`python -m cmemi worker --worker-id w1 ...`), so an
operator or a chaos script can find it. Under `cmemi up` (CMEMI_UP_PID set) the services outlive a
coordinator restart and die with `cmemi up` instead (shared/runtime/lifeline.py); the new coordinator adopts
them from `RUN_DIR/children.json`. Without `cmemi up`, children die with the coordinator (PR_SET_PDEATHSIG).
Under `cmemi up`, a child is forked by its zygote when it can (shared/runtime/zygote.py): watched like an adopted
process, its exit code read from the zygote's record; otherwise it starts as a new interpreter.
"""

from __future__ import annotations

import enum
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cmemi.shared.runtime import zygote
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.lifeline import Stoppable, die_with_parent


class SlotState(enum.Enum):
    """What the coordinator wants of a child's slot."""

    ACTIVE = "active"  # keep a process in it: restart it (after its backoff) when it dies
    RETIRED = "retired"  # scaled away, or finished its part of a completed run: let it exit, never restart it
    GIVEN_UP = "given_up"  # died more than cluster.max_restarts times in a row: not restarted again


@dataclass
class Child:
    role: str
    ident: str
    argv: list[str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0  # backoff: not before this monotonic time
    progress_at_start: int | None = None  # the leader's: the run's progress step when this process was started
    slot: SlotState = SlotState.ACTIVE
    deaths: list[float] = field(default_factory=list)
    pidfd: int | None = None  # readable once the process exits (Linux >= 5.3), so waiting costs no polling
    adopted: int | None = None  # pid of a process started by an earlier coordinator (not our child)
    spare: bool = False
    dismissed: bool = False  # a spare told the run is over (it exits)
    registered: bool = False  # seen in Redis under this pid (the start deadline no longer applies)
    launched: list[str] = field(default_factory=list)  # the running process's command line (a spare's differs from argv)
    exit_record: str | None = None  # forked by `cmemi up`'s zygote: where it writes the exit code (shared/runtime/zygote.py)
    _adopted_rc: int | None = None

    @property
    def name(self) -> str:
        return f"{self.role}:{self.ident}"

    @property
    def pid(self) -> int | None:
        if self.popen is not None:
            return self.popen.pid
        return self.adopted

    @property
    def running(self) -> bool:
        """A process exists for this child (ours or adopted), whether or not it has exited yet."""
        return self.popen is not None or self.adopted is not None

    @property
    def alive(self) -> bool:
        return self.running and self.poll() is None

    def poll(self) -> int | None:
        """None while running; the exit code once exited (Exit.UNKNOWN for an adopted process)."""
        if self.popen is not None:
            return self.popen.poll()
        if self.adopted is None:
            return None
        if self._adopted_rc is None and not _process_running(self.adopted, self.pidfd):
            rc = zygote.exit_code(self.exit_record) if self.exit_record else None
            self._adopted_rc = Exit.UNKNOWN if rc is None else rc
        return self._adopted_rc

    def start(self, env: dict[str, str] | None = None) -> None:
        """Forked by `cmemi up`'s zygote when it can (fast: torch is imported there), else a new interpreter."""
        preexec = None if os.environ.get("CMEMI_UP_PID") else die_with_parent  # see the module docstring
        self.adopted, self._adopted_rc, self.registered = None, None, False
        forked = zygote.spawn(self.argv, dict(os.environ) if env is None else env) if preexec is None else None
        if forked is not None:
            self.adopt(forked.pid, self.argv, pidfd=forked.pidfd, exit_record=forked.exit_record)
            return
        self.exit_record = None
        self.popen = subprocess.Popen(self.argv, preexec_fn=preexec, env=env)
        self.launched = list(self.argv)
        self.started_at = time.monotonic()
        self._open_pidfd(self.popen.pid)

    def adopt(self, pid: int, launched: list[str], pidfd: int | None = None, exit_record: str | None = None) -> None:
        """A process that is not our child: started by an earlier coordinator, or forked by the zygote."""
        self.popen, self.adopted, self._adopted_rc, self.launched = None, pid, None, list(launched)
        self.exit_record = exit_record
        self.started_at = time.monotonic()
        if pidfd is not None:
            self.close_pidfd()
            self.pidfd = pidfd
        else:
            self._open_pidfd(pid)

    def gone_unseen(self, pid: int, launched: list[str], exit_record: str | None = None) -> None:
        """Started by an earlier coordinator and gone before this one adopted it: its exit is read now (the zygote's
        record of it, else Exit.UNKNOWN), so the loop judges it like an exit it saw (coordinator.py `_check_children`):
        a death is declared once (`died`), a clean exit is not one. No pidfd: the pid may be another process's now."""
        self.popen, self.adopted, self.launched, self.exit_record = None, pid, list(launched), exit_record
        self.close_pidfd()
        rc = zygote.exit_code(exit_record) if exit_record else None
        self._adopted_rc = Exit.UNKNOWN if rc is None else rc

    def forget(self) -> None:
        """The process is gone: the slot has no process until the next start."""
        self.popen, self.adopted, self._adopted_rc = None, None, None
        self.close_pidfd()

    def _open_pidfd(self, pid: int) -> None:
        self.close_pidfd()
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux, or an old kernel: wait_for_exit polls instead
            self.pidfd = None

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def signal(self, sig: int) -> None:
        pid = self.pid
        if pid is not None and self.alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def kill(self) -> None:
        """Hung or fenced: no grace. Returns once the process is gone."""
        if not self.alive:
            return
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()
        else:
            _wait_gone(self, 10.0)


def terminate(proc: Stoppable, grace: float = 5.0) -> None:
    """SIGTERM a child we started, SIGKILL it after `grace` seconds; returns once it is reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def service_argv(role: str, config: str, *extra: str) -> list[str]:
    """No secret here: argv is readable by every local user (`ps`); the Redis URL travels in the environment."""
    return [sys.executable, "-m", "cmemi", role, "--config", config, *extra]


def _process_running(pid: int, pidfd: int | None) -> bool:
    """For a process that is not our child: running (not exited, not a zombie)."""
    if pidfd is not None:
        return not select.select([pidfd], [], [], 0)[0]
    return zygote.running(pid)


def _wait_gone(c: Child, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while c.poll() is None:
        if time.monotonic() > deadline:
            return False
        if c.pidfd is not None:
            select.select([c.pidfd], [], [], max(0.0, deadline - time.monotonic()))
        else:
            time.sleep(0.02)
    return True


def stop_all(children: list[Child], grace: float) -> None:
    """SIGTERM everyone, wait up to `grace` seconds, then SIGKILL whoever is left."""
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        if c.popen is not None:
            try:
                c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait()
        elif c.adopted is not None and not _wait_gone(c, max(0.0, deadline - time.monotonic())):
            c.kill()


# ---------------------------------------------------------------- adoption across coordinator restarts
def cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            # NUL padding after the last argument: a command line rewritten in place (a zygote child, shared/runtime/proctitle.py)
            data = f.read().rstrip(b"\0")
    except OSError:
        return None
    return [a.decode(errors="replace") for a in data.split(b"\0")] if data else []


def save_children(path: Path, children: list[Child]) -> None:
    """Record every running child (pid and command line) for a restarted coordinator to adopt."""
    rows = [{"role": c.role, "ident": c.ident, "argv": c.argv, "launched": c.launched, "pid": c.pid,
             "spare": c.spare, "restarts": c.restarts, "exit_record": c.exit_record} for c in children if c.alive]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, path)


def load_children(path: Path) -> list[Child]:
    """Children recorded by an earlier coordinator that still run the same command line (not a reused pid)."""
    return read_children(path)[0]


def read_children(path: Path) -> tuple[list[Child], list[Child]]:
    """Children recorded by an earlier coordinator: (those still running the same command line, adopted; those gone
    since, `Child.gone_unseen`). A process that died between two coordinators (the test_events_once.py flake: w0
    SIGKILLed as the new one started) was once left out here and its slot refilled: its death had no `died` event,
    and its record, overwritten by its replacement's, never went silent for liveness to judge."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], []
    out: list[Child] = []
    gone: list[Child] = []
    for row in rows:
        pid = row.get("pid")
        launched = row.get("launched") or row["argv"]
        if not isinstance(pid, int):
            continue
        c = Child(row["role"], row["ident"], list(row["argv"]), restarts=int(row.get("restarts", 0)),
                  spare=bool(row.get("spare")))
        record = row.get("exit_record")
        record = record if isinstance(record, str) else None
        if cmdline(pid) == launched:
            c.adopt(pid, launched, exit_record=record)
        else:
            c.gone_unseen(pid, launched, exit_record=record)
        (out if c.alive else gone).append(c)
    return out, gone


def wait_for_exit(children: list[Child], timeout: float, poll_interval: float = 0.02) -> None:
    """Return when one of the running `children` exits, or after `timeout` seconds. Children already seen
    to have exited (returncode set) are not waited on; without pidfds this falls back to polling."""
    fds = []
    for c in children:
        if not c.running or (c.popen is not None and c.popen.returncode is not None) or c._adopted_rc is not None:
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
