"""A shard that outlives its leader joins the new term in place (issue 47, services/aggregator/shard/newterm.py):
the parts that move to the new term, each against its real other end where it has one.

- the shard's step log (steplog/shard.py `enter_term`) against the checkpointer's real LogServer on a real Redis:
  an entry the shard ships under the old term once the new term began is dropped and counted (`stale_term`), and
  the same step shipped again under the new term is held;
- its snapshots (snapshots/send.py `enter_term`) against a played checkpointer on real sockets: the old term's
  snapshot in flight is given up (the checkpointer drops it and never answers), the next goes out under the new term;
- its door for workers' hellos (door.py): the old term's workers forgotten, hellos parked until the new leader's
  welcome, then answered;
- where it must restart instead, it leaves without the interpreter's teardown and still removes its ipc:// files.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
from cmemi.services.aggregator.shard.door import Door
from cmemi.services.aggregator.snapshots.send import CheckpointerLink
from cmemi.services.aggregator.steplog.link import StepLogLink
from cmemi.services.aggregator.steplog.reading import LogEntries
from cmemi.services.aggregator.steplog.shard import ShardStepLog
from cmemi.services.checkpointer.logserver import LogServer
from cmemi.services.checkpointer.steplog import StepLog

from tests.helpers.rig import PlayedCheckpointer, context, until

pytestmark = pytest.mark.timeout(120)


def slice_of(step: int) -> dict[str, torch.Tensor]:
    return {"p1": torch.randn(50, 20, generator=torch.Generator().manual_seed(step))}


def test_a_shard_in_a_new_term_ships_under_it_and_its_old_term_entries_are_dropped(tmp_path: Path,
                                                                                   redis_server) -> None:
    """The one-line change that fails this: `enter_term` not setting the link's term (step 2 dropped again)."""
    ctx = context(tmp_path, redis_server.url, "cluster.shards=2", "cluster.max_message_bytes=16777216")
    ctx.redis.set(ctx.keys.term, 1)
    zctx = zmq.Context()
    log = StepLog(0, 64 << 20, lambda header, metas: pytest.fail("nothing spills at 64 MB"))
    server = LogServer(ctx, zctx, log, threading.Lock()).start()
    ctx.redis.hset(ctx.keys.checkpointer, mapping={"addr": server.addr, "incarnation": "1", "log": server.addr})
    shard = ShardStepLog(ctx, zctx, term=1, shard=1)
    try:
        shard.ship(1, slice_of(1))  # (with its shard_ready), then the leader's entry of step 1, acknowledged
        leader = StepLogLink(ctx, zctx, term=1)
        leader.ship_staged(1, leader.stage(slice_of(1), None), False, [1.0, 2.0], 1.0)
        assert leader.confirm(lambda s: pytest.fail(f"log_gap at {s}")) is False
        leader.close()
        ctx.redis.set(ctx.keys.term, 2)  # the leader died; a new one allocated its term and replays to step 1
        leader = StepLogLink(ctx, zctx, term=2)
        assert [m.header["step"] for m in LogEntries(leader).entries(0)] == [1]
        leader.close()
        shard.ship(2, slice_of(2))  # this shard has not seen the new term yet
        until(lambda: server.drops.counts["stale_term"] >= 1, 10, "the old term's entry dropped",
              step=lambda: shard.link.replies(20))
        assert log.entry(1, 2) is None and 2 in shard.kept  # not held; the shard would send it again
        shard.enter_term(2, 1, None)  # joined the new term in place at step 1
        assert not shard.kept and shard.link.term == 2
        shard.ship(2, slice_of(2))  # (the same step, shipped again under the new term)
        until(lambda: log.entry(1, 2) is not None, 10, "step 2 held in the new term", step=lambda: shard.link.replies(20))
        held = log.entry(1, 2)
        assert held is not None and torch.equal(held.loaded()["g.p1"], slice_of(2)["p1"])
        assert server.drops.counts["stale_term"] == 1
    finally:
        shard.close()
        server.close()
        zctx.term()


