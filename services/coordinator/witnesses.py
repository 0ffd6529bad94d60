"""Is a missing Redis heartbeat a death? Two more witnesses are asked before a process is declared dead by it.

Judged on Redis heartbeats alone, a 2 s cut of the Redis/coordinator host fenced every worker (each exited with
code 3 and restarted, though all of them were alive and still talking to the servers; issue 47): every heartbeat
expired at once, and so did the coordinator's grounds to judge any of them. A missing heartbeat now counts only when

1. **the path to Redis is seen to work**: some other member's heartbeat (the coordinator's own excluded: it may
   sit beside Redis) has changed within `stale_s` = max(cluster.dead_after / 2, 2 x heartbeat_interval), and has
   after a break (every heartbeat stopped at once), has done so again for `settle_s` = cluster.dead_after +
   REDIS_RECONNECT_S. When every heartbeat stops at once, it is Redis (or the way to it) that is gone, not the
   whole cluster; once beats come back, a member whose Redis connection was stuck in a call through the outage
   (a client gives up after REDIS_RECONNECT_S) gets the time to reconnect and beat before it is judged. The
   coordinator's own view counts too: after a scan that could not reach Redis, the path has to be seen working
   again the same way (`lost_redis`), so nothing is fenced on what was read before the outage. (A coordinator
   that starts judges at once, as before: the heartbeats it finds are its first sight of a working path); and
2. for a worker, **the leader has not heard it either** (shared/coordination/heard.py): the leader's count of
   the messages it heard from that incarnation has not moved for cluster.dead_after.

Both are read on the coordinator's clock (a value compared with the one read before), never on another host's.
Nothing is slower for a process that is really gone: a child of ours that exits is declared dead from its exit
(services/coordinator/child_exit.py, before any heartbeat is looked at); a silent one elsewhere stops beating and
stops being heard at the same moment, and every other member keeps the path fresh, so it is declared dead when
its heartbeat expires, as before. What is held back is a judgement while everyone is silent at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cmemi.shared.config.system import ClusterConfig

REDIS_RECONNECT_S = 5.0  # membership.connect's socket_timeout: a call stuck through an outage gives up by then


@dataclass
class Witnesses:
    cluster: ClusterConfig
    beats: dict[str, tuple[str, float]] = field(default_factory=dict)  # member -> (heartbeat value, when it changed)
    heard: dict[str, tuple[str, float]] = field(default_factory=dict)  # worker id -> (leader's record, when it changed)
    fresh_since: float | None = None  # since when the path to Redis has been seen working without a break
    healing: bool = False  # the path was seen broken (or Redis lost by us): judge only after `settle_s`
    lost: bool = False  # our last scan could not reach Redis
    redis_back: float | None = None  # when a scan of ours reached Redis again after one that could not

    @property
    def stale_s(self) -> float:
        return max(self.cluster.dead_after / 2, 2 * self.cluster.heartbeat_interval)

    @property
    def settle_s(self) -> float:
        return self.cluster.dead_after + REDIS_RECONNECT_S

    def observe(self, beats: dict[str, str | None], heard: dict[str, str], now: float | None = None) -> None:
        """One scan's reading: every member's heartbeat value (None: expired) but the coordinator's, and the
        leader's record of what it heard."""
        now = time.monotonic() if now is None else now
        if self.lost:
            self.lost, self.redis_back = False, now
        for name, value in beats.items():
            if value is not None and self.beats.get(name, ("", 0.0))[0] != value:
                self.beats[name] = (value, now)
        for wid, value in heard.items():
            if self.heard.get(wid, ("", 0.0))[0] != value:
                self.heard[wid] = (value, now)
        newest = max((t for _v, t in self.beats.values()), default=None)
        if newest is None or now - newest > self.stale_s:
            self.fresh_since, self.healing = None, self.healing or bool(self.beats)
        elif self.fresh_since is None:
            self.fresh_since = newest

    def lost_redis(self) -> None:
        """A scan could not reach Redis: what we read before is no ground to judge on after it heals."""
        self.fresh_since, self.healing, self.lost = None, True, True
        self.beats.clear()

    def own_view_settled(self, now: float | None = None) -> bool:
        """Our own children beat through our own way to Redis: only after we lost it do they get `settle_s` to
        beat again before their silence is theirs."""
        now = time.monotonic() if now is None else now
        return not self.lost and (self.redis_back is None or now - self.redis_back >= self.settle_s)

    def path_works(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.fresh_since is None:
            return False
        if self.healing and now - self.fresh_since < self.settle_s:
            return False
        self.healing = False
        return True

    def leader_hears(self, wid: str, inc: int, now: float | None = None) -> bool:
        """The leader heard incarnation `inc` of worker `wid` within cluster.dead_after."""
        now = time.monotonic() if now is None else now
        value, changed = self.heard.get(wid, ("", 0.0))
        return value.partition(":")[0] == str(inc) and now - changed < self.cluster.dead_after

    def may_judge(self, role: str, ident: str, inc: int) -> bool:
        """May a missing heartbeat of this incarnation be taken for a death now?"""
        if not self.path_works():
            return False
        return not (role == "worker" and self.leader_hears(ident, inc))
