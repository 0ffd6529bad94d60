"""`cmemi dashboard`'s server, in process on a free loopback port: its JSON endpoints (the status report is `cmemi
status --json`'s, the curve points and events come incrementally), the token (401 without it, on every path), the
Host check, the static files (and nothing else) from the package; and the command line in a real process: the URL
printed, served until Ctrl-C, a bad argument one line with exit 2."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cmemi.commands.dashboard.access import Access
from cmemi.commands.dashboard.server import DashboardServer
from cmemi.commands.dashboard.snapshot import Dashboard
from cmemi.commands.status import cli as status_cli
from tests.conftest import ROOT, cmemi_cmd
from tests.test_status_plot import write_run_files

TIMED = ("time", "progress_age_s")  # the report's fields that move with the clock


def serve(run_dir: Path, token: str | None = None) -> Iterator[DashboardServer]:
    server = DashboardServer(("127.0.0.1", 0), Dashboard(run_dir, status_every=0.0), Access(token))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_run_files(tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def dash(run_dir: Path) -> Iterator[DashboardServer]:
    yield from serve(run_dir)


def get(server: DashboardServer, path: str, host: str | None = None) -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, res.read().decode(), dict(res.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def get_json(server: DashboardServer, path: str) -> Any:
    status, body, headers = get(server, path)
    assert status == 200 and headers["Content-Type"] == "application/json", body
    return json.loads(body)


def test_status_endpoint_is_cmemi_status_json(dash: DashboardServer, run_dir: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    assert status_cli.main([str(run_dir), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    served = get_json(dash, "/api/status")
    assert served["error"] is None
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMED}  # noqa: E731
    assert strip(served["report"]) == strip(cli) and served["report"]["state"] == "completed"


def test_state_sends_only_the_rows_the_page_has_not_seen(dash: DashboardServer, run_dir: Path) -> None:
    first = get_json(dash, "/api/state")
    m, e = first["metrics"], first["events"]
    assert m["start"] == 0 and len(m["rows"]) == 44 and m["rows"][0] == {
        "step": 1, "loss": 2.0, "lr": pytest.approx(0.0975), "step_time_s": 0.01, "samples_per_s": 6400.0,
        "live_workers": 2, "t": 1_000_000.01}
    assert [x["kind"] for x in e["rows"]] == ["coordinator_started", "aggregator_started", "checkpoint_saved",
                                             "fault_injected", "died", "fenced", "restarted", "aggregator_started",
                                             "checkpoint_restored", "run_completed"]  # no process_started, ...
    assert first["status"]["report"]["step"] == 40 and first["checkpoints"] == []
    with open(run_dir / "metrics.jsonl", "a") as f:  # the run goes on: a step and a NaN loss (JSON has no NaN)
        f.write(json.dumps({"step": 41, "loss": 0.1, "t": 2e6}) + "\n" + '{"step": 42, "loss": NaN, "t": 2e6}\n')
    again = get_json(dash, f"/api/state?metrics={m['total']}&mgen={m['generation']}&events={e['total']}"
                           f"&egen={e['generation']}")
    assert again["metrics"]["start"] == 44 and again["metrics"]["rows"] == [
        {"step": 41, "loss": 0.1, "t": 2e6}, {"step": 42, "loss": None, "t": 2e6}]
    assert again["events"]["rows"] == [] and again["events"]["start"] == 10
    assert get_json(dash, "/api/metrics?since=45&gen=0")["rows"] == [{"step": 42, "loss": None, "t": 2e6}]
    assert len(get_json(dash, "/api/events?since=0")["rows"]) == 10
    assert get_json(dash, "/api/state?metrics=44&mgen=7")["metrics"]["start"] == 0  # a stale generation: all rows


def test_page_and_static_files_only(dash: DashboardServer) -> None:
    status, page, headers = get(dash, "/")
    assert status == 200 and 'src="static/app.js"' in page and "{{query}}" not in page
    assert "default-src 'self'" in headers["Content-Security-Policy"] and headers["Cache-Control"] == "no-store"
    assert "http://" not in page and "https://" not in page  # nothing from a CDN: the machine may be offline
    assert 'src="static/curves.js"' in page
    for name, holds in (("app.js", "api/state"), ("curves.js", "function drawCurves")):
        status, script, headers = get(dash, f"/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript") and holds in script
        assert "http" not in script.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace, not a URL
    assert get(dash, "/static/style.css")[0] == 200
    for path in ("/static/index.html", "/static/../cli.py", "/static/%2e%2e/cli.py", "/api/nothing", "/cli.py"):
        assert get(dash, path)[0] == 404, path
    assert get(dash, "/api/state", host="attacker.example:80")[0] == 403  # DNS rebinding onto loopback
    assert get(dash, "/api/state", host=f"localhost:{dash.port}")[0] == 200


def test_an_endpoint_that_fails_answers_500_with_the_reason_and_the_server_goes_on(run_dir: Path) -> None:
    for server in serve(run_dir):
        def broken(target, n):
            raise ValueError("unreadable progress")

        server.dashboard.report = broken
        status, body, _ = get(server, "/api/status")
        assert status == 500 and body == "/api/status: ValueError: unreadable progress\n"
        assert get(server, "/api/checkpoints")[0] == 200


def test_every_path_needs_the_token_when_one_is_set(run_dir: Path) -> None:
    for server in serve(run_dir, token="s3cret-token"):
        for path in ("/", "/static/app.js", "/api/state", "/api/status", "/api/checkpoints", "/nothing"):
            status, body, _ = get(server, path)
            assert status == 401 and "token" in body, path
            assert get(server, path + "?token=s3cret-tokeN")[0] == 401
        status, page, _ = get(server, "/?token=s3cret-token")
        assert status == 200 and 'src="static/app.js?token=s3cret-token"' in page
        assert get(server, "/static/app.js?token=s3cret-token")[0] == 200
        assert get(server, "/api/state?token=s3cret-token&metrics=3", host="anything:1")[0] == 200
        assert server.url("10.1.2.3") == f"http://10.1.2.3:{server.port}/?token=s3cret-token"


@contextmanager
def cli(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`cmemi dashboard ARGS` in a real process, with the line it printed first (the URL once bound); stopped after."""
    # SIGINT as a terminal's foreground job has it: a suite started in the background (`make test &`) ignores it, and
    # a child inherits the ignoring (Python then installs no KeyboardInterrupt handler: Ctrl-C would do nothing)
    with subprocess.Popen(cmemi_cmd("dashboard", *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        try:
            assert proc.stdout is not None
            yield proc, proc.stdout.readline()  # EOF ("") if it failed: the assertions below show its stderr
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=20)


def test_cli_prints_its_url_serves_and_stops_on_ctrl_c(run_dir: Path) -> None:
    with cli(str(run_dir), "--port", "0") as (proc, line):
        assert line.startswith(f"cmemi dashboard: {run_dir} at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "api/status", timeout=10) as res:
            assert json.loads(res.read())["report"]["step"] == 40
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0


def test_cli_bound_elsewhere_prints_a_token_and_refuses_requests_without_it(run_dir: Path) -> None:
    with cli(str(run_dir), "--host", "0.0.0.0", "--port", "0") as (_proc, line):
        url = line.split(" at ", 1)[1].split()[0]
        port, token = int(url.split(":")[2].split("/")[0]), url.split("?token=")[1]
        assert len(token) >= 40, line
        base = f"http://127.0.0.1:{port}/api/status"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base, timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        with urllib.request.urlopen(f"{base}?token={token}", timeout=10) as res:
            assert res.status == 200


def test_cli_bad_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, says in (([str(tmp_path / "nowhere")], "is not a directory; pass the run directory"),
                           ([str(tmp_path), "--port", str(port)], f"--port {port}: already in use"),
                           ([str(tmp_path), "--port", "70000"], "--port 70000: a port is 0..65535"),
                           ([str(tmp_path), "--host", "192.0.2.1", "--port", "0"],  # TEST-NET: not this machine's
                            "--host 192.0.2.1 --port 0: cannot bind")):
            r = subprocess.run(cmemi_cmd("dashboard", *args), cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
            assert r.stderr.startswith("cmemi: error: ") and says in r.stderr, (args, r.stderr)
