"""Where each parameter-server shard k > 0 is now, read from its Redis record off the worker's loop (issue 47).

A worker learns the shards' addresses from the leader's welcome. A shard restarted within the term (its new
incarnation replays the step log to the leader's step and is taken in that term: services/aggregator/leader/
roster.py) listens on a new address, and no new term comes to bring it: the worker would wait out its link's
timeout (10 s and more) on the dead one. Each shard's record (`member:aggregator:k`, written by the new process
before it restores anything) names its address; `Watch` (shared/coordination/watch.py) reads them every
`INTERVAL_S` on its own thread, and the worker's waits and sends check the newest reading (`moved`): a shard whose
record names another address than the link's is linked to there (shard_links.py `relink`). The leader's welcome
may still name the dead address while the new one replays; the record is newer (`newest`).

The leader says it too: the first lease it hands a worker after it took a restarted shard in carries every shard's
(k, incarnation, address) (`told`), so the worker relinks before it pulls or pushes that lease's slices, and a
re-leased slice never goes into the dead link while the record's next reading is still to come. A reading and a
lease may come in either order: the higher incarnation wins (a record without one, of an older cmemi, counts as
-1). An entry that is not a shard, an incarnation and a tcp:// address is dropped and counted (`dropped`): a bad
address would otherwise fail the worker's dial.
"""

from __future__ import annotations

import re
from typing import Any

import redis
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import texts
from cmemi.shared.coordination.watch import Watch
from cmemi.shared.wire import samehost

INTERVAL_S = 0.25  # a shard's new address is seen this long at most after its process registered
TCP = re.compile(r"tcp://[A-Za-z0-9_.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")


class ShardAddrs:
    def __init__(self, client: redis.Redis, keys: Keys, shards: int) -> None:
        self.keys, self.ids = keys, range(1, shards)
        self.seen: dict[int, tuple[int, str]] = {}  # shard k -> (incarnation, address): the newest reading or lease
        self.dropped = 0  # lease entries that named no usable shard address
        self.watch: Watch[dict[int, tuple[int, str]]] | None = Watch(client, INTERVAL_S, self._read, "shards").start() \
            if shards > 1 else None

    def _read(self, client: redis.Redis) -> dict[int, tuple[int, str]]:
        pipe = client.pipeline(transaction=False)  # one round trip for every shard
        for k in self.ids:
            pipe.hmget(self.keys.member("aggregator", str(k)), ["addr", "state", "incarnation"])
        out = {}
        for k, reply in zip(self.ids, pipe.execute(), strict=True):
            addr, state, inc = texts(reply)
            if addr is not None and state == "running":
                out[k] = (int(inc) if inc is not None and inc.isdigit() else -1, addr)
        return out

    def _merge(self, k: int, inc: int, addr: str) -> None:
        if k not in self.seen or inc >= self.seen[k][0]:
            self.seen[k] = (inc, addr)

    def _update(self) -> None:
        if self.watch is not None and (new := self.watch.take()) is not None:
            for k, (inc, addr) in new[0].items():
                self._merge(k, inc, addr)

    def told(self, entries: Any) -> None:
        """A lease's `shards` (the leader's word, [[k, incarnation, address], ...]): merged as a reading is; a
        malformed entry (or list) is dropped and counted, the rest kept."""
        if not isinstance(entries, list):
            self.dropped += 1
            return
        for entry in entries:
            if usable(entry, self.ids):
                self._merge(*entry)
            else:
                self.dropped += 1

    def newest(self, k: int, told: str) -> str:
        """Shard k's address: the newest read or leased (newer than any welcome), else `told` (the leader's)."""
        self._update()
        return self.seen[k][1] if k in self.seen else told

    def moved(self, linked: dict[int, str]) -> tuple[int, str] | None:
        """(k, its address now) of a shard whose newest address is another than its link's (`linked`), if any."""
        self._update()
        for k, addr in linked.items():
            if k in self.seen and (now := self.seen[k][1]) != addr:
                return k, now
        return None

    def poke(self) -> None:
        """Read now (a shard is silent: a restarted one's record is seen within a read)."""
        if self.watch is not None:
            self.watch.poke()

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()


def usable(entry: Any, ids: range) -> bool:
    """Is `entry` [k, incarnation, address] with k one of `ids` and an address a worker can dial (tcp://host:port,
    with or without its same-host part: shared/wire/samehost.py)?"""
    if not (isinstance(entry, list) and len(entry) == 3):
        return False
    k, inc, addr = entry
    if type(k) is not int or type(inc) is not int or k not in ids or inc < 0 or not isinstance(addr, str):
        return False
    ends = samehost.parse(addr)
    return TCP.fullmatch(ends.tcp) is not None and (ends.ipc is None or "\0" not in ends.ipc)
