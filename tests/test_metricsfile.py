"""metrics.jsonl with two leaders appending at once (services/aggregator/common/metricsfile.py): a deposed leader
that logs the step it had shipped after losing its term, and its successor, which replayed that step from the step
log (tests/test_partitions.py, partition (b), logged that step twice). Real files, two writers as two leaders hold
them; each case in both orders."""

from __future__ import annotations

import json
from pathlib import Path

from cmemi.services.aggregator.common.metricsfile import MetricsFile


def line(step: int, term: int, **more: object) -> dict:
    return {"step": step, "loss": 1.0 / step, "term": term, **more}


def steps(path: Path) -> list[tuple[int, int]]:
    """(step, term) of each step line, in order."""
    rows = [json.loads(t) for t in path.read_text().splitlines()]
    return [(r["step"], r["term"]) for r in rows if "eval" not in r]


def test_the_deposed_leaders_line_of_a_step_its_successor_replayed_and_logged_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    old, new = MetricsFile(path, 1), MetricsFile(path, 2)
    assert all(old.append(line(s, 1)) for s in (8, 9))
    assert new.append(line(10, 2, replayed=True), replayed=True)  # the successor replayed 10: no line of it yet
    assert new.append(line(11, 2))
    assert not old.append(line(10, 1)), "step 10's ack came after its leader lost its term: logged by the newer one"
    assert old.append(line(12, 1)), "past what the newer term logged: written, for the fencing checks to see"
    assert steps(path) == [(8, 1), (9, 1), (10, 2), (11, 2), (12, 1)]
    old.close()
    new.close()


def test_a_replayed_steps_line_is_not_written_when_its_deposed_leader_logged_it_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    old, new = MetricsFile(path, 1), MetricsFile(path, 2)
    assert old.append(line(9, 1))
    # the successor read the file's last step (9) when its replay started; the deposed leader logs 10 now
    assert old.append(line(10, 1))
    assert not new.append(line(10, 2, replayed=True), replayed=True)
    assert new.append(line(11, 2))
    assert steps(path) == [(9, 1), (10, 1), (11, 2)]
    old.close()
    new.close()


def test_steps_a_newer_term_trains_again_and_evaluations_are_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    old, new = MetricsFile(path, 1), MetricsFile(path, 2)
    assert all(old.append(line(s, 1)) for s in (4, 5, 6))
    assert new.append(line(5, 2)), "back to a checkpoint (a double fault): step 5 trained again is a new result"
    assert new.append({"step": 5, "eval": {"loss": 0.5}, "term": 2})
    assert old.append({"step": 6, "eval": {"loss": 0.4}, "term": 1})
    assert steps(path) == [(4, 1), (5, 1), (6, 1), (5, 2)]
    assert sum(1 for t in path.read_text().splitlines() if "eval" in json.loads(t)) == 2
    old.close()
    new.close()
