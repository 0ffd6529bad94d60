"""CurveZMQ encryption, authentication, and a role for every peer (`security.*`).

On by default. A key directory (`security.keys_dir`, made by `cmemi keys DIR`, or by `cmemi up` in
RUN_DIR/keys for the run) holds one key pair per role, secrets mode 0600:

    server.key[_secret]       the aggregator and the checkpointer serve with it
    aggregator.key[_secret]   the aggregator, as a client of the checkpointer
    coordinator.key[_secret]  the coordinator, as a client of the aggregator (fences)
    worker.key[_secret]       every worker (one shared key: scaling up needs no new key)
    worker-NAME.key           more worker keys (public part only on the servers), e.g. one per host;
                              picked up while running, so adding a host needs no restart

A host needs only its own role's secret plus the public `*.key` files (`ROLE_SECRETS`); `cmemi keys DIR
--per-role OUT` writes OUT/<role>/ with exactly that, one directory per container or host, and such a
directory is a complete keys_dir for its role: a worker's container then holds no key that would let
it act as the aggregator, the checkpointer or the coordinator. Servers accept only the
public keys found there, and pyzmq's authenticator sets every message's `User-Id` to the client's
Z85 key: `Curve.role(frame)` maps it back to the role, and each server checks that role per
message type (only workers ask for work, only the coordinator fences, only the aggregator talks to
the checkpointer). A peer with an unknown key, or no encryption at all, fails the handshake inside
ZeroMQ: its bytes never reach a service, and libzmq buffers nothing for it.

Same-host workers (shared/wire/samehost.py) reach a server's ipc:// endpoint instead, without encryption: ZeroMQ's
PLAIN hello carries the worker's secret key, and the ZAP handler (`_LocalAuth`) admits the peer only if the
kernel's SO_PEERCRED uid (libzmq hands it over as the ZAP address, `host:uid:gid:pid`) is ours and the key's
public half is a worker key in keys_dir; its messages then carry the User-Id `ipc:worker`, so the per-message
role checks are the same. No other role is admitted there.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from cmemi.shared.errors import WireError
from zmq.auth.thread import ThreadAuthenticator

ROLES = ("aggregator", "coordinator", "worker")  # client roles; "server" is the servers' own pair
# The secret keys each service loads at start (curve_from_config), and the only ones its host needs: the
# servers serve with the server pair, each client uses its own role's pair.
ROLE_SECRETS = {"aggregator": ("server", "aggregator"), "checkpointer": ("server",),
                "coordinator": ("coordinator",), "worker": ("worker",)}
LOCAL_DOMAIN = b"cmemi-local"  # the ZAP domain of the ipc:// endpoints
LOCAL_USER = "ipc:"  # User-Id prefix of a peer admitted on an ipc:// endpoint
RESCAN_S = 1.0  # an unknown key re-reads keys_dir at most this often (new worker keys while running)


class SecurityError(WireError, ValueError):
    pass


@dataclass
class KeyPair:
    public: bytes
    secret: bytes


def load_keypair(path: Path, what: str) -> KeyPair:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read the {what} key {str(path)!r} ({exc}); create the keys with "
                            "`cmemi keys DIR` and set security.keys_dir: DIR (or security.curve: false)") from None
    if secret is None:
        raise SecurityError(f"{what} key {str(path)!r} holds no secret key; copy {path.name} from the "
                            "directory `cmemi keys` made")
    return KeyPair(public, secret)


def public_key(path: Path) -> bytes:
    public, _secret = zmq.auth.load_certificate(str(path))
    return public


def generate(directory: Path, extra_workers: int = 0, if_missing: bool = False) -> list[Path]:
    """Key pairs for the server and each client role (plus `extra_workers` more worker keys), secrets 0600.
    `if_missing`: keep a directory that already has its keys (a resumed run, a restarted compose)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    names = ["server", *ROLES, *(f"worker-{i}" for i in range(extra_workers))]
    made = []
    for name in names:
        if if_missing and (directory / f"{name}.key_secret").is_file():
            continue
        old = os.umask(0o077)  # the secret never exists with looser permissions, not even for a moment
        try:
            pub, sec = zmq.auth.create_certificates(str(directory), name)
        finally:
            os.umask(old)
        Path(sec).chmod(0o600)
        Path(pub).chmod(0o644)
        made += [Path(pub), Path(sec)]
    return made


