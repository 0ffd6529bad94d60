"""`cmemi up`'s side of the zygote (cmemi/launcher/zygote.py): start it first, hand it the run, read its verdict.

`CMEMI_ZYGOTE=0` turns it off: `cmemi up` then checks the config itself and every service starts as a
fresh interpreter, as they do whenever the zygote is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from cmemi.services.coordinator.supervisor import terminate
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.runtime.lifeline import die_with_parent
from cmemi.shared.runtime.proctitle import ROOM
from cmemi.shared.runtime.zygote import PID_ENV, SOCKET_ENV, zygote_dir

OFF_ENV = "CMEMI_ZYGOTE"  # "0": no zygote


class Zygote:
    def __init__(self) -> None:
        # The padding reserves argv room for the longest command line a child will show (shared/runtime/proctitle.py);
        # the zygote retitles itself `python -m cmemi zygote` at once.
        self.proc = subprocess.Popen([sys.executable, "-m", "cmemi", "zygote", " " * ROOM], stdin=subprocess.PIPE,
                                     preexec_fn=die_with_parent)
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
