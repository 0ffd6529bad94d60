"""RUN_DIR/prometheus/targets.json from the run's member records, against a real redis-server: every advertised
endpoint in Prometheus's file_sd format, labelled; a cleanly stopped service left out; a killed one kept until its
replacement registers under its id; the file rewritten (atomically) only when it changes."""

from __future__ import annotations

import json
from pathlib import Path

from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect

from cmemi.launcher.prometheus_targets import TargetsFile


def record(client, keys: Keys, role: str, ident: str, inc: int, port: int | None, state: str = "running") -> None:
    rec = {"role": role, "id": ident, "incarnation": str(inc), "state": state, "pid": "1"}
    if port is not None:
        rec["metrics_url"] = f"http://127.0.0.1:{port}/metrics"
    client.hset(keys.member(role, ident), mapping=rec)


def test_targets_follow_the_member_records(redis_server, tmp_path: Path) -> None:
    client, keys = connect(redis_server.url), Keys("r1")
    record(client, keys, "aggregator", "0", 1, 9101)
    record(client, keys, "worker", "w0", 2, 9102)
    record(client, keys, "worker", "w1", 3, 9103, state="stopped")  # left cleanly (cmemi scale down)
    record(client, keys, "checkpointer", "0", 4, None)  # metrics.enabled off where it runs: nothing to scrape
    record(client, Keys("other"), "worker", "w0", 1, 9999)  # another run's records in the same Redis stay out
    f = TargetsFile(tmp_path, client, keys, "r1")
    f.refresh()
    path = tmp_path / "prometheus" / "targets.json"
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9101"],
         "labels": {"job": "cmemi", "run": "r1", "role": "aggregator", "id": "0", "incarnation": "1"}},
        {"targets": ["127.0.0.1:9102"],
         "labels": {"job": "cmemi", "run": "r1", "role": "worker", "id": "w0", "incarnation": "2", "worker": "w0"}}]
    inode = path.stat().st_ino
    f.refresh()
    assert path.stat().st_ino == inode  # unchanged: not rewritten
    # w0 killed: its record stays (Prometheus shows the target down) until the replacement registers under w0
    record(client, keys, "worker", "w0", 5, 9105)
    f.refresh()
    groups = json.loads(path.read_text())
    assert [g["targets"] for g in groups] == [["127.0.0.1:9101"], ["127.0.0.1:9105"]]
    assert groups[1]["labels"]["incarnation"] == "5" and path.stat().st_ino != inode  # a new file, renamed in place
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]  # no temporary file left beside it


def test_redis_away_keeps_the_file(tmp_path: Path, redis_server) -> None:
    client, keys = connect(redis_server.url), Keys("r1")
    record(client, keys, "aggregator", "0", 1, 9101)
    f = TargetsFile(tmp_path, client, keys, "r1")
    f.refresh()
    before = (tmp_path / "prometheus" / "targets.json").read_text()
    redis_server.stop()
    f.refresh()  # no error: the last known targets stay
    assert (tmp_path / "prometheus" / "targets.json").read_text() == before
