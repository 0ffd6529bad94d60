"""`cmemi status` and `cmemi plot`: reports from Redis keys and from run files, the table, the PNG."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect

from cmemi import cli
from cmemi.commands import plot
from cmemi.commands.status import cli as status_cli
from cmemi.commands.status.render import render
from cmemi.commands.status.report import collect
from cmemi.commands.status.target import StatusError, Target
from tests.conftest import ROOT, cmemi_cmd
from tests.helpers.chaos import Cluster, poll

COLUMNS = ("id", "incarnation", "host", "pid", "state", "heartbeat", "microbatches")


def cli_main_rc(argv: list[str]) -> int:
    """`cmemi ARGV` in this process (the real entry point, which ends in sys.exit); its exit code."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code


# ------------------------------------------------------------------------------------------ synthetic run
def write_run_files(run_dir: Path, steps: int = 40, with_eval: bool = True, faults: bool = True,
                    completed: bool = True) -> None:
    """A small but complete run directory, as `cmemi up` leaves it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = 1_000_000.0
    (run_dir / "config.yaml").write_text(f"run:\n  name: synth\ntrain:\n  steps: {steps}\n")
    lines = []
    for s in range(1, steps + 1):
        lines.append({"step": s, "loss": 2.0 / s, "lr": 0.1 * (1 - s / steps), "step_time_s": 0.01,
                      "samples_per_s": 6400.0, "bytes_in": 1000, "bytes_out": 500, "live_workers": 2,
                      "t": t0 + 0.01 * s})
        if with_eval and s % 10 == 0:
            lines.append({"step": s, "eval": {"accuracy": 0.5 + s / (4 * steps), "loss": 1.0 / s}, "t": t0 + 0.01 * s})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    events = [
        {"t": t0 - 5, "kind": "coordinator_started", "supervise": "local", "workers": 2},
        {"t": t0 - 4, "kind": "process_started", "role": "worker", "id": "w0", "pid": 101},
        {"t": t0 - 4, "kind": "process_started", "role": "worker", "id": "w1", "pid": 102},
        {"t": t0 - 1, "kind": "worker_started", "worker": "w0", "incarnation": 11, "host": "h0"},
        {"t": t0 - 1, "kind": "worker_started", "worker": "w1", "incarnation": 12, "host": "h1"},
        {"t": t0, "kind": "aggregator_started", "term": 7, "addr": "tcp://127.0.0.1:1", "step": 0},
        {"t": t0 + 0.1, "kind": "checkpoint_saved", "step": 10, "path": str(run_dir / "checkpoints/step-00000010")},
    ]
    if faults:
        events += [
            {"t": t0 + 0.15, "kind": "fault_injected", "role": "worker", "id": "w1", "incarnation": 12, "pid": 102},
            {"t": t0 + 0.16, "kind": "died", "role": "worker", "id": "w1", "incarnation": 12, "how": "exit -9"},
            {"t": t0 + 0.16, "kind": "fenced", "role": "worker", "id": "w1", "incarnation": 12},
            {"t": t0 + 0.17, "kind": "restarted", "role": "worker", "id": "w1", "via": "spare", "pid": 103},
            {"t": t0 + 0.18, "kind": "worker_started", "worker": "w1", "incarnation": 13, "host": "h1"},
            {"t": t0 + 0.25, "kind": "aggregator_started", "term": 8, "addr": "tcp://127.0.0.1:2", "step": 10},
            {"t": t0 + 0.25, "kind": "checkpoint_restored", "step": 10, "term": 8},
        ]
    if completed:
        events.append({"t": t0 + 0.5, "kind": "run_completed", "steps": steps, "params_sha256": "ab" * 32})
        (run_dir / "summary.json").write_text(json.dumps({
            "steps": steps, "final_loss": 2.0 / steps, "eval": {"accuracy": 0.75, "loss": 0.05}, "wall_s": 0.5,
            "samples_per_s": 5000.0, "workers": 2, "bytes_sent": 1000, "bytes_received": 500, "final_lr": 0.0,
            "term": 8}))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_plot_series_and_fault_lines(tmp_path: Path) -> None:
    write_run_files(tmp_path / "run")
    fig, series = plot.build_figure(tmp_path / "run")
    try:
        assert {"loss", "lr", "samples_per_s", "eval", "eval:accuracy", "eval:loss", "faults"} <= series
        gids = [ln.get_gid() for ax in fig.axes for ln in ax.get_lines()]
        for kind in ("fault_injected", "died", "fenced", "restarted", "aggregator_started", "checkpoint_restored"):
            assert f"fault:{kind}" in gids, kind
        # the first aggregator start is the beginning of training, not a fault: one line per panel for the restart
        assert gids.count("fault:aggregator_started") == len(fig.axes)
        loss = next(ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "loss")
        assert len(loss.get_xdata()) == 40 and loss.get_xdata()[0] == pytest.approx(0.01)  # seconds since start
        assert fig.axes[-1].get_xlabel() == "seconds since training began"
        acc = next(ln for ln in fig.axes[1].get_lines() if ln.get_gid() == "eval:accuracy")
        assert list(acc.get_ydata()) == pytest.approx([0.5 + s / 160 for s in (10, 20, 30, 40)])
    finally:
        plot.plt.close(fig)


def test_plot_final_eval_marker_and_step_axis(tmp_path: Path) -> None:
    write_run_files(tmp_path / "run", with_eval=False, faults=False)
    fig, series = plot.build_figure(tmp_path / "run", x="step")
    try:
        assert series == {"loss", "lr", "samples_per_s", "eval", "eval:accuracy", "eval:loss"}
        marker = next(ln for ln in fig.axes[1].get_lines() if ln.get_gid() == "eval:accuracy:final")
        assert list(marker.get_xdata()) == [40] and list(marker.get_ydata()) == [0.75]
        assert fig.axes[-1].get_xlabel() == "step"
    finally:
        plot.plt.close(fig)


def test_plot_breaks_lines_where_training_stopped_or_went_back(tmp_path: Path) -> None:
    """An aggregator restart: a gap in time, then steps again from the restored checkpoint."""
    run_dir = tmp_path / "run"
    write_run_files(run_dir, with_eval=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t_back = rows[19]["t"] + 5.0
    rows = rows[:20] + [{**r, "t": t_back + 0.01 * i} for i, r in enumerate(rows[14:])]  # 15..40 again
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for x in ("time", "step"):
        fig, _series = plot.build_figure(run_dir, x=x)
        try:
            lr = next(ln for ln in fig.axes[2].get_lines() if ln.get_gid() == "lr")
            ys = np.asarray(lr.get_ydata(), dtype=float)
            assert len(ys) == 20 + 1 + 26 and np.isnan(ys[20]) and np.isfinite(np.delete(ys, 20)).all()
        finally:
            plot.plt.close(fig)


def test_plot_errors_on_a_directory_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert plot.main([str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_status_from_files_of_a_finished_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run_files(run_dir)
    r = collect(Target(run_dir))
    assert r["source"] == "files" and r["state"] == "completed" and r["step"] == r["total"] == 40
    assert r["term"] == 8 and r["checkpoint"]["step"] == 10 and r["eval"]["accuracy"] == 0.75
    assert r["bytes_per_s"] == pytest.approx(3000.0)
    workers = {w["id"]: w for w in r["workers"]}
    assert workers["w0"]["incarnation"] == 11 and workers["w0"]["pid"] == 101
    assert workers["w1"]["incarnation"] == 13 and workers["w1"]["pid"] == 103  # the spare that took over
    assert {w["state"] for w in workers.values()} == {"exited"}
    assert [e["kind"] for e in r["events"]][-1] == "run_completed" and len(r["events"]) == 8


def test_status_unreachable_redis(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # a port nobody listens on: bind, read the port, close
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run_dir / "cluster.json").write_text(json.dumps({"redis": f"redis://:secretpw@127.0.0.1:{port}/0", "run": "x"}))
    assert status_cli.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cmemi: error: cannot reach redis at 127.0.0.1:")
    assert "secretpw" not in err
    # once the run's files are there, the report falls back to them and says so
    write_run_files(run_dir)
    assert status_cli.main([str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "files" and report["state"] == "completed"
    # a completed run whose Redis is gone is simply over: no alarm, just where the report comes from
    assert report["note"] == f"showing the files in {run_dir}" and "secretpw" not in json.dumps(report)
    (run_dir / "summary.json").unlink()  # not completed, Redis unreachable: that is worth saying
    assert status_cli.main([str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "files" and report["state"] == "stopped"
    assert "cannot reach redis" in report["note"] and "secretpw" not in json.dumps(report)
    with pytest.raises(SystemExit):  # neither RUN_DIR nor --redis: argparse's usage error
        status_cli.main([])


def test_status_from_redis_keys(redis_server, tmp_path: Path, capsys: pytest.CaptureFixture,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker state, ages, progress, term, checkpoint and the last events, from hand-written keys."""
    client = connect(redis_server.url)
    k = Keys("synth")
    now = time.time()

    def member(role: str, ident: str, inc: int, state: str = "running", hb: bool = True, **extra) -> None:
        client.hset(k.member(role, ident), mapping={"incarnation": inc, "pid": 1000 + inc, "host": "h", "role": role,
                                                    "id": ident, "state": state, "started_at": now - 5, **extra})
        if hb:
            client.set(k.heartbeat(role, ident), f"{inc}:{now - 0.5:.3f}", px=5000)

    client.set(k.state, "running")
    client.hset(k.progress, mapping={"step": 12, "total": 50, "loss": "0.5", "lr": "0.01", "samples_s": "4000.0",
                                     "live_workers": 2, "term": 9, "t": now - 0.2})
    client.hset(k.aggregator, mapping={"addr": "tcp://127.0.0.1:5", "term": 9, "pid": 1, "incarnation": 3})
    member("aggregator", "0", 3, addr="tcp://127.0.0.1:5", term=9)
    member("coordinator", "0", 1)
    member("worker", "w0", 20, transport="ipc")
    member("worker", "w1", 21, hb=False, transport="aggregator:ipc shard1:tcp")       # silent: dead or hung, not yet declared
    member("worker", "w2", 22)
    client.set(k.fence("worker", "w2"), 22)     # declared dead
    member("worker", "w10", 23, state="stopped", hb=False)  # left gracefully
    client.set(k.ckpt_latest, 10)
    for i in range(12):
        client.xadd(k.events, {"json": json.dumps({"t": now - 12 + i, "kind": f"e{i}"})})

    r = collect(Target(None, redis_server.url, "synth"))
    waited = time.time() - now  # the ages grew by at most this since the keys were written
    assert r["source"] == "redis" and r["state"] == "running" and r["run"] == "synth"
    assert (r["step"], r["total"], r["loss"], r["lr"], r["samples_per_s"], r["term"]) == (12, 50, 0.5, 0.01, 4000.0, 9)
    assert 0.2 <= r["progress_age_s"] <= 0.2 + waited
    assert r["bytes_per_s"] is None and any(g.startswith("bytes_per_s") for g in r["gaps"])
    assert any(g.startswith("microbatches_done") for g in r["gaps"])
    states = {w["id"]: (w["incarnation"], w["state"]) for w in r["workers"]}
    assert states == {"w0": (20, "running"), "w1": (21, "no heartbeat"), "w2": (22, "fenced"), "w10": (23, "stopped")}
    assert [w["id"] for w in r["workers"]] == ["w0", "w1", "w2", "w10"]
    assert 0.4995 <= r["workers"][0]["heartbeat_age_s"] <= 0.5005 + waited  # the heartbeat holds ms
    assert r["workers"][1]["heartbeat_age_s"] is None
    assert [w.get("transport") for w in r["workers"]] == ["ipc", "aggregator:ipc shard1:tcp", None, None]
    assert r["services"]["aggregator"]["addr"] == "tcp://127.0.0.1:5" and r["services"]["aggregator"]["term"] == 9
    assert r["checkpoint"] == {"step": 10, "path": None}
    assert [e["kind"] for e in r["events"]] == [f"e{i}" for i in range(4, 12)]  # the last 8, oldest first

    # per-worker microbatch counts light up once the aggregator publishes them (the proposed key)
    client.hset(k.prefix + "microbatches", mapping={"w0:20": 17})
    r = collect(Target(None, redis_server.url, "synth"))
    assert r["workers"][0]["microbatches_done"] == 17 and not any(g.startswith("microbatches") for g in r["gaps"])

    text = render(r)
    for col in COLUMNS:
        assert col in text
    assert "state running" in text and "step 12/50" in text and "term 9" in text and "step 10" in text
    assert "no heartbeat" in text and "fenced" in text and "e11" in text and "e3" not in text
    assert "transport" in text and "aggregator:ipc shard1:tcp" in text

    # --watch: one report per refresh until the run ends (JSON lines with --json)
    sleeps = []

    def finish_on_second_refresh(seconds: float) -> None:
        sleeps.append(seconds)
        client.set(k.state, "completed")

    monkeypatch.setattr(status_cli.time, "sleep", finish_on_second_refresh)
    capsys.readouterr()
    assert status_cli.main(["--redis", redis_server.url, "--run", "synth", "--watch", "--json", "--interval", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["state"] for line in lines] == ["running", "completed"] and sleeps == [0.5]
    monkeypatch.undo()

    # a wrong run name is a one-line error, not an empty table
    with pytest.raises(StatusError, match="no run named 'other'"):
        collect(Target(None, redis_server.url, "other"))
    # ...but a run dir whose cluster.json was just written (`cmemi up` starting) is "starting"
    run_dir = tmp_path / "starting"
    run_dir.mkdir()
    (run_dir / "cluster.json").write_text(json.dumps({"redis": redis_server.url, "run": "other"}))
    r = collect(Target(run_dir))
    assert r["state"] == "starting" and r["workers"] == [] and r["step"] == 0


# ------------------------------------------------------------------------------------------ a real run
@pytest.mark.integration
def test_status_and_plot_of_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    c = Cluster(run_dir, "cluster.spare_workers=0", "checkpoint.every_steps=100")  # digits.yaml: 300 steps
    try:
        target = Target(run_dir)
        seen = []

        def registered():
            r = collect(target)
            seen.append(r)
            return r if r["source"] == "redis" and len(r["workers"]) == 2 else None

        r = poll(registered, 90, "two workers in `cmemi status`", interval=0.25)
        assert r["state"] == "running" and r["total"] == 300 and 0 <= r["step"] <= 300
        members = c.members("worker")
        assert {w["id"]: w["incarnation"] for w in r["workers"]} == {i: int(m["incarnation"]) for i, m in members.items()}
        assert all(w["host"] and w["pid"] and w["state"] == "running" for w in r["workers"])

        # the CLI while it runs (a subprocess: what a user gets)
        out = subprocess.run(cmemi_cmd("status", str(run_dir), "--json"), cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        live = json.loads(out.stdout)
        assert live["source"] == "redis" and live["state"] in ("running", "completed") and live["run"] == c.keys.prefix[6:-1]
        assert len(live["workers"]) == 2 and live["step"] <= live["total"] == 300

        while c.proc.poll() is None:
            try:
                seen.append(collect(target))
            except StatusError:
                pass
            time.sleep(0.25)
        assert c.wait() == 0, c.output()
    finally:
        c.close()

    states = [r["state"] for r in seen]
    order = ["starting", "running", "completed"]
    assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), states
    steps = [r["step"] for r in seen if r["source"] == "redis"]
    assert steps == sorted(steps) and all(r["step"] <= r["total"] for r in seen if r["total"])
    mid = [r for r in seen if r["source"] == "redis" and 0 < r["step"] < 300]
    assert all(r["loss"] is not None and r["lr"] is not None and r["samples_per_s"] for r in mid)
    assert all(r["checkpoint"]["step"] is None or r["checkpoint"]["step"] % 100 == 0 for r in mid)

    # after the run: Redis is gone, the files tell the rest, and status says so
    out = subprocess.run(cmemi_cmd("status", str(run_dir), "--json"), cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["source"] == "files" and done["state"] == "completed" and "cannot reach" not in done["note"]
    assert done["step"] == done["total"] == 300 and done["eval"]["accuracy"] > 0.8
    assert {w["id"] for w in done["workers"]} == {"w0", "w1"} and all(w["incarnation"] for w in done["workers"])
    table = render(collect(Target(run_dir)))
    assert "state completed" in table and "step 300/300" in table
    for col in COLUMNS:
        assert col in table

    png = tmp_path / "out" / "run.png"
    capsys.readouterr()
    assert cli_main_rc(["plot", str(run_dir), "-o", str(png)]) == 0
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    fig, series = plot.build_figure(run_dir)
    plot.plt.close(fig)
    assert {"loss", "lr", "samples_per_s", "eval"} <= series and "faults" not in series
