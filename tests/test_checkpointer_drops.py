"""The checkpointer's dropped-message counts: logged sparingly, published to Redis in batches, kept while Redis is
down (a real redis-server, stopped and restarted on its port)."""

from __future__ import annotations

from types import SimpleNamespace

from cmemi.services.checkpointer.drops import Drops
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect


def test_drops_are_logged_sparingly_and_reach_redis_after_an_outage(redis_server) -> None:
    lines: list[dict] = []
    keys = Keys("drops")
    client = connect(redis_server.url)
    drops = Drops(client, keys, SimpleNamespace(warning=lambda event, **f: lines.append(f)))
    for _ in range(2000):
        drops.count("bad_checksum", "x" * 500)
    drops.count("wrong_role")
    assert [f["count"] for f in lines if f["reason"] == "bad_checksum"] == [1, 2, 3, 1000, 2000]
    assert all(len(f["detail"]) <= 200 for f in lines)
    redis_server.stop()  # injected: Redis away when the counts are published
    drops.publish()
    assert drops.unpublished == {"bad_checksum": 2000, "wrong_role": 1}
    redis_server.start(port=redis_server.port)
    drops.publish()
    drops.count("wrong_role")
    drops.publish()  # only what is new is added
    assert client.hgetall(keys.ckpt_dropped) == {"bad_checksum": "2000", "wrong_role": "2"}
    assert not drops.unpublished and drops.counts["wrong_role"] == 2
