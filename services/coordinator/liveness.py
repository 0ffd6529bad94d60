"""Liveness: a process is alive while its heartbeat key exists (a TTL of cluster.dead_after), or while the witnesses
say its silence proves nothing (witnesses.py: everyone fell silent at once, or the leader still hears it).

Each scan finds the members whose heartbeat is gone and the local children that did not register in time
(cluster.start_timeout), and yields each as a `Death` for the coordinator to fence and replace. A child of ours
that is still running but silent is hung (or stopped): it is killed first, without grace, so that its
replacement never runs beside it. A scan is a generator on purpose: each death is handled before the next
record is judged, as the fences it writes decide whether a later record counts as a new death.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from cmemi.services.coordinator.fencing import Fencer
from cmemi.services.coordinator.supervisor import Child
from cmemi.services.coordinator.witnesses import Witnesses
from cmemi.shared.runtime.service import ServiceContext


@dataclass(frozen=True)
class Death:
    role: str
    ident: str
    how: str  # for the "died" event and the log
    pid: int | None
    inc: int | None  # None: read from its record when fenced
    child: Child | None  # ours to restart; None: another host's or an orchestrator's process


class Liveness:
    def __init__(self, ctx: ServiceContext, fencer: Fencer) -> None:
        self.ctx, self.cfg, self.fencer = ctx, ctx.cfg, fencer
        self.witnesses = Witnesses(ctx.cfg.cluster)

    def scan(self, children: dict[str, Child], local: bool) -> Iterator[Death]:
        """The deaths seen now. A RedisError goes to the caller (the coordinator retries every 0.2 s), and what
        was seen before it no longer counts (witnesses.Witnesses.lost_redis)."""
        try:
            yield from self._scan(children, local)
        except redis.RedisError:
            self.witnesses.lost_redis()
            raise

    def _scan(self, children: dict[str, Child], local: bool) -> Iterator[Death]:
        r, k = self.ctx.redis, self.ctx.keys
        member_prefix = k.member("", "")[:-1]  # ...:member:
        members = [(key, *key[len(member_prefix):].partition(":")[::2])
                   for key in r.scan_iter(match=k.member("*", "*"), count=500)]
        # Every heartbeat's value and the leader's record of whom it heard, in one pipelined round trip (the
        # witnesses judge from how they change); then only the members whose heartbeat is missing are read. A
        # local child that has not registered yet needs every record (its pid), for its start deadline.
        pipe = r.pipeline(transaction=False)
        for _key, role, ident in members:
            pipe.get(k.heartbeat(role, ident))
        pipe.hgetall(k.heard)
        *beats, heard = pipe.execute()
        self.witnesses.observe({f"{role}:{ident}": beat for (_k, role, ident), beat in zip(members, beats, strict=True)
                                if role != "coordinator"}, heard)
        starting = local and any(not c.registered and c.alive for c in children.values())
        if not starting:
            members = [m for m, beat in zip(members, beats, strict=True) if beat is None]
            if not members:
                return
        # Each record and its heartbeat in one MULTI/EXEC: a graceful exit marks the record stopped and
        # deletes the heartbeat atomically, so it is never seen half done (running, without a heartbeat).
        pipe = r.pipeline(transaction=True)
        for key, role, ident in members:
            pipe.hgetall(key)
            pipe.exists(k.heartbeat(role, ident))
        replies = pipe.execute()
        if starting:
            yield from self._late_starters(children, replies[::2])
        for record, alive in zip(replies[::2], replies[1::2], strict=True):
            if alive or not record or record.get("role") == "coordinator" or record.get("state") == "stopped":
                continue
            role, ident, inc, pid = record["role"], record["id"], int(record["incarnation"]), int(record.get("pid", 0))
            if self.fencer.known_dead(role, ident, inc):
                continue
            if time.time() - float(record.get("started_at", 0)) < self.cfg.cluster.dead_after:
                continue
            child = children.get(f"{role}:{ident}")
            if child is not None and child.pid == pid and child.alive:
                # ours, on this host: its way to Redis is ours, which this scan just used, so its silence is its own
                # (unless we lost Redis ourselves a moment ago: then it gets the time to reconnect, as we did)
                if not self.witnesses.own_view_settled():
                    continue
                child.kill()  # alive but silent: hung (or stopped); kill it, do not wait on it
                yield Death(role, ident, "heartbeat missing (hung)", pid, inc, child)
            elif (child is None or child.pid != pid) and self.witnesses.may_judge(role, ident, inc):
                # not ours to restart (another host / orchestrator): detect, fence, re-admit later -- unless everyone
                # fell silent at once (Redis, or the way to it, is what is gone) or the leader still hears it
                yield Death(role, ident, "heartbeat missing", pid, inc, None)

    def _late_starters(self, children: dict[str, Child], records: list[dict[str, str]]) -> Iterator[Death]:
        """A started process must register (a member record with its pid) within cluster.start_timeout."""
        pids = {(rec.get("role"), rec.get("id")): rec.get("pid") for rec in records if rec}
        now = time.monotonic()
        for child in list(children.values()):
            if child.registered or not child.alive:
                continue
            if pids.get((child.role, child.ident)) == str(child.pid):
                child.registered = True
            elif now - child.started_at > self.cfg.cluster.start_timeout:
                pid = child.pid
                child.kill()
                yield Death(child.role, child.ident, f"did not register within cluster.start_timeout="
                            f"{self.cfg.cluster.start_timeout:g}s (hung at start)", pid, None, child)
