"""`cmemi logs`: the run's service log files, merged in time order, filtered by role (unit tests on files;
tests/test_up.py reads the logs of a real run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cmemi.commands import logs


def line(t: str, service: str, event: str, **kw) -> str:
    return json.dumps({"event": event, "service": service, "level": "info", "timestamp": f"2026-01-01T00:00:{t}Z",
                       **kw})


def write(run_dir: Path) -> None:
    d = run_dir / "logs"
    d.mkdir(parents=True)
    (d / "aggregator.log").write_text("\n".join([line("01.0", "aggregator", "listening"),
                                                 line("04.0", "aggregator", "run completed", steps=3)]) + "\n")
    (d / "worker-w0.log").write_text("\n".join([line("02.0", "worker", "joined", worker_id="w0"),
                                                "Traceback (most recent call last):", "  boom"]) + "\n")
    (d / "worker-w1.log").write_text(line("03.0", "worker", "joined", worker_id="w1") + "\n")


def test_merged_in_time_order_with_tracebacks_after_their_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path)
    assert logs.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    sources = [o.split()[1] if not o.startswith(" ") else o.split()[0] for o in out]
    assert sources == ["aggregator", "worker-w0", "worker-w0", "worker-w0", "worker-w1", "aggregator"], out
    assert "listening" in out[0] and "Traceback" in out[2] and "boom" in out[3] and "run completed" in out[5]
    assert "worker_id=w0" in out[1] and "steps=3" in out[-1]


def test_role_filter_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path)
    assert [f.name for f in logs.log_files(tmp_path, "worker")] == ["worker-w0.log", "worker-w1.log"]
    assert [f.name for f in logs.log_files(tmp_path, "worker-w1")] == ["worker-w1.log"]
    assert logs.main([str(tmp_path), "aggregator", "--json"]) == 0
    raw = capsys.readouterr().out.splitlines()
    assert [json.loads(r)["event"] for r in raw] == ["listening", "run completed"]


def test_unknown_role_is_one_line_naming_what_exists(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path)
    assert logs.main([str(tmp_path), "checkpointer"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no logs for 'checkpointer'" in err and "worker-w0" in err


def test_follow_prints_new_lines_and_new_files(tmp_path: Path) -> None:
    import os
    import select
    import subprocess
    import time

    from tests.conftest import ROOT, cmemi_cmd

    write(tmp_path)
    proc = subprocess.Popen(cmemi_cmd("logs", str(tmp_path), "-f"), cwd=ROOT, stdout=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None
    try:
        seen = b""

        def wait_for(text: str) -> None:
            nonlocal seen
            deadline = time.monotonic() + 60
            while text.encode() not in seen:
                assert time.monotonic() < deadline, f"{text!r} not followed: {seen!r}"
                if select.select([proc.stdout], [], [], 0.5)[0]:
                    seen += os.read(proc.stdout.fileno(), 65536)

        wait_for("run completed")  # the existing lines first
        with open(tmp_path / "logs" / "aggregator.log", "a") as f:
            f.write(line("05.0", "aggregator", "appended later") + "\n")
        wait_for("appended later")
        (tmp_path / "logs" / "checkpointer.log").write_text(line("06.0", "checkpointer", "a new process") + "\n")
        wait_for("a new process")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
