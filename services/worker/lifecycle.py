"""Who a worker is, and whether it should still be running.

A warm spare loads everything, then waits for the coordinator to hand it the id of a dead worker; a worker
registers a new incarnation of its id (heartbeating from then on). It exits cleanly when the run is over,
and with Exit.FENCED when its incarnation was declared dead (the supervisor starts a fresh one). While idle,
those facts and the aggregator's address are read off the loop (shared/coordination/watch.py).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from cmemi.shared.coordination.membership import Member, text
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.runtime.exits import Exit
from cmemi.shared.runtime.service import ServiceContext

# The longest an idle worker waits for the Redis reading it asked for (a local read takes well under a millisecond).
# Small: a message that comes meanwhile waits too; a reading later than this is taken at the next idle check.
FRESH_S = 0.01


class Lifecycle:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.member: Member | None = None
        self.watch: Watch | None = None  # once registered (a spare, once it has an identity)
        self.links: dict[str, str] = {}  # peer -> the transport this worker reaches it by (status)

    def wait_for_identity(self, spare: str) -> str | None:
        """As a warm spare: block until the coordinator hands us the id of a dead worker to replace (None: an
        empty id, the run is over, or a stop signal)."""
        self.ctx.log.info("spare ready", spare=spare)
        while not self.ctx.stopping.is_set():
            try:
                item = self.ctx.redis.blpop([self.ctx.keys.spare(spare)], timeout=1)
            except redis.RedisError:
                time.sleep(0.1)
                continue
            if item is not None:
                return text(item[1]) or None
        return None

    def register(self, wid: str) -> int:
        """A new incarnation of `wid`, heartbeating; returns it."""
        cfg, keys = self.ctx.cfg, self.ctx.keys
        self.member = Member(self.ctx.redis, keys, "worker", wid, cfg.cluster.heartbeat_interval,
                             cfg.cluster.dead_after, extra=self.ctx.member_extra).start()
        # while idle: fenced? run over? another aggregator? Read off the loop (shared/coordination/watch.py)
        def read(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)  # (queued one by one: redis-py types a queued command as its reply)
            pipe.get(keys.fence("worker", wid))
            pipe.get(keys.state)
            pipe.hgetall(keys.aggregator)
            return pipe.execute()
        self.watch = Watch(self.ctx.redis, 1.0, read, "worker").start()
        return self.member.incarnation

    def transport(self, peer: str, kind: str) -> None:
        """Record in the member record how this worker reaches `peer` (ipc or tcp), for `cmemi status`."""
        if peer == "aggregator":  # a new term: the shards' links are made again after the leader's welcome
            self.links.clear()
        self.links[peer] = kind
        kinds = set(self.links.values())
        value = kinds.pop() if len(kinds) == 1 else " ".join(f"{p}:{k}" for p, k in sorted(self.links.items()))
        if self.member is None:
            return
        self.member.extra = {**self.member.extra, "transport": value}  # a re-registration writes it again
        try:
            self.ctx.redis.hset(self.ctx.keys.member("worker", self.member.ident), "transport", value)
        except redis.RedisError:
            pass

    def exit_if_finished(self) -> None:
        """A worker that (re)starts after the run ended, or missed the stop message, leaves cleanly."""
        self.exit_if_over(self.ctx.run_state())

    def exit_if_over(self, state: str | None) -> None:
        if state in ("completed", "failed"):
            self.ctx.log.info("run is over; exiting", state=state)
            raise SystemExit(0)

    def check_fenced(self) -> None:
        assert self.member is not None
        try:
            fenced = self.member.fenced()
        except redis.RedisError:
            return
        self.exit_if_fenced(fenced)

    def exit_if_fenced(self, fenced: bool) -> None:
        if fenced:
            self.ctx.log.warning("this incarnation was fenced; exiting so a fresh one replaces it")
            raise SystemExit(Exit.FENCED)

    def idle_check(self) -> dict[str, str] | None:
        """While idle: exit if fenced or the run is over; the aggregator's record if a new reading came. Idle means
        the leader was silent for a while (dead, restarting, or a slow step): a reading is made now and waited for (at
        most FRESH_S), so a restarted leader's address is seen at the first idle check after it was written. (Taking
        the reading the previous idle check had asked for saw it one idle wait later: issue 47, 0.1-0.2 s of a leader's
        kill -> next new step at the worst kill point.)"""
        if self.watch is None:
            return None
        seen = self.watch.fresh(FRESH_S)
        if seen is None:
            return None
        fence, state, info = seen[0]
        self.exit_if_fenced(self.member is not None and self.member.fenced_by(fence))
        self.exit_if_over(state)
        return info

    def forget_readings(self) -> None:
        """Readings taken before a (re)join are stale."""
        if self.watch is not None:
            self.watch.take()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.member is not None:
            self.member.stop()
