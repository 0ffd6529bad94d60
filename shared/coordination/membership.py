"""Membership in Redis: register (get an incarnation), heartbeat with a TTL, record events.

Redis may restart empty at any time; a heartbeat that finds its member record gone re-creates it,
so processes re-register by themselves.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, cast

import redis
from cmemi.shared.coordination.keys import Keys


def text(reply: Any) -> str | None:
    """A string reply or None: `connect`'s client decodes every response, where redis-py's annotations also allow
    bytes (and, for a pipeline, more)."""
    return cast("str | None", reply)


def texts(reply: Any) -> list[str | None]:
    """An HMGET reply, each field's string or None (see `text`)."""
    return cast("list[str | None]", reply)


def table(reply: Any) -> dict[str, str]:
    """An HGETALL reply, field -> string (see `text`)."""
    return cast("dict[str, str]", reply)


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10,
                                decode_responses=True)


def wait_for_redis(client: redis.Redis, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis did not answer within {timeout:g}s ({exc}); check cluster.redis") from None
            time.sleep(0.05)


def emit(client: redis.Redis, keys: Keys, kind: str, **fields: Any) -> None:
    """Append one event to the run's event stream. Never raises: losing an event must not kill a service."""
    event = {"t": time.time(), "kind": kind, **fields}
    try:
        client.xadd(keys.events, {"json": json.dumps(event)}, maxlen=100_000, approximate=True)
    except redis.RedisError:
        pass


def read_events(client: redis.Redis, keys: Keys, after: str = "0-0", block_ms: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    out = []
    # [(stream, [(entry id, fields)])], decoded (see `text`)
    reply = cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]",
                 client.xread({keys.events: after}, block=block_ms, count=1000) or [])
    for _stream, entries in reply:
        for entry_id, data in entries:
            out.append((entry_id, json.loads(data["json"])))
    return out


def allocate(client: redis.Redis, key: str) -> int:
    """A number larger than every number handed out before under `key`: Redis INCR, kept growing across Redis
    data loss by the coordinator (shared/coordination/counters.py), never floored on a wall clock."""
    return int(client.incr(key))


def running_members(client: redis.Redis, keys: Keys, role: str) -> dict[str, dict[str, str]]:
    """The members of `role` that are running and heartbeating now: id -> their record (pid, incarnation, host, ...)."""
    out: dict[str, dict[str, str]] = {}
    for key in client.scan_iter(match=keys.member(role, "*"), count=500):
        rec = table(client.hgetall(key))
        if rec.get("state") == "running" and client.exists(keys.heartbeat(role, rec["id"])):
            out[rec["id"]] = rec
    return out


# Only touch the record if it is still ours: a newer incarnation may already have taken the id.
_MARK_STOPPED = """
if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'state', 'stopped')
  redis.call('DEL', KEYS[2])
end
"""


class Member:
    """One process's membership: incarnation number plus a heartbeat thread."""

    def __init__(self, client: redis.Redis, keys: Keys, role: str, ident: str,
                 heartbeat_interval: float, dead_after: float, extra: dict[str, Any] | None = None) -> None:
        self.client, self.keys, self.role, self.ident = client, keys, role, ident
        self.interval, self.ttl_ms = heartbeat_interval, int(dead_after * 1000)
        self.extra = extra or {}
        self.incarnation = allocate(client, keys.incarnation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_record()

    def _write_record(self) -> None:
        record = {"incarnation": self.incarnation, "pid": os.getpid(), "host": socket.gethostname(),
                  "started_at": time.time(), "role": self.role, "id": self.ident, "state": "running", **self.extra}
        self.client.hset(self.keys.member(self.role, self.ident), mapping={k: str(v) for k, v in record.items()})

    def beat(self) -> None:
        key = self.keys.heartbeat(self.role, self.ident)
        pipe = self.client.pipeline(transaction=False)  # one round trip
        pipe.set(key, f"{self.incarnation}:{time.time():.3f}", px=self.ttl_ms)
        pipe.exists(self.keys.member(self.role, self.ident))
        _, exists = pipe.execute()
        if not exists:
            self._write_record()  # Redis lost its data: re-register

    def fenced(self) -> bool:
        return self.fenced_by(text(self.client.get(self.keys.fence(self.role, self.ident))))

    def fenced_by(self, fence: str | None) -> bool:
        """Does this fence value (the fence key's, None if unset) fence this incarnation?"""
        return fence is not None and int(fence) >= self.incarnation

    def start(self) -> Member:
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.role}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except redis.RedisError:
                pass  # Redis is down or restarting; keep trying, the coordinator judges liveness

    def stop(self) -> None:
        """Graceful exit: mark the record stopped first, so the silence that follows is not taken for a death."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            self.client.eval(_MARK_STOPPED, 2, self.keys.member(self.role, self.ident),
                             self.keys.heartbeat(self.role, self.ident), str(self.incarnation))
        except redis.RedisError:
            pass
