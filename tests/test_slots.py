"""Slot accounting and adoption, on real processes: a spare that took a slot restarts as that worker, and a
restarted coordinator adopts exactly the processes an earlier one started (not a reused pid)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from cmemi.services.coordinator.coordinator import Coordinator
from cmemi.services.coordinator.supervisor import Child, load_children, save_children
from cmemi.shared.config.loading import load_config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.runtime.exits import Exit

from tests.conftest import DIGITS
from tests.helpers.chaos import poll


def sleeper(*tag: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(120)", *tag]


def test_adoption_follows_the_command_line_and_reads_exits(tmp_path: Path) -> None:
    a, b = Child("worker", "w0", sleeper("w0")), Child("worker", "spare1", sleeper("spare1"), spare=True)
    a.start()
    b.start()
    path = tmp_path / "children.json"
    try:
        save_children(path, [a, b])
        b.argv = sleeper("changed")  # the recorded command line no longer matches the process: not adopted
        rows = path.read_text().replace("spare1", "other")
        path.write_text(rows)
        adopted = load_children(path)
        assert [(c.name, c.pid, c.spare) for c in adopted] == [("worker:w0", a.pid, False)]
        child = adopted[0]
        assert child.alive and child.popen is None
        a.popen.send_signal(signal.SIGKILL)  # our own child: we reap it, the adopter only sees it gone
        a.popen.wait()
        poll(lambda: child.poll() is not None, 10, "the adopted process seen to exit")
        assert child.poll() == Exit.UNKNOWN and not child.alive
    finally:
        for c in (a, b):
            c.kill()


def test_a_spare_that_took_a_slot_restarts_as_that_worker(redis_server, tmp_path: Path) -> None:
    cfg = load_config(DIGITS, [f"run.dir={tmp_path}", "run.name=slots"])
    coord = object.__new__(Coordinator)  # the slot logic only, without starting a cluster
    events: list[tuple[str, dict]] = []
    coord.cfg, coord.children, coord.spares, coord.log = cfg, {}, [], SimpleNamespace(error=print, warning=print)
    coord.ctx = SimpleNamespace(redis=connect(redis_server.url), keys=Keys("slots"),
                                emit=lambda kind, **f: events.append((kind, f)))
    coord._add_spare = lambda: None  # no new spare: the next death must start a new process
    coord.children_file, coord._saved_children = tmp_path / "children.json", []  # saved right after a hand-off
    worker = Child("worker", "w0", sleeper("--worker-id", "w0"))
    spare = Child("worker", "spare1", sleeper("--spare", "spare1"), spare=True)
    coord.children[worker.name] = worker
    coord.spares.append(spare)
    for c in (worker, spare):
        c.start()
    try:
        worker.kill()
        coord._replace(worker)
        took = coord.children["worker:w0"]
        assert took is spare and not took.spare and took.argv == worker.argv
        assert coord.ctx.redis.lpop(Keys("slots").spare("spare1")) == "w0"
        rows = json.loads((tmp_path / "children.json").read_text())  # a coordinator dying now adopts it as w0
        assert [(r["ident"], r["spare"], r["pid"]) for r in rows] == [("w0", False, spare.pid)]
        took.kill()
        coord._replace(took)  # no spare left: a new process, with the worker's command line
        assert not took.running and took.next_start <= time.monotonic() + 0.5
        poll(lambda: coord._check_children() or took.alive, 10, "the slot restarted (after its backoff)")
        assert took.alive and took.launched == worker.argv and "--spare" not in took.launched
    finally:
        for c in (worker, spare, coord.children["worker:w0"]):
            c.kill()
