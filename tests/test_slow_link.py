"""A slow link is progress, not silence (issue 32): each worker is a host of its own behind a link shaped with
`tc tbf`, so slow that one parameter set takes longer to arrive than a worker waits before it asks again
(2 x cluster.dead_after). The worker re-asks; the leader, whose last work to it is still unanswered, answers
`pending` instead of releasing the lease and queuing a second parameter set behind the first (the resend storm
that made K = 1, N = 8 at 50 Mbit/s take 37-59 s a step). Shown: the re-asks happened, no parameter set was
sent twice to a worker (`duplicate_param_sends`, counted by the leader), and the result is `cmemi reference`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cmemi.shared.config.loading import dump_config, load_config

from tests.conftest import DIGITS, ROOT
from tests.helpers import netns
from tests.test_netns import Timer, poll, read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.fault]

STEPS = 3
HIDDEN = 1024  # the digits MLP 64-1024-1024-10: 1.12 M parameters, 4.5 MB in fp32
RATE = "6mbit"  # 0.75 MB/s each way: one parameter set takes ~6 s, over the 4 s a worker waits before re-asking
SETS = (f"model.kwargs.hidden={HIDDEN}", f"train.steps={STEPS}", f"scheduler.kwargs.T_max={STEPS}",
        "cluster.workers=2", "cluster.dead_after=2.0", "cluster.spare_workers=0", "checkpoint.every_steps=0",
        "security.curve=false")


@pytest.mark.timeout(420)
def test_a_parameter_set_slower_than_the_patience_is_sent_once(lab: netns.NetLab, tmp_path: Path, capsys) -> None:
    from cmemi.launcher.redis_server import redis_server_binary

    timer = Timer()
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    run_dir.mkdir()
    logs.mkdir()
    cfg = load_config(DIGITS, [*SETS, "run.name=slowlink", f"run.dir={run_dir}"])
    cfg_path = tmp_path / "cluster.yaml"
    cfg_path.write_text(dump_config(cfg))
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    assert cfg.cluster.dead_after * 2 == 4.0

    srv, w0, w1 = lab.host("srv", 2), lab.host("w0", 3), lab.host("w1", 4)
    for h in (w0, w1):
        lab.shape(h, RATE)
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    password = "slowlink-" + os.urandom(8).hex()
    lab.start(srv, [redis_server_binary(), "--port", "6379", "--bind", srv.ip, "--requirepass", password, "--save", "",
                    "--appendonly", "no", "--dir", str(redis_dir), "--logfile", str(redis_dir / "redis.log")],
              logs / "redis.log")
    poll(lambda: "Ready to accept" in ((redis_dir / "redis.log").read_text()
                                      if (redis_dir / "redis.log").is_file() else ""), 30, "redis-server ready")
    url = f"redis://:{password}@{srv.ip}:6379/0"
    for h in (w0, w1):
        lab.reach(h, srv, 6379)
    timer.mark(f"hosts up; w0 and w1 behind {RATE} links")

    def start(role: str, host: netns.Host, *extra: str, log: str):
        argv = [sys.executable, "-m", "cmemi", role, "--config", str(cfg_path), "--set", f"cluster.host={host.ip}",
                *extra]
        return lab.start(host, argv, logs / f"{log}.log", cwd=ROOT, env={**os.environ, "CMEMI_REDIS_URL": url})

    procs = {"coord": start("coordinator", srv, "--supervise", "none", log="coord"),
             "ckpt": start("checkpointer", srv, log="ckpt"),
             "w0": start("worker", w0, "--worker-id", "w0", log="w0"),
             "w1": start("worker", w1, "--worker-id", "w1", log="w1"),
             "agg": start("aggregator", srv, log="agg")}

    def diagnostics() -> str:
        out = ["", "exit codes " + ", ".join(f"{k}={p.poll()}" for k, p in procs.items())]
        for f in sorted(logs.glob("*.log")):
            out.append(f"---- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    codes = netns.wait_all(procs, ["agg", "w0", "w1", "coord"], 300, diagnostics)
    assert codes == {"agg": 0, "w0": 0, "w1": 0, "coord": 0}, f"{codes}{diagnostics()}"
    timer.mark("run completed")

    reference = subprocess.run([sys.executable, "-m", "cmemi", "reference", str(cfg_path)], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    reasks = sum(e.get("event") == "no reply; asking again" for w in ("w0", "w1")
                 for e in read_jsonl(logs / f"{w}.log"))
    died = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] in ("died", "fenced")]
    with capsys.disabled():
        print(f"\n[slow link] {STEPS} steps at {RATE}: {reasks} re-asks, "
              f"duplicate_param_sends {summary['duplicate_param_sends']}, bytes to workers "
              f"{summary['bytes_received']:,}, wall {summary['wall_s']:.1f} s", flush=True)
    assert reasks >= 1, "no worker waited longer than its patience: make the link slower" + diagnostics()
    assert summary["duplicate_param_sends"] == 0, diagnostics()
    assert died == [], died  # slow, not dead
    assert summary["params_sha256"] in reference.stdout, reference.stdout[-500:]