def test_the_old_terms_snapshot_in_flight_is_given_up_and_the_next_goes_under_the_new_term(tmp_path: Path,
                                                                                           redis_server) -> None:
    """A checkpointer drops an old term's snapshot without an answer: kept in flight, it would hold every later one
    back for good. The one-line change that fails this: `enter_term` keeping `in_flight`."""
    ctx = context(tmp_path, redis_server.url, "cluster.shards=2")
    played = PlayedCheckpointer(ctx, answers=["retry"] * 1000)  # the old term's: never saved
    zctx = zmq.Context()
    link = CheckpointerLink(ctx, zctx, 1, lambda reason, detail: None)
    pieces = {"p1": torch.ones(8)}

    def snap(step: int, term: int) -> Any:
        progress = {"step": step, "term": term}
        return step, {"progress": progress}, pieces

    try:
        link.offer(snap(4, 1))
        until(lambda: 4 in played.snapshots, 10, "the old term's snapshot sent", step=lambda: (link.poll(),
                                                                                            played.sock.poll(20)))
        assert link.in_flight is not None and not link.idle
        link.enter_term(2)
        assert link.idle and link.term == 2 and link.sock is None
        played.answers = []  # the new term's are saved
        link.offer(snap(6, 2))
        saved: list[int] = []
        until(lambda: 6 in saved, 10, "the new term's snapshot saved", step=lambda: (saved.extend(link.poll()),
                                                                                    played.sock.poll(20)))
        assert link.idle
    finally:
        link.close()
        played.close()
        zctx.destroy(linger=0)


def test_the_door_forgets_the_old_terms_workers_and_parks_hellos_until_the_new_welcome() -> None:
    """Fakes for the admission and intake (the door's rule only; the real ones: test_shards.py). The one-line change
    that fails this: `new_term` not clearing the admitted workers, or not parking."""
    sent: list[tuple[bytes, str, dict[str, Any]]] = []
    admitted: dict[bytes, Any] = {b"old": SimpleNamespace(wid="w0", inc=1, host="h")}
    kept: list[set[bytes]] = []

    def hello(identity: bytes, h: dict[str, Any]) -> Any:
        admitted[identity] = SimpleNamespace(wid=h["wid"], inc=h["inc"], host="h")
        return admitted[identity]

    admission = SimpleNamespace(workers=admitted, hello=hello)
    intake = SimpleNamespace(keep=lambda peers: kept.append(set(peers)), grant=lambda identity, h: False)
    door = Door(admission, intake, lambda i, m, **f: sent.append((i, m, f)), SimpleNamespace(info=lambda *a, **k: None),
                shard=1)  # type: ignore[arg-type]
    door.opened({"sha256": "x"}, term=1, step=10, total=100)
    door.new_term(2)
    assert not admitted and kept == [set()] and door.fp is None
    assert sent == [(b"old", "reject", {"fatal": False, "reason": "term 2 started: say hello again"})]  # not waiting
    sent.clear()
    door.hello(b"new", {"wid": "w0", "inc": 1}, term=2, step=10, total=100)
    assert sent == [] and door.parked and door.agrees({"sha256": "x"}) is False  # parked: no welcome, no reject
    door.opened({"sha256": "x"}, term=2, step=10, total=100)
    assert [(i, m, f["term"]) for i, m, f in sent] == [(b"new", "welcome", 2)] and b"new" in admitted
    assert not door.parked and door.agrees({"sha256": "x"})


LEAVER = """
import sys, zmq
from pathlib import Path
from cmemi.shared.runtime.exits import exit_now
from cmemi.shared.wire import samehost

zctx = zmq.Context()
sock = zctx.socket(zmq.ROUTER)
print(samehost.bind_ipc(sock, Path(sys.argv[1]), "aggregator"), flush=True)
sock.close(linger=0)
zctx.term()  # (what the shard's close does before it leaves: ShardServer.close)
exit_now(4)
"""


def test_a_service_that_leaves_now_removes_its_ipc_socket_files(tmp_path: Path) -> None:
    """A service leaves by os._exit (shared/runtime/exits.py `exit_now`: a shard leaving its term, every service the
    zygote forked), which runs no atexit handler: what `at_exit` registered runs there instead — removing its ipc://
    socket file and, the last one out, the run's socket directory (shared/wire/samehost.py). A real process, its real
    exit code. The change that fails this: `exit_now` not running the `at_exit` handlers (the directory stays)."""
    done = subprocess.run([sys.executable, "-c", LEAVER, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 4, done.stderr
    endpoint = done.stdout.strip()
    assert endpoint.startswith("ipc://"), done.stdout
    path = Path(endpoint.removeprefix("ipc://"))
    assert path.parent.parent == tmp_path and not path.exists() and not path.parent.exists()
