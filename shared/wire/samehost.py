"""Same-host peers: an ipc:// endpoint beside the CurveZMQ tcp:// one, chosen per peer (`cluster.transport`).

A server (the aggregator, a shard) binds its ROUTER twice: tcp:// with CurveZMQ as always, and, unless
`cluster.transport: tcp`, ipc:// in a socket directory of mode 0700 owned by this uid (`socket_dir`). It
advertises both, with its host identity, as one address string (`advertise`):

    tcp://10.0.0.5:41234|ipc:///run/dir/ipc/aggregator-1234.sock|<host id>

A worker (`connect`) takes the ipc:// endpoint when the server's host identity equals its own and
`cluster.transport` allows it, else the tcp:// one; `shm` (same host only) refuses a remote server with
one line. The host identity (`host_id`) is the kernel's boot id, the hostname and the network namespace's
inode: two processes in different network namespaces (containers, tests/helpers/netns.py) are different hosts.

Who may use the ipc:// endpoint is decided by the kernel and by the worker's key (shared/wire/security.py,
`Curve.serve_local`): the directory's mode keeps other uids from connecting at all, the ZAP handler refuses
a peer whose SO_PEERCRED uid is not ours, and the PLAIN hello must carry a worker secret key whose public
key is in keys_dir. Only workers use this path: the aggregator, the coordinator and the checkpointer keep
CurveZMQ, so no privileged role's proof ever travels over it. The checkpointer's step log socket has an ipc://
endpoint too (`bind_ipc`), but CurveZMQ stays on there: the aggregator reaches it with its own key, as over tcp://
(what that link saves is the TCP stack; its tensors go through shared memory, services/aggregator/steplog/). There is no encryption on it: a Unix socket's
bytes never leave the kernel, and only root or our own uid could read them (see docs/security.md's threat model).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
from cmemi.shared.errors import WireError
from cmemi.shared.runtime.exits import at_exit
from cmemi.shared.wire.security import LOCAL_USER, Curve

_SEP = "|"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes on Linux, with its NUL


class TransportError(WireError, ValueError):
    """A peer this process may not reach with the configured `cluster.transport` (one line, exit 2)."""


def host_id() -> str:
    """This process's host identity: boot id, hostname and network namespace (different ones: different hosts)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return hashlib.sha256(f"{boot}/{socket.gethostname()}/{netns}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Endpoints:
    tcp: str
    ipc: str | None = None
    host: str | None = None


def advertise(tcp: str, ipc: str | None) -> str:
    """The address string a server publishes: its tcp:// endpoint, and its ipc:// one with its host identity."""
    return tcp if ipc is None else _SEP.join((tcp, ipc, host_id()))


def parse(addr: str) -> Endpoints:
    parts = addr.split(_SEP)
    if len(parts) == 3 and parts[1].startswith("ipc://"):
        return Endpoints(parts[0], parts[1], parts[2])
    return Endpoints(parts[0])


def on_this_host(addrs: dict[int, str | None]) -> list[int]:
    """The keys of the servers advertised in `addrs` (k: address) that run on this host: their address names this
    host's identity (only an address with an ipc:// endpoint does: with `cluster.transport: tcp`, none)."""
    me = host_id()
    return sorted(k for k, a in addrs.items() if a is not None and parse(a).host == me)


def tcp_of(addr: str) -> str:
    """The tcp:// endpoint of an advertised address (tools and tests that talk CurveZMQ to a server)."""
    return parse(addr).tcp


def choose(addr: str, transport: str, peer: str) -> tuple[str, str]:
    """(endpoint, "ipc" or "tcp") for reaching the server advertised as `addr`."""
    ends = parse(addr)
    same = ends.ipc is not None and ends.host == host_id()
    if transport == "shm" and not same:
        why = "it advertises no same-host endpoint" if ends.ipc is None else "it runs on another host"
        raise TransportError(f"cluster.transport is 'shm' but the {peer} at {ends.tcp} is not reachable that way "
                             f"({why}); set cluster.transport: auto (or tcp) to reach remote peers over CurveZMQ")
    if same and transport != "tcp":
        assert ends.ipc is not None
        return ends.ipc, "ipc"
    return ends.tcp, "tcp"


def same_host(addr: str, transport: str) -> str | None:
    """The ipc:// endpoint of a server advertised as `addr` when it runs on this host and `cluster.transport` is not
    tcp; else None (its tcp:// one). For the servers' own links (the step log), which never refuse a remote peer."""
    ends = parse(addr)
    return ends.ipc if ends.ipc is not None and ends.host == host_id() and transport != "tcp" else None


def connect(curve: Curve, sock: zmq.Socket[bytes], addr: str, transport: str, peer: str) -> str:
    """Connect a worker's socket to the server advertised as `addr` (CurveZMQ over tcp://, or the worker's key
    proof over ipc://); returns the transport taken."""
    endpoint, kind = choose(addr, transport, peer)
    if kind == "ipc":
        curve.connect_local(sock)
    else:
        curve.connect_as_client(sock)
    sock.connect(endpoint)
    return kind


def socket_dir(run_dir: Path) -> Path:
    """The run's ipc socket directory: RUN_DIR/ipc when its socket paths fit in sun_path, else one under the
    system's temporary directory named by the run directory. Mode 0700 and owned by this uid, or refused."""
    d = Path(run_dir).resolve() / "ipc"
    if len(str(d)) > _SUN_PATH_MAX - 32:  # room for "/aggregator-4194304.sock"
        key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
        d = Path(tempfile.gettempdir()) / f"cmemi-{os.getuid()}-{key}"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise TransportError(f"the socket directory {str(d)!r} must be a directory of mode 0700 owned by uid "
                             f"{os.getuid()}; remove it (it is made again), or set cluster.transport: tcp")
    return d


def bind_local(curve: Curve, zctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], run_dir: Path, name: str) -> str:
    """Bind `sock` (already bound to tcp://) to a fresh ipc:// endpoint as well, for same-host workers
    (`Curve.serve_local`); returns that endpoint."""
    curve.serve_local(zctx, sock)
    return bind_ipc(sock, run_dir, name)


def bind_ipc(sock: zmq.Socket[bytes], run_dir: Path, name: str) -> str:
    """Bind `sock` to a fresh ipc:// endpoint in the run's socket directory with the mechanism it has now: bound
    without `bind_local`'s PLAIN, a CurveZMQ server stays one there (the checkpointer's step log: only the aggregator's
    key may talk to it, and no role's proof travels in the clear). Sockets of processes that are gone (SIGKILLed:
    nobody unlinked them) are removed first."""
    d = socket_dir(run_dir)
    for old in d.glob("*.sock"):
        pid = old.stem.rpartition("-")[2]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                old.unlink()
    path = d / f"{name}-{os.getpid()}.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    endpoint = f"ipc://{path}"
    sock.bind(endpoint)
    at_exit(lambda: _unlink(path))  # libzmq may leave the file behind; a SIGKILL certainly does (swept above)
    return endpoint


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the last one out removes the directory


def alive(pid: int) -> bool:
    """Is process `pid` alive (of any uid)? Owners of socket files and shared-memory segments are named by pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def came_local(frame: zmq.Frame) -> bool:
    """Did `frame` arrive on an ipc:// endpoint (its peer admitted by `Curve.serve_local`: our uid)?"""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return False
    return user in (LOCAL_USER.rstrip(":"), LOCAL_USER + "worker")  # exactly: a Z85 key may begin with "ipc:"
