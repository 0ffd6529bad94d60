"""The 300-fault soak's stall (issue 47), across emulated hosts: shard 1 of K = 2 SIGSTOPped while what arrives at the
checkpointer's host is lost (a one-way cut), then both healed. The step log's entries sent into the cut must get
there once it heals (the link given up and dialled again, the entries unacknowledged sent again: steplog/link.py),
so training moves again within RESUMES_S of the heal, with no step logged twice and params_sha256 equal to
`cmemi reference` (tests/test_partitions.py's `partitioned` checks the rest). Before the fix, an entry lost with its
connection was sent again only to a restarted checkpointer, and the leader's ack of its step never came (the soak:
no step for two minutes, then "the checkpointer did not answer the step log entry" after ACK_TIMEOUT_S).
Needs root, `ip netns` and `iptables` (as tests/test_netns.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import netns
from tests.helpers.netns_faults import Fault, Faults
from tests.test_netns import poll
from tests.test_partitions import partitioned

pytestmark = [pytest.mark.integration, pytest.mark.fault]

STOP_S = 0.8  # shard 1 stopped: under cluster.dead_after (1 s), so it is not replaced
CUT_S = 2.5  # what the servers' hosts send the checkpointer's lost: past the link timeout T (1 s), so those links are
# given up (from the servers' hosts only: cut from Redis past cluster.dead_after, it would be declared dead, and the
# orchestrator here replaces servers only)
RESUMES_S = 20.0  # a step after the heal within this: T + a resend (2 T) + slack for a loaded machine
healed_after: list[float] = []  # seconds from the heal to the next step committed


@contextlib.contextmanager
def stop_shard_then_cut_into_the_checkpointer(f: Faults) -> Iterator[None]:
    """Both faults and their heal happen on entry; then the next step is waited for (`healed_after`), and the rest of
    the `partitioned` outage passes with every link up."""
    end = time.monotonic() + CUT_S
    ckpt = f.host("ckpt")
    with f.drops([(ckpt, ["-s", f.host(k).ip]) for k in ("agg", "agg1")]):  # one way: into the checkpointer's host
        with f.stop(Fault("stop", "agg1", STOP_S)):
            poll(lambda: time.monotonic() >= end - CUT_S + STOP_S, STOP_S + 5, "shard 1's stop")
        poll(lambda: time.monotonic() >= end, CUT_S + 5, "the cut")
    healed, t0 = f.run.step(), time.monotonic()
    poll(lambda: f.run.step() > healed, RESUMES_S, f"a step after the heal (at step {healed})", f.run.diagnostics)
    healed_after.append(time.monotonic() - t0)
    yield


@pytest.mark.timeout(300)
def test_shard_stopped_and_the_checkpointers_host_cut_one_way_then_training_moves_again(
        lab: netns.NetLab, tmp_path: Path, capsys) -> None:
    out = partitioned(lab, tmp_path, capsys, 2, stop_shard_then_cut_into_the_checkpointer,
                      "shard 1 SIGSTOPped, the checkpointer's host cut one way (in), both healed")
    with capsys.disabled():
        print(f"[partition] a step {healed_after[-1]:.2f}s after the heal", flush=True)
    assert out["checks"]["steps_logged_twice"] == 0, f"steps logged twice: {out['checks']}"
