"""A soak's result rebuilt from what its run left (issue 47: the 1,000-fault soak at 738000b trained every step, then
died in its `cmemi reference`): the log's fault lines, a tiny synthetic work folder, `bench/soak.py --rescore` end
to end and the manual's table of a rescored result. Fast: no cluster, no training, no root."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench import soak as bench_soak
from scripts.tables import provenance
from scripts.tables import soak as soak_table
from tests.helpers.netns_faults import schedule
from tests.helpers.netns_soak import PLACEMENT
from tests.helpers.soak_rescore import HOLD, RescoreError, parse_log, rescore

SHA = "ab" * 32
TRACEBACK = ("Traceback (most recent call last):\n  File \"bench/soak.py\", line 73, in <module>\n"
             "subprocess.TimeoutExpired: Command '['/x/.venv/bin/python', '-m', 'cmemi', 'reference', "
             "'/tmp/w/cluster.yaml']' timed out after 300 seconds\n")


def line(n: int, t: float, kind: str, key: str, seconds: float, step: int, missed: bool = False) -> str:
    """One fault line as tests/helpers/netns_soak.py prints it."""
    return (f"[soak {t:7.1f}s] fault {n}: {kind} {key} {seconds:.2f}s at step {step}"
            f"{' (missed: no such process or port)' if missed else ''}")


def soak_log(seed: int = 47) -> str:
    """Seed 47's first seven faults (what the seed check compares), a missed port fault, and two server kills:
    ckpt's 4.3 s after agg1's by the log's T less the holds (a double fault), though 5.3 s apart by T alone."""
    drawn = list(schedule(random.Random(seed), list(PLACEMENT), 7, HOLD))
    assert drawn[0][:2] == ("kill", "agg1")  # the double fault below pairs with this first kill
    rows = [line(i + 1, 9.0 + 1.5 * i, k, key, s, 21 + i) for i, (k, key, s) in enumerate(drawn)]
    rows += [line(8, 25.0, "port", "agg", 0.50, 30, missed=True),
             line(9, 26.0, "kill", "ckpt", 1.00, 31),  # starts 16.4 s after agg1's kill: not double
             line(10, 40.0, "kill", "agg1", 0.40, 32),
             line(11, 45.3, "kill", "ckpt", 1.40, 33)]  # starts 43.9 - 39.6 = 4.3 s after agg1's: double
    return "[soak] some other line\n" + "\n".join(rows) + "\n" + TRACEBACK


