"""A shard's step log entries through its shared-memory slots on one host (issue 47, the step log's cost at K = 2):
a shard k > 0's StepLogLink and the checkpointer's LogServer (its own thread, its StepLog), both real and in process,
on a real Redis, over ipc://.

A shard keeps its entries until `logged` (services/aggregator/steplog/shard.py) and ships them without waiting for
acks, so its slot must never be written again before what it holds is acknowledged: with the checkpointer
not reading yet, the next entries wait `keep_wait_s` for the slot, then go as frames (counted), and every entry
reaches the log bitwise once it reads (none is lost to a slot written again); with the checkpointer busy for a
second (its log's lock held, as the write of the entries ahead holds its thread), the next entry waits for the slot
and goes through it. A descriptor naming no segment, or a slot written since (a torn one), is dropped and
counted at the checkpointer, which goes on. A kept entry sent again to a checkpointer that restarted on another
host goes as frames read from its slot. With the spool on, a same-host entry lands through one buffer reused from
entry to entry and the log keeps it only in its segment: every entry still held bitwise, and replayed so."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zmq
from cmemi.services.aggregator.steplog.link import StepLogLink, inputs_of, keep_wait_s
from cmemi.services.aggregator.steplog.reading import LogEntries
from cmemi.services.checkpointer.logfiles import LogFiles, Stored
from cmemi.services.checkpointer.logserver import LogServer
from cmemi.services.checkpointer.steplog import StepLog
from cmemi.shared.memory import shm
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import transfer

from tests.helpers.rig import context, until

pytestmark = pytest.mark.timeout(120)


def slice_of(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 100, generator=g), "b": torch.randn(9, generator=g)}


def same_host(tmp_path: Path, redis_url: str, *sets: str) -> ServiceContext:
    if not shm.available():
        pytest.fail("this test needs a writable /dev/shm (the same-host step log's slots)")
    ctx = context(tmp_path, redis_url, "cluster.transport=auto", "cluster.shards=2", "cluster.max_message_bytes=16777216",
                  *sets)
    ctx.redis.set(ctx.keys.term, 1)
    return ctx


def serve(ctx: ServiceContext, zctx: zmq.Context, files: LogFiles | None = None,
          lock: threading.Lock | None = None) -> tuple[LogServer, StepLog]:
    """A LogServer advertised in Redis, its thread not started (`start` it: until then nothing is read or acked).
    `lock`: its log's (held by the test: nothing is logged or acked meanwhile)."""
    log = StepLog(0, 64 << 20, lambda header, metas: pytest.fail("nothing spills at 64 MB"), files)
    server = LogServer(ctx, zctx, log, lock or threading.Lock())
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    return server, log


def held_bitwise(log: StepLog, step: int) -> bool:
    entry = log.entry(1, step)
    return entry is not None and all(torch.equal(entry.loaded()[f"g.{n}"], t) for n, t in slice_of(step).items())


def acked(link: StepLogLink, steps: set[int]) -> set[int]:
    """The steps `link` has read a `logged` of (its replies waited for, 100 ms at a time)."""
    for msg in link.replies(100):
        if msg.type == "logged":
            steps.add(msg.header["step"])
    return steps


def test_a_shards_entries_go_through_its_slots_and_wait_for_their_acks_before_a_slot_is_written_again(
        tmp_path: Path, redis_server) -> None:
    """The one-line change that fails this: staging.py `can_keep` returning True (the slot written again before its
    entry was acknowledged: step 1's slot holds step 3 when the checkpointer reads it, `shm_overwritten`, and the log
    never holds step 1). Its one slot (`shm.Writer(slots=1)`): with two, step 2 went through the second."""
    ctx = same_host(tmp_path, redis_server.url)
    zctx = zmq.Context()
    server, log = serve(ctx, zctx)
    shard = StepLogLink(ctx, zctx, term=1, shard=1)
    try:
        sent = {}
        for step in (1, 2, 3):  # the checkpointer reads nothing yet: no ack comes
            g = slice_of(step)
            sent[step] = shard.encode(step, g, None, None, 0.0)
            for t in g.values():
                t.mul_(-1)  # the commit's optimizer step changes the gradient in place: the kept copy must not
            shard.send(sent[step])
        headers = [transfer_header(m) for m in sent.values()]
        assert ["shm" in h for h in headers] == [True, False, False]  # one slot: the others waited for it, then frames
        # (step 1's slot is then no longer waited for: a shard encodes step s once the commit of s - 1 is in, which
        # needed every entry before it held; this test encodes step 4 only once 1-3 are acknowledged)
        assert shard.framed == 2 and not shard.staging.held
        server.start()
        seen: set[int] = set()
        until(lambda: acked(shard, seen) >= {1, 2, 3}, 30, "logged of steps 1-3")
        assert not shard.staging.held  # every slot free again
        sent[4] = shard.encode(4, slice_of(4), None, None, 0.0)
        shard.send(sent[4])
        assert "shm" in transfer_header(sent[4]) and shard.framed == 2
        until(lambda: 4 in acked(shard, seen), 30, "logged of step 4")
        assert all(held_bitwise(log, s) for s in (1, 2, 3, 4))
        assert not server.drops.counts
    finally:
        shard.close()
        server.close()
        zctx.term()


