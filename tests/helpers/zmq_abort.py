"""Reproduce libzmq 4.3.5's `Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`: a server's ZeroMQ
aborting the whole process when a peer dies while the server is not reading that peer (docs/concepts/faults.md,
"libzmq aborts"; tests/test_zmq_abort.py runs it).

A round, on real sockets with the project's own options (shared/runtime/links.py `set_link_options`, CurveZMQ with
the project's keys and ZAP handler, the server ROUTER's RCVHWM = 2 of shared/runtime/service.py `serve_router`):

1. a server process binds its ROUTER on port 0, reads the client's first message (so it knows the client's
   routing id), then reads nothing more: a service's loop busy with a step;
2. a client process sends until its own send queue is full, so the server's ZeroMQ holds RCVHWM messages and
   has stopped reading that connection ("input stopped");
3. the client is SIGKILLed, and the server sends it one message (a reply, a commit): the client's kernel answers
   it, and any PING, with a reset, so the connection fails while the server's input from it is stopped;
4. the server goes on not reading for `HOLD_S`, then drains its socket and exits 0.

libzmq marks such a connection failed and stops polling it (`_io_error`), but its heartbeat timer (ZMQ_HEARTBEAT_IVL
on this end) and its PONG to a PING it decodes once the reader drains (ZMQ_HEARTBEAT_IVL on the other end) still
write to it, and `out_event` asserts `!_io_error`: the server dies of SIGABRT (exit -6). The round counts it.
`--hostile` puts a hostile process's connections before every other round's client (`hostile`: garbage, a
greeting then garbage, resets, a half-open connection): the server must serve the real client all the same.
`--server-ping MS` / `--client-ping MS` turn heartbeats on at that end, over the project's options (which set none
since this was found; shared/runtime/links.py); the PONG path needs the PING among the bytes libzmq had read but not
yet passed on when it stopped, so it wants small messages (`--part 64`) and frequent PINGs (`--client-ping 1`).

    python -m tests.helpers.zmq_abort 20                          # the project's options: 20 rounds; prints the aborts
    python -m tests.helpers.zmq_abort 20 --server-ping 200        # the server's heartbeat timer (as before the fix)
    python -m tests.helpers.zmq_abort 20 --client-ping 1 --part 64  # the server's PONG to a client's PING
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq
from cmemi.shared.config.system import ClusterConfig
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.wire import security

ROOT = Path(__file__).resolve().parents[2]
HOLD_S = 1.0  # the server reads nothing this long after the kill: five heartbeat intervals at the default 0.2 s
PART = 64 * 1024  # bytes per client message: a few fill the server's RCVHWM and both kernels' buffers
CLIENT_SNDHWM = 4  # the client's own queue, small so "full" comes after a few hundred KiB, not SNDHWM's 1,000 parts
PING_TIMEOUT_S = 60.0  # links.py's heartbeat timeout and TTL while it set heartbeats (FROZEN_PEER_S)
START_S = 20.0  # a child must say it is ready within this (a loaded CI host starts Python slowly)
FILL_S = 60.0  # the client must fill its queue within this (tiny `--part`s take the longest to fill the kernels' buffers)


def _options(sock: zmq.Socket[bytes], ping_ms: int) -> None:
    """The project's link options, plus heartbeats every `ping_ms` as links.py set them until this was found: a
    long timeout and TTL (libzmq's default timeout, one interval, would drop the server's connection first, its
    input stopped so that no PONG is read within it)."""
    set_link_options(sock, ClusterConfig())
    if ping_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PING_TIMEOUT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(PING_TIMEOUT_S * 1000))


def server(keys: Path, ping_ms: int) -> int:
    """The server end, as `serve_router` sets it up; prints its port, then follows the parent's lines on stdin."""
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    curve = security.Curve(True, keys, "aggregator")
    sock = zctx.socket(zmq.ROUTER)
    _options(sock, ping_ms)
    curve.serve(zctx, sock)
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    if not sock.poll(int(START_S * 1000)):
        return 3
    ident = sock.recv_multipart()[0]  # the client's routing id; nothing more is read until the parent says so
    print("joined", flush=True)
    for line in sys.stdin:
        if line.strip() == "poke":  # the client is dead: a reply to it meets its kernel's reset
            sock.send_multipart([ident, b"reply"])
        elif line.strip() == "drain":
            while sock.poll(200):
                sock.recv_multipart()
            print("alive", flush=True)
            break
    sock.close(linger=0)
    curve.close()
    zctx.term()
    return 0


