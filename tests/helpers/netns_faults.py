"""Faults across emulated hosts (tests/helpers/netns_cluster.py), one kind per function, and an orchestrator.

    faults = Faults(run, random.Random(seed))
    rec = faults.inject("cut_out", "agg", 1.2)     # every packet from the leader's host lost for 1.2 s
    faults.revive()                                 # restart what exited (as an orchestrator would, on its host)

Kinds (KINDS): `kill` (SIGKILL, restarted at once on its host), `stop` (SIGSTOP, SIGCONT after the hold), `cut` (the
host's cable pulled: both ways), `cut_in` / `cut_out` (one way: only what arrives at / leaves the host lost),
`loss` (30 % of the host's packets lost, both ways), `partition` (this host and one other cannot reach each other;
both reach everyone else), `port` (every packet to or from a port the leader, a shard or the checkpointer listens on lost). Every packet is dropped
where it arrives (iptables INPUT), as `HostsRun.port_blocked` explains: a drop on the way out would be a local
error that TCP retries at once, not a loss on the wire. `tc netem` is not used: the test machines' kernels lack it.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import netns
from tests.helpers.netns_cluster import HostsRun, iptables

KINDS = ("kill", "stop", "cut", "cut_in", "cut_out", "loss", "partition", "port")
LISTENERS = ("agg", "agg1", "ckpt")  # the processes with a port to block
LOSS = "0.3"


@dataclass
class Fault:
    kind: str
    key: str  # the process (kill, stop) or the host's first process (network kinds)
    seconds: float
    t: float = field(default_factory=time.time)
    other: str | None = None  # partition: the host on the other side; port: the port
    hit: bool = True  # False: the target had already exited (nothing to kill or stop)

    def row(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "seconds": round(self.seconds, 3), "t": self.t,
                "other": self.other, "hit": self.hit}


def role_of(key: str) -> str:
    """The role a placement key names: agg is the leader, aggN shard N, wN a worker."""
    return {"coord": "coordinator", "agg": "leader", "ckpt": "checkpointer", "redis": "redis"}.get(
        key, "shard" if key.startswith("agg") else "worker" if key.startswith("w") else key)


class Faults:
    """Injects faults into a HostsRun and restarts what they end (every start as an operator would, on its host)."""

    def __init__(self, run: HostsRun, rng: random.Random, argv: dict[str, tuple[str, ...]] | None = None) -> None:
        self.run, self.rng = run, rng
        self.argv = argv or {}  # key -> (role, *extra) to restart it with
        self.restarts: dict[str, int] = {}
        self.exit_codes: list[tuple[str, int]] = []

    # ---- processes
    def proc(self, key: str):
        if key == "redis":
            return self.run.lab.procs[0]  # HostsRun starts redis-server first
        return self.run.procs[key]

    def revive(self) -> list[str]:
        """Restart every process that exited with a non-zero code (a kill, a fence: code 3) before the run's end;
        the keys restarted."""
        done = self.run.procs["agg"].poll() == 0  # the leader finished the run: exits are the end, not faults
        out = []
        for key, proc in list(self.run.procs.items()):
            rc = proc.poll()
            if rc is None or key not in self.argv or done or (rc == 0 and key != "ckpt"):
                continue
            self.exit_codes.append((key, rc))
            self.run.start(key, *self.argv[key])
            self.restarts[key] = self.restarts.get(key, 0) + 1
            out.append(key)
        return out

    # ---- one fault
    def inject(self, kind: str, key: str, seconds: float) -> Fault:
        """Apply one fault for `seconds` (the hold restarts whatever exits meanwhile), then heal it."""
        fault = Fault(kind, key, seconds)
        with getattr(self, kind)(fault):
            self.hold(seconds)
        self.revive()
        return fault

    def hold(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.revive()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def host(self, key: str) -> netns.Host:
        return self.run.hosts[self.run.placement[key]]

    @contextlib.contextmanager
    def kill(self, f: Fault) -> Iterator[None]:
        f.hit = self._signal(f.key, signal.SIGKILL)
        yield

    @contextlib.contextmanager
    def stop(self, f: Fault) -> Iterator[None]:
        f.hit = self._signal(f.key, signal.SIGSTOP)
        try:
            yield
        finally:
            if f.hit:
                self._signal(f.key, signal.SIGCONT)

    def _signal(self, key: str, sig: int) -> bool:
        proc = self.proc(key)
        if proc.poll() is not None:
            return False
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    @contextlib.contextmanager
    def cut(self, f: Fault) -> Iterator[None]:
        with self.run.cut(f.key):
            yield

    @contextlib.contextmanager
    def cut_in(self, f: Fault) -> Iterator[None]:
        with self.drops([(self.host(f.key), ["!", "-i", "lo"])]):
            yield

    @contextlib.contextmanager
    def cut_out(self, f: Fault) -> Iterator[None]:
        h = self.host(f.key)
        with self.drops([(o, ["-s", h.ip]) for o in self.run.hosts.values() if o is not h]):
            yield

    @contextlib.contextmanager
    def loss(self, f: Fault) -> Iterator[None]:
        h = self.host(f.key)
        rand = ["-m", "statistic", "--mode", "random", "--probability", LOSS]
        rules = [(h, ["!", "-i", "lo", *rand])] + [(o, ["-s", h.ip, *rand]) for o in self.run.hosts.values() if o is not h]
        with self.drops(rules):
            yield

    @contextlib.contextmanager
    def partition(self, f: Fault) -> Iterator[None]:
        h = self.host(f.key)
        others = [k for k in self.run.placement if self.run.placement[k] != self.run.placement[f.key]]
        f.other = f.other or self.rng.choice(sorted(others))
        o = self.host(f.other)
        with self.drops([(h, ["-s", o.ip]), (o, ["-s", h.ip])]):
            yield

    @contextlib.contextmanager
    def port(self, f: Fault) -> Iterator[None]:
        port = self.server_port(f.key)
        f.other = str(port) if port else None
        if port is None:
            f.hit = False
            yield
            return
        with self.run.port_blocked(f.key, port):
            yield

    def server_port(self, key: str) -> int | None:
        """A TCP port the process of `key` listens on (`ss` in its namespace, matched by pid); None for a process
        that listens on none (a worker) or is not running."""
        proc = self.proc(key)
        if proc.poll() is not None:
            return None
        r = subprocess.run(["ip", "netns", "exec", self.host(key).ns, "ss", "-ltnpH"], capture_output=True, text=True,
                           timeout=20)
        ports = sorted({int(m.group(1)) for line in r.stdout.splitlines() if f"pid={proc.pid}," in line
                        for m in [re.search(r":(\d+)\s", line)] if m})
        return self.rng.choice(ports) if ports else None

    @contextlib.contextmanager
    def drops(self, rules: list[tuple[netns.Host, list[str]]]) -> Iterator[None]:
        """While inside: what each host receives matching its iptables match is dropped (a fault of the test's own)."""
        added = []
        try:
            for h, match in rules:
                iptables(h, "-I", "INPUT", *match, "-j", "DROP")
                added.append((h, match))
            yield
        finally:
            for h, match in added:
                iptables(h, "-D", "INPUT", *match, "-j", "DROP")


def schedule(rng: random.Random, keys: list[str], count: int, hold: tuple[float, float]) -> Iterator[tuple[str, str, float]]:
    """A seeded schedule of `count` faults: (kind, key, seconds), kinds in turn (so each kind gets count / 8) and a
    target drawn for each; Redis only stopped (a killed Redis restarts empty: that is tests/test_chaos.py's)."""
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        pool = [k for k in keys if (k != "redis" or kind == "stop") and (kind != "port" or k in LISTENERS)]
        yield kind, rng.choice(pool), rng.uniform(*hold)