def test_a_shards_entry_waits_for_its_slot_while_the_checkpointer_still_writes_the_one_before(
        tmp_path: Path, redis_server) -> None:
    """Issue 47 (K = 4, a 113 M-parameter model: shards 1 and 3 sent entries as frames, over their memory budgets). A
    shard stages step s + 1 once the commit of s is in, which needs only its entry of s - 1 held, so its entry of s
    may still be written when the checkpointer's work of a step outlasts the workers'. Its ack is waited for
    `keep_wait_s` (at least 2 T: 6 s here), not 50 ms: with the checkpointer's log busy, step 2 still
    goes through the slot, and both entries are held bitwise (the log is held busy for 0.3 s: six times the old
    wait, a twentieth of the new one). The one-line change that fails this: `keep_wait_s`
    returning 0.05 (the old KEEP_WAIT_S: step 2 goes as frames, `framed` 1)."""
    ctx = same_host(tmp_path, redis_server.url, "cluster.dead_after=6")
    zctx = zmq.Context()
    busy = threading.Lock()
    server, log = serve(ctx, zctx, lock=busy)
    server.start()
    shard = StepLogLink(ctx, zctx, term=1, shard=1)
    encoded: dict[int, list[list]] = {}
    second = threading.Thread(target=lambda: encoded.update({2: shard.encode(2, slice_of(2), None, None, 0.0)}))
    try:
        with busy:  # the checkpointer's log thread busy: step 1's entry is read, not logged, not acknowledged
            encoded[1] = shard.encode(1, slice_of(1), None, None, 0.0)
            shard.send(encoded[1])
            second.start()  # the commit of step 1 came: step 2's entry is encoded while step 1's is not acknowledged
            second.join(timeout=0.3)  # (the checkpointer stays busy 0.3 s, or until step 2 went as frames)
            still_waiting = second.is_alive()
        second.join(timeout=30)
        assert still_waiting and not second.is_alive()
        assert "shm" in transfer_header(encoded[2]) and shard.framed == 0 and shard.slots_used == 2
        shard.send(encoded[2])
        seen: set[int] = set()
        until(lambda: acked(shard, seen) >= {1, 2}, 30, "logged of steps 1-2")
        assert held_bitwise(log, 1) and held_bitwise(log, 2) and not server.drops.counts
        assert keep_wait_s(ctx.cfg.cluster, 0) >= 6.0  # (why 0.3 s is well within the wait)
    finally:
        if second.ident is not None:
            second.join(timeout=30)
        shard.close()
        server.close()
        zctx.term()


def transfer_header(msgs: list[list]) -> dict:
    import msgpack

    return msgpack.unpackb(msgs[0][0])


