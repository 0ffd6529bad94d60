"""The zygote template (cmemi/launcher/zygote_template.py), on the session's real one (tests/conftest.py): it forks a
zygote that takes the asker's descriptors and reports its exit, and refuses, in words, whoever a fork could not
serve as a fresh zygote would; what is not a request is dropped, and it serves on. (That a run's zygote forked here
dies with `cmemi up`: tests/test_zygote.py's SIGKILL test; that runs through it give the reference's bits: every
cluster test of the suite.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cmemi.shared.runtime.zygote import connect_path

from cmemi.launcher.zygote_up import TEMPLATE_ENV, Forked
from tests.conftest import DIGITS, FAST, ROOT, cmemi_cmd, up_args
from tests.helpers.chaos import poll

ZYGOTE = [sys.executable, "-m", "cmemi", "zygote"]


@pytest.fixture
def template(zygote_template: str | None) -> str:
    if zygote_template is None:
        pytest.skip("CMEMI_TEST_TEMPLATE=0: no template this session")
    return zygote_template


def request(**changes: Any) -> dict[str, Any]:
    return {"argv": ZYGOTE, "env": dict(os.environ), "cwd": os.getcwd(), "umask": 0o022, **changes}


def raw_ask(path: str, req: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
    """The template's reply (None: it closed without one, i.e. dropped the request); a pidfd it sent is closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    short, fd = connect_path(path)
    try:
        with sock:
            sock.connect(short)
            socket.send_fds(sock, [json.dumps(req).encode() + b"\n"], fds)
            data, got, _flags, _addr = socket.recv_fds(sock, 65536, 1)
    finally:
        os.close(fd)
    for extra in got:
        os.close(extra)
    return json.loads(data) if data else None


def test_a_forked_zygote_reads_the_askers_stdin_and_its_exit_is_read_back(template: str) -> None:
    """The zygote reads its one line from the pipe the asker sent; a line that is no run makes it exit 0 (as when
    `cmemi up` ends before it has a run); the template's record of its exit gives the code."""
    forked = Forked.ask(template, ZYGOTE)
    assert isinstance(forked, Forked), forked
    with forked.stdin:
        poll(lambda: Path(f"/proc/{forked.pid}/cmdline").read_bytes().split(b"\0")[:4] == [a.encode() for a in ZYGOTE],
             30, "the forked zygote titled `python -m cmemi zygote`")
        assert forked.poll() is None
        forked.stdin.write(b"not a run\n")
    assert forked.wait(timeout=60) == 0


@pytest.mark.parametrize("what, fds, why", [
    ({"env": {**os.environ, "PYTHONPATH": "/elsewhere"}}, 3, "PYTHONPATH"),
    ({"env": {**os.environ, "OMP_NUM_THREADS": "7"}}, 3, "OMP_NUM_THREADS"),
    ({"env": {**os.environ, "KMP_DUPLICATE_LIB_OK": "True"}}, 3, ""),  # scikit-learn's import sets it: served
    ({"env": {**os.environ, "CMEMI_HUGE_PAGES": "0"}}, 3, "GLIBC_TUNABLES"),  # its zygote would start without them
    ({"argv": [sys.executable, "-m", "cmemi", "worker"]}, 3, None),  # it forks zygotes only: dropped
    ({}, 2, None),  # not its three descriptors: dropped
    ({"umask": "022"}, 3, None),
])
def test_what_a_fork_cannot_serve_is_refused_or_dropped_and_it_serves_on(template: str, what: dict[str, Any],
                                                                           fds: int, why: str | None) -> None:
    r, w = os.pipe()
    try:
        reply = raw_ask(template, request(**what), [r, 1, 2][:fds])
    finally:
        os.close(r)
        os.close(w)
    if why is None:
        assert reply is None
    elif not why:
        assert reply is not None and "pid" in reply, reply  # served (the zygote exits at the pipe's end)
    else:
        assert reply is not None and why in reply["error"], reply
    forked = Forked.ask(template, ZYGOTE)  # and the next good request is served
    assert isinstance(forked, Forked), forked
    forked.stdin.close()
    assert forked.wait(timeout=60) == 0


