"""Who may read the dashboard. Bound to a loopback address (the default, 127.0.0.1) it is this machine's users'
only; bound elsewhere (`--host 0.0.0.0`) anyone who reaches the port could read the run, so every request must then
carry the token printed in the URL (`?token=...`); one without it gets 401.

The token is 32 random bytes (`secrets.token_urlsafe`), new at each start, compared with `hmac.compare_digest` (in
constant time: a timing does not tell how much of a guess was right). On loopback the Host header must name a
loopback host too: a web page the browser opened elsewhere cannot point its own domain at 127.0.0.1 (DNS
rebinding) and read the run through it.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from urllib.parse import quote


def is_loopback(host: str) -> bool:
    """`host` names this machine only: localhost, 127.0.0.0/8, ::1."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str | None) -> str:
    """The host of a Host header, without its port: "127.0.0.1:8765" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    text = (header or "").strip()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Access:
    """The dashboard's access rule: a token, or none (loopback only)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    @classmethod
    def for_host(cls, host: str) -> Access:
        """No token on a loopback address; a fresh one anywhere else."""
        return cls(None if is_loopback(host) else secrets.token_urlsafe(32))

    def allows(self, token: str | None) -> bool:
        """The request's `?token=` matches (always true without a token)."""
        if self.token is None:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def host_allowed(self, header: str | None) -> bool:
        """Without a token only a loopback Host header is served (a rebinding page names its own domain)."""
        return self.token is not None or is_loopback(host_name(header))

    def query(self) -> str:
        """What the page's URLs carry: "?token=..." or nothing."""
        return f"?token={quote(self.token)}" if self.token else ""
