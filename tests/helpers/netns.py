"""Separate "hosts" on one Linux machine: network namespaces on a private bridge, for tests run as root.

    lab = NetLab()                        # a namespace holding the bridge br0
    redis = lab.host("redis", 2)          # namespace <prefix>-redis with eth0 = 10.213.0.2/24 on the bridge
    p = lab.start(redis, ["redis-server", ...], log_path)   # the process runs inside that namespace
    lab.reach(w1, redis, 6379)            # wait until w1 can open a TCP connection to redis:6379
    lab.cut(w1); lab.restore(w1)          # pull a host's cable (its bridge port goes down) and plug it back
    iptables(w1, "-A", "OUTPUT", ...)     # a rule in the host's own namespace
    lab.close()                           # kills what it started, deletes every namespace (and so every veth)

`gated_mlp` is the digits MLP with a test hook: in a process started with CMEMI_TEST_GATE=PATH, a
forward pass that begins while the file PATH exists waits until it is removed (and writes PATH.held
meanwhile), so a test can hold a worker in the middle of computing a gradient.

The bridge lives in a namespace of its own and the addresses exist only inside namespaces this lab
created, so nothing touches the root namespace's network. Names carry the creating process's pid:
namespaces whose creator is gone (a test run that was SIGKILLed) are removed by the next lab.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cmemi.shared.runtime.lifeline import die_with_parent

PREFIX = "cmemi-nt"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-")


def gated_mlp(**kwargs):
    """The digits MLP; in a process with CMEMI_TEST_GATE=PATH, forward passes wait while PATH exists."""
    from cmemi.examples.digits import make_model

    model = make_model(**kwargs)
    gate = os.environ.get("CMEMI_TEST_GATE")
    if gate:
        inner = model.forward

        def forward(x):
            if os.path.exists(gate):
                Path(gate + ".held").write_text(str(os.getpid()))
                while os.path.exists(gate):
                    time.sleep(0.01)
            return inner(x)

        model.forward = forward
    return model


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def wait_all(procs: dict[str, subprocess.Popen], names: list[str], timeout: float, diagnostics) -> dict[str, int]:
    """Wait for each named process to exit, all within `timeout` seconds; their exit codes. AssertionError (with
    `diagnostics()`) for one that does not finish."""
    deadline = time.monotonic() + timeout
    for k in names:
        try:
            procs[k].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{k} did not finish{diagnostics()}") from None
    return {k: procs[k].returncode for k in names}


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` in {ns} failed: {r.stderr.strip()}")


def iptables(host: Host, *args: str) -> None:
    """Run iptables in the host's namespace (its own tables: nothing outside the lab is touched)."""
    r = subprocess.run(["ip", "netns", "exec", host.ns, "iptables", *args], capture_output=True, text=True,
                       timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"`iptables {' '.join(args)}` in {host.name} failed: {r.stderr.strip()}")


def connected(host: Host, peer: Host) -> bool:
    """Does the host hold an established TCP connection with `peer` (either end's view, `ss` in its namespace)?"""
    r = subprocess.run(["ip", "netns", "exec", host.ns, "ss", "-Htn", "state", "established", "dst", peer.ip],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"`ss` in {host.name} failed: {r.stderr.strip()}")
    return bool(r.stdout.strip())


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_orphans() -> list[str]:
    """Delete namespaces of earlier labs whose creating process no longer exists."""
    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
    return removed


def unavailable() -> str | None:
    """None when this process can really create network namespaces with veths; otherwise why not."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    ns = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        r = _ip("netns", "add", ns, check=False)
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
        for args in (("-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"),
                     ("-n", ns, "link", "add", "b0", "type", "bridge"),
                     ("netns", "exec", ns, "true")):
            r = _ip(*args, check=False)
            if r.returncode != 0:
                return f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}"
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot use network namespaces: {exc}"
    finally:
        _ip("netns", "del", ns, check=False)


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    port_if: str  # its veth end on the bridge (in the bridge namespace)


class NetLab:
    def __init__(self, subnet: str = "10.213.0") -> None:
        remove_orphans()
        self.subnet = subnet
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self.others: list[subprocess.Popen] = []  # in the root namespace, stopped at close (IdleReference)
        self._created: list[str] = []
        _ip("netns", "add", self.bridge_ns)
        self._created.append(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def host(self, name: str, last_octet: int) -> Host:
        """A new namespace wired to the bridge, with address <subnet>.<last_octet>/24 on its eth0."""
        ns = f"{self.tag}-{name}"
        port_if = f"v-{name}"[:15]
        ip = f"{self.subnet}.{last_octet}"
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", self.bridge_ns, "link", "add", port_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.bridge_ns, "link", "set", port_if, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", port_if, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = self.hosts[name] = Host(name, ns, ip, port_if)
        return host

    def start(self, host: Host, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Run argv inside the host's namespace (`ip netns exec` execs it: the pid is the program's)."""
        out = open(log, "ab")
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, preexec_fn=die_with_parent)
        finally:
            out.close()
        self.procs.append(proc)
        return proc

    def shape(self, host: Host, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Token-bucket both ends of the host's veth (`tc ... tbf`): eth0 (host -> bridge) and its bridge port
        (bridge -> host), each at `rate` (tc's units, e.g. 50mbit), queueing at most `latency` of data."""
        spec = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _tc(host.ns, "qdisc", "replace", "dev", "eth0", *spec)
        _tc(self.bridge_ns, "qdisc", "replace", "dev", host.port_if, *spec)

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its bridge port goes down, every packet to or from it is lost."""
        _ip("-n", self.bridge_ns, "link", "set", host.port_if, "down")

    def restore(self, host: Host) -> None:
        _ip("-n", self.bridge_ns, "link", "set", host.port_if, "up")

    def reach(self, src: Host, dst: Host, port: int, timeout: float = 20) -> None:
        """Wait until a TCP connection from src to dst:port succeeds (through the bridge, not loopback)."""
        code = ("import socket, sys\n"
                "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()\n"
                "except OSError as e:\n    sys.exit(str(e))")
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(["ip", "netns", "exec", src.ns, sys.executable, "-c", code, dst.ip, str(port)],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{src.name} ({src.ip}) cannot reach {dst.name} ({dst.ip}:{port}): {r.stderr.strip()}")
            time.sleep(0.1)

    @staticmethod
    def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def close(self) -> list[str]:
        """Stop every process started here, delete every namespace; returns what could not be removed."""
        self.procs.extend(self.others)
        self.others.clear()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        left = []
        for ns in reversed(self._created):  # deleting a namespace destroys its veth ends (and their peers)
            if _ip("netns", "del", ns, check=False).returncode != 0 and ns in _namespaces():
                left.append(ns)
        self._created = [ns for ns in self._created if ns in left]
        return left
