"""CurveZMQ encryption and authentication of every peer (`security.curve`).

Servers (aggregator, checkpointer) hold the server key pair; clients (workers, the coordinator, the
aggregator talking to the checkpointer) hold a client key pair each and must be listed by public key
in `security.allowed_client_keys`. A peer that is not listed, or not encrypted at all, fails the
handshake inside ZeroMQ: its messages never reach the service's logic. Keys come from `cmemi keys DIR`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class SecurityError(ValueError):
    pass


@dataclass
class KeyPair:
    public: bytes
    secret: bytes


def load_keypair(path: str, what: str) -> KeyPair:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read {what} {path!r} ({exc}); create keys with `cmemi keys DIR`") from None
    if secret is None:
        raise SecurityError(f"{what} {path!r} holds no secret key; point it at the *.key_secret file")
    return KeyPair(public, secret)


def generate(directory: Path, clients: int) -> list[Path]:
    """A server key pair and `clients` client key pairs (name.key public, name.key_secret secret)."""
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    for name in ["server", *(f"client{i}" for i in range(clients))]:
        pub, sec = zmq.auth.create_certificates(str(directory), name)
        Path(sec).chmod(0o600)
        made += [Path(pub), Path(sec)]
    return made


@dataclass
class Curve:
    """Per-process CurveZMQ setup; a no-op when security.curve is false."""

    enabled: bool
    server: KeyPair | None = None  # only processes that serve (aggregator, checkpointer)
    server_public: bytes | None = None
    client: KeyPair | None = None
    allowed: list[bytes] = field(default_factory=list)
    _auth: ThreadAuthenticator | None = None

    def serve(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server that accepts only the allowed client keys (ZAP, one thread per context)."""
        if not self.enabled:
            return
        if self.server is None:
            raise SecurityError("security.curve is on but security.server_secret_key_file is not set")
        if self._auth is None:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            allowed = set(self.allowed)
            self._auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(allowed))
        sock.curve_secretkey = self.server.secret
        sock.curve_publickey = self.server.public
        sock.curve_server = True

    def connect_as_client(self, sock: zmq.Socket) -> None:
        if not self.enabled:
            return
        if self.client is None or self.server_public is None:
            raise SecurityError("security.curve is on but security.client_secret_key_file or "
                                "security.server_public_key is not set")
        sock.curve_secretkey = self.client.secret
        sock.curve_publickey = self.client.public
        sock.curve_serverkey = self.server_public

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _Allowed:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, z85_key: bytes) -> bool:  # pyzmq hands over the Z85 form
        return z85_key in self.keys


def curve_from_config(sec: object) -> Curve:
    """Build the process's Curve from a SecurityConfig (see shared.config)."""
    if not getattr(sec, "curve", False):
        return Curve(False)
    server = load_keypair(sec.server_secret_key_file, "security.server_secret_key_file") \
        if sec.server_secret_key_file else None
    client = load_keypair(sec.client_secret_key_file, "security.client_secret_key_file") \
        if sec.client_secret_key_file else None
    server_public = sec.server_public_key.encode() if sec.server_public_key else (server.public if server else None)
    return Curve(True, server=server, server_public=server_public, client=client,
                 allowed=[k.encode() for k in sec.allowed_client_keys])
