"""Redis off the loops: shared/coordination/watch.py's Watch and the leader's ProgressWriter, against a real redis-server,
stopped and started again under them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from cmemi.services.aggregator.leader.progress import ProgressWriter
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.coordination.watch import Watch

from cmemi.launcher.redis_server import EmbeddedRedis


def _until(cond: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_watch_gives_each_answer_once_and_keeps_reading_through_an_outage(tmp_path: Path) -> None:
    """The test decides when the watch's thread reads (one permit per read), so each outcome is exact."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url)
    client.set("k", "1")
    gate, tried = threading.Semaphore(0), []

    def read(r: redis.Redis) -> str | None:
        gate.acquire()
        tried.append(1)
        return r.get("k")

    watch = Watch(client, 0.02, read, "test").start()
    try:
        gate.release()  # one read
        assert _until(watch.take) == ("1",)
        assert watch.take() is None  # no read since: the answer is given once, not again
        port = server.port
        server.stop()  # the thread's reads fail; the loop's take() never waits for them
        before = len(tried)
        for _ in range(3):
            gate.release()
        _until(lambda: len(tried) == before + 3)
        t0 = time.monotonic()
        for _ in range(20):
            assert watch.take() is None  # a failed read tells nothing new
        assert time.monotonic() - t0 < 0.5
        server.start(port=port)
        client.set("k", "2")
        gate.release(10_000)
        assert _until(lambda: watch.take() == ("2",))
    finally:
        gate.release(10_000)  # a thread waiting for a permit must not hold up stop()
        watch.stop()
        server.stop()


def test_poke_reads_now_instead_of_after_the_interval(tmp_path: Path) -> None:
    """A worker whose leader went silent pokes its watch: the restarted leader's record is read at once, not up to
    `interval` (an hour here) later."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url)
    client.set("k", "old")
    watch = Watch(client, 3600.0, lambda r: r.get("k"), "test").start()
    try:
        assert _until(watch.take) == ("old",)  # the first reading, at start
        client.set("k", "new")
        t0 = time.monotonic()
        assert watch.take() is None  # no reading since, and none for an hour unless poked
        watch.poke()
        assert _until(watch.take, timeout=5.0) == ("new",)
        assert time.monotonic() - t0 < 5.0
        t1 = time.monotonic()
        watch.stop()  # a stop wakes the thread out of its hour's wait too
        assert time.monotonic() - t1 < 2.0
    finally:
        watch.stop()
        server.stop()


def test_progress_writer_keeps_the_newest_progress_and_every_microbatch_across_an_outage(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    client, keys = connect(server.url), Keys("run")
    writer = ProgressWriter(client, keys)
    try:
        writer.put({"step": 1}, {"w0:1": 2})
        writer.flush(timeout=10)
        assert client.hget(keys.progress, "step") == "1" and client.hget(keys.microbatches, "w0:1") == "2"
        port = server.port
        server.stop()
        for step in range(2, 6):  # while Redis is down: the counts add up, the newest progress replaces the others
            writer.put({"step": step}, {"w0:1": 1, "w1:1": 1})
        server.start(port=port)  # (it takes longer than the writer needs to fail once)
        writer.flush(timeout=10)
        assert client.hget(keys.progress, "step") == "5"
        assert client.hgetall(keys.microbatches) == {"w0:1": "6", "w1:1": "4"}  # none lost, none twice
    finally:
        writer.close()
        server.stop()
