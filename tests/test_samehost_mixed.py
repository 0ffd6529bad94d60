"""Mixed placements in one run: two workers on the servers' host take ipc://, one on another host takes CurveZMQ.

The servers (Redis, the coordinator, the checkpointer, the leader and shard 1 of `cluster.shards: 2`) and workers
w0, w1 share one network namespace, "srv"; w2 runs alone in "far". Each worker must reach the leader and shard 1
by the transport its placement calls for, and the run must end bitwise equal to `cmemi reference`. Needs root and
`ip netns` (tests/helpers/netns.py); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from cmemi.shared.config.loading import dump_config, load_config
from cmemi.shared.wire.security import generate

from cmemi.launcher.redis_server import redis_server_binary
from tests.conftest import DIGITS, ROOT, cmemi_cmd
from tests.helpers import netns

pytestmark = [pytest.mark.integration]

STEPS = 300
SETS = (f"train.steps={STEPS}", f"scheduler.kwargs.T_max={STEPS}", "cluster.workers=3", "cluster.shards=2",
        "checkpoint.every_steps=0", "cluster.spare_workers=0")


def joins(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if '"event": "joined"' in line]


@pytest.mark.timeout(600)
def test_same_host_workers_take_ipc_remote_one_takes_curve_same_bits(lab: netns.NetLab, tmp_path: Path) -> None:
    run_dir, logs, keys = tmp_path / "run", tmp_path / "logs", tmp_path / "keys"
    run_dir.mkdir()
    logs.mkdir()
    generate(keys)
    cfg = load_config(DIGITS, [*SETS, f"run.name=mixed-{secrets.token_hex(4)}", f"run.dir={run_dir}",
                               f"security.keys_dir={keys}"])
    cfg_path = tmp_path / "cluster.yaml"
    cfg_path.write_text(dump_config(cfg))
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    srv, far = lab.host("srv", 2), lab.host("far", 3)

    password = secrets.token_hex(16)
    lab.start(srv, [redis_server_binary(), "--port", "6379", "--bind", srv.ip, "--requirepass", password, "--save", "",
                    "--appendonly", "no", "--dir", str(tmp_path)], logs / "redis.log")
    lab.reach(far, srv, 6379)
    env = {**os.environ, "CMEMI_REDIS_URL": f"redis://:{password}@{srv.ip}:6379/0"}
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, host: netns.Host, role: str, *extra: str) -> None:
        argv = [sys.executable, "-m", "cmemi", role, "--config", str(cfg_path), "--set", f"cluster.host={host.ip}",
                *extra]
        procs[name] = lab.start(host, argv, logs / f"{name}.log", cwd=ROOT, env=env)

    start("coord", srv, "coordinator", "--supervise", "none")
    start("ckpt", srv, "checkpointer")
    start("agg0", srv, "aggregator")
    start("agg1", srv, "aggregator", "--shard", "1")
    for wid in ("w0", "w1"):
        start(wid, srv, "worker", "--worker-id", wid)
    start("w2", far, "worker", "--worker-id", "w2")

    def diagnostics() -> str:
        return "".join(f"\n---- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))

    rc = netns.wait_all(procs, ["agg0", "w0", "w1", "w2"], 420, diagnostics)
    assert rc["agg0"] == 0, diagnostics()
    ipc = {"aggregator": "shm", "shard1": "shm"}  # over ipc:, tensors in shared-memory slots
    tcp = {"aggregator": "tcp", "shard1": "tcp"}
    for wid, want in (("w0", ipc), ("w1", ipc), ("w2", tcp)):
        seen = joins(logs / f"{wid}.log")
        assert seen and all(j["transport"] == want for j in seen), (wid, [j["transport"] for j in seen])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    ref = subprocess.run(cmemi_cmd("reference", str(cfg_path), "--set", f"run.dir={tmp_path / 'ref'}"), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert summary["params_sha256"] in ref.stdout, (summary["params_sha256"], ref.stdout[-500:])