def work_folder(tmp: Path, steps: int = 4, sha: str = SHA) -> Path:
    """A soak's --work folder in miniature: the config, metrics (step 3 logged again under a new term), events
    (three starts of the leader, one of shard 1, two of w0), the summary, and the logs with one libzmq abort."""
    work = tmp / "work"
    (work / "run").mkdir(parents=True)
    (work / "logs").mkdir()
    (work / "cluster.yaml").write_text(f"train:\n  steps: {steps}\n")
    metrics = [{"step": 1, "loss": 1.0, "term": 1, "t": 1.0}, {"step": 2, "loss": 0.9, "term": 1, "t": 2.0},
               {"step": 3, "loss": 0.8, "term": 1, "t": 3.0}, {"step": 3, "loss": 0.8, "term": 2, "t": 5.0},
               {"step": 4, "loss": 0.7, "term": 2, "t": 6.0}]
    starts = [("aggregator", "0", 10), ("aggregator", "1", 11), ("worker", "w0", 12), ("aggregator", "0", 20),
              ("worker", "w0", 21), ("aggregator", "0", 30), ("aggregator", "0", 30)]  # the last: the same process
    events = [{"kind": "startup", "role": r, "id": i, "pid": pid, "phases": {"spawned": 0.5 + pid / 100}, "t": 1.0}
              for r, i, pid in starts]
    events += [{"kind": "aggregator_started", "term": 1, "t": 0.9}, {"kind": "aggregator_started", "term": 2, "t": 4.0},
               {"kind": "run_completed", "steps": steps, "t": 6.6}]
    (work / "run" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (work / "run" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (work / "run" / "summary.json").write_text(json.dumps({"steps": steps, "params_sha256": sha}))
    (work / "logs" / "agg.log").write_text('{"event": "x"}\nAssertion failed: !_io_error (src/stream_engine_base.cpp:310)\n')
    (work / "logs" / "w0.log").write_text('{"event": "joined"}\n')
    return work


def test_the_log_gives_each_fault_row_in_order() -> None:
    rows = parse_log(soak_log())
    assert len(rows) == 11
    assert rows[0] == {"kind": "kill", "key": "agg1", "seconds": rows[0]["seconds"], "t": None, "other": None,
                       "hit": True, "role": "shard", "step": 21, "log_s": 9.0}
    assert rows[7]["hit"] is False and rows[7]["role"] == "leader"
    assert [r["role"] for r in rows[8:]] == ["checkpointer", "shard", "checkpointer"]
    with pytest.raises(RescoreError, match="whole stdout"):
        parse_log(line(2, 1.0, "kill", "w0", 0.5, 3))
    with pytest.raises(RescoreError, match="--log"):
        parse_log("no faults here\n")


def test_a_rescore_counts_what_the_run_left(tmp_path: Path) -> None:
    work = work_folder(tmp_path)
    (tmp_path / "soak.log").write_text(soak_log())
    r = rescore(work, tmp_path / "soak.log", reference=SHA, faults=10)
    assert (r["faults_asked"], r["faults"], r["faults_missed"]) == (10, 10, 1)
    assert r["by_kind"]["kill"] == 4 and "port" not in r["by_kind"] and r["by_role"]["checkpointer"] >= 2
    assert r["double_faults"] == 1 and r["schedule"][10].get("double") and not r["schedule"][8].get("double")
    assert (r["steps_redone"], r["steps_logged_twice"], r["terms"], r["violations"]) == (1, 1, 2, [])
    assert r["bitwise_equal"] and r["params_sha256"] == SHA and r["error"] is None
    assert r["restarts"] == {"agg": 2, "w0": 1} and r["exit_codes"] is None and r["aborts_logged"] == {"agg": 1}
    assert (r["faults_s"], r["wall_s"], r["run_s"]) == (45.3, None, 6.0)
    assert r["rescored"]["from"] == str(work) and r["rescored"]["log"] == str(tmp_path / "soak.log")
    assert r["rescored"]["why"].endswith("`cmemi reference` timed out after 300 seconds (the last line of its log)")
    assert any("exit codes: not recorded" in n for n in r["rescored"]["notes"])


def test_a_rescore_refuses_another_seed_and_a_bare_folder(tmp_path: Path) -> None:
    work = work_folder(tmp_path)
    (tmp_path / "soak.log").write_text(soak_log())
    with pytest.raises(RescoreError, match="--seed"):
        rescore(work, tmp_path / "soak.log", reference=SHA, seed=48)
    with pytest.raises(RescoreError, match="--work"):
        rescore(tmp_path, tmp_path / "soak.log", reference=SHA)


def test_a_run_that_did_not_finish_or_differs_says_so(tmp_path: Path) -> None:
    work = work_folder(tmp_path, sha="cd" * 32)
    (tmp_path / "soak.log").write_text(soak_log())
    events = (work / "run" / "events.jsonl").read_text().splitlines()
    (work / "run" / "events.jsonl").write_text("\n".join(e for e in events if "run_completed" not in e) + "\n")
    r = rescore(work, tmp_path / "soak.log", reference=SHA)
    assert not r["bitwise_equal"] and "did not finish" in r["error"] and r["run_s"] is None


def test_bench_soak_rescore_writes_a_result_the_table_shows(tmp_path: Path, monkeypatch, capsys) -> None:
    work = work_folder(tmp_path)
    (tmp_path / "soak.log").write_text(soak_log())
    ref = tmp_path / "ref.log"
    ref.write_text(json.dumps({"steps": 4, "params_sha256": SHA}, indent=1) + "\n\nreal\t0m1.0s\n")
    results = tmp_path / "results"
    results.mkdir()
    out = results / "soak.json"
    args = ["--rescore", str(work), "--log", str(tmp_path / "soak.log"), "--reference-summary", str(ref),
            "--faults", "10", "--run-commit", "7" * 40, "--out", str(out)]
    assert bench_soak.main(args) == 0
    d = json.loads(out.read_text())
    assert d["reference_params_sha256"] == SHA and d["run_commit"] == "7" * 40 and "7" * 40 in d["commit_note"]
    assert d["command"].startswith(".venv/bin/python bench/soak.py --rescore")
    monkeypatch.setattr(provenance, "RESULTS", results)
    table = soak_table.soak()
    assert "Rebuilt with `bench/soak.py --rescore`" in table and "at commit `7777777`" in table
    assert "Processes restarted (at least" in table and "1 were aborts inside libzmq" in table
    assert "the run itself over in 6 s" in table and "| **10** |" in table
    ref.write_text("no summary here\n")
    assert bench_soak.main(args) == 2 and "JSON summary" in capsys.readouterr().err
    assert bench_soak.main(["--rescore", str(work), "--out", str(out)]) == 2
    assert bench_soak.main([*args[:-4], "--run-commit", "HEAD", "--out", str(out)]) == 2
    assert "--run-commit 'HEAD' is not a commit" in capsys.readouterr().err
