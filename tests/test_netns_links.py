"""Links and liveness across separate emulated hosts (issue 47). A blip fences no one: see the second test.

An outage costs its length, not twice it: the leader's port is down for D seconds on its own host
while a run trains across separate emulated hosts; no two consecutive steps are more than D + 2 s apart.

Without the link options (shared/runtime/links.py) nothing notices the dead connections: what was sent during the
outage waits for TCP's next retransmission, which backs off (0.2, 0.6, 1.4, 3.0, 6.2, 12.6 s ... after the first
loss), so training resumes at the first retransmission after the port is back: D = 4 gave 6.67 s without a step
(the one at 6.2 s), over the bound, where the options gave 4.30 s (a D just short of a retransmission, 13 s, came
out at 13.3 s either way). With them both ends give the connection up within T = max(1 s, cluster.dead_after / 2),
dial again every <= 0.25 s (a dial unanswered for 0.5 s is made again), and the worker's re-ask, queued
meanwhile, goes out as soon as the port is back.

Only the leader's port is blocked (iptables, each packet dropped where it arrives): its Redis heartbeat goes on,
so nothing is fenced and the measured gap is the links' alone. Needs root and working `ip netns` and `iptables`
(as tests/test_netns.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers import netns
from tests.helpers.netns_cluster import HostsRun
from tests.test_netns import Timer

pytestmark = [pytest.mark.integration, pytest.mark.fault]

STEPS = 900
OUTAGE_S = 4.0  # > T: the connections are given up and dialled again
SLACK_S = 2.0
SETS = (f"train.steps={STEPS}", f"scheduler.kwargs.T_max={STEPS}", "cluster.dead_after=1.0",
        "cluster.heartbeat_interval=0.1", "cluster.workers=2", "checkpoint.every_steps=0")
PLACEMENT = {"redis": "ctl", "coord": "ctl", "agg": "agg", "ckpt": "ckpt", "w0": "w0", "w1": "w1"}


@pytest.mark.timeout(600)
def test_a_leader_port_outage_stalls_training_for_its_length_only(lab: netns.NetLab, tmp_path: Path, capsys) -> None:
    timer = Timer()
    run = HostsRun(lab, tmp_path, SETS, PLACEMENT)
    run.start_all()
    port = run.leader_port()
    run.wait_step(100)
    timer.mark(f"training at step {run.step()}; blocking the leader's port {port} for {OUTAGE_S:g}s")
    t_cut = time.time()
    with run.port_blocked("agg", port):
        run.hold(OUTAGE_S)  # the outage's length is the point: the services are watched meanwhile
    t_back = time.time()
    timer.mark(f"port open again at step {run.step()}")
    run.wait_step(run.step() + 50, timeout=60)
    codes = run.finish()
    assert codes == {"agg": 0, "coord": 0, "w0": 0, "w1": 0}, f"{codes}{run.diagnostics()}"

    rows = run.metrics()
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1)), "a step was lost or redone"
    gaps = run.gaps()
    longest, at = max(gaps)
    stalled = max(g for g, s in gaps if rows[s - 1]["t"] >= t_cut)  # the step that ended the outage's stall
    with capsys.disabled():
        print(f"\n[links] leader port down {t_back - t_cut:.2f}s: longest gap between steps {longest:.2f}s "
              f"(before step {at}); bound {OUTAGE_S + SLACK_S:g}s", flush=True)
    assert stalled >= OUTAGE_S - 1.0, f"the outage did not stall training ({stalled:.2f}s): is the port the leader's?"
    assert longest <= OUTAGE_S + SLACK_S, f"{longest:.2f}s without a step for a {OUTAGE_S:g}s outage{run.diagnostics()}"
    assert not run.events("died") and not run.events("fenced"), "a port outage fenced a process"
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["params_sha256"] in run.reference(), "the result differs from `cmemi reference`"


BLIP_S = 3.0  # the Redis/coordinator host's cut: longer than cluster.dead_after (2 s), shorter than 5 s
BLIP_STEPS = 2000  # training goes on through the cut (50-250 steps/s here): the run outlasts it (100 + 3 s of steps)
BLIP_SETS = (f"train.steps={BLIP_STEPS}", f"scheduler.kwargs.T_max={BLIP_STEPS}", "cluster.workers=2",
             "checkpoint.every_steps=0")  # cluster.dead_after and heartbeat_interval at their defaults (2 s, 0.2 s)


@pytest.mark.timeout(600)
def test_a_blip_of_the_redis_host_fences_no_one(lab: netns.NetLab, tmp_path: Path, capsys) -> None:
    """A blip fences no one (issue 47): the host of Redis and the coordinator is cut off for 3 s, past
    cluster.dead_after, while a run trains. Every heartbeat expires at once; judged on them alone, every worker was
    fenced and exited with code 3. Now the coordinator sees that everyone fell silent at once, waits for the
    heartbeats to come back (services/coordinator/witnesses.py), and no one is declared dead or fenced; training
    goes on through the cut (the leader and the workers do not need Redis to train)."""
    timer = Timer()
    run = HostsRun(lab, tmp_path, BLIP_SETS, PLACEMENT)
    assert BLIP_S > run.cfg.cluster.dead_after
    run.start_all()
    run.wait_step(100)
    timer.mark(f"training at step {run.step()}; cutting the Redis/coordinator host for {BLIP_S:g}s")
    t_cut = time.time()
    with run.cut("coord"):
        run.hold(BLIP_S)
    t_back = time.time()
    timer.mark(f"the Redis/coordinator host is back, run at step {run.step()}")
    run.wait_step(min(run.step() + 100, BLIP_STEPS), timeout=120)
    codes = run.finish()
    assert codes == {"agg": 0, "coord": 0, "w0": 0, "w1": 0}, f"{codes}{run.diagnostics()}"  # 3 = fenced

    rows = run.metrics()
    during = [m["step"] for m in rows if t_cut <= m["t"] <= t_back]
    with capsys.disabled():
        print(f"\n[blip] Redis/coordinator host cut {t_back - t_cut:.2f}s: {len(during)} steps trained meanwhile, "
              f"{len(run.events('died'))} deaths, {len(run.events('fenced'))} fences", flush=True)
    assert not run.events("died") and not run.events("fenced"), run.diagnostics()
    assert during, "training stopped while the Redis host was cut off"
    assert [m["step"] for m in rows] == list(range(1, BLIP_STEPS + 1)), "a step was lost or redone"
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["params_sha256"] in run.reference(), "the result differs from `cmemi reference`"
