"""What keeps `cmemi up` free of single points of failure, itself aside.

- One `cmemi up` per run directory: an flock on RUN_DIR/lock, which names its holder (host, pid) and is
  released by the kernel when the holder dies, however it dies.
- `--resume` checks: something to resume, and the same config (fields that change no result excepted).
- Supervision: `cmemi up` is a child subreaper (orphaned services stay its children, reapable); it restarts
  the coordinator (the new one adopts the running services) and the embedded redis-server (same port,
  same password, its AOF replayed), and reaps whatever else exits.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import redis

from cmemi.launcher.redis_server import EmbeddedRedis
from cmemi.services.coordinator.supervisor import HEALTHY_AFTER_S, backoff, load_children, stop_all
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.schema import Config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import emit
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.lifeline import Stoppable

PR_SET_CHILD_SUBREAPER = 36
LOCK_FILE = "lock"

# Fields a resumed run may change without --force-config: none changes what is computed.
FREE_ON_RESUME = ("run.dir", "train.steps", "train.log_every", "eval.", "cluster.", "checkpoint.", "metrics.",
                  "security.", "device")


def become_subreaper() -> None:
    """Orphaned descendants (services whose coordinator died) are re-parented to this process."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass


class RunLocked(ConfigError):
    pass


class RunLock:
    """An exclusive flock on RUN_DIR/lock; the file says who holds it."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise RunLocked(f"run directory {str(run_dir)!r} is in use by {holder}; wait for that run to end "
                            "(or stop it), or choose another run.name / run.dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"cmemi up (host {socket.gethostname()}, pid {os.getpid()})\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def clear_run_dir(run_dir: Path) -> None:
    """--overwrite: delete the earlier run's files, keeping the lock we hold."""
    import shutil

    for p in run_dir.iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def check_resume(run_dir: Path, cfg: Config, force_config: bool) -> None:
    """--resume needs a checkpoint, and the config it was written with (fields in FREE_ON_RESUME aside)."""
    # imports torch: not at module level, so `cmemi up` can take the run directory's lock before torch loads
    from cmemi.services.checkpointer.store import CheckpointStore

    root = run_dir / "checkpoints"
    if not root.is_dir() or not CheckpointStore(root).list():
        raise ConfigError(f"nothing to resume in {str(run_dir)!r}: it holds no checkpoint; start the run without "
                          "--resume (add --overwrite to replace what is there)")
    saved = run_dir / "config.yaml"
    if force_config or not saved.is_file():
        return
    old, new = _flat(dataclasses.asdict(load_config(saved))), _flat(dataclasses.asdict(cfg))
    changed = sorted(k for k in old.keys() | new.keys()
                     if old.get(k) != new.get(k) and not any(k == f or (f.endswith(".") and k.startswith(f))
                                                             for f in FREE_ON_RESUME))
    if changed:
        raise ConfigError(f"--resume with a changed config: {', '.join(changed)} differ from {saved}; "
                          "resume with the same values, or pass --force-config to continue with the new ones")


def refuse_live_run(client: redis.Redis, keys: Keys) -> None:
    """Never clear the keys of a run that is live elsewhere (a shared Redis): its coordinator heartbeats."""
    record = cast("dict[str, str]", client.hgetall(keys.member("coordinator", "0")))  # decoded (membership.text)
    if record and record.get("state") == "running" and client.exists(keys.heartbeat("coordinator", "0")):
        raise RunLocked(f"run {keys.prefix.split(':')[1]!r} is live in this Redis (coordinator pid "
                        f"{record.get('pid')} on host {record.get('host')}); stop it first, or choose another run.name")


