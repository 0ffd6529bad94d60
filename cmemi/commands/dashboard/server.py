"""The dashboard's HTTP server: the page, its static files and the JSON endpoints the page polls every second.

Routes (GET; each one behind `access`: 401 without the token where one is required, 403 for a foreign Host):

- `/`: the page (static/index.html, its asset URLs given the token);
- `/static/NAME`: the page's script and style, from this package (no CDN: the machine may be offline);
- `/api/state?metrics=N&mgen=G&events=M&egen=H`: what the page shows, with the curve points and timeline events
  past the N and M it holds (of generations G and H: `tail`);
- `/api/status`: `cmemi status --json`'s report; `/api/metrics?since=N&gen=G`, `/api/events?since=N&gen=G`: the
  rows alone; `/api/checkpoints`.

Standard library only (`http.server`, one thread per request): a page polling once a second is a few requests a
second, and `cmemi dashboard` must work wherever `cmemi status` does.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cmemi.commands.dashboard.access import Access
from cmemi.commands.dashboard.snapshot import Dashboard, checkpoints

STATIC = Path(__file__).resolve().parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
# everything from this server; inline SVG is drawn by the script (no inline script or style to allow)
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


class DashboardServer(ThreadingHTTPServer):
    """One run's dashboard on one address (port 0: a free one, read back from `port`)."""

    daemon_threads = True  # a page left open must not hold up Ctrl-C
    block_on_close = False

    def __init__(self, address: tuple[str, int], dashboard: Dashboard, access: Access) -> None:
        self.dashboard, self.access = dashboard, access
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET  # --host ::1 or ::
        super().__init__(address, Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, host: str) -> str:
        """The URL to open: with the token where one is required (a wildcard address shows this host's name)."""
        host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/{self.access.query()}"


def integer(query: dict[str, list[str]], name: str) -> int | None:
    """A query parameter as an int, None when absent or not a number (the rows are then sent from the start)."""
    try:
        return int(query[name][0])
    except (KeyError, IndexError, ValueError):
        return None


class Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "cmemi-dashboard"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        access = self.server.access
        if not access.host_allowed(self.headers.get("Host")):
            self._text(HTTPStatus.FORBIDDEN, "this dashboard is bound to loopback: open it as 127.0.0.1 or localhost")
            return
        if not access.allows(query.get("token", [None])[0]):
            self._text(HTTPStatus.UNAUTHORIZED, "a token is required: open the URL `cmemi dashboard` printed "
                       "(it ends with ?token=...)")
            return
        route = ROUTES.get(url.path)
        if route is not None:
            try:
                body = route(self.server.dashboard, query)
            except Exception as exc:  # noqa: BLE001 - the page shows why, and the server keeps serving
                self._text(HTTPStatus.INTERNAL_SERVER_ERROR, f"{url.path}: {type(exc).__name__}: {exc}")
                return
            self._json(body)
        elif url.path == "/":
            page = (STATIC / "index.html").read_text().replace("{{query}}", access.query())
            self._send(HTTPStatus.OK, page.encode(), TYPES[".html"])
        elif url.path.startswith("/static/") and url.path[len("/static/"):] in assets():
            name = url.path[len("/static/"):]
            self._send(HTTPStatus.OK, (STATIC / name).read_bytes(), TYPES[Path(name).suffix])
        else:
            self._text(HTTPStatus.NOT_FOUND, f"no such page: {url.path}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        """Quiet: a page polls every second; only errors are worth a line (log_error still prints them)."""

    def _json(self, body: dict[str, Any] | list[Any]) -> None:
        self._send(HTTPStatus.OK, json.dumps(body, default=str, allow_nan=False).encode(), "application/json")

    def _text(self, status: HTTPStatus, text: str) -> None:
        self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def assets() -> set[str]:
    """The files the page may load: only these names are served (no path from the URL reaches the disk)."""
    return {p.name for p in STATIC.iterdir() if p.suffix in TYPES and p.name != "index.html"}


ROUTES: dict[str, Callable[[Dashboard, dict[str, list[str]]], Any]] = {
    "/api/state": lambda d, q: d.state(integer(q, "metrics") or 0, integer(q, "mgen"),
                                       integer(q, "events") or 0, integer(q, "egen")),
    "/api/status": lambda d, q: d.status(),
    "/api/metrics": lambda d, q: d.rows("metrics", integer(q, "since") or 0, integer(q, "gen")),
    "/api/events": lambda d, q: d.rows("events", integer(q, "since") or 0, integer(q, "gen")),
    "/api/checkpoints": lambda d, q: checkpoints(d.run_dir),
}
