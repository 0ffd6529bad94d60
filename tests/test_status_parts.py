"""`cmemi status`'s parts on their own: the metrics readers (a file being written, a cut tail), the rates, the
Redis label that never shows a password, and the loose values both sources read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cmemi.commands.status.files import rates, read_events_file, read_metrics
from cmemi.commands.status.render import human_bytes
from cmemi.commands.status.target import StatusError, Target, redis_label, schedule
from cmemi.commands.status.values import natural_key, number


def test_read_metrics_skips_a_line_being_written_and_the_cut_line_of_a_tail(tmp_path: Path) -> None:
    rows = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(50)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 50, "lo')  # the aggregator is writing line 51
    assert read_metrics(tmp_path) == rows
    tail = read_metrics(tmp_path, tail_bytes=200)
    assert tail and tail == rows[-len(tail):] and len(tail) < 50  # whole lines only
    assert read_metrics(tmp_path / "nowhere") == []


def test_read_events_file_sorts_by_time_and_skips_what_is_not_an_event(tmp_path: Path) -> None:
    lines = [{"t": 2, "kind": "b"}, {"t": 1, "kind": "a"}, {"t": 3}, [1, 2]]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    assert [e["kind"] for e in read_events_file(tmp_path)] == ["a", "b"]


def test_rates_weigh_each_step_by_its_time() -> None:
    rows = [{"loss": 1, "step_time_s": 1.0, "samples_per_s": 100, "bytes_in": 50, "bytes_out": 50},
            {"loss": 1, "step_time_s": 3.0, "samples_per_s": 300, "bytes_in": 0, "bytes_out": 400},
            {"eval": {"accuracy": 0.5}}]  # not a step
    assert rates(rows) == (pytest.approx(250.0), pytest.approx(125.0))
    assert rates(rows, window=1) == (pytest.approx(300.0), pytest.approx(400 / 3))
    assert rates([{"loss": 1, "step_time_s": 1.0, "samples_per_s": 10}]) == (10.0, None)  # no byte counts logged
    assert rates([]) == (None, None)


def test_the_redis_label_never_shows_the_password() -> None:
    assert redis_label("redis://:hunter2@10.0.0.5:6380/3") == "10.0.0.5:6380/3"
    assert redis_label("redis://localhost") == "localhost:6379/0"


def test_a_target_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(StatusError, match="cluster.json not found"):
        Target(tmp_path)
    with pytest.raises(StatusError, match="pass --run NAME"):
        Target(None, "redis://localhost:6379/0")
    (tmp_path / "config.yaml").write_text("run: {name: from-config}\ntrain: {steps: 120, local_steps: 4}\n")
    (tmp_path / "cluster.json").write_text(json.dumps({"redis": "redis://localhost:1/0"}))
    target = Target(tmp_path)
    assert target.run == "from-config" and target.from_cluster_json
    assert schedule(tmp_path) == (30, 4)  # with local steps a step of the servers is a round


def test_loose_values() -> None:
    assert (number("3.0", int), number("x"), number(None), number(""), number("0.5")) == (3, None, None, None, 0.5)
    assert sorted(["w10", "w2", "spare1", "w1"], key=natural_key) == ["spare1", "w1", "w2", "w10"]
    assert (human_bytes(None), human_bytes(999), human_bytes(1500), human_bytes(2.5e9)) == (
        "-", "999 B/s", "1.5 kB/s", "2.5 GB/s")