class Supervisor:
    """Runs the coordinator (and the embedded redis-server) until the run ends; restarts them when they die."""

    def __init__(self, argv: list[str], embedded: EmbeddedRedis | None, client: redis.Redis, keys: Keys,
                 max_restarts: int, env: dict[str, str] | None = None) -> None:
        self.argv, self.embedded, self.client, self.keys, self.env = argv, embedded, client, keys, env
        self.max_restarts = max_restarts
        self.coordinator: subprocess.Popen | None = None
        self.coordinator_fd: int | None = None  # its pidfd: readable once it exits
        self.restarts = {"coordinator": 0, "redis": 0}
        self.started = {"coordinator": 0.0, "redis": time.monotonic()}
        self.next_start = 0.0
        self.others: list[Stoppable] = []  # more children of ours, not to be reaped here (the zygote)

    def start_coordinator(self) -> None:
        # PR_SET_PDEATHSIG: the coordinator dies with `cmemi up`; the services it starts do too (shared/runtime/lifeline.py)
        from cmemi.shared.runtime.lifeline import die_with_parent

        self.coordinator = subprocess.Popen(self.argv, preexec_fn=die_with_parent, env=self.env)
        if self.coordinator_fd is not None:
            os.close(self.coordinator_fd)
        try:
            self.coordinator_fd = os.pidfd_open(self.coordinator.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: wait() sleeps its whole time
            self.coordinator_fd = None
        self.started["coordinator"] = time.monotonic()
        startup.mark("coordinator_spawned")

    def _count(self, what: str) -> bool:
        """One more restart of `what`; False once it failed max_restarts times in a row."""
        if time.monotonic() - self.started[what] >= HEALTHY_AFTER_S:
            self.restarts[what] = 0
        self.restarts[what] += 1
        return self.restarts[what] <= self.max_restarts

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, less if the coordinator exits first (the end of a run is seen at once). Its
        pidfd turns readable at its exit; nothing is reaped here (check() does that)."""
        if self.coordinator_fd is None or self.coordinator is None or self.coordinator.returncode is not None:
            time.sleep(seconds)
            return
        select.select([self.coordinator_fd], [], [], seconds)

    def check(self) -> int | None:
        """One supervision round. Returns the coordinator's exit code once the run is over, else None."""
        if self.embedded is not None and self.embedded.proc is not None and self.embedded.proc.poll() is not None:
            rc = self.embedded.proc.returncode
            if not self._count("redis"):
                raise RuntimeError(f"the embedded redis-server died {self.restarts['redis']} times (last exit code "
                                   f"{rc}); see {self.embedded.workdir / 'redis.log'}")
            print(f"cmemi: redis-server exited ({rc}); restarting it on port {self.embedded.port}", flush=True)
            self.embedded.start(port=self.embedded.port)  # same port, same password, the AOF replayed
            self.started["redis"] = time.monotonic()
            emit(self.client, self.keys, "restarted", role="redis", id="0", via="new_process",
                 pid=self.embedded.proc.pid if self.embedded.proc else None)
        assert self.coordinator is not None
        if self.coordinator.returncode is None:
            rc = self.coordinator.poll()
            if rc is not None and self._coordinator_done(rc):
                return rc
            if rc is not None:
                if not self._count("coordinator"):
                    raise RuntimeError(f"the coordinator died {self.restarts['coordinator']} times in a row "
                                       f"(last exit code {rc}); see its log")
                self.next_start = time.monotonic() + backoff(self.restarts["coordinator"])
                print(f"cmemi: the coordinator exited ({rc}); restarting it (the services keep running)", flush=True)
        if self.coordinator.returncode is not None and time.monotonic() >= self.next_start:
            self.start_coordinator()
            emit(self.client, self.keys, "restarted", role="coordinator", id="0", via="new_process",
                 pid=self.coordinator.pid)
        self.reap()
        return None

    def _coordinator_done(self, rc: int) -> bool:
        """Exit codes that end the run: 0 (completed), 130 (stopped), or a run the coordinator marked failed."""
        if rc in (0, 130):
            return True
        try:
            return self.client.get(self.keys.state) == "failed"
        except redis.RedisError:
            return False

    def reap(self) -> None:
        """Collect orphaned services that exited (re-parented to us as subreaper), leaving our own children
        to their Popen objects."""
        ours = {p.pid for p in (self.coordinator, self.embedded.proc if self.embedded else None, *self.others)
                if p is not None}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid in ours:
                return  # Popen.poll() collects it at the next round
            try:
                os.waitpid(info.si_pid, 0)
            except ChildProcessError:
                pass

    def stop(self, grace: float = 10.0) -> None:
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait()
        if self.coordinator_fd is not None:
            os.close(self.coordinator_fd)
            self.coordinator_fd = None


def stop_orphans(run_dir: Path) -> None:
    """Services a dead coordinator left behind (still listed in RUN_DIR/children.json): stop them now."""
    stop_all(load_children(run_dir / "children.json"), grace=5.0)
    (run_dir / "children.json").unlink(missing_ok=True)


def run_supervised(sup: Supervisor, stopping: Callable[[], bool], show: Callable[[], None]) -> int | None:
    """Supervise until the run ends (the coordinator's exit code) or a stop is asked (None)."""
    sup.start_coordinator()
    while True:
        if stopping():
            return None
        rc = sup.check()
        if rc is not None:
            return rc
        show()
        sup.wait(0.25)