def test_another_niceness_is_refused(template: str) -> None:
    """A process the template could not make its fork like (here: niceness) is told why; `cmemi up` then starts its
    own zygote (cmemi/launcher/zygote_up.py)."""
    code = ("import json, os, sys; from tests.test_zygote_template import raw_ask, request; r, w = os.pipe(); "
            f"print(json.dumps(raw_ask({template!r}, request(), [r, 1, 2])))")
    out = subprocess.run(["nice", "-n", "3", sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "niceness" in json.loads(out.stdout.splitlines()[-1])["error"]


@pytest.mark.integration
def test_a_run_the_template_refuses_says_why_and_starts_its_own_zygote(template: str, tmp_path: Path) -> None:
    flag = "0" if os.environ.get("PYTHONDONTWRITEBYTECODE") == "1" else "1"
    proc = subprocess.run(up_args(tmp_path / "run", *FAST), cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": flag})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "zygote" / "template.txt").read_text() == (
        "not served by the zygote template: refused: interpreter-start variables differ: PYTHONDONTWRITEBYTECODE; "
        "started its own\n")
    assert "template" not in proc.stderr  # a run's errors stay one line (tests/test_hf_lm.py, tests/test_config.py)
    phases = json.loads((tmp_path / "run" / "startup.json").read_text())["processes"]["zygote"]
    assert list(phases) == ["spawned", "imported", "user_code_imported", "plugins_checked", "listening"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 60


def test_a_variable_torch_sets_itself_is_no_difference_unless_given_another_value(template: str) -> None:
    """torch sets TORCHINDUCTOR_CACHE_DIR in os.environ when torch._dynamo is imported (the template's imports and
    any process that used torch.optim): a `cmemi up` started by such a process passes it on, as a fresh zygote's
    import would set it — served (refused before: tests/test_config.py's one-line errors got a second line); set to
    another directory, it is a difference."""
    import torch._dynamo  # noqa: F401  (sets it here, as in the template)

    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    forked = Forked.ask(template, ZYGOTE)
    assert isinstance(forked, Forked), forked
    forked.stdin.close()
    assert forked.wait(timeout=60) == 0
    r, w = os.pipe()
    try:
        reply = raw_ask(template, request(env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}), [r, 1, 2])
    finally:
        os.close(r)
        os.close(w)
    assert reply is not None and "TORCHINDUCTOR_CACHE_DIR" in reply["error"], reply



@pytest.mark.integration
def test_cmemi_reference_is_forked_past_its_imports_and_gives_what_it_gives_alone(template: str, tmp_path: Path) -> None:
    """~40 references a suite, each a torch import: the template forks them too. The output and the exit codes are
    a fresh interpreter's: the same summary, and a bad config's one line with code 2. Who computed it: the user's
    module records its importer's pid and argv (tests/helpers/usercode_models.py) — a child of the template, not
    the `cmemi reference` we started."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "ref-template", "seed": 0, "dir": str(tmp_path / "run")},
        "model": {"factory": "tests.helpers.usercode_models:model", "kwargs": {"classes": 4}},
        "data": {"factory": "tests.helpers.usercode_models:train_set", "kwargs": {"classes": 4}},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9}},
        "train": {"steps": 5, "global_batch": 32, "microbatches": 4, "loss": "torch.nn.functional:cross_entropy"}}))
    outs = {}
    for name, drop in (("forked", ()), ("alone", (TEMPLATE_ENV,))):
        imports = tmp_path / f"{name}.txt"
        env = {**{k: v for k, v in os.environ.items() if k not in drop}, "CMEMI_TEST_IMPORTS": str(imports)}
        proc = subprocess.Popen(cmemi_cmd("reference", str(config)), cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        (line,) = imports.read_text().splitlines()
        pid, argv = line.split(maxsplit=1)
        assert argv.split()[0] == "reference"
        assert (int(pid) == proc.pid) == (name == "alone"), f"{name}: computed by {pid}, asker {proc.pid}"
        outs[name] = {k: v for k, v in json.loads(out).items() if k != "wall_s"}  # wall_s: the clock's
    assert outs["forked"] == outs["alone"]
    bad = subprocess.run(cmemi_cmd("reference", str(config), "--set", "train.stepz=5"), cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr[-3000:]
    assert len(bad.stderr.strip().splitlines()) == 1 and "train.stepz" in bad.stderr, bad.stderr


@pytest.mark.integration
def test_a_forked_reference_dies_with_the_command_that_asked_for_it(template: str) -> None:
    """A timeout that SIGKILLs `cmemi reference` must not leave its forked child training on (its lifeline)."""
    before = set(children(template))
    asker = subprocess.Popen(cmemi_cmd("reference", DIGITS, "--set", "train.steps=100000"), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll(lambda: set(children(template)) - before, 60, "the template forked the reference")
        (child,) = set(children(template)) - before
    finally:
        asker.kill()
        asker.wait(timeout=30)
    poll(lambda: child not in children(template), 30, "the forked reference gone with its asker")


def children(template: str) -> list[int]:
    pid = json.loads((Path(template).parent / "ready.json").read_text())["pid"]
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
