"""The checkpoint disk fills up; the checkpointer restarts on a fixed port. Nothing is lost."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import LONG
from tests.helpers.chaos import Cluster, poll

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(500)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_full_disk_stops_cleanly_then_resume_with_checkpointer_restarts_on_a_fixed_port(
        tmp_path: Path, reference: str) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    # ~210 kB per checkpoint (weights + momentum): 1 MB holds four, keep_last=10 wants more
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(ckpts)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        sets = (*LONG, "cluster.workers=2", "checkpoint.every_steps=20", "checkpoint.keep_last=10")
        c = Cluster(run_dir, *sets)
        rc = c.wait(timeout=240)
        out = c.output()
        assert rc == 2, out
        line = [x for x in out.splitlines() if x.startswith("cmemi: error:")][-1]
        assert line.startswith("cmemi: error: disk full writing checkpoint of step "), out
        assert f"to {ckpts}: need " in line and " MB, " in line and " free" in line and "--resume" in line
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        assert not any(e["kind"] == "restarted" and e["role"] == "checkpointer" for e in events), "a crash loop"
        stopped_at = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*"))
        # room again; resume, with the checkpointer on a fixed port, killed twice
        subprocess.run(["mount", "-o", "remount,size=64M", str(ckpts)], check=True)
        port = free_port()
        c = Cluster(run_dir, *sets, f"cluster.checkpointer_port={port}", flags=("--resume",))
        try:
            c.wait_step(stopped_at + 100)
            for _ in range(2):
                latest = int(c.redis.get(c.keys.ckpt_latest) or 0)
                c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
                assert c.members("checkpointer")["0"]["addr"].endswith(f":{port}")
                # checkpoints go on after the restart at the same address
                poll(lambda latest=latest: int(c.redis.get(c.keys.ckpt_latest) or 0) >= latest + 60, 90,
                     "checkpoints after a checkpointer restart on a fixed port")
        finally:
            rc = c.wait()
        assert rc == 0, c.output()
        s = c.summary
        assert s["steps"] == 1200 and s["params_sha256"] == reference
    finally:
        subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)
