"""A slow host costs its share (issue 48; services/aggregator/common/pace.py): a real `cmemi up` of streaming local
steps, two workers, worker w1's compute thirty times slower (tests/helpers/fixtures.py's `slow_host_mlp`). The leader
takes w1's replicas to w0, with their states (and a replay), and the result is still bitwise `cmemi reference`'s. The
same run with `cluster.pace_replicas=false` is the contrast: w1 keeps its half of the replicas to the end (each replica
stays with its holder), so only the policy moves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_up
from tests.test_local_steps import STREAM, reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SLOW = (*STREAM, "cluster.workers=2", "model.factory=tests.helpers.fixtures:slow_host_mlp",
        "model.kwargs={pace: 0.01, slow: w1, factor: 30.0}")


def test_a_slow_workers_replicas_move_to_the_fast_one_and_the_result_is_the_reference(tmp_path: Path) -> None:
    want = reference(tmp_path, *SLOW)["params_sha256"]
    on = run_up(tmp_path / "on", *SLOW, timeout=400)
    assert on.rc == 0, on.stderr[-3000:]
    s = on.summary
    assert s["steps"] == 36 and s["params_sha256"] == want, (s, want)
    by = s["replicas_by_worker"]
    assert sum(by.values()) >= 36 * 4, by  # every replica's every segment, by someone (a duplicate counts once each)
    assert s["replica_share_cuts"] >= 1 and by.get("w1", 0) < by["w0"] / 3, s
    shares = [e for e in on.events() if e["kind"] == "replica_share"]
    assert shares and all(e["worker"] == "w1" for e in shares), shares
    assert 1 <= s["inner_states_sent"] <= 4, s  # a moved replica's state went down to w0 once (measured: 1)

    off = run_up(tmp_path / "off", *SLOW, "cluster.pace_replicas=false", timeout=400)
    assert off.rc == 0, off.stderr[-3000:]
    assert off.summary["params_sha256"] == want
    by_off = off.summary["replicas_by_worker"]
    assert off.summary["replica_share_cuts"] == 0 and by_off.get("w1", 0) >= sum(by_off.values()) / 4, by_off
    assert not [e for e in off.events() if e["kind"] == "replica_share"]
