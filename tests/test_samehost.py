"""The same-host endpoint (shared/wire/samehost.py, shared/wire/security.py): who may connect to a server's ipc:// endpoint,
which role its messages carry, and which endpoint a worker picks. Real sockets, real uids, no cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.wire import samehost
from cmemi.shared.wire.security import Curve, curve_from_config, generate

from tests.conftest import DIGITS

NOBODY = 65534


class Server:
    """A ROUTER as the aggregator makes it: CurveZMQ on tcp://, then the ipc:// endpoint in a 0700 directory."""

    def __init__(self, run_dir: Path, curve: Curve) -> None:
        self.curve = curve
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        curve.serve(self.ctx, self.sock)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.ipc = samehost.bind_local(curve, self.ctx, self.sock, run_dir, "aggregator")
        self.addr = samehost.advertise(f"tcp://127.0.0.1:{port}", self.ipc)

    def seen(self, n: int, timeout: float = 5) -> list[tuple[bytes, str | None]]:
        """(body, role) of up to n messages received within `timeout` seconds."""
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart(copy=False)
                out.append((frames[1].bytes, self.curve.role(frames[1])))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.curve.close()
        self.ctx.term()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate(tmp_path / "keys")
    return tmp_path / "keys"


def curve(keys: Path, role: str) -> Curve:
    return curve_from_config(type("Sec", (), {"curve": True, "keys_dir": str(keys)})(), role)


def dealer(ctx: zmq.Context, opened: list[zmq.Socket]) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    opened.append(s)
    return s


def knock(s: zmq.Socket, body: bytes) -> None:
    """Send without waiting: once the server refused the handshake a DEALER has no peer left, and a blocking send
    would wait for one forever (the refusal is what is tested, not the send)."""
    with contextlib.suppress(zmq.Again):
        s.send(body, zmq.NOBLOCK)


@pytest.mark.timeout(60)
def test_only_a_worker_key_of_our_uid_gets_in(tmp_path: Path, keys: Path) -> None:
    server = Server(tmp_path / "run", curve(keys, "aggregator"))
    ctx, opened = zmq.Context(), []
    try:
        worker = dealer(ctx, opened)
        assert samehost.connect(curve(keys, "worker"), worker, server.addr, "auto", "aggregator") == "ipc"
        worker.send(b"from-worker")
        assert server.seen(1) == [(b"from-worker", "worker")]  # the role survives: per-message checks still apply

        # the aggregator's and the coordinator's secrets are not worker keys: refused (only workers use ipc://)
        for role in ("aggregator", "coordinator"):
            s = dealer(ctx, opened)
            s.plain_username = b"worker"
            s.plain_password = zmq.auth.load_certificate(str(keys / f"{role}.key_secret"))[1]
            s.connect(server.ipc)
            knock(s, role.encode())
        # a same-uid stranger without the run's keys: a made-up key, a worker's *public* key, no hello at all
        forged = [zmq.curve_keypair()[1], zmq.auth.load_certificate(str(keys / "worker.key"))[0], None]
        for password in forged:
            s = dealer(ctx, opened)
            if password is not None:
                s.plain_username, s.plain_password = b"worker", password
            s.connect(server.ipc)
            knock(s, b"stranger")
        assert server.seen(1, timeout=2) == []
        assert server.curve.refused_local >= 4  # each PLAIN hello above reached ZAP and was refused there
        worker.send(b"still-here")
        assert server.seen(1) == [(b"still-here", "worker")]
    finally:
        for s in opened:
            s.close(linger=0)
        ctx.term()
        server.close()


