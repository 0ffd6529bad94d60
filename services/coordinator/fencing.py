"""Fencing: a process declared dead is fenced (its incarnation written to Redis) and the aggregator is told.

A fenced incarnation's gradients and hellos are refused everywhere, so a process that was only hung (or
partitioned) cannot come back and hand in work twice: every step is applied exactly once. A fence Redis cannot
take yet (it is down) is kept and retried at every scan; the aggregator also fences an old incarnation itself
when the new one says hello, so a restart never waits for Redis.
"""

from __future__ import annotations

import redis
import zmq
from cmemi.shared.coordination.membership import text
from cmemi.shared.runtime import metrics
from cmemi.shared.runtime.links import set_link_options
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import header as wire
from cmemi.shared.wire import samehost

Who = tuple[str, str]  # (role, id)


class Fencer:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.declared: dict[Who, int] = {}  # (role, id) -> newest incarnation declared dead
        self.pending: dict[Who, int] = {}  # fences Redis could not take yet
        self.zctx = zmq.Context()
        self.agg_sock: zmq.Socket | None = None
        self.agg_addr: str | None = None

    def known_dead(self, role: str, ident: str, inc: int) -> bool:
        """Incarnation `inc` was declared dead already, by us or by an earlier coordinator (its fence key)."""
        if self.declared.get((role, ident), 0) >= inc:
            return True
        if int(self.ctx.redis.get(self.ctx.keys.fence(role, ident)) or 0) >= inc:
            self.declared[(role, ident)] = inc
            return True
        return False

    def declare_dead(self, role: str, ident: str, how: str, pid: int | None, inc: int | None = None) -> None:
        """Count and announce a death, then fence its incarnation (read from its record when not given)."""
        r, k = self.ctx.redis, self.ctx.keys
        if inc is None:
            try:
                record = r.hgetall(k.member(role, ident))
            except redis.RedisError:
                record = {}  # Redis is down: restart now; the aggregator fences the old incarnation on the new hello
            if record and int(record.get("pid", -1)) == pid:
                inc = int(record["incarnation"])
        metrics.DEATHS.labels(role).inc()
        self.ctx.emit("died", role=role, id=ident, incarnation=inc, how=how, pid=pid)
        self.ctx.log.warning("process died", role=role, id=ident, incarnation=inc, how=how)
        if inc is None:
            return  # died before registering: nothing to fence
        self.declared[(role, ident)] = inc
        self.pending[(role, ident)] = inc
        try:
            self.retry()
        except redis.RedisError:
            pass  # retried at every scan until Redis answers

    def retry(self) -> None:
        """Write every pending fence; raises RedisError while Redis is down (the caller retries later)."""
        r, k = self.ctx.redis, self.ctx.keys
        for (role, ident), inc in list(self.pending.items()):
            r.set(k.fence(role, ident), inc)
            del self.pending[(role, ident)]
            self.ctx.emit("fenced", role=role, id=ident, incarnation=inc)
            if role == "worker":
                self._tell_aggregator(ident, inc)

    def _tell_aggregator(self, wid: str, inc: int) -> None:
        """The leader frees the fenced worker's leases at once instead of waiting for them to time out."""
        addr = text(self.ctx.redis.hget(self.ctx.keys.aggregator, "addr"))
        if addr is None:
            return
        if addr != self.agg_addr:
            if self.agg_sock is not None:
                self.agg_sock.close(linger=0)
            self.agg_sock = self.zctx.socket(zmq.DEALER)
            set_link_options(self.agg_sock, self.ctx.cfg.cluster)
            self.ctx.curve.connect_as_client(self.agg_sock)
            self.agg_sock.setsockopt(zmq.LINGER, 0)
            self.agg_sock.connect(samehost.tcp_of(addr))  # fences: CurveZMQ always (only workers use ipc://)
            self.agg_addr = addr
        assert self.agg_sock is not None
        # header-only (shared/wire/header.py): the coordinator never imports torch, so a restarted one is up in ~1 s
        self.agg_sock.send(wire.header_only("fence", self.ctx.run, {"wid": wid, "inc": inc}))

    def close(self) -> None:
        if self.agg_sock is not None:
            self.agg_sock.close(linger=0)
        self.zctx.destroy(linger=200)
