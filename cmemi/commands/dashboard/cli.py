"""`cmemi dashboard RUN_DIR [--host H] [--port P]`: serve a live page of the run until Ctrl-C.

It prints the URL to open (`--port 0` takes a free port, printed). Bound to 127.0.0.1 by default; bound to any
other address the URL carries a token (`access`). Read-only, like `cmemi status`: it writes nothing to Redis or to
the run directory, and starts before, during or after the run.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path

from cmemi.commands.dashboard.access import Access
from cmemi.commands.dashboard.server import DashboardServer
from cmemi.commands.dashboard.snapshot import Dashboard
from cmemi.shared.runtime.exits import Exit

DEFAULT_PORT = 8765


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi dashboard", description="A live page of a run in the browser: curves, "
                                "workers, events and checkpoints, updated every second.")
    p.add_argument("run_dir", help="the run directory (its cluster.json names the run's Redis)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other address requires the printed token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return _error(f"{run_dir} is not a directory; pass the run directory of a `cmemi up` run (its run.dir)")
    if not 0 <= args.port <= 65535:
        return _error(f"--port {args.port}: a port is 0..65535 (0 takes a free one)")
    try:
        server = DashboardServer((args.host, args.port), Dashboard(run_dir), Access.for_host(args.host))
    except socket.gaierror as exc:
        return _error(f"--host {args.host}: not an address of this machine ({exc.strerror}); e.g. 127.0.0.1 or 0.0.0.0")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return _error(f"--port {args.port}: already in use on {args.host}; pick another, or --port 0 for a free one")
        return _error(f"--host {args.host} --port {args.port}: cannot bind ({exc.strerror}); e.g. --host 127.0.0.1 "
                      "--port 0")
    print(f"cmemi dashboard: {run_dir} at {server.url(args.host)} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        server.server_close()
    return 0


def _error(text: str) -> int:
    print(f"cmemi: error: {text}", file=sys.stderr)
    return Exit.FATAL