def test_a_torn_or_garbage_slot_descriptor_is_dropped_and_counted_and_the_log_goes_on(
        tmp_path: Path, redis_server) -> None:
    ctx = same_host(tmp_path, redis_server.url)
    zctx = zmq.Context()
    server, log = serve(ctx, zctx)
    server.start()
    shard = StepLogLink(ctx, zctx, term=1, shard=1)
    try:
        good = shard.encode(1, slice_of(1), None, None, 0.0)
        desc = transfer_header(good)["shm"]
        fields = {"step": 1, "term": 1, "shard": 1, "skip": False, "loss": 0.0, "partials": None, "evals": None,
                  "replicas": None}
        bad = [{**desc, "seg": "cmemi-nosuchsegment"},  # garbage: no such segment
               {**desc, "seq": desc["seq"] + 2},  # torn: the slot written again since (its sequence moved on)
               {**desc, "slot": 7},  # garbage: no such slot
               {"seg": 3}]  # garbage: not a descriptor
        for d in bad:
            shard.send(transfer.messages("step_log", ctx.run, {**fields, "shm": d}, shard.cap, {}))
        shard.send(good)
        seen: set[int] = set()
        until(lambda: 1 in acked(shard, seen), 30, "logged of step 1")
        assert held_bitwise(log, 1)
        assert sum(server.drops.counts.values()) == len(bad), server.drops.counts
        assert server._thread.is_alive()
    finally:
        shard.close()
        server.close()
        zctx.term()


def test_a_kept_entry_sent_again_to_a_checkpointer_on_another_host_goes_as_frames_from_its_slot(
        tmp_path: Path, redis_server) -> None:
    ctx = same_host(tmp_path, redis_server.url)
    zctx = zmq.Context()
    here, _ = serve(ctx, zctx)
    shard = StepLogLink(ctx, zctx, term=1, shard=1)
    elsewhere_ctx = context(tmp_path, redis_server.url, "cluster.shards=2", "cluster.max_message_bytes=16777216")
    elsewhere: LogServer | None = None
    try:
        msgs = shard.encode(1, slice_of(1), None, None, 0.0)
        assert shard.local and "shm" in transfer_header(msgs)
        elsewhere, log = serve(elsewhere_ctx, zctx)  # restarted, on tcp:// only (no ipc:// endpoint: another host)
        ctx.redis.hset(ctx.keys.checkpointer, "incarnation", "2")
        elsewhere.start()
        assert shard.moved() and not shard.local
        shard.send(msgs)
        seen: set[int] = set()
        until(lambda: 1 in acked(shard, seen), 30, "logged of step 1")
        assert held_bitwise(log, 1) and not elsewhere.drops.counts
    finally:
        shard.close()
        here.close()
        if elsewhere is not None:
            elsewhere.close()
        zctx.term()


def test_with_the_spool_on_same_host_entries_land_through_one_reused_buffer_and_are_held_in_the_segment_bitwise(
        tmp_path: Path, redis_server) -> None:
    """The one-line change that fails this: steplog.py `add` without its `Landed` branch (a same-host entry's pieces
    then held as they landed): every held entry would be a view of the landing buffer, which holds the last entry's
    bytes."""
    ctx = same_host(tmp_path, redis_server.url)
    zctx = zmq.Context()
    server, log = serve(ctx, zctx, LogFiles(tmp_path / "segments", lambda exc, attempt: pytest.fail(str(exc))))
    server.start()
    leader, shard = StepLogLink(ctx, zctx, term=1), StepLogLink(ctx, zctx, term=1, shard=1)
    replayer: StepLogLink | None = None
    try:
        for step in (1, 2, 3):
            shard.send(shard.encode(step, slice_of(step), None, None, 0.0))
            g = {n: -t for n, t in slice_of(step).items()}  # the leader's slice: another layout, the same buffer
            leader.ship_staged(step, leader.stage(g, None), False, [1.0, 2.0], float(step))
            assert leader.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
        for step in (1, 2, 3):
            assert held_bitwise(log, step)
            lead = log.entry(0, step)
            assert lead is not None and all(isinstance(t, Stored) for t in lead.tensors.values())
            assert torch.equal(lead.loaded()["g.w"], -slice_of(step)["w"])
        assert log.in_memory == 0 and not server.drops.counts
        ctx.redis.set(ctx.keys.term, 2)  # a restarted leader replays them from the segment
        replayer = StepLogLink(ctx, zctx, term=2)
        got = []
        for msg in LogEntries(replayer).entries(0):
            g, _ = inputs_of(msg.tensors, msg.header["skip"])
            assert g is not None and torch.equal(g["w"], -slice_of(msg.header["step"])["w"])
            got.append(msg.header["step"])
        assert got == [1, 2, 3]
    finally:
        for link in (leader, shard, *([replayer] if replayer else [])):
            link.close()
        server.close()
        zctx.term()
