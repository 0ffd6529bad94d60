"""Streaming local steps keep each replica with the worker that holds its inner state (docs/design.md §10): the
leader leases a replica held by another live worker to nobody else (services/aggregator/leader/handout.py,
`Handout.placement`), so with no fault no inner state crosses the wire after the first round. Without that rule
(`avoid = set()`) a replica goes with its state to whoever asks first, and the run is still bitwise right — only
this count tells."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_up
from tests.test_local_steps import STREAM

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_streaming_with_two_workers_keeps_each_replica_with_its_holder(tmp_path: Path) -> None:
    """Measured (W = 2, 4 replicas, 36 segments): 0 states sent in every run; 13 and 29 with `avoid = set()`. A holder
    silent for a lease's timeout on a loaded machine may lose its replicas once: at most one state per replica."""
    r = run_up(tmp_path / "run", *STREAM, "cluster.workers=2")
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["steps"] == 36, r.summary
    assert r.summary["inner_states_sent"] <= 4, r.summary