def plain_hello_as(uid: int, path: Path, password: bytes) -> str:
    """From a forked child running as `uid`: a raw ZMTP 3.0 PLAIN hello as a worker to the Unix socket `path`.
    Returns "EACCES" (the kernel refused the connect), or the server's answer ("WELCOME", "ERROR" or "EOF")."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child touches no ZeroMQ state of the parent: a plain socket only
        answer = "EOF"
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                try:
                    s.connect(str(path))
                    greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"PLAIN".ljust(20, b"\x00") + b"\x00" * 32
                    hello = b"\x05HELLO" + bytes([6]) + b"worker" + bytes([len(password)]) + password
                    s.sendall(greeting + b"\x04" + bytes([len(hello)]) + hello)
                    got = b""
                    while chunk := s.recv(4096):
                        got += chunk
                        if b"WELCOME" in got[64:] or b"ERROR" in got[64:]:
                            answer = "WELCOME" if b"WELCOME" in got[64:] else "ERROR"
                            break
                except PermissionError:
                    answer = "EACCES"
                except OSError:  # a refused hello may end in a reset
                    pass
        finally:
            os.write(write, answer.encode())
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        return f.read()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_is_refused_even_with_the_worker_key(keys: Path) -> None:
    run_dir = Path(tempfile.mkdtemp())  # searchable by others all the way down to the socket directory
    run_dir.chmod(0o755)
    server = Server(run_dir, curve(keys, "aggregator"))
    secret = zmq.auth.load_certificate(str(keys / "worker.key_secret"))[1]
    try:
        path = Path(server.ipc.removeprefix("ipc://"))
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert plain_hello_as(os.getuid(), path, secret) == "WELCOME"  # the raw hello itself is right
        assert plain_hello_as(NOBODY, path, secret) == "EACCES"  # the directory's mode: connect() fails
        before = server.curve.refused_local
        path.parent.chmod(0o755)  # without the directory's protection, the SO_PEERCRED uid check still refuses
        path.chmod(0o777)
        assert plain_hello_as(NOBODY, path, secret) in ("ERROR", "EOF")  # libzmq may just hang up
        assert server.curve.refused_local == before + 1
        assert server.seen(1, timeout=1) == []
    finally:
        server.close()
        shutil.rmtree(run_dir)


def test_choose_takes_ipc_only_on_the_same_host() -> None:
    here = samehost.advertise("tcp://10.0.0.5:1", "ipc:///x/a-1.sock")
    there = "tcp://10.0.0.5:1|ipc:///x/a-1.sock|0123456789abcdef"
    assert samehost.choose(here, "auto", "aggregator") == ("ipc:///x/a-1.sock", "ipc")
    assert samehost.choose(here, "shm", "aggregator") == ("ipc:///x/a-1.sock", "ipc")
    assert samehost.choose(here, "tcp", "aggregator") == ("tcp://10.0.0.5:1", "tcp")
    assert samehost.choose(there, "auto", "aggregator") == ("tcp://10.0.0.5:1", "tcp")
    assert samehost.choose("tcp://10.0.0.5:1", "auto", "aggregator") == ("tcp://10.0.0.5:1", "tcp")
    assert samehost.tcp_of(here) == "tcp://10.0.0.5:1"
    with pytest.raises(samehost.TransportError, match=r"^cluster.transport is 'shm' but the shard1 at "
                       r"tcp://10.0.0.5:1 .*another host.*set cluster.transport: auto") as exc:
        samehost.choose(there, "shm", "shard1")
    assert "\n" not in str(exc.value)


def test_transport_config_names_the_field_and_the_fix() -> None:
    assert load_config(DIGITS, []).cluster.transport == "auto"
    with pytest.raises(ConfigError, match=r"'cluster.transport' = 'ipc': must be one of auto, tcp, shm; use auto"):
        load_config(DIGITS, ["cluster.transport=ipc"])


def test_socket_dir_is_private_and_stale_sockets_go(tmp_path: Path) -> None:
    d = samehost.socket_dir(tmp_path / "run")
    assert d.stat().st_mode & 0o777 == 0o700
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = d / f"aggregator-{int(dead.stdout)}.sock"
    stale.touch()
    server = Server(tmp_path / "run", Curve(False))
    try:
        assert not stale.exists()
        assert sorted(p.name for p in d.iterdir()) == [f"aggregator-{os.getpid()}.sock"]
    finally:
        server.close()
    d.chmod(0o755)
    with pytest.raises(samehost.TransportError, match="mode 0700"):
        samehost.socket_dir(tmp_path / "run")
