"""A real headless Chromium driven over the DevTools protocol, for tests that read a live page.

The protocol runs over a pipe (`--remote-debugging-pipe`: Chromium reads JSON messages from its fd 3 and writes
them to its fd 4, each ended by a NUL byte), so no websocket client and no debugging port is needed. A page stays
open while the test reads its DOM again and again (`Runtime.evaluate`): it shows that the page updates itself,
which two `--dump-dom` loads would not. Every read has a deadline; Chromium runs with a fresh profile, without
the sandbox (tests run as root) and without a GPU, and is killed if it does not close.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-background-networking", "--disable-sync",
         # a tab the test opens is not the focused one: its timers must not be throttled (the page polls every 1 s)
         "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
         "--disable-backgrounding-occluded-windows", "--window-size=1400,1000", "--remote-debugging-pipe")


def chromium() -> str:
    """The Chromium binary; a missing one fails the test with how to install it (never a skip)."""
    found = os.environ.get("CMEMI_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise RuntimeError("chromium not found: install Debian's chromium (`sudo bash scripts/system_packages.sh "
                           "chromium`, run by `make test`) or set CMEMI_CHROMIUM to a Chromium binary")
    return found


def above_4(fd: int) -> int:
    """`fd` moved to a number above 4: the shell's `3<&N 4>&M` must not overwrite one end with the other."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium with one page, read through the DevTools protocol."""

    def __init__(self, profile: Path, log: Path, timeout: float = 60.0) -> None:
        self.timeout = timeout
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        to_chrome_r, from_chrome_w = above_4(to_chrome_r), above_4(from_chrome_w)
        # bash puts the two pipe ends at fds 3 and 4, where Chromium looks for them (dash takes no fd above 9)
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(["bash", "-c", script, chromium(), *FLAGS, f"--user-data-dir={profile}",
                                      "about:blank"], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buffer = b""
        self.next_id = 0
        self.session: str | None = None
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send one command and wait (with the deadline) for its answer; events in between are skipped."""
        self.next_id += 1
        ident = self.next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" in self.buffer:
                raw, _, self.buffer = self.buffer.partition(b"\0")
                reply = json.loads(raw)
                if "id" not in reply:
                    self.events.append(reply)  # console messages, exceptions, ...: read by `problems`
                elif reply["id"] == ident:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return dict(reply.get("result", {}))
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.from_chrome], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {self.timeout:g}s")
            chunk = os.read(self.from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.proc.poll()}) during {method}; see {self.log.name}")
            self.buffer += chunk

    def open(self, url: str) -> None:
        """Open `url` in a new tab and attach to it: later calls act on this page. The page's console and its
        uncaught exceptions are recorded from the start (`problems`)."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=self.session)
        self.call("Page.navigate", {"url": url}, self.session)

    def problems(self) -> list[str]:
        """What went wrong in the page so far: uncaught exceptions, console errors, and the browser's own error
        entries (a resource that failed to load, a Content-Security-Policy violation)."""
        out = []
        for e in self.events:
            params = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(str(params.get("exceptionDetails", {}).get("exception", {}).get("description")))
            elif e.get("method") == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif e.get("method") == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        return out

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able values only)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised in the page: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, self.session)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close")
            self.proc.wait(timeout=20)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for fd in (self.to_chrome, self.from_chrome):
                os.close(fd)
            self.log.close()
