"""A training run over separate emulated hosts (tests/helpers/netns.py), started as an operator would.

    run = HostsRun(lab, tmp_path, sets, placement={"redis": "ctl", "coord": "ctl", "agg": "agg", ...})
    run.start_all(); run.wait_step(100)
    with run.port_blocked("agg", run.leader_port()): ...     # every packet to/from that port lost on the wire
    run.finish(); run.longest_gap()

Each service runs in its host's namespace with `--set cluster.host=<its address>`, CurveZMQ on (keys generated),
the coordinator with `--supervise none`; Redis on the host named "redis" in `placement`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cmemi.shared.config.loading import dump_config, load_config
from cmemi.shared.runtime.lifeline import die_with_parent
from cmemi.shared.wire.security import generate

from cmemi.launcher.redis_server import redis_server_binary
from tests.conftest import DIGITS, ROOT
from tests.helpers import netns
from tests.helpers.netns import iptables
from tests.test_netns import poll, read_jsonl


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


class HostsRun:
    def __init__(self, lab: netns.NetLab, tmp_path: Path, sets: tuple[str, ...], placement: dict[str, str]) -> None:
        self.lab, self.placement = lab, placement
        self.run_dir, self.logs = tmp_path / "run", tmp_path / "logs"
        self.run_dir.mkdir()
        self.logs.mkdir()
        keys = tmp_path / "keys"
        generate(keys)
        name = f"hosts-{secrets.token_hex(4)}"
        self.cfg = load_config(DIGITS, [*sets, f"run.name={name}", f"run.dir={self.run_dir}",
                                        f"security.keys_dir={keys}"])
        self.cfg_path = tmp_path / "cluster.yaml"
        self.cfg_path.write_text(dump_config(self.cfg))
        self.idle_reference = IdleReference(self.cfg_path, tmp_path)
        lab.others.append(self.idle_reference.proc)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        names = list(dict.fromkeys(placement.values()))
        self.hosts = {h: lab.host(h, i) for i, h in enumerate(names, start=2)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_dir = tmp_path / "redis"
        self.redis_dir.mkdir()
        password = secrets.token_hex(16)
        redis_host = self.hosts[placement["redis"]]
        lab.start(redis_host, [redis_server_binary(), "--port", "6379", "--bind", redis_host.ip, "--requirepass",
                               password, "--save", "", "--appendonly", "no", "--dir", str(self.redis_dir),
                               "--logfile", str(self.redis_dir / "redis.log")], self.logs / "redis.log")
        poll(lambda: "Ready to accept connections" in _text(self.redis_dir / "redis.log"), 30, "redis-server ready")
        self.url = f"redis://:{password}@{redis_host.ip}:6379/0"
        for h in self.hosts.values():
            if h is not redis_host:
                lab.reach(h, redis_host, 6379)

    def start(self, key: str, role: str, *extra: str, log: str | None = None) -> subprocess.Popen:
        host = self.hosts[self.placement[key]]
        argv = [sys.executable, "-m", "cmemi", role, "--config", str(self.cfg_path),
                "--set", f"cluster.host={host.ip}", *extra]
        proc = self.lab.start(host, argv, self.logs / f"{log or key}.log", cwd=ROOT,
                              env={**os.environ, "CMEMI_REDIS_URL": self.url})  # the password stays out of argv
        self.procs[log or key] = proc
        return proc

    def start_all(self, workers: tuple[str, ...] = ("w0", "w1")) -> None:
        self.start("coord", "coordinator", "--supervise", "none")
        self.start("ckpt", "checkpointer")
        self.start("agg", "aggregator")
        for w in workers:
            self.start(w, "worker", "--worker-id", w)

    # ---- what the run wrote
    def events(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "events.jsonl")
                if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def step(self) -> int:
        m = self.metrics()
        return m[-1]["step"] if m else 0

    def diagnostics(self) -> str:
        out = ["", f"step {self.step()}; exit codes " + ", ".join(f"{k}={p.poll()}" for k, p in self.procs.items())]
        for log in sorted(self.logs.glob("*.log")):
            out.append(f"---- {log.name}\n{_text(log)[-1500:]}")
        out.append("---- events\n" + "\n".join(json.dumps(e) for e in read_jsonl(self.run_dir / "events.jsonl")[-30:]))
        return "\n".join(out)

    def wait_step(self, n: int, timeout: float = 180) -> int:
        def reached() -> int:
            if self.step() >= n:  # checked first: a run that reached n and then ended is not a failure
                return self.step()
            for k in ("coord", "agg", "ckpt"):
                if self.procs[k].poll() is not None:
                    raise AssertionError(f"{k} exited with {self.procs[k].returncode}{self.diagnostics()}")
            return self.step() >= n and self.step()
        return poll(reached, timeout, f"step {n}", self.diagnostics)

    def hold(self, seconds: float) -> None:
        """Let `seconds` pass (a fault's length), failing at once if a server exits meanwhile."""
        end = time.monotonic() + seconds

        def over() -> bool:
            for k in ("coord", "agg", "ckpt"):
                if self.procs[k].poll() is not None:
                    raise AssertionError(f"{k} exited with {self.procs[k].returncode}{self.diagnostics()}")
            return time.monotonic() >= end
        poll(over, seconds + 5, f"{seconds:g}s to pass")

    def leader_port(self) -> int:
        addr = poll(lambda: self.events("aggregator_started"), 60, "the leader's address", self.diagnostics)[-1]["addr"]
        m = re.search(r"tcp://[\d.]+:(\d+)", addr)
        assert m, addr
        return int(m.group(1))

    # ---- faults
    @contextmanager
    def port_blocked(self, key: str, port: int) -> Iterator[None]:
        """Every TCP packet to or from `port` on the host of `key` lost (its other connections go on).

        Each packet is dropped where it arrives (iptables INPUT on the host for `port`, on every other host for
        packets from it): a packet a host's own netfilter drops on its way out is a local error to its TCP, which
        then retries every 0.5 s instead of backing off as after a loss on the wire."""
        host = self.hosts[self.placement[key]]
        rules = [(host, ["-p", "tcp", "--dport", str(port)])]
        rules += [(h, ["-p", "tcp", "-s", host.ip, "--sport", str(port)]) for h in self.hosts.values() if h is not host]
        for h, match in rules:
            iptables(h, "-I", "INPUT", *match, "-j", "DROP")
        try:
            yield
        finally:
            for h, match in rules:
                iptables(h, "-D", "INPUT", *match, "-j", "DROP")

    @contextmanager
    def cut(self, key: str) -> Iterator[None]:
        """The cable of the host of `key` pulled (every packet to or from it lost)."""
        host = self.hosts[self.placement[key]]
        self.lab.cut(host)
        try:
            yield
        finally:
            self.lab.restore(host)

    # ---- the end
    def finish(self, names: tuple[str, ...] = ("agg", "coord", "w0", "w1"), timeout: float = 300) -> dict[str, int]:
        codes = netns.wait_all(self.procs, list(names), timeout, self.diagnostics)
        for proc in self.lab.procs:  # the checkpointer serves until stopped; Redis too
            self.lab.stop(proc)
        return codes

    def reference(self, timeout: float = 300) -> str:
        """The summary (JSON text, params_sha256 in it) of `cmemi reference` for this config: a fault-free run in the
        root namespace, started with the cluster on idle CPU (IdleReference); `timeout` counts from this call."""
        return self.idle_reference.result(timeout)

    def gaps(self) -> list[tuple[float, int]]:
        """(seconds since the step before, step) for every logged step after the first."""
        rows = self.metrics()
        return [(b["t"] - a["t"], b["step"]) for a, b in zip(rows, rows[1:], strict=False)]


class IdleReference:
    """`cmemi reference` of a config, computed while the test's cluster runs, on CPU the cluster leaves idle.

    Why: an emulated-host fault test spends much of its wall time waiting (outages held, polls), and its reference of
    3,000-6,000 steps took another 20-60 s after the run, ~4 min of CI's suite (the emulated hosts cannot use the
    zygote template: another namespace). Under SCHED_IDLE the reference gets no CPU that a runnable process of the
    cluster wants, so no timing the test measures moves; `result` puts its threads back to normal scheduling."""

    def __init__(self, cfg_path: Path, out_dir: Path) -> None:
        self.stdout, self.stderr = out_dir / "reference.json", out_dir / "reference.err"
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "cmemi", "reference", str(cfg_path)], cwd=ROOT,
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_idle)

    def result(self, timeout: float) -> str:
        """Its stdout once it exits 0 (subprocess.TimeoutExpired after `timeout` s; AssertionError on a failure)."""
        for tid in _threads(self.proc.pid):
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass  # the thread ended meanwhile
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        assert self.proc.returncode == 0, self.stderr.read_text()[-2000:]
        return self.stdout.read_text()


def _idle() -> None:
    die_with_parent()
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # threads torch starts later inherit it


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []  # it exited already