def client(keys: Path, port: int, ping_ms: int, part: int) -> int:
    """The client end (a worker's DEALER): sends until its queue is full, says so, and waits to be killed."""
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    _options(sock, ping_ms)
    security.Curve(True, keys, "worker").connect_as_client(sock)
    sock.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"hello")
    payload = os.urandom(part)
    deadline = time.monotonic() + FILL_S
    while time.monotonic() < deadline:
        if not sock.poll(200, zmq.POLLOUT):  # the pipe stayed full: the server's input has stopped
            print("full", flush=True)
            sys.stdin.readline()  # the parent SIGKILLs us here
            return 0
        sock.send(payload, zmq.NOBLOCK)
    return 3


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.zmq_abort", *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _line(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the {what} ended before saying it was ready (exit {proc.wait(START_S)})")
    return line


def hostile(port: int) -> list[socket.socket]:
    """A hostile process on the same host, before the real client: garbage bytes then a reset; a ZMTP greeting
    for CURVE then garbage then a reset; and a connection left half-open (returned: close them after the round).
    None of them completes a CURVE handshake, so libzmq drops each inside its handshake (`error` during it)."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + bytes(32)
    for first in (os.urandom(4096), greeting + os.urandom(4096)):
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(first)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a reset
        raw.close()
    return [socket.create_connection(("127.0.0.1", port))]


def one_round(keys: Path, server_ping: int = 0, client_ping: int = 0, part: int = PART,
              with_hostile: bool = False) -> int:
    """One round (the module docstring); returns the server's exit code: 0 survived, -6 libzmq's abort."""
    srv = _spawn("server", str(keys), str(server_ping))
    cli = None
    half_open: list[socket.socket] = []
    try:
        port = _line(srv, "server")
        if with_hostile:
            half_open = hostile(int(port))
        cli = _spawn("client", str(keys), port, str(client_ping), str(part))
        if _line(srv, "server") != "joined" or _line(cli, "client") != "full":
            raise RuntimeError("the round's processes did not reach their places")
        cli.send_signal(signal.SIGKILL)
        cli.wait(START_S)
        assert srv.stdin is not None
        try:
            srv.stdin.write("poke\n")
            srv.stdin.flush()
            srv.wait(HOLD_S)  # not a sleep: returns at once if the server aborts
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        if srv.poll() is None:
            srv.stdin.write("drain\n")
            srv.stdin.flush()
            assert srv.stdout is not None
            said = srv.stdout.readline().strip()  # nothing: it aborted while draining (a PONG to a buffered PING)
            if said not in ("alive", ""):
                raise RuntimeError(f"the server said {said!r} after draining")
        return srv.wait(START_S)
    finally:
        for raw in half_open:
            raw.close()
        for proc in (cli, srv):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except BrokenPipeError:  # a line still buffered for a process that died
                    pass


def rounds(n: int, deadline_s: float, server_ping: int = 0, client_ping: int = 0, part: int = PART,
           stop_at_abort: bool = False, with_hostile: bool = False) -> tuple[int, int]:
    """Up to `n` rounds within `deadline_s` (at least one), stopping at the first abort if asked; returns (rounds run,
    rounds whose server aborted)."""
    aborts = ran = 0
    end = time.monotonic() + deadline_s
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        security.generate(keys)
        while ran < n and (ran == 0 or time.monotonic() < end) and not (stop_at_abort and aborts):
            rc = one_round(keys, server_ping, client_ping, part, with_hostile and ran % 2 == 1)
            if rc not in (0, -signal.SIGABRT):
                raise RuntimeError(f"the server exited {rc}, neither survived (0) nor libzmq's abort (-6)")
            aborts += rc == -signal.SIGABRT
            ran += 1
    return ran, aborts


def main(argv: list[str]) -> int:
    if argv[0] == "server":
        return server(Path(argv[1]), int(argv[2]))
    if argv[0] == "client":
        return client(Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]))
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.zmq_abort", description=__doc__.split("\n")[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("--server-ping", type=int, default=0, help="ZMQ_HEARTBEAT_IVL (ms) on the server end; 0: none")
    ap.add_argument("--client-ping", type=int, default=0, help="ZMQ_HEARTBEAT_IVL (ms) on the client end; 0: none")
    ap.add_argument("--part", type=int, default=PART, help="bytes per client message")
    ap.add_argument("--hostile", action="store_true", help="every other round, a hostile raw TCP client first")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds; no round starts after it")
    a = ap.parse_args(argv)
    ran, aborts = rounds(a.rounds, a.deadline, a.server_ping, a.client_ping, a.part, with_hostile=a.hostile)
    print(f"libzmq {zmq.zmq_version()} (pyzmq {zmq.pyzmq_version()}): {aborts} of {ran} rounds aborted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
