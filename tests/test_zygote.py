"""The zygote (cmemi/launcher/zygote.py), on real processes: it forks services that look and exit like fresh ones,
drops what is not a request, and is no single point of failure: SIGKILLed mid-run, the services go on and
the coordinator starts the next ones as new interpreters."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cmemi.services.coordinator.supervisor import Child, cmdline, service_argv
from cmemi.shared.config.loading import dump_config, load_config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect
from cmemi.shared.runtime.log import LOG_DIR_ENV
from cmemi.shared.runtime.service import REDIS_URL_ENV
from cmemi.shared.runtime.zygote import connect_path, exit_code, running, spawn

from cmemi.launcher.zygote_up import TEMPLATE_ENV, Zygote
from tests.conftest import DIGITS, FAST, ROOT, up_args
from tests.helpers.chaos import Cluster, poll

RUN = "zygote-test"


def parent(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("PPid:")))


@pytest.mark.parametrize("request_, why", [
    ([], "not an object"),
    ({"argv": "python -m cmemi worker", "env": {}, "cwd": "/"}, "list of strings"),
    ({"argv": ["python", "-m", "cmemi", "zygote"], "env": {}, "cwd": "/"}, "python -m cmemi"),
    ({"argv": ["python", "-c", "import os", "worker"], "env": {}, "cwd": "/"}, "python -m cmemi"),
    ({"argv": ["python", "-m", "cmemi", "worker\0x"], "env": {}, "cwd": "/"}, "list of strings"),
    ({"argv": ["python", "-m", "cmemi", "worker"], "env": {"A=B": "c"}, "cwd": "/"}, "map of strings"),
    ({"argv": ["python", "-m", "cmemi", "worker"], "env": {"A": 1}, "cwd": "/"}, "map of strings"),
    ({"argv": ["python", "-m", "cmemi", "worker"], "env": {}, "cwd": None}, "cwd"),
])
def test_only_a_service_command_line_is_a_request(request_: object, why: str) -> None:
    from cmemi.shared.runtime.zygote import validate

    with pytest.raises(ValueError, match=why):
        validate(request_)
    ok = {"argv": [sys.executable, "-m", "cmemi", "worker", "--config", "c.yaml"], "env": {"A": "b"}, "cwd": "/"}
    assert validate(ok) == {**ok, "umask": None}
    assert validate({**ok, "umask": 0o027})["umask"] == 0o027
    for bad in (-1, 0o1000, "022", True):
        with pytest.raises(ValueError, match="umask"):
            validate({**ok, "umask": bad})
    with pytest.raises(ValueError, match="zygote"):  # a template forks zygotes, and nothing else
        validate(ok, roles=("zygote",))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A zygote serving a digits run (no CurveZMQ: the test makes no keys), as `cmemi up` starts one."""
    run_dir = tmp_path_factory.mktemp("zygote") / "run"
    run_dir.mkdir()
    cfg = load_config(DIGITS, [f"run.dir={run_dir}", f"run.name={RUN}", "security.curve=false",
                               "cluster.dead_after=0.5", "cluster.heartbeat_interval=0.1"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    zygote = Zygote()
    try:
        zygote.serve(run_dir)
        verdict = poll(zygote.poll, 180, "the zygote's verdict on the config")
        yield zygote, run_dir, verdict
    finally:
        zygote.stop()


@pytest.mark.integration
def test_the_zygote_checks_the_config_then_listens_for_its_owner_only(served) -> None:
    zygote, run_dir, verdict = served
    assert verdict["rc"] == 0 and list(verdict["phases"]) == [
        "spawned", "imported", "user_code_imported", "plugins_checked", "listening"]  # the config's modules, once
    sock = run_dir / "zygote" / "socket"
    mode = os.stat(sock).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert cmdline(zygote.proc.pid) == [sys.executable, "-m", "cmemi", "zygote"]
    # what is not a request is dropped without an answer, and the zygote serves on
    for junk in (b"not json\n", json.dumps({"argv": [sys.executable, "-m", "cmemi", "up", "x"], "env": {},
                                            "cwd": "/"}).encode() + b"\n",
                 json.dumps({"argv": ["sh", "-c", "true"], "env": {}, "cwd": "/"}).encode() + b"\n",
                 b"[" * 100_000 + b"\n", b"[" * (2 << 20)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            short, fd = connect_path(str(sock))
            try:
                s.connect(short)
            finally:
                os.close(fd)
            s.settimeout(30)
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(100) == b""
            except (BrokenPipeError, ConnectionResetError):
                pass  # it stopped reading an oversized request: dropped as well
    assert zygote.proc.poll() is None
    forked = spawn(service_argv("worker", "/nonexistent.yaml"), dict(os.environ))
    assert forked is not None and forked.pidfd is not None
    os.close(forked.pidfd)
    poll(lambda: Path(forked.exit_record).exists(), 60, "the exit record of a worker with a missing config")
    assert exit_code(forked.exit_record) == 2 and not Path(forked.exit_record).exists()


@pytest.mark.integration
def test_forked_services_show_their_role_register_and_exit_with_their_codes(
        served, redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the coordinator's own Child: exit codes 0 (run over), 2 (a user error), 3 (fenced) and a
    SIGKILL read back from the zygote's records, and each command line exactly the one asked for."""
    zygote, run_dir, _ = served
    monkeypatch.setenv("CMEMI_UP_PID", str(os.getpid()))  # as under `cmemi up`: the services die with us
    monkeypatch.setenv(REDIS_URL_ENV, redis_server.url)
    monkeypatch.setenv(LOG_DIR_ENV, str(run_dir / "logs"))
    r, keys = connect(redis_server.url), Keys(RUN)
    r.hset(keys.aggregator, mapping={"addr": "tcp://127.0.0.1:9", "term": 1})  # nobody answers a hello there
    r.set(keys.fence("worker", "w2"), 10**9)  # every incarnation of w2 is fenced
    config = str(run_dir / "config.yaml")
    children = {name: Child("worker", name, service_argv("worker", config, "--worker-id", name))
                for name in ("w1", "w2", "w3")}
    children["bad"] = Child("worker", "bad", service_argv("worker", str(run_dir / "missing.yaml")))
    try:
        for c in children.values():
            c.start()
            assert c.popen is None and c.exit_record is not None, "not forked by the zygote"
            assert parent(c.pid) == zygote.proc.pid
        for name in ("w1", "w3"):  # a working service: registered under its forked pid, role on its command line
            c = children[name]
            poll(lambda c=c: r.hget(keys.member("worker", c.ident), "pid") == str(c.pid), 60, f"{name} registered")
            assert cmdline(c.pid) == c.argv
            assert Path(f"/proc/{c.pid}/cmdline").read_bytes().split(b"\0")[3] == b"worker"
        poll(lambda: children["bad"].poll() is not None, 60, "the worker with a missing config exits")
        assert children["bad"].poll() == 2
        os.kill(children["w3"].pid, signal.SIGKILL)
        poll(lambda: children["w3"].poll() is not None, 60, "w3 seen dead")
        assert children["w3"].poll() == -signal.SIGKILL
        poll(lambda: children["w2"].poll() is not None, 60, "w2 exits fenced (after its hello goes unanswered)")
        assert children["w2"].poll() == 3
        assert children["w1"].alive
        r.set(keys.state, "completed")
        poll(lambda: children["w1"].poll() is not None, 60, "w1 leaves once the run is over")
        assert children["w1"].poll() == 0
        assert not list((run_dir / "zygote" / "exits").iterdir()), "a read record is deleted"
    finally:
        for c in children.values():
            c.kill()


@pytest.mark.integration
def test_a_config_that_fails_the_check_is_one_line_and_starts_no_service(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(up_args(tmp_path / "run", *FAST, "model.factory=cmemi.examples.digits:make_modle"),
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.factory" in lines[0] and "make_model" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "logs" / "aggregator.log").exists(), "a service started before the check"
    assert time.monotonic() - t0 < 120
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True).stdout == b""


@pytest.mark.integration
def test_a_sigkilled_zygote_stops_nothing_and_later_starts_fall_back(tmp_path: Path) -> None:
    """One run: services forked by the zygote; the zygote SIGKILLed mid-run; a worker killed after that is
    restarted as a new interpreter; the run completes; `cmemi up` leaves no process behind. Paced: without the
    zygote the replacement starts a new interpreter (seconds), and the run must still be going by then."""
    c = Cluster(tmp_path / "run", "train.steps=400", "scheduler.kwargs.T_max=400", "checkpoint.every_steps=0",
                "cluster.spare_workers=0", "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1",
                "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")
    try:
        c.wait_step(20)
        zpid = json.loads((c.run_dir / "zygote" / "ready.json").read_text())["pid"]
        before = {(role, i): int(rec["pid"]) for role in ("aggregator", "checkpointer", "worker")
                  for i, rec in c.members(role).items()}
        assert len(before) == 4 and all(parent(pid) == zpid for pid in before.values()), before
        for (role, _), pid in before.items():
            assert cmdline(pid)[:4] == [sys.executable, "-m", "cmemi", role]
        os.kill(zpid, signal.SIGKILL)
        step = c.step()
        c.wait_step(step + 20)
        now = {(role, i): int(rec["pid"]) for role in ("aggregator", "checkpointer", "worker")
               for i, rec in c.members(role).items()}
        assert now == before, "a service died with the zygote"
        c.replaced("worker", "w0", c.signal("worker", "w0"))
        new = int(c.members("worker")["w0"]["pid"])
        coordinator = int(c.members("coordinator")["0"]["pid"])
        assert parent(new) == coordinator, "the restart did not fall back to a new process"
        died = [e for e in c.events("died") if e["id"] == "w0"]
        assert died and died[-1]["how"] == "exited", died  # its exit code went with the zygote
        rc = c.wait()
    finally:
        c.close()
    assert rc == 0, c.output()
    assert c.summary["steps"] == 400
    assert subprocess.run(["pgrep", "-f", str(c.run_dir)], capture_output=True).stdout == b""


@pytest.mark.integration
@pytest.mark.parametrize("zygote_from", ["cmemi up", "template"])
def test_a_sigkilled_cmemi_up_takes_the_zygote_and_every_forked_service_with_it(
        tmp_path: Path, zygote_from: str, zygote_template: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own zygote dies with it by PR_SET_PDEATHSIG; one forked by the session's template
    (cmemi/launcher/zygote_template.py), whose parent is the template, by its pidfd of `cmemi up`."""
    if zygote_from == "template" and zygote_template is None:
        pytest.skip("CMEMI_TEST_TEMPLATE=0: no template this session")
    if zygote_from == "cmemi up":
        monkeypatch.delenv(TEMPLATE_ENV, raising=False)
    c = Cluster(tmp_path / "run", "train.steps=100000", "scheduler.kwargs.T_max=100000", "checkpoint.every_steps=0",
                "cluster.spare_workers=0")
    try:
        c.wait_step(5)
        zpid = json.loads((c.run_dir / "zygote" / "ready.json").read_text())["pid"]
        pids = [int(rec["pid"]) for role in ("coordinator", "aggregator", "checkpointer", "worker")
                for rec in c.members(role).values()]
        assert len(pids) == 5 and sum(parent(p) == zpid for p in pids) == 4, pids
        template = zygote_template and json.loads((Path(zygote_template).parent / "ready.json").read_text())["pid"]
        said = (c.run_dir / "zygote" / "template.txt").read_text() if zygote_from == "template" else ""
        assert said.startswith("forked by") or zygote_from != "template", said
        assert parent(zpid) == (template if zygote_from == "template" else c.proc.pid)
        pids.append(zpid)
        c.proc.kill()  # SIGKILL: nothing of `cmemi up` runs after this
        c.proc.wait()
        poll(lambda: not any(running(p) for p in pids), 60, "every process of the run gone")
    finally:
        c.close()
    assert subprocess.run(["pgrep", "-f", str(c.run_dir)], capture_output=True).stdout == b""
