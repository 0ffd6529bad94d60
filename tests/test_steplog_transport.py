"""The step log's link, both ends real and in process (issue 47): a leader's StepLogLink and the checkpointer's
LogServer (its own thread, its StepLog), on a real Redis. Same host (`cluster.transport: auto`): ipc:// with each
entry's tensors in a shared-memory slot, both ways; `tcp`: frames over tcp://. Either way the log holds each entry
bitwise as staged, a replay gets them back in order, bitwise, with two requests ahead, and it ends at the log's end.
Past `checkpoint.step_log_memory_mb` the entries land in spool files and come back the same."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cmemi.services.aggregator.steplog.link import StepLogLink, inputs_of
from cmemi.services.aggregator.steplog.reading import LogEntries
from cmemi.services.checkpointer import logfiles, steplog
from cmemi.services.checkpointer.logserver import LogServer
from cmemi.services.checkpointer.spool import Spooled
from cmemi.services.checkpointer.steplog import StepLog
from cmemi.shared.memory import shm

from tests.helpers.logserver import log_server
from tests.helpers.rig import context

pytestmark = pytest.mark.timeout(120)


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)}


@pytest.mark.parametrize("transport,memory_mb", [("auto", 64), ("tcp", 64), ("auto", 0)])
def test_entries_go_and_come_back_bitwise(tmp_path: Path, redis_server, transport: str, memory_mb: int) -> None:
    if transport == "auto" and not shm.available():
        pytest.fail("this test needs a writable /dev/shm (the same-host step log's slots)")
    ctx = context(tmp_path, redis_server.url, f"cluster.transport={transport}",
                  f"checkpoint.step_log_memory_mb={memory_mb}", "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    import zmq

    zctx = zmq.Context()
    try:
        with log_server(tmp_path, ctx, zctx, memory_mb) as (server, log):
            assert ("ipc://" in server.addr) == (transport == "auto")
            link = StepLogLink(ctx, zctx, term=1)
            for step in range(1, 6):
                g = grads(step) if step != 3 else None  # step 3: skipped (an fp16 overflow)
                buf = {"running": torch.full((4,), float(step))}
                staged = link.stage(g, buf)
                if g is not None:
                    for t in g.values():
                        t.mul_(-1)  # the optimizer step changes the gradient in place: the staged copy must not
                link.ship_staged(step, staged, g is None, None, float(step), None)
                assert link.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
            assert link.local == (transport == "auto") and (link.staging.desc is not None) == link.local
            held = log.entry(0, 2)
            assert held is not None
            assert torch.equal(held.loaded()["g.w"], grads(2)["w"])
            if memory_mb == 0:
                assert log.spilled == 5 and all(isinstance(t, Spooled) for t in held.tensors.values())
            link.close()

            ctx.redis.set(ctx.keys.term, 2)  # a restarted leader replays after restoring step 1
            replayer = StepLogLink(ctx, zctx, term=2)
            got = []
            for msg in LogEntries(replayer).entries(1):
                g, b = inputs_of(msg.tensors, msg.header["skip"])
                got.append(msg.header["step"])
                assert b is not None and torch.equal(b["running"], torch.full((4,), float(msg.header["step"])))
                if msg.header["step"] == 3:
                    assert g is None
                else:
                    assert g is not None and all(torch.equal(g[n], grads(msg.header["step"])[n]) for n in ("w", "b"))
                assert ("shm" in msg.header) == (transport == "auto")
            assert got == [2, 3, 4, 5]
            replayer.close()
    finally:
        zctx.term()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_leader_and_a_shard_replaying_at_once_each_get_their_own_entries_bitwise(
        tmp_path: Path, redis_server, transport: str) -> None:
    """K = 2: the leader's and shard 1's entries of steps 1..4, then both replays read in turns, one entry each, as a
    new leader's and a restarted shard's may run at once. Same host, each through a ring of the checkpointer's own
    (checkpointer/logserver.py `slots[shard]`): both get their slices bitwise. Before issue 47's change a shard's
    replay came as frames (about twice the leader's time per entry, CurveZMQ on both sides); with one ring for both,
    one's entries would overwrite the other's (`shm_overwritten`). The one-line change that fails this: reading.py
    asking for slots only at shard 0 (`shm` false at shard 1)."""
    if transport == "auto" and not shm.available():
        pytest.fail("this test needs a writable /dev/shm (the same-host step log's slots)")
    ctx = context(tmp_path, redis_server.url, f"cluster.transport={transport}", "cluster.shards=2",
                  "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    import zmq

    zctx = zmq.Context()
    log = StepLog(0, 64 << 20, lambda header, metas: pytest.fail("nothing spills at 64 MB"))
    server = LogServer(ctx, zctx, log, threading.Lock()).start()
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    leader, shard = StepLogLink(ctx, zctx, term=1), StepLogLink(ctx, zctx, term=1, shard=1)

    def slice_of(k: int, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * k + step)
        return {f"p{k}": torch.randn(200, 100, generator=g)}

    replays: list[StepLogLink] = []
    try:
        for step in range(1, 5):
            shard.send(shard.encode(step, slice_of(1, step), None, None, 0.0))  # (with its shard_ready)
            leader.ship_staged(step, leader.stage(slice_of(0, step), None), False, [1.0, 2.0], float(step))
            assert leader.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
        ctx.redis.set(ctx.keys.term, 2)  # a new leader and a restarted shard replay after the run's start
        replays = [StepLogLink(ctx, zctx, term=2), StepLogLink(ctx, zctx, term=2, shard=1)]
        readers = [LogEntries(r).entries(0) for r in replays]
        got: list[list[int]] = [[], []]
        for _ in range(4):
            for k, entries in enumerate(readers):  # in turns: each one's next entry while the other's is out
                msg = next(entries)
                g, _ = inputs_of(msg.tensors, msg.header["skip"])
                assert g is not None and torch.equal(g[f"p{k}"], slice_of(k, msg.header["step"])[f"p{k}"]), (k, msg.header)
                assert ("shm" in msg.header) == (transport == "auto"), (k, msg.header)
                got[k].append(msg.header["step"])
        assert got == [[1, 2, 3, 4], [1, 2, 3, 4]]
        assert [list(r) for r in readers] == [[], []]  # both end at the log's end
    finally:
        for link in (leader, shard, *replays):
            link.close()
        server.close()
        zctx.term()


@pytest.mark.parametrize("count", [1, 3])
def test_a_same_host_replay_reads_the_spool_into_the_slot_and_applies_the_gradient_where_it_lies(
        tmp_path: Path, redis_server, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Issue 47 (a replay's time grows with the steps since the checkpoint): with the spool on, a same-host entry is
    held only in its segment file. Its replay is read from there straight into the asker's slot (no `Entry.loaded`:
    a `bytes` and a `bytearray` per tensor on the way), and a trainer that only reads its gradient is lent the slot's
    views (`lend`: no copy into kept buffers; the next request goes out once the entry was used), the buffer sum
    still copied (folding divides it in place). With `count` 3, three entries per request and answer (`log_entries`,
    one slot): the log's 4 entries come as 3, then 1 with `end`. Bitwise the entries shipped, in order, to the log's
    end. Fails on the code before it: `entries` took no `lend` (nor `count`), and the checkpointer loaded each entry
    before writing it to the slot."""
    if not shm.available():
        pytest.fail("this test needs a writable /dev/shm (the same-host step log's slots)")
    ctx = context(tmp_path, redis_server.url, "cluster.transport=auto", "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    import zmq

    loads: list[int] = []
    real_loaded = steplog.Entry.loaded

    def loaded(self: steplog.Entry) -> dict[str, torch.Tensor]:
        loads.append(int(self.fields.get("step", -1)))
        return real_loaded(self)

    monkeypatch.setattr(steplog.Entry, "loaded", loaded)
    zctx = zmq.Context()
    files, _ = logfiles.opened(tmp_path / "steplog", True, False, lambda exc, attempt: pytest.fail(str(exc)))
    log = StepLog(0, 64 << 20, lambda header, metas: pytest.fail("nothing spills with the segments on"), files)
    server = LogServer(ctx, zctx, log, threading.Lock()).start()
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    link, replayer = StepLogLink(ctx, zctx, term=1), None
    try:
        for step in range(1, 6):
            link.ship_staged(step, link.stage(grads(step), {"running": torch.full((4,), float(step))}), False, None,
                             float(step))
            assert link.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
        held = log.entry(0, 3)
        assert held is not None and all(isinstance(t, logfiles.Stored) for t in held.tensors.values())
        ctx.redis.set(ctx.keys.term, 2)  # a restarted leader replays after restoring step 1
        replayer = StepLogLink(ctx, zctx, term=2)
        got, where, answers = [], [], []
        real_wait = replayer.wait

        def wait(*args: Any, **kwargs: Any) -> Any:
            answers.append((msg := real_wait(*args, **kwargs)).type)
            return msg

        monkeypatch.setattr(replayer, "wait", wait)
        for msg in LogEntries(replayer).entries(1, lend=True, count=count):
            g, b = inputs_of(msg.tensors, msg.header["skip"])
            step = msg.header["step"]
            assert ("shm" in msg.header) == (count == 1) and g is not None and b is not None  # (a batch's: its own)
            assert all(torch.equal(g[n], grads(step)[n]) for n in ("w", "b")), step
            assert torch.equal(b["running"], torch.full((4,), float(step)))
            b["running"].div_(4)  # (what folding does: the buffer sum is the replay's own copy, not the slot)
            got.append(step)
            where.append(g["w"].data_ptr())
        assert got == [2, 3, 4, 5]
        if count == 1:  # lent: each entry's gradient lies in its slot of the checkpointer's two (kept copies: one buffer)
            assert where[0] == where[2] != where[1] == where[3]
            assert answers == ["log_entry"] * 4 + ["log_end"]
        else:  # steps 2..4 in one slot, 5 in the other, the log's end said with it
            assert len(set(where)) == 4
            assert answers == ["log_entries", "log_entries"]
        assert loads == []  # every entry went from its segment into the slot, none loaded first
    finally:
        link.close()
        if replayer is not None:
            replayer.close()
        server.close()
        files.close()
        zctx.term()


def test_close_leaves_the_socket_to_the_log_thread_while_it_is_inside_a_message(tmp_path: Path, redis_server,
                                                                                 monkeypatch) -> None:
    """The step log's thread owns its socket: `close` while the thread is inside a message (a long spool write; here
    held on an event) must not close the socket under it, or libzmq asserts and aborts the whole process (CI's pytest
    process died of SIGABRT so, stop 55). The thread closes it itself once the message is done. The old `close` (join
    2 s, then `sock.close`) fails the first assertion after `close`."""
    import zmq
    from cmemi.services.checkpointer import logserver

    ctx = context(tmp_path, redis_server.url, "cluster.transport=tcp", "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    zctx = zmq.Context()
    server = LogServer(ctx, zctx, StepLog(0, 64 << 20, lambda h, m: pytest.fail("nothing spills")), threading.Lock())
    inside, release = threading.Event(), threading.Event()
    receive = server._receive

    def held() -> None:
        inside.set()
        release.wait(30)
        receive()

    monkeypatch.setattr(server, "_receive", held)
    monkeypatch.setattr(logserver, "CLOSE_S", 0.3)
    server.start()
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    link = StepLogLink(ctx, zctx, term=1)
    try:
        link.ship_staged(1, link.stage(grads(1), None), False, None, 1.0, None)
        assert inside.wait(30), "the entry never reached the log thread"
        server.close()  # returns after CLOSE_S: the thread is still inside the message
        assert not server.sock.closed, "closed from another thread while the log thread was using it"
        release.set()
        assert link.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False  # the entry is still acknowledged
        deadline = time.monotonic() + 30
        while not server.sock.closed:
            assert time.monotonic() < deadline, "the log thread did not close its socket when it ended"
            time.sleep(0.01)  # (a poll of the thread's own state, with a deadline)
    finally:
        release.set()
        link.close()
        server.close()
        zctx.term()
