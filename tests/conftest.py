"""Shared fixtures: a real redis-server on a free loopback port, and a helper that runs `cmemi up`."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cmemi.launcher.redis_server import EmbeddedRedis

# Tests that run torch in the pytest process itself: one thread, like the services (2 shared cores).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.yaml")


@dataclass
class RunResult:
    rc: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]


def cmemi_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cmemi", *args]


def up_args(run_dir: Path, *sets: str, config: str = DIGITS) -> list[str]:
    args = ["up", config, "--set", f"run.dir={run_dir}", "--set", f"run.name=t{abs(hash(str(run_dir))) % 10**8}"]
    for s in sets:
        args += ["--set", s]
    return cmemi_cmd(*args)


def run_up(run_dir: Path, *sets: str, config: str = DIGITS, timeout: float = 240) -> RunResult:
    proc = subprocess.run(up_args(run_dir, *sets, config=config), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    return RunResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


# Small and quick, still the real example: 60 steps, no spare, final checkpoint only.
FAST = ("train.steps=60", "scheduler.kwargs.T_max=60", "cluster.spare_workers=0", "checkpoint.every_steps=0")


# Long enough to kill things several times; bitwise deterministic whatever the worker count.
LONG = ("train.steps=1200", "scheduler.kwargs.T_max=1200", "checkpoint.every_steps=0", "cluster.dead_after=1.0",
        "cluster.heartbeat_interval=0.1")


@pytest.fixture(scope="session", autouse=True)
def zygote_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """One warm zygote for the session (cmemi/launcher/zygote_template.py): every `cmemi up` a test starts forks its
    zygote from it, past the ~4 s of imports each would spend (most of a short run's wall time). Runs it cannot
    serve as a fresh zygote would (another namespace, PYTHONPATH, ...) start their own, as a user's `cmemi up` always
    does; so do the tests of the zygote's own start (`no_template`). CMEMI_TEST_TEMPLATE=0 turns it off."""
    from cmemi.shared.runtime.lifeline import die_with_parent
    from cmemi.shared.runtime.proctitle import ROOM

    from cmemi.launcher.zygote_up import TEMPLATE_ENV

    if os.environ.get("CMEMI_TEST_TEMPLATE") == "0" or sys.platform != "linux":
        yield None
        return
    sock = tmp_path_factory.mktemp("zygote-template") / "socket"
    proc = subprocess.Popen(cmemi_cmd("zygote-template", str(sock), " " * ROOM), cwd=ROOT, stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    deadline = time.monotonic() + 120
    while not (sock.parent / "ready.json").exists():
        assert proc.poll() is None, f"the zygote template exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the zygote template did not listen within 120 s"
        time.sleep(0.05)
    os.environ[TEMPLATE_ENV] = str(sock)
    try:
        yield str(sock)
    finally:
        os.environ.pop(TEMPLATE_ENV, None)
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def no_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's `cmemi up` starts its zygote itself, as a user's does (what it checks is that start)."""
    from cmemi.launcher.zygote_up import TEMPLATE_ENV

    monkeypatch.delenv(TEMPLATE_ENV, raising=False)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of a fault-free run of LONG."""
    r = run_up(tmp_path_factory.mktemp("ref") / "run", *LONG, "cluster.workers=1", "cluster.spare_workers=0")
    assert r.rc == 0, r.stderr[-3000:]
    return r.summary["params_sha256"]


@pytest.fixture
def redis_server(tmp_path: Path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def lab():
    """Separate hosts on this machine (tests/helpers/netns.py): skipped where network namespaces are not available."""
    from tests.helpers import netns

    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"separate-hosts test needs Linux network namespaces: {why}")
    lab = netns.NetLab()
    try:
        yield lab
    finally:
        left = lab.close()
        assert not left, f"network namespaces left behind: {left}"


@pytest.fixture
def shm_run() -> Iterator[str]:
    """A run id of its own for shared-memory segments (shared/memory/shm.py); what the test left under /dev/shm is removed."""
    from cmemi.shared.memory import shm

    run = f"shm-test-{secrets.token_hex(4)}"
    yield run
    for path in shm.owned(run):
        path.unlink()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the suite's time goes, by test file (setup + call + teardown of its tests): `--durations` names the
    slowest tests, this the files, so that CI's hour can be planned (docs/contributing.md)."""
    by_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown") and hasattr(r, "duration"):
                name = r.nodeid.split("::")[0]
                by_file[name] = by_file.get(name, 0.0) + r.duration
    if not by_file:
        return
    total = sum(by_file.values())
    terminalreporter.write_sep("=", f"time by test file: {total:.0f} s in {len(by_file)} files, the 25 longest")
    for name, s in sorted(by_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{s:8.1f}s {100 * s / total:5.1f}%  {name}")
