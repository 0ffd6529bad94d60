"""What every service does at start: parse its flags, load the config, connect to Redis, bind its log.

Run-time failures a user can fix (bad config, unreadable data) exit with code 2 and a one-line
message in Redis (`error`), so the supervisor reports them instead of restarting forever.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import redis
import structlog
import zmq
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.schema import Config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect, emit, text, wait_for_redis
from cmemi.shared.runtime import lifeline, metrics, startup
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.log import setup_logging
from cmemi.shared.wire import samehost
from cmemi.shared.wire.security import Curve, SecurityError, curve_from_config

REDIS_URL_ENV = "CMEMI_REDIS_URL"  # how `cmemi up` and the coordinator hand the Redis URL (and password) down


@dataclass
class ServiceContext:
    cfg: Config
    redis: redis.Redis
    keys: Keys
    run: str
    log: structlog.stdlib.BoundLogger
    args: argparse.Namespace
    stopping: threading.Event
    member_extra: dict[str, str]  # fields every Member record of this process carries (metrics_url)
    curve: Curve  # CurveZMQ for this process's sockets (a no-op unless security.curve)

    @property
    def run_dir(self) -> Path:
        return self.cfg.run.path

    def emit(self, kind: str, **fields: Any) -> None:
        emit(self.redis, self.keys, kind, **fields)

    def fatal(self, message: str) -> NoReturn:
        """Record a one-line, user-fixable error for the run and exit with Exit.FATAL."""
        self.log.error("fatal", error=message)
        first = True
        try:  # the first fatal error is the run's (others that follow are its consequences)
            first = bool(self.redis.set(self.keys.error, message, nx=True))
            self.redis.set(self.keys.user_error, "1")
            self.emit("fatal", service=self.log_service, error=message)
        except redis.RedisError:
            pass
        if first and os.environ.get("CMEMI_UP") != "1":  # under `cmemi up`, it prints the run's error once
            print(f"cmemi: error: {message}", file=sys.stderr, flush=True)
        sys.exit(Exit.FATAL)

    def run_state(self) -> str | None:
        try:
            return text(self.redis.get(self.keys.state))
        except redis.RedisError:
            return None

    @property
    def log_service(self) -> str:
        return str(structlog.contextvars.get_contextvars().get("service", "?"))


def common_parser(role: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"cmemi {role}", description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--config", required=True, help="run config YAML (the run directory's config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--redis", default=None, help="Redis URL (default: $CMEMI_REDIS_URL, then cluster.redis); a "
                   "password here is visible to every local user in `ps`: prefer the environment variable")
    return p


def redis_url(args: argparse.Namespace, cfg: Config) -> str | None:
    """--redis, else the inherited environment (never on a command line: `ps` shows argv to everyone), else the config."""
    return args.redis or os.environ.get(REDIS_URL_ENV) or cfg.cluster.redis


def start_service(role: str, args: argparse.Namespace, **bind: Any) -> ServiceContext:
    lifeline.hold()
    log = setup_logging(role, **bind)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"cmemi {role}: error: {exc}", file=sys.stderr)
        sys.exit(Exit.FATAL)
    url = redis_url(args, cfg)
    if not url:
        print(f"cmemi {role}: error: no Redis URL; set {REDIS_URL_ENV}, cluster.redis or --redis URL", file=sys.stderr)
        sys.exit(Exit.FATAL)
    client = connect(url)
    wait_for_redis(client, timeout=30)
    startup.mark("connected")
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:  # handlers only set flags; loops notice
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        curve = curve_from_config(cfg.security, role)
    except SecurityError as exc:
        print(f"cmemi {role}: error: {exc}", file=sys.stderr)
        sys.exit(Exit.FATAL)
    if role == "checkpointer":  # builds no model; the others size messages from the one they build (shared/wire/limits.py)
        from cmemi.shared.wire.limits import derive_max_message_bytes  # here: the coordinator needs no torch

        derive_max_message_bytes(cfg)
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    metrics_url = metrics.serve(cfg)
    extra = {"metrics_url": metrics_url} if metrics_url else {}
    return ServiceContext(cfg, client, Keys(cfg.run.name), cfg.run.name, log, args, stopping, extra, curve)


def serve_router(ctx: ServiceContext, zctx: zmq.Context[zmq.Socket[bytes]], port: int) -> tuple[zmq.Socket[bytes], str]:
    """A service's ROUTER: CurveZMQ server (when on), messages capped, bound to cluster.host:port (0: a free port),
    and, unless cluster.transport is tcp, to an ipc:// endpoint for same-host workers (shared/wire/samehost.py); returns
    it and the address peers connect to (both endpoints, `samehost.advertise`)."""
    from cmemi.shared.wire import (
        protocol,  # here: it imports torch, which the coordinator (and `cmemi up`) never need
    )

    sock = zctx.socket(zmq.ROUTER)
    set_link_options(sock, ctx.cfg.cluster)  # a dead link noticed in seconds (shared/runtime/links.py)
    ctx.curve.serve(zctx, sock)
    sock.setsockopt(zmq.MAXMSGSIZE, ctx.cfg.cluster.message_cap())
    # at most two messages (parts of a big gradient: transfer.PART each) queued per peer in ZeroMQ; the rest waits
    # in the peer's queue (zero-copy from its tensors) and the kernel's: without it, every part of every worker's
    # gradient could sit here beside their reassembled copies (docs/design.md §8). Curve's ZAP takes one entry.
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.setsockopt(zmq.LINGER, 1000)
    tcp = protocol.bind(sock, ctx.cfg.cluster.host, port)
    local = None
    if ctx.cfg.cluster.transport != "tcp":
        try:
            local = samehost.bind_local(ctx.curve, zctx, sock, ctx.run_dir, ctx.log_service)
        except samehost.TransportError as exc:
            ctx.fatal(str(exc))
    return sock, samehost.advertise(tcp, local)
