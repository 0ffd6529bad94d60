"""Where each parameter-server shard k > 0 is now, read from its Redis record off the worker's loop (issue 47).

A worker learns the shards' addresses from the leader's welcome. A shard restarted within the term (its new
incarnation replays the step log to the leader's step and is taken in that term: services/aggregator/leader/
roster.py) listens on a new address, and no new term comes to bring it: the worker would wait out its link's
timeout (10 s and more) on the dead one. Each shard's record (`member:aggregator:k`, written by the new process
before it restores anything) names its address; `Watch` (shared/coordination/watch.py) reads them every
`INTERVAL_S` on its own thread, and the worker's waits and sends check the newest reading (`moved`): a shard whose
record names another address than the link's is linked to there (shard_links.py `relink`). The leader's welcome
may still name the dead address while the new one replays; the record is newer (`newest`).
"""

from __future__ import annotations

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import texts
from cmemi.shared.coordination.watch import Watch

INTERVAL_S = 0.25  # a shard's new address is seen this long at most after its process registered


class ShardAddrs:
    def __init__(self, client: redis.Redis, keys: Keys, shards: int) -> None:
        self.keys, self.ids = keys, range(1, shards)
        self.seen: dict[int, str] = {}  # shard k -> the address its record named when last read
        self.watch: Watch[dict[int, str]] | None = Watch(client, INTERVAL_S, self._read, "shards").start() \
            if shards > 1 else None

    def _read(self, client: redis.Redis) -> dict[int, str]:
        pipe = client.pipeline(transaction=False)  # one round trip for every shard
        for k in self.ids:
            pipe.hmget(self.keys.member("aggregator", str(k)), ["addr", "state"])
        out = {}
        for k, reply in zip(self.ids, pipe.execute(), strict=True):
            addr, state = texts(reply)
            if addr is not None and state == "running":
                out[k] = addr
        return out

    def _update(self) -> None:
        if self.watch is not None and (new := self.watch.take()) is not None:
            self.seen.update(new[0])

    def newest(self, k: int, told: str) -> str:
        """Shard k's address: its record's if read (it is newer than any welcome), else `told` (the leader's)."""
        self._update()
        return self.seen.get(k, told)

    def moved(self, linked: dict[int, str]) -> tuple[int, str] | None:
        """(k, its address now) of a shard whose record names another address than its link's (`linked`), if any."""
        self._update()
        for k, addr in linked.items():
            if (now := self.seen.get(k)) is not None and now != addr:
                return k, now
        return None

    def poke(self) -> None:
        """Read now (a shard is silent: a restarted one's record is seen within a read)."""
        if self.watch is not None:
            self.watch.poke()

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
