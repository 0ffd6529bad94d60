"""samples/s: samples trained ÷ training wall seconds over an interval (the progress line's definition)."""

from __future__ import annotations

import pytest
from cmemi.services.aggregator.leader.throughput import Throughput


def test_window_rate_and_whole_run() -> None:
    t = Throughput(global_batch=64, window=1.0)
    assert t.rate(10, 0.5) == pytest.approx(10 * 64 / 0.5)  # first call: the run so far
    assert t.rate(20, 1.0) == pytest.approx(10 * 64 / 0.5)  # since the mark (10, 0.5)
    assert t.rate(40, 1.6) == pytest.approx(30 * 64 / 1.1)  # window passed: mark moves to (40, 1.6)
    assert t.rate(50, 1.8) == pytest.approx(10 * 64 / 0.2)
    assert t.rate(60, 4.0, whole_run=True) == pytest.approx(60 * 64 / 4.0)  # = summary.json's figure


def test_restored_run_counts_earlier_terms() -> None:
    t = Throughput(global_batch=32)
    assert t.rate(200, 10.0) == pytest.approx(200 * 32 / 10.0)  # step and wall both include earlier terms
    assert t.rate(200, 10.0) == 0.0  # no time passed since the mark
