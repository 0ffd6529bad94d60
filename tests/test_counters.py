"""Incarnations and terms only grow: Redis INCR, restored past the highest known value after Redis loses data."""

from __future__ import annotations

import json
from pathlib import Path

from cmemi.shared.coordination.counters import GAP, Counters
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import allocate, connect


def test_counters_survive_redis_losing_its_data(redis_server, tmp_path: Path) -> None:
    client, keys = connect(redis_server.url), Keys("counters")
    path = tmp_path / "counters.json"
    counters = Counters(path, client, keys)
    handed = [allocate(client, keys.incarnation) for _ in range(5)] + [allocate(client, keys.term)]
    assert handed[:5] == [1, 2, 3, 4, 5]  # from Redis, not from a clock
    assert counters.check() == []
    assert json.loads(path.read_text()) == {keys.incarnation: 5, keys.term: 1}
    client.flushall()  # Redis restarted empty
    again = Counters(path, client, keys)  # a restarted coordinator reads the file
    assert sorted(again.check()) == sorted([keys.incarnation, keys.term])
    assert allocate(client, keys.incarnation) == 5 + GAP + 1
    assert allocate(client, keys.term) == 1 + GAP + 1
    client.set(keys.incarnation, 3)  # an AOF that lost the last writes: behind, not empty
    assert again.check() == [keys.incarnation]
    assert allocate(client, keys.incarnation) > 5 + GAP + 1
