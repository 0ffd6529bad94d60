"""The same-host path under faults: every role SIGKILLed while workers talk to the aggregator over ipc://, their
tensors in shared-memory slots (shared/memory/shm.py).

The run must end as a fault-free one does (the same params_sha256), every worker (re)join must have taken the slots,
and nothing may be left behind: no socket file in the run's socket directory, no new /dev/shm entry. While it runs,
after each fault, the live aggregator and workers hold no descriptor of a segment they have not mapped (CPython's
mmap keeps one per map), no memfd, and no more maps than their readers' bounds allow.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster, poll
from tests.test_chaos import inject

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(900)]

FAULTS = ((100, "worker_kill"), (250, "aggregator"), (400, "checkpointer"), (550, "coordinator"),
          (700, "worker_kill"), (850, "aggregator"))


def joins(run_dir: Path) -> list[dict]:
    """Every worker's "joined" log line (one per (re)join, carrying the transport it took per server)."""
    out = []
    for log in sorted((run_dir / "logs").glob("worker*.log")):
        for line in log.read_text().splitlines():
            if '"event": "joined"' in line:
                out.append(json.loads(line))
    return out


def shm_use(pid: int) -> tuple[set[str], set[str], int]:
    """(segments it holds a descriptor of, segments it maps, memfds) of a live process; empty if it is gone."""
    fds: set[str] = set()
    memfds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                fds |= {target.removesuffix(" (deleted)")} if target.startswith("/dev/shm/cmemi-") else set()
                memfds += target.startswith("/memfd:")
        maps = {line.split(None, 5)[5].removesuffix(" (deleted)") for line in
                Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/cmemi-" in line}
    except OSError:
        return set(), set(), 0
    return fds, maps, memfds


def check_live(c: Cluster) -> int:
    """Each live aggregator and worker: a descriptor only for a segment it maps, no memfd, maps within bounds (its
    own segment and the one it replaced, and its reader's limit: 2 * (workers + spares) + 2 at the leader, 4 at a
    worker). Returns how many segments they map (0 would make the check vacuous)."""
    mapped = 0
    for role, bound in (("aggregator", 2 + 2 * 3 + 2), ("worker", 2 + 4)):
        for ident, rec in c.members(role).items():
            fds, maps, memfds = shm_use(int(rec["pid"]))
            assert fds <= maps and memfds == 0 and len(maps) <= bound, (role, ident, fds, maps, memfds)
            mapped += len(maps)
    return mapped


def test_every_role_killed_over_ipc_same_bits_no_leaks(tmp_path: Path, reference: str) -> None:
    shm_before = sorted(os.listdir("/dev/shm"))
    rng = random.Random(31)
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=1", "checkpoint.every_steps=50",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.02}")
    try:
        sockets = c.run_dir / "ipc"
        poll(lambda: len(list(sockets.glob("aggregator-*.sock"))) == 1, 120, "the aggregator's ipc:// endpoint")
        mapped = 0
        for at, kind in FAULTS:
            poll(lambda at=at: c.step() >= at, 180, f"step {at}")
            mapped += check_live(c)
            inject(c, rng, kind)
    finally:
        rc = c.wait(timeout=600)
    assert rc == 0, c.output()
    assert mapped > 0  # the live processes were seen holding their slots
    assert c.summary["params_sha256"] == reference
    seen = joins(c.run_dir)
    killed_aggregators = sum(kind == "aggregator" for _, kind in FAULTS)
    assert len(seen) >= 2 * (1 + killed_aggregators), seen  # each worker joined each aggregator term
    assert all(j["transport"] == {"aggregator": "shm"} for j in seen), [j["transport"] for j in seen]
    # killed aggregators left their socket files; the next one swept them, the last one removed its own
    assert not sockets.exists() or list(sockets.iterdir()) == []
    assert sorted(os.listdir("/dev/shm")) == shm_before
