"""`cmemi dashboard` in a real headless Chromium during a live `cmemi up` in which a worker is SIGKILLed: the same
open page (never reloaded) shows the step advancing, then the death and the replacement within seconds, then the
step advancing again. The page is read through its DOM ids and data-attributes, never its pixels; a screenshot and
the DOM at the end are kept (under $CMEMI_TEST_ARTIFACTS if set, else the test's tmp_path; their paths printed)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cmemi.commands.dashboard.access import Access
from cmemi.commands.dashboard.server import DashboardServer
from cmemi.commands.dashboard.snapshot import Dashboard
from tests.conftest import LONG, ROOT, cmemi_cmd
from tests.helpers.browser import Browser
from tests.helpers.chaos import Cluster, poll
from tests.test_status_plot import write_run_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # real Chromium processes (and a real run)

STEPS = 3000  # far more than the test watches (it stops the run once it has seen the replacement train)
DOM_S = 60.0  # deadline for each thing the page must show; measured times are printed

# One read of the page: what the test checks, as the page's DOM has it.
READ = """(() => {
  if (!document.getElementById('step')) {  // still about:blank, or loading
    return {polls: 0, step: -1, state: '', lossPoints: 0, lossLastStep: -1, markers: 0, evalPoints: 0,
            checkpoints: [], workers: {}, events: []};
  }
  const rows = [...document.querySelectorAll('#workers tbody tr')];
  return {
    polls: Number(document.body.dataset.polls),
    step: Number(document.getElementById('step').dataset.step || -1),
    state: document.getElementById('state').dataset.state,
    lossPoints: Number(document.getElementById('curve-loss').dataset.points),
    lossLastStep: Number(document.getElementById('curve-loss').dataset.lastStep || -1),
    markers: Number(document.getElementById('curve-loss').dataset.markers),
    evalPoints: Number(document.getElementById('curve-eval').dataset.points),
    checkpoints: [...document.querySelectorAll('#checkpoints tbody tr')].map((r) => Number(r.dataset.step)),
    workers: Object.fromEntries(rows.map((r) => [r.dataset.worker,
      {state: r.dataset.state, incarnation: Number(r.dataset.incarnation), host: r.dataset.host}])),
    events: [...document.querySelectorAll('#events li')].map((li) => ({kind: li.dataset.kind, id: li.dataset.id,
      incarnation: li.dataset.incarnation === undefined ? null : Number(li.dataset.incarnation)})),
  };
})()"""


def artifacts_dir(tmp_path: Path) -> Path:
    path = Path(os.environ["CMEMI_TEST_ARTIFACTS"]) if os.environ.get("CMEMI_TEST_ARTIFACTS") else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.fault
def test_the_page_follows_a_live_run_through_a_worker_kill(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    c = Cluster(tmp_path / "run", *LONG, f"train.steps={STEPS}", f"scheduler.kwargs.T_max={STEPS}",
                "cluster.workers=2", "cluster.spare_workers=1", "checkpoint.every_steps=50", "eval.every_steps=50",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.02}")
    dash_log = tmp_path / "dashboard.log"  # a file, not a pipe nobody reads: the server never blocks on its output
    with open(dash_log, "w") as out:
        dash = subprocess.Popen(cmemi_cmd("dashboard", str(c.run_dir), "--port", "0"), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    browser = None
    try:
        line = poll(lambda: dash.poll() is None and " at http://" in (text := dash_log.read_text()) and text, 60,
                    "cmemi dashboard's URL")
        url = line.split(" at ", 1)[1].split()[0]
        browser = Browser(tmp_path / "profile", tmp_path / "chromium.log")
        browser.open(url)

        def page() -> dict:
            return browser.eval(READ)

        # the step advances in the open page: two values, the second larger, with the curves following; by step
        # 60 the first evaluation and checkpoint (step 50) are on it
        first = poll(lambda: (p := page())["step"] >= 60 and len(p["workers"]) == 2 and p["evalPoints"] >= 1
                     and 50 in p["checkpoints"] and all(w["state"] == "running" for w in p["workers"].values())
                     and p, DOM_S, "the page showing step 60, an evaluation, checkpoint 50 and 2 running workers",
                     interval=0.1)
        later = poll(lambda: (p := page())["step"] > first["step"] and p["lossLastStep"] > first["lossLastStep"]
                     and p, DOM_S, "the page's step advancing", interval=0.1)
        assert later["polls"] > first["polls"] and later["lossPoints"] > 0 and later["state"] == "running"
        assert later["step"] <= c.step()  # what the page shows is the run's (at most a poll behind)

        victim = sorted(later["workers"])[0]
        shown_inc = later["workers"][victim]["incarnation"]
        inc = c.signal("worker", victim)  # SIGKILL, recorded as a fault_injected event
        killed = time.monotonic()
        assert inc == shown_inc  # the table showed the incarnation that is killed

        def died(p: dict) -> bool:
            return any(e["kind"] == "died" and e["id"] == victim and e["incarnation"] == inc for e in p["events"])

        def replaced(p: dict) -> bool:
            w = p["workers"].get(victim)
            return w is not None and w["incarnation"] > inc and w["state"] == "running"

        seen_death = poll(lambda: died(p := page()) and p, DOM_S, f"the death of {victim} on the page", interval=0.1)
        death_s = time.monotonic() - killed
        seen_back = poll(lambda: replaced(p := page()) and p, DOM_S, f"{victim} replaced on the page", interval=0.1)
        back_s = time.monotonic() - killed
        assert any(e["kind"] == "fault_injected" and e["id"] == victim for e in seen_back["events"])
        assert seen_death["markers"] >= 1 or seen_back["markers"] >= 1  # the death marked on the loss curve
        # ... and training goes on, in the same page
        after = poll(lambda: (p := page())["step"] > seen_back["step"] and p["state"] == "running"
                     and sum(w["state"] == "running" for w in p["workers"].values()) == 2 and p, DOM_S,
                     "the step advancing after the replacement, 2 workers running", interval=0.1)

        out = artifacts_dir(tmp_path)
        shot = browser.screenshot(out / "dashboard-live-run.png")
        (out / "dashboard-live-run.html").write_text(browser.eval("document.documentElement.outerHTML"))
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert browser.problems() == []  # no exception, no console error, nothing the CSP refused
        with capsys.disabled():
            print(f"\ndashboard: page showed {victim}'s death {death_s:.1f}s and its replacement "
                  f"(incarnation {seen_back['workers'][victim]['incarnation']}) {back_s:.1f}s after the kill; "
                  f"step {first['step']} -> {after['step']} in one page; screenshot {shot}")
    finally:
        if browser is not None:
            browser.close()
        dash.terminate()
        dash.wait(timeout=20)
        c.close()


def test_the_page_of_a_finished_run_behind_a_token_with_a_rollback(tmp_path: Path) -> None:
    """The page in the browser, served with a token (its script and its calls carry it, the CSP lets nothing else
    in): a finished run whose aggregator went back from step 40 to 30 and redid 31..40 shows each step once, with
    the redone values, the faults marked, the checkpoints listed; and nothing goes wrong in the page."""
    run_dir = tmp_path / "run"
    write_run_files(run_dir)  # 40 steps; w1 killed, fenced and restarted; an aggregator restart at step 10
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in range(31, 41):
            f.write(json.dumps({"step": step, "loss": 9.0, "samples_per_s": 100.0, "t": 1_000_001.0 + step}) + "\n")
    for step in (10, 20):
        (run_dir / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors").write_bytes(b"x" * 1000)
    token = secrets.token_urlsafe(32)
    server = DashboardServer(("127.0.0.1", 0), Dashboard(run_dir), Access(token))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    browser = Browser(tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(server.url("127.0.0.1"))
        p = poll(lambda: (p := browser.eval(READ))["polls"] >= 2 and p, DOM_S, "the page polled twice", interval=0.1)
        assert p["state"] == "completed" and p["step"] == 40
        assert p["lossPoints"] == 40 and p["lossLastStep"] == 40  # 1..30, then 31..40 once: the redone ones
        assert browser.eval("document.getElementById('curve-loss').dataset.lastValue") == "9"
        assert p["markers"] == 5  # died, fenced, restarted, the aggregator's restart and its restore (the first
        # aggregator start comes before step 1: not drawn)
        assert p["evalPoints"] == 4 and p["checkpoints"] == [20, 10]
        assert browser.eval("document.querySelector('#checkpoints tr[data-latest=\"true\"]').dataset.step") == "10"
        assert p["workers"] == {"w0": {"state": "exited", "incarnation": 11, "host": "h0"},
                                "w1": {"state": "exited", "incarnation": 13, "host": "h1"}}
        assert [e["kind"] for e in p["events"]][:3] == ["run_completed", "checkpoint_restored", "aggregator_started"]
        assert browser.eval("document.getElementById('connection').dataset.ok") == "true"
        assert browser.problems() == []
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
