"""Unit tests of the fencing checks the partition tests and the soak read metrics.jsonl with
(tests/helpers/netns_checks.py): each rule found broken on a hand-made log, and a clean log passing; and which
fallbacks count as a double fault after a checkpointer's restart."""

from __future__ import annotations

from tests.helpers.netns_checks import fencing, log_lost_redone


def line(step: int, term: int, loss: float = 1.0) -> dict:
    return {"step": step, "loss": loss + step, "term": term, "t": 0.0}


def test_a_clean_log_with_a_restart_counts_the_redone_steps() -> None:
    rows = [line(s, 1) for s in range(1, 6)] + [line(s, 2) for s in range(4, 9)]
    rows.insert(3, {"step": 3, "eval": {"loss": 0.5}, "t": 0.0})  # evaluation lines are not steps
    out = fencing(rows, 8)
    assert out["violations"] == []
    assert out["steps_redone"] == 2 and out["steps_logged_twice"] == 2 and out["terms"] == [1, 2]


def test_a_deposed_leader_committing_after_its_successor_is_found() -> None:
    rows = [line(1, 1), line(2, 1), line(1, 2), line(3, 1), line(2, 2), line(3, 2)]
    assert fencing(rows, 3)["violations"] == ["step 3 committed under term 1 after term 2 took over"]


def test_two_results_for_one_step_are_found() -> None:
    rows = [line(1, 1), line(2, 1), line(2, 2, loss=9.0)]
    out = fencing(rows, 2)
    assert len(out["violations"]) == 1 and "different losses under terms [1, 2]" in out["violations"][0]


def test_a_lost_step_and_a_line_without_term_are_found() -> None:
    rows = [line(1, 1), {"step": 3, "loss": 1.0, "t": 0.0}]
    out = fencing(rows, 3)
    assert "line 2 (step 3) has no term" in out["violations"]
    assert "1 steps never logged (first [2])" in out["violations"]


def test_a_deposed_leader_committing_after_a_newer_term_started_is_found() -> None:
    rows = [{**line(s, 1), "t": float(s)} for s in range(1, 6)] + [{**line(s, 2), "t": 10.0 + s} for s in range(3, 6)]
    events = [{"kind": "aggregator_started", "term": 1, "t": 0.0}, {"kind": "aggregator_started", "term": 2, "t": 3.5}]
    out = fencing(rows, 5, events)
    assert out["violations"] == ["2 steps committed under term 1 after a newer term's leader started (steps 4..5)"]
    assert fencing(rows, 5, events[:1])["violations"] == []  # without the takeover's time only the order is checked


def ckpt_start() -> dict:
    return {"kind": "startup", "role": "checkpointer"}


def redone(steps: int) -> dict:
    return {"kind": "steps_redone", "steps": steps}


def test_a_checkpointer_restart_whose_spool_held_the_log_is_no_double_fault() -> None:
    """Issue 47: the step log is read back after the checkpointer's restart; a server's fallback after it is counted
    as a double fault only when the read-back lost entries, Redis lost the run (no read-back), or there was none."""
    first = [ckpt_start(), {"kind": "step_log_recovered", "read_back": False, "lost": 0}]  # the run's start
    intact = [ckpt_start(), {"kind": "step_log_recovered", "read_back": True, "lost": 0}]
    cut = [ckpt_start(), {"kind": "step_log_recovered", "read_back": True, "lost": 2}]
    unread = [ckpt_start(), {"kind": "step_log_recovered", "read_back": False, "lost": 0}]
    assert log_lost_redone([*first, redone(5)]) == {"events": 0, "steps": 0, "all_events": 1}
    assert log_lost_redone([*first, *intact, redone(5)]) == {"events": 0, "steps": 0, "all_events": 1}
    assert log_lost_redone([*first, *cut, redone(5)]) == {"events": 1, "steps": 5, "all_events": 1}
    assert log_lost_redone([*first, *unread, redone(5)]) == {"events": 1, "steps": 5, "all_events": 1}
    assert log_lost_redone([*first, ckpt_start(), redone(7)])["events"] == 1  # no spool: a restart loses the log
    covered = [*first, *cut, {"kind": "checkpoint_saved"}, redone(3)]
    assert log_lost_redone(covered)["events"] == 0  # a checkpoint after the restart covers what was lost
