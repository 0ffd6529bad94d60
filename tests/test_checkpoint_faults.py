"""The aggregator, the checkpointer and Redis die mid-run; checkpoints get damaged. Nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from cmemi.services.checkpointer.store import CheckpointStore

from cmemi.launcher.redis_server import EmbeddedRedis
from tests.conftest import LONG, ROOT, cmemi_cmd, run_up
from tests.helpers.chaos import Cluster, poll

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def finished_like_reference(c: Cluster, rc: int, reference: str) -> dict:
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference
    return s


def test_aggregator_killed_several_times(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=50", "cluster.workers=2")
    kills = 0
    try:
        for target in (150, 500, 850):
            c.wait_step(target)
            c.replaced("aggregator", "0", c.signal("aggregator", "0"))  # restores the latest checkpoint
            kills += 1
    finally:
        rc = c.wait()
    s = finished_like_reference(c, rc, reference)
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 3 and all(step % 50 == 0 and step > 0 for step in restored)
    assert s["term"] > 1


def test_checkpointer_killed_during_writes(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=5", "checkpoint.keep_last=100000",
                "cluster.workers=2")
    store = CheckpointStore(c.run_dir / "checkpoints")
    problems: list[str] = []
    checked: list[int] = []
    stop = threading.Event()

    def watch_latest() -> None:  # `latest` must always name a checkpoint that verifies
        while not stop.is_set():
            try:
                latest = c.redis.get(c.keys.ckpt_latest)
            except redis.RedisError:
                return
            if latest is not None:
                problem = store.verify(store.root / f"step-{int(latest):08d}")
                if problem:
                    problems.append(f"latest={latest}: {problem}")
                checked.append(int(latest))
            stop.wait(0.01)

    watcher = threading.Thread(target=watch_latest, daemon=True)
    watcher.start()
    kills = 0
    try:
        for target in range(100, 1100, 120):
            c.wait_step(target)
            c.replaced("checkpointer", "0", c.signal("checkpointer", "0"))
            kills += 1
    finally:
        rc = c.wait()
        stop.set()
        watcher.join()
    finished_like_reference(c, rc, reference)
    assert not problems, problems[:5]
    # the watcher really saw the pointer move (how often depends on the machine: on a fast one training ends
    # within a few kills, and the rest land on the final checkpoint's writes)
    assert len(set(checked)) >= 3, sorted(set(checked))
    assert kills >= 7
    verify = subprocess.run(cmemi_cmd("checkpoints", "verify", str(c.run_dir)), cwd=ROOT, capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout[-2000:]
    assert not list((c.run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_newest_checkpoint_is_caught_and_skipped(tmp_path: Path, damage: str) -> None:
    sets = ("train.steps=300", "checkpoint.every_steps=50", "checkpoint.keep_last=3", "cluster.spare_workers=0")
    first = run_up(tmp_path / "run", *sets)
    assert first.rc == 0, first.stderr[-3000:]
    newest = first.run_dir / "checkpoints" / "step-00000300" / "model.safetensors"
    data = newest.read_bytes()
    newest.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]) if damage == "corrupt" else data[:-100])
    verify = subprocess.run(cmemi_cmd("checkpoints", "verify", str(first.run_dir)), cwd=ROOT, capture_output=True,
                            text=True)
    assert verify.returncode == 1 and "step      300: DAMAGED" in verify.stdout
    proc = subprocess.run([*cmemi_cmd("up", str(first.run_dir / "config.yaml")), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(x) for x in (first.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "checkpoint_damaged" and e["step"] == 300 for e in events)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_restored"] == [250]
    assert json.loads((first.run_dir / "summary.json").read_text())["params_sha256"] == first.summary["params_sha256"]


def test_redis_restarted_empty_mid_run(tmp_path: Path, reference: str) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        c = Cluster(tmp_path / "run", *LONG, f"cluster.redis={server.url}", "checkpoint.every_steps=100",
                    "cluster.workers=2")
        try:
            for target in (300, 800):
                c.wait_step(target)
                server.proc.kill()  # SIGKILL: no save, the data is gone
                server.proc.wait()
                server.start(port=server.port)  # comes back empty where everyone expects it
                c.redis = redis.Redis.from_url(server.url, decode_responses=True)
                poll(lambda: c.redis.exists(c.keys.aggregator) and c.redis.exists(c.keys.ckpt_latest), 30,
                     "re-registration and pointer rebuilt")
        finally:
            rc = c.wait()
        finished_like_reference(c, rc, reference)
    finally:
        server.stop()


def test_retention_after_a_long_run(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", "train.steps=300", "checkpoint.every_steps=10", "checkpoint.keep_last=3",
               "checkpoint.keep_every=100", "cluster.spare_workers=0")
    assert r.rc == 0, r.stderr[-3000:]
    steps = sorted(int(p.name.split("-")[1]) for p in (r.run_dir / "checkpoints").glob("step-*"))
    # the newest 3 (a snapshot may be skipped when a newer one replaces it unsent) + milestones 100, 200, 300
    assert len(steps) == 5 and {100, 200, 300} <= set(steps), steps
    assert all(s > 200 for s in steps if s % 100), steps


def test_ctrl_c_stops_everything_and_resume_finishes(tmp_path: Path, reference: str) -> None:
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=50", "cluster.workers=2")
    try:
        c.wait_step(400)
        c.proc.send_signal(signal.SIGINT)
        assert c.proc.wait(timeout=60) == 130
    finally:
        c.close()
    leftovers = subprocess.run(["pgrep", "-f", str(c.run_dir)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"orphan processes: {leftovers}"
    assert not any(os.path.exists(f"/proc/{p}") for p in leftovers)
    proc = subprocess.run([*cmemi_cmd("up", str(c.run_dir / "config.yaml")), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((c.run_dir / "summary.json").read_text())
    assert s["steps"] == 1200 and s["params_sha256"] == reference


def test_export_loads_with_plain_torch(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", "train.steps=20", "cluster.spare_workers=0")
    assert r.rc == 0
    for fmt, loader in (("safetensors", "from safetensors.torch import load_file as load; sd = load(p)"),
                        ("pt", "import torch; sd = torch.load(p, weights_only=True)")):
        out = tmp_path / f"w.{fmt}"
        exp = subprocess.run(cmemi_cmd("checkpoints", "export", str(r.run_dir), "--format", fmt, "-o", str(out)),
                             cwd=ROOT, capture_output=True, text=True)
        assert exp.returncode == 0, exp.stderr
        # a clean interpreter outside the project (-I: no cwd, no user site) loads it with torch alone
        code = f"p = {str(out)!r}; {loader}; print(sorted(sd))"
        probe = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
        assert probe.returncode == 0, probe.stderr
        assert "0.weight" in probe.stdout


def test_a_small_message_cap_sends_everything_in_parts(tmp_path: Path, reference: str) -> None:
    """cluster.max_message_bytes=65536, under digits' ~105 kB of parameters: gradients, parameters, snapshots
    and the restore after an aggregator SIGKILL can only travel in parts (a bigger message is never sent, and
    ZeroMQ would cut off its sender); a worker SIGKILL too. The run ends bitwise like the fault-free one with the
    default cap."""
    cap = 65536
    c = Cluster(tmp_path / "run", *LONG, "checkpoint.every_steps=50", "cluster.workers=2",
                f"cluster.max_message_bytes={cap}")
    try:
        c.wait_step(250)
        poll(lambda: int(c.redis.get(c.keys.ckpt_latest) or 0) >= 100, 60, "a checkpoint written from parts")
        c.replaced("aggregator", "0", c.signal("aggregator", "0"))  # its successor restores in parts
        c.wait_step(500)
        c.replaced("worker", "w0", c.signal("worker", "w0"))  # a gradient in parts may be cut short: never waited for
    finally:
        rc = c.wait()
    s = finished_like_reference(c, rc, reference)
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 1 and restored[0] >= 100 and restored[0] % 50 == 0, restored
    assert (c.run_dir / "model.safetensors").stat().st_size > cap  # it came as one snapshot, in parts
    # no part was ever malformed or too big (a transfer cut short by the kill may rightly be abandoned)
    reasons = {**s["dropped_messages"], **s["checkpointer_dropped_messages"]}
    malformed = {"part_order", "part_repeated", "unknown_transfer", "bad_range", "missing_bytes", "bad_length",
                 "bad_checksum", "too_big", "too_many_parts", "unexpected_part", "frame_count"}
    assert not malformed & set(reasons), reasons