def export_role(directory: Path, dest: Path, role: str) -> list[Path]:
    """Write into `dest` one role's key directory, made from the full one `generate` wrote: every public
    *.key and only the role's own *.key_secret files (ROLE_SECRETS); a secret of another role already in
    `dest` is removed. Rerunning it is safe (each file is replaced whole, secrets never looser than 0600)."""
    if role not in ROLE_SECRETS:
        raise SecurityError(f"unknown role {role!r} for a key directory; choose one of {sorted(ROLE_SECRETS)}")
    own = {f"{name}.key_secret" for name in ROLE_SECRETS[role]}
    missing = sorted(f for f in own if not (directory / f).is_file())
    if missing:
        raise SecurityError(f"{str(directory)!r} has no {', '.join(missing)}; make the keys with `cmemi keys DIR` first")
    dest.mkdir(parents=True, exist_ok=True)
    dest.chmod(0o700)
    for stale in dest.glob("*.key_secret"):
        if stale.name not in own:
            stale.unlink()
    written = []
    for src in [*sorted(directory.glob("*.key")), *(directory / f for f in sorted(own))]:
        mode = 0o600 if src.name.endswith("_secret") else 0o644
        tmp = dest / f".{src.name}.tmp"
        old = os.umask(0o077)
        try:
            tmp.write_bytes(src.read_bytes())
        finally:
            os.umask(old)
        tmp.chmod(mode)
        os.replace(tmp, dest / src.name)
        written.append(dest / src.name)
    return written


def read_public_keys(directory: Path) -> dict[bytes, str]:
    """Z85 public key -> role, from the *.key files of a key directory."""
    out: dict[bytes, str] = {}
    for path in sorted(directory.glob("*.key")):
        role = "worker" if path.stem.startswith("worker") else path.stem
        if role in ROLES:
            try:
                out[public_key(path)] = role
            except (OSError, ValueError):
                continue  # half-written while we read: the next rescan sees it
    return out


class _Roles:
    """The authenticator's callback: a key is allowed if keys_dir names it (re-read for unknown keys)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.by_key = read_public_keys(directory)
        self.next_scan = time.monotonic() + RESCAN_S

    def callback(self, domain: str, z85_key: bytes) -> bool:  # pyzmq hands over the Z85 form
        with self.lock:
            if z85_key not in self.by_key and time.monotonic() >= self.next_scan:
                self.next_scan = time.monotonic() + RESCAN_S
                self.by_key = read_public_keys(self.directory)
            return z85_key in self.by_key

    def role(self, z85_key: str) -> str | None:
        with self.lock:
            return self.by_key.get(z85_key.encode())


class _LocalAuth(ThreadAuthenticator):
    """ZAP for CurveZMQ (pyzmq's rules) and for the ipc:// endpoints' PLAIN hellos (ours: same uid, worker key)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], worker_key: Callable[[bytes], bool] | None) -> None:
        super().__init__(ctx)
        self.worker_key = worker_key  # None: Curve is off, no keys, no roles (the uid still decides)
        self.refused = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) == 8 and msg[5] == b"PLAIN":
            user = self.local(msg[2], msg[3], msg[7])
            if user is None:
                self.refused += 1
                self._send_zap_reply(msg[1], b"400", b"refused")
            else:
                self._send_zap_reply(msg[1], b"200", b"OK", user)
            return
        if msg[5:6] == [b"PLAIN"]:
            self._send_zap_reply(msg[1], b"400", b"refused")
            return
        await super().handle_zap_message(msg)

    def local(self, domain: bytes, address: bytes, password: bytes) -> str | None:
        """The User-Id of an ipc:// peer, or None to refuse it."""
        if domain != LOCAL_DOMAIN:
            return None  # PLAIN anywhere else (a tcp:// endpoint) is not ours
        fields = address.decode("ascii", "replace").rsplit(":", 3)
        if len(fields) != 4 or fields[1] != str(os.getuid()):
            return None  # another uid (or no peer credentials at all)
        if self.worker_key is None:
            return LOCAL_USER.rstrip(":")
        try:
            public = zmq.curve_public(password)
        except (zmq.ZMQError, ValueError, TypeError):
            return None
        return f"{LOCAL_USER}worker" if self.worker_key(public) else None


