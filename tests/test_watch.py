"""Redis off the loops: shared/coordination/watch.py's Watch (and an idle worker's check on it,
services/worker/lifecycle.py) and the leader's ProgressWriter, against a real redis-server, stopped and started again
under them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from cmemi.services.aggregator.leader.progress import ProgressWriter
from cmemi.services.worker.lifecycle import Lifecycle
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.coordination.watch import Watch

from cmemi.launcher.redis_server import EmbeddedRedis
from tests.helpers.rig import context


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


def test_fresh_waits_for_a_reading_begun_after_it_and_gives_up_at_its_timeout(tmp_path: Path) -> None:
    """`fresh` is the record as it is now, not the reading an earlier poke made; with Redis away it returns at its
    timeout with nothing new, and the loop goes on."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url)
    client.set("k", "old")
    watch = Watch(client, 3600.0, lambda r: r.get("k"), "test").start()
    try:
        assert _until(watch.take) == ("old",)
        client.set("k", "new")
        assert watch.fresh(5.0) == ("new",)
        assert watch.take() is None  # given once
        server.stop()
        t0 = time.monotonic()
        assert watch.fresh(0.2) is None  # (the read failed, or is still trying: nothing new either way)
        assert time.monotonic() - t0 < 2.0
    finally:
        watch.stop()
        server.stop()


def test_an_idle_worker_sees_a_new_leaders_record_at_its_first_idle_check_after_it_was_written(tmp_path: Path) -> None:
    """Issue 47: a worker whose leader went silent checks Redis at each idle wait (100 ms). It compared the reading
    its previous check had asked for, so a restarted leader's record written after that reading was seen one idle
    wait late (0.1-0.2 s of a leader's kill -> next new step). Now the check reads Redis and waits for that reading.
    Fails on the code before it (`take` then `poke` in `idle_check`): the first check after the record was written
    returns nothing new."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    ctx = context(tmp_path, server.url)
    life = Lifecycle(ctx)
    try:
        life.register("w0")
        _until(lambda: life.idle_check() is not None)  # the record as it was (no leader yet)
        assert life.watch is not None
        _until(life.watch.take)  # whatever that check asked for was read already: nothing pending now
        ctx.redis.hset(ctx.keys.aggregator, mapping={"addr": "tcp://127.0.0.1:5", "term": "2"})
        info = life.idle_check()
        assert info is not None and info.get("addr") == "tcp://127.0.0.1:5" and info.get("term") == "2"
    finally:
        life.close()
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
