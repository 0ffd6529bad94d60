"""Start-up phases: every process reports when it reached each stage; `cmemi up --verbose` prints them."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect, emit
from cmemi.shared.runtime import startup

from cmemi.launcher.startup_report import StartupReport
from tests.conftest import FAST, ROOT, up_args

PROCESS_PHASES = {
    "cmemi up": ["spawned", "imported", "redis_started", "redis_ready", "coordinator_spawned"],
    # imports torch and the services while `cmemi up` starts Redis and the coordinator; checks the config's
    # functions; then forks every service (cmemi/launcher/zygote.py)
    "zygote": ["spawned", "imported", "user_code_imported", "plugins_checked", "listening"],
    "coordinator": ["spawned", "imported", "connected", "services_spawned"],
    "checkpointer": ["spawned", "imported", "connected", "listening"],
    # the aggregator reads no data: the run's fingerprint is the first worker's (services/aggregator/common/dataprint.py)
    "aggregator": ["spawned", "imported", "connected", "model_built", "checkpoint_asked", "listening"],
    "worker w0": ["spawned", "imported", "connected", "model_built", "dataset_built", "fingerprinted", "registered",
                  "welcomed"],
}


def test_a_phase_keeps_the_first_time_it_was_reached() -> None:
    startup.mark("test_phase")
    first = startup.phases()["test_phase"]
    startup.mark("test_phase")
    got = startup.phases()
    assert got["test_phase"] == first
    assert next(iter(got)) == "spawned" and got["spawned"] <= first  # this process was forked before it marked


def test_the_report_waits_for_every_process_and_the_first_step(tmp_path: Path, redis_server) -> None:
    client, keys = connect(redis_server.url), Keys("startup-test")
    t0 = time.time()
    report = StartupReport(tmp_path, client, keys, workers=1, own={"spawned": t0, "imported": t0})
    for role, ident in (("coordinator", "0"), ("checkpointer", "0"), ("aggregator", "0")):
        emit(client, keys, "startup", role=role, id=ident, pid=1, phases={"spawned": t0, "imported": t0}, cpu_s=1.0)
    assert not report.poll()  # worker w0 and the first step are missing
    emit(client, keys, "startup", role="worker", id="w0", pid=2, phases={"spawned": t0, "welcomed": t0}, cpu_s=1.0)
    assert not report.poll()  # the first step is missing
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "t": t0}) + "\n")
    assert report.poll() and not report.poll()  # complete once, then done
    written = json.loads((tmp_path / "startup.json").read_text())
    assert set(written["processes"]) == {"cmemi up", "coordinator", "checkpointer", "aggregator", "worker w0"}
    assert written["first_step_s"] is not None and written["cpu_s"]["worker w0"] == 1.0
    assert "worker w0" in report.format() and "welcomed" in report.format()


@pytest.mark.integration
def test_up_verbose_prints_each_phase_to_the_first_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([*up_args(run_dir, *FAST), "--verbose"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("cmemi: start-up: first step after")]
    assert len(head) == 1, proc.stdout
    shown = {line[2:16].strip(): line[16:] for line in lines[head[0] + 1:] if line.startswith("  ")}
    for name, phases in {**PROCESS_PHASES, "worker w1": PROCESS_PHASES["worker w0"],
                         "run": ["first_gradient", "first_step"]}.items():
        assert name in shown, (name, proc.stdout)
        for phase in phases:
            assert f"{phase} " in shown[name], (name, phase, shown[name])
    saved = json.loads((run_dir / "startup.json").read_text())
    for name, phases in PROCESS_PHASES.items():
        assert list(saved["processes"][name]) == phases, (name, saved["processes"][name])
    assert saved["first_step_s"] is not None
    # forked by the zygote once it listened: `spawned` is the fork (the kernel's start time, 10 ms ticks)
    listening = saved["processes"]["zygote"]["listening"]
    for name in ("checkpointer", "aggregator", "worker w0", "worker w1"):
        assert saved["processes"][name]["spawned"] >= listening - 0.02, (name, saved["processes"][name], listening)