@dataclass
class Curve:
    """Per-process CurveZMQ setup; a no-op when security.curve is false."""

    enabled: bool
    keys_dir: Path | None = None
    role_name: str = ""
    _auth: _LocalAuth | None = None
    _roles: _Roles | None = None
    _mine: dict[str, KeyPair] = field(default_factory=dict)

    def _pair(self, name: str) -> KeyPair:
        assert self.keys_dir is not None
        if name not in self._mine:
            path = self.keys_dir / f"{name}.key_secret"
            if name == "worker" and not path.exists():  # a host given its own worker-N key instead of the shared one
                own = sorted(self.keys_dir.glob("worker-*.key_secret"))
                path = own[0] if len(own) == 1 else path
            self._mine[name] = load_keypair(path, name)
        return self._mine[name]

    def serve(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
        """Make `sock` a CURVE server that accepts only keys listed in keys_dir (ZAP, one thread per context)."""
        if not self.enabled:
            return
        server = self._pair("server")
        self._authenticator(ctx)
        sock.curve_secretkey = server.secret
        sock.curve_publickey = server.public
        sock.curve_server = True

    def _authenticator(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> _LocalAuth:
        if self._auth is None:
            worker_key = None
            if self.enabled:
                assert self.keys_dir is not None
                roles = self._roles = _Roles(self.keys_dir)
                worker_key = lambda public: roles.callback("*", public) and roles.role(public.decode()) == "worker"  # noqa: E731
            self._auth = _LocalAuth(ctx, worker_key)
            self._auth.start()
            if self.enabled:
                self._auth.configure_curve_callback(domain="*", credentials_provider=self._roles)
        return self._auth

    def serve_local(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
        """Make the endpoints `sock` binds from now on (ipc:// ones) admit only same-uid workers (`_LocalAuth`).
        libzmq takes a socket's mechanism at bind time, so its tcp:// endpoint, bound before, keeps CurveZMQ."""
        self._authenticator(ctx)
        sock.plain_server = True
        sock.zap_domain = LOCAL_DOMAIN

    def connect_local(self, sock: zmq.Socket[bytes]) -> None:
        """A worker's socket to an ipc:// endpoint: its secret key proves it is a worker (no encryption)."""
        sock.plain_username = b"worker"
        sock.plain_password = self._pair("worker").secret if self.enabled else b"-"

    @property
    def refused_local(self) -> int:
        """ipc:// peers the ZAP handler refused (another uid, no worker key)."""
        return self._auth.refused if self._auth is not None else 0

    def connect_as_client(self, sock: zmq.Socket[bytes]) -> None:
        if not self.enabled:
            return
        assert self.keys_dir is not None
        mine = self._pair(self.role_name)
        try:
            server_public = public_key(self.keys_dir / "server.key")
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot read the server's public key in {str(self.keys_dir)!r} ({exc}); "
                                "copy server.key from the directory `cmemi keys` made") from None
        sock.curve_secretkey = mine.secret
        sock.curve_publickey = mine.public
        sock.curve_serverkey = server_public

    def role(self, frame: zmq.Frame) -> str | None:
        """The role of the peer that sent `frame` (None with Curve off: no key, no role)."""
        if not self.enabled or self._roles is None:
            return None
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            return ""
        if not isinstance(user, str):  # libzmq's User-Id property is a string; its annotation allows an int
            return ""
        if user.startswith(LOCAL_USER):
            return user.removeprefix(LOCAL_USER)
        return self._roles.role(user) or ""

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def curve_from_config(sec: object, role: str) -> Curve:
    """Build the process's Curve from a SecurityConfig (see shared.config); checks its own keys now, so a
    missing or unreadable key is one clear line at start, not a failure at the first connection."""
    if not getattr(sec, "curve", False):
        return Curve(False)
    keys_dir = getattr(sec, "keys_dir", None)
    if not keys_dir:
        raise SecurityError("security.curve is on but security.keys_dir is not set; make keys with "
                            "`cmemi keys DIR` and set security.keys_dir: DIR (`cmemi up` does this by itself), "
                            "or set security.curve: false on a trusted network")
    curve = Curve(True, Path(keys_dir), role)
    if role in ("aggregator", "checkpointer"):
        curve._pair("server")
    if role in ROLES:
        curve._pair(role)
    return curve
