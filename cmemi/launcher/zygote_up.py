"""`cmemi up`'s side of the zygote (cmemi/launcher/zygote.py): start it first, hand it the run, read its verdict.

`CMEMI_ZYGOTE=0` turns it off: `cmemi up` then checks the config itself and every service starts as a
fresh interpreter, as they do whenever the zygote is gone. With `CMEMI_ZYGOTE_TEMPLATE=SOCKET`, the zygote is forked
by that template, past its imports (cmemi/launcher/zygote_template.py), when the template serves this `cmemi up`;
otherwise it is started here as always.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from cmemi.services.coordinator.supervisor import terminate
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.lifeline import die_with_parent
from cmemi.shared.runtime.proctitle import ROOM
from cmemi.shared.runtime.zygote import PID_ENV, SOCKET_ENV, ask, exit_code, zygote_dir

OFF_ENV = "CMEMI_ZYGOTE"  # "0": no zygote
TEMPLATE_ENV = "CMEMI_ZYGOTE_TEMPLATE"  # a template's socket (cmemi/launcher/zygote_template.py)


class Zygote:
    def __init__(self) -> None:
        # The padding reserves argv room for the longest command line a child will show (shared/runtime/proctitle.py);
        # the zygote retitles itself `python -m cmemi zygote` at once.
        argv = [sys.executable, "-m", "cmemi", "zygote", " " * ROOM]
        template = os.environ.get(TEMPLATE_ENV, "")
        forked = Forked.ask(template, argv[:4]) if template else None
        # what the run's RUN_DIR/zygote/template.txt says (not stderr: a config error stays one line)
        self.template = (f"forked by the zygote template at {template}" if isinstance(forked, Forked)
                         else f"not served by the zygote template: {forked}; started its own" if template else None)
        self.proc: subprocess.Popen | Forked = forked if isinstance(forked, Forked) else subprocess.Popen(
            argv, stdin=subprocess.PIPE, preexec_fn=die_with_parent)
        self.dir: Path | None = None
        self.verdict: dict[str, Any] | None = None

    @staticmethod
    def start() -> Zygote | None:
        if os.environ.get(OFF_ENV) == "0" or sys.platform != "linux":
            return None
        return Zygote()

    def serve(self, run_dir: Path) -> None:
        """Hand the zygote the run (its config is written), and tell every later child where it listens."""
        self.dir = zygote_dir(run_dir)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        (self.dir / "ready.json").unlink(missing_ok=True)
        if self.template is not None:
            (self.dir / "template.txt").write_text(self.template + "\n")
        sock = self.dir / "socket"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"config": str(run_dir / "config.yaml"), "socket": str(sock)}).encode()
                                  + b"\n")
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: poll() reports it, the services start without it
        os.environ[SOCKET_ENV], os.environ[PID_ENV] = str(sock), str(self.proc.pid)

    def poll(self) -> dict[str, Any] | None:
        """The plugin check's verdict once known ({"rc": 0, "phases": ...}); raises ConfigError when the config
        failed it. {"rc": None} when the zygote died without one: `cmemi up` then checks the config itself."""
        if self.verdict is not None or self.dir is None:
            return self.verdict
        try:
            self.verdict = json.loads((self.dir / "ready.json").read_text())
        except (OSError, ValueError):
            if self.proc.poll() is None:
                return None
            self.verdict = {"rc": None}
            return self.verdict
        rc = self.verdict.get("rc")
        if rc == 2 and self.verdict.get("error"):
            raise ConfigError(self.verdict["error"])
        if rc:
            raise ConfigError(f"checking the config's functions failed (exit code {rc}); the traceback above "
                              "names the line")
        return self.verdict

    def stop(self) -> None:
        os.environ.pop(SOCKET_ENV, None)
        os.environ.pop(PID_ENV, None)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        terminate(self.proc)


class Forked:
    """A zygote forked by a template: not our child, so watched through the pidfd the template sent, its exit
    code read from the template's record. What `cmemi up` does with a Popen of its zygote (poll, wait, signal,
    write its stdin) it does with this."""

    def __init__(self, pid: int, pidfd: int, record: str, template: int, stdin: IO[bytes] | None) -> None:
        self.pid, self.pidfd, self.record, self.template, self.stdin = pid, pidfd, record, template, stdin
        self.returncode: int | None = None

    @staticmethod
    def ask(path: str, argv: list[str]) -> Forked | str:
        """A zygote from the template at `path`, or why not (there is none, or it refuses this `cmemi up`)."""
        r, w = os.pipe()
        try:
            got = ask(path, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask()},
                      [r, sys.stdout.fileno(), sys.stderr.fileno()])
        finally:
            os.close(r)
        if isinstance(got, str):
            os.close(w)
            return got
        pid, pidfd, record, template = got
        return Forked(pid, pidfd, record, template, os.fdopen(w, "wb"))

    @staticmethod
    def run(path: str, args: list[str]) -> int | str:
        """`python -m cmemi ARGS` (a command the template serves: `reference`) forked by the template at `path`, past
        its imports, with this process's standard streams: its exit code once it ended, or why the template did not
        serve it (the caller then runs the command itself). Ctrl-C reaches it as it reaches us (it joined our process
        group); a SIGTERM to us is passed on; it dies with us (its lifeline)."""
        argv = [sys.executable, "-m", "cmemi", *args]
        got = ask(path, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask()}, [0, 1, 2])
        if isinstance(got, str):
            return got
        proc = Forked(*got, None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        return proc.wait()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            rc = exit_code(self.record, self.template)
            self.returncode = Exit.UNKNOWN if rc is None else rc
            os.close(self.pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self.pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("cmemi zygote", timeout or 0)
        rc = self.poll()
        assert rc is not None
        return rc

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
