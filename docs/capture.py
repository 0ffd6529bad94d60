"""Regenerate docs/status.txt and docs/plot.png from a real run with faults in it.

    .venv/bin/python docs/capture.py

Runs `cmemi up examples/digits.yaml` (run `digits-faults`, 1500 steps, evaluation every 250 steps) in
the background, SIGKILLs worker w1 at step ~430 (the warm spare takes over) and the aggregator at
step ~900 (it restarts from the latest checkpoint), captures `cmemi status` right after the worker
was replaced, and plots the finished run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmemi.shared.coordination.keys import Keys  # noqa: E402
from cmemi.shared.coordination.membership import connect, emit  # noqa: E402

RUN = "digits-faults"
RUN_DIR = Path("runs") / RUN
CMEMI = [sys.executable, "-m", "cmemi"]


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def main() -> None:
    os.chdir(ROOT)
    (RUN_DIR / "cluster.json").unlink(missing_ok=True)  # an earlier run's: not the Redis of this one
    log = open("/tmp/cmemi-capture.log", "w")  # noqa: SIM115
    up = subprocess.Popen([*CMEMI, "up", "examples/digits.yaml", "--overwrite", "--set", f"run.name={RUN}",
                           "--set", "train.steps=1500", "--set", "scheduler.kwargs.T_max=1500",
                           "--set", "eval.every_steps=250", "--set", "checkpoint.every_steps=100"],
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        capture(up)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=30)
    subprocess.run([*CMEMI, "plot", str(RUN_DIR), "-o", "docs/plot.png"], check=True)
    print(Path("docs/status.txt").read_text())


def capture(up: subprocess.Popen) -> None:
    info = wait(lambda: (RUN_DIR / "cluster.json").is_file() and json.loads((RUN_DIR / "cluster.json").read_text()),
                60, "cluster.json")
    r, k = connect(info["redis"]), Keys(info["run"])

    def step() -> int:
        return int(r.hget(k.progress, "step") or 0)

    def kill(role: str, ident: str) -> int:
        rec = r.hgetall(k.member(role, ident))
        emit(r, k, "fault_injected", role=role, id=ident, incarnation=int(rec["incarnation"]), signal="SIGKILL",
             pid=int(rec["pid"]))
        os.kill(int(rec["pid"]), signal.SIGKILL)
        return int(rec["incarnation"])

    def first_grad(ident: str, inc: int) -> bool:
        return any((e := json.loads(f["json"]))["kind"] == "first_grad_accepted" and e.get("worker") == ident
                   and e.get("incarnation") == inc for _id, f in r.xrevrange(k.events, count=50))

    wait(lambda: step() >= 430, 180, "step 430")  # not right on a checkpoint (every 100)
    old = kill("worker", "w1")
    new = wait(lambda: r.exists(k.heartbeat("worker", "w1"))
               and int(r.hget(k.member("worker", "w1"), "incarnation") or 0) > old
               and int(r.hget(k.member("worker", "w1"), "incarnation")), 60, "w1 replaced")
    wait(lambda: first_grad("w1", new), 60, "the new w1's first gradient")
    time.sleep(0.5)
    text = subprocess.run([*CMEMI, "status", str(RUN_DIR)], capture_output=True, text=True, check=True).stdout
    Path("docs/status.txt").write_text(f"$ cmemi status {RUN_DIR}\n{text}")
    wait(lambda: step() >= 900, 180, "step 900")
    kill("aggregator", "0")
    rc = up.wait(timeout=300)
    if rc != 0:
        raise SystemExit(f"cmemi up exited {rc}; see /tmp/cmemi-capture.log")

if __name__ == "__main__":
    main()
