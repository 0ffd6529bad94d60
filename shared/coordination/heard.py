"""The leader's word on each worker: when it last heard from it over ZeroMQ, a second liveness channel beside Redis.

A worker's Redis heartbeat can lapse while the worker is alive and training (its link to the Redis host cut for a
moment, Redis slow): judged on that channel alone, the coordinator fenced every worker of a run whose Redis host
was cut for 2 s (issue 47). The leader hears every worker that trains (its wants and gradients), so it records
here, per worker, the incarnation it last heard and a counter of the times it did; the coordinator
(services/coordinator/witnesses.py) takes a worker for dead only when this record has not moved for
cluster.dead_after as well. A counter, not a time: the coordinator compares what it reads with what it read
before, on its own clock, so no two hosts' clocks are ever compared.

`note` is a dict update on the leader's loop; a thread of its own writes what changed, at most every
heartbeat interval (one HSET; Redis stays off the loop, docs/design.md §6). A write Redis cannot take is retried
with the next.
"""

from __future__ import annotations

import threading

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import table


class HeardWriter:
    def __init__(self, client: redis.Redis, keys: Keys, interval: float) -> None:
        self.client, self.keys, self.interval = client, keys, interval
        self._lock = threading.Lock()
        self._heard: dict[str, tuple[int, int]] = {}  # wid -> (incarnation, times heard)
        self._written: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heard", daemon=True)
        self._thread.start()

    def note(self, wid: str, inc: int) -> None:
        """A message from incarnation `inc` of worker `wid` arrived."""
        with self._lock:
            seen = self._heard.get(wid)
            self._heard[wid] = (inc, seen[1] + 1 if seen is not None and seen[0] == inc else 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def write(self) -> None:
        """Write what changed since the last write (the thread calls it every interval)."""
        with self._lock:
            changed = {w: v for w, v in self._heard.items() if self._written.get(w) != v}
        if not changed:
            return
        try:
            self.client.hset(self.keys.heard, mapping={w: f"{inc}:{n}" for w, (inc, n) in changed.items()})
        except redis.RedisError:
            return  # Redis down or cut off: written with the next change
        self._written.update(changed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def read_heard(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """worker id -> "incarnation:count" as the leader last wrote it (empty before it heard anyone)."""
    return table(client.hgetall(keys.heard))
