"""Each event once: a run whose coordinator is SIGKILLed three times (and a worker once, under a restarted
coordinator) ends with every event of its Redis stream exactly once in events.jsonl and each death once in
`cmemi events`. Before, each restarted coordinator appended the whole stream again (one run held 1,805 lines
for 702 events, `cmemi events` listed 96 deaths for 37)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import LONG, ROOT
from tests.helpers.chaos import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.mark.timeout(600)
def test_each_event_once_after_three_coordinator_kills(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "run", *LONG, "cluster.workers=2", "cluster.spare_workers=0")
    try:
        c.wait_step(50)
        c.replaced("coordinator", "0", c.signal("coordinator", "0"))
        c.replaced("worker", "w0", c.signal("worker", "w0"))  # a death the restarted coordinator declares
        for _ in range(2):
            c.wait_step(c.step() + 20)
            c.replaced("coordinator", "0", c.signal("coordinator", "0"))
        c.wait_step(c.step() + 20)
        stream = [entry_id for entry_id, _fields in c.redis.xrange(c.keys.events)]  # before the run ends
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    lines = [json.loads(line) for line in (c.run_dir / "events.jsonl").read_text().splitlines()]
    sids = [e["sid"] for e in lines]
    repeated = {sid: n for sid, n in Counter(sids).items() if n > 1}
    assert not repeated, f"{len(repeated)} events copied more than once, of {len(set(sids))}"
    assert set(stream) <= set(sids), "an event of the stream is missing from the file"
    bodies = Counter(json.dumps({k: v for k, v in e.items() if k != "sid"}, sort_keys=True) for e in lines)
    assert max(bodies.values()) == 1, "the same event written twice under two ids"
    kinds = Counter(e["kind"] for e in lines)
    assert kinds["coordinator_started"] == 4, kinds  # the first and three restarts
    assert kinds["fault_injected"] == 4, kinds
    worker_deaths = [e for e in lines if e["kind"] == "died" and e["role"] == "worker"]
    assert [e["id"] for e in worker_deaths] == ["w0"], worker_deaths

    out = subprocess.run([sys.executable, "-m", "cmemi", "events", str(c.run_dir), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["role"], r["id"]) for r in rows if r["role"] == "worker"] == [("worker", "w0")], rows
    assert len(rows) == len([e for e in lines if e["kind"] == "died"]), rows
