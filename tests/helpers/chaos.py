"""Fault injection against a real `cmemi up`: find processes through Redis, SIGKILL/SIGSTOP them."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect, emit, running_members

from tests.conftest import DIGITS, ROOT, up_args


def poll(cond, timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:g}s")


def seeded_steps(spans: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """A fresh seed (name it in every failure) and one step drawn from it in each [lo, hi) span, in order.
    CMEMI_TEST_SEED=<seed> draws from a failure's seed instead, to run it again."""
    forced = os.environ.get("CMEMI_TEST_SEED")
    seed = int(forced) if forced else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    return seed, [rng.randrange(lo, hi) for lo, hi in spans]


class Cluster:
    """A `cmemi up` in the background, with its Redis for inspection and for recording injected faults."""

    def __init__(self, run_dir: Path, *sets: str, config: str = DIGITS, flags: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        # a previous run's cluster.json names a Redis that is gone: read only the one this `cmemi up` writes
        (run_dir / "cluster.json").unlink(missing_ok=True)
        self.log = open(run_dir.parent / f"{run_dir.name}.log", "a")
        self.proc = subprocess.Popen([*up_args(run_dir, *sets, config=config), *flags], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        info = poll(lambda: self._info(), 60, "cluster.json")
        self.redis: redis.Redis = connect(info["redis"])
        self.run = info["run"]
        self.keys = Keys(self.run)
        self.redis_url = info["redis"]

    def _info(self) -> dict[str, Any] | None:
        path = self.run_dir / "cluster.json"
        if self.proc.poll() is not None:
            raise RuntimeError(f"cmemi up exited early with {self.proc.returncode}; see {self.log.name}")
        return json.loads(path.read_text()) if path.is_file() else None

    def step(self) -> int:
        try:
            return int(self.redis.hget(self.keys.progress, "step") or 0)
        except redis.RedisError:
            return 0

    def wait_step(self, n: int, timeout: float = 120) -> int:
        return poll(lambda: self.proc.poll() is None and self.step() >= n and self.step(), timeout, f"step {n}")

    def kill_at(self, role: str, ident: str, steps: list[int], step_timeout: float = 120,
                replace_timeout: float = 60) -> list[int]:
        """SIGKILL role/ident once the run reaches each of `steps`, each time waiting until its next incarnation
        registered and heartbeats (a server does once it replayed the step log); returns the steps it was killed at
        (the run may have passed a target by a few)."""
        killed_at = []
        for target in steps:
            killed_at.append(self.wait_step(target, timeout=step_timeout))
            self.replaced(role, ident, self.signal(role, ident), timeout=replace_timeout)
        return killed_at

    def members(self, role: str) -> dict[str, dict[str, str]]:
        """Running members of a role: id -> record (pid, incarnation, ...)."""
        return running_members(self.redis, self.keys, role)

    def replaced(self, role: str, ident: str, old_inc: int, timeout: float = 60) -> None:
        """Wait until a newer incarnation of role/ident has registered and heartbeats."""
        def newer() -> bool:
            rec = self.redis.hgetall(self.keys.member(role, ident))
            return bool(rec) and int(rec["incarnation"]) > old_inc and bool(
                self.redis.exists(self.keys.heartbeat(role, ident)))
        poll(newer, timeout, f"a new incarnation of {role}:{ident}")

    def signal(self, role: str, ident: str, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to the current incarnation of role/ident (recorded as a fault); returns that incarnation."""
        rec = self.redis.hgetall(self.keys.member(role, ident))
        pid = int(rec["pid"])
        emit(self.redis, self.keys, "fault_injected", role=role, id=ident, incarnation=int(rec["incarnation"]),
             signal=signal.Signals(sig).name, pid=pid)
        os.kill(pid, sig)
        return int(rec["incarnation"])

    def double_fault(self, shard: str) -> None:
        """Aggregator `shard` and the checkpointer SIGKILLed together (the step log dies with its holder); returns
        once a new checkpointer heartbeats."""
        ckpt = self.redis.hgetall(self.keys.member("checkpointer", "0"))
        self.signal("aggregator", shard)
        self.signal("checkpointer", "0")
        self.replaced("checkpointer", "0", int(ckpt["incarnation"]))

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        entries = self.redis.xrange(self.keys.events)
        evs = [json.loads(fields["json"]) for _id, fields in entries]
        return [e for e in evs if kind is None or e["kind"] == kind]

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def output(self) -> str:
        """The tail of `cmemi up`'s output and of each service's log file (RUN_DIR/logs/)."""
        tails = [Path(self.log.name).read_text()[-4000:]]
        tails += [f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:]
                  for p in sorted((self.run_dir / "logs").glob("*.log"))]
        return "\n".join(tails)
