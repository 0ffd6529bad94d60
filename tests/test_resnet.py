"""A model with BatchNorm and dropout, and torch + numpy + random augmentation in __getitem__ (examples/resnet):
one params_sha256 for 1, 2 and 3 workers, data read in the worker or ahead in loader processes, with a worker, a
loader and the aggregator SIGKILLed, equal to `cmemi reference`;
trained running statistics in the export; early stopping that survives an aggregator kill; accuracy like a plain
PyTorch loop. And user code that breaks: exit 2, one line, fast."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cmemi.shared.config.loading import load_config
from safetensors.torch import load_file

from cmemi.commands.reference import train
from tests.conftest import FAST, ROOT, cmemi_cmd, run_up
from tests.helpers.chaos import Cluster, poll
from tests.helpers.plain import plain_loop

RESNET = str(ROOT / "examples" / "resnet.yaml")
# Early stopping on a metric that never improves: evaluations at 10, 20, 30, 40 -> the run stops at step 50
# (the decision from the evaluation at 40 is taken at the next boundary). A checkpoint every 5 steps.
R = ("train.steps=60", "scheduler.kwargs.T_max=60", "cluster.spare_workers=0", "checkpoint.every_steps=5",
     "eval.fn=tests.helpers.fixtures:constant_eval", "eval.every_steps=10", "eval.early_stop_metric=score",
     "eval.patience=3", "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1")


@pytest.fixture(scope="module")
def resnet_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`cmemi reference` on R, through the command line."""
    out = tmp_path_factory.mktemp("reference") / "summary.json"
    args = [a for s in R for a in ("--set", s)]
    proc = subprocess.run(cmemi_cmd("reference", RESNET, *args, "--out", str(out)), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary and summary["stopped_early"] and summary["steps"] == 50, summary
    return summary


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_one_result_for_any_worker_count_and_faults(tmp_path: Path, resnet_reference: dict) -> None:
    want = resnet_reference["params_sha256"]
    for n, loaders in ((1, 0), (3, 2)):
        r = run_up(tmp_path / f"w{n}", *R, f"cluster.workers={n}", f"data.workers={loaders}", config=RESNET,
                   timeout=600)
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["params_sha256"] == want and r.summary["steps"] == 50, (n, r.summary)
    c = Cluster(tmp_path / "faults", *R, "cluster.workers=2", "data.workers=1", config=RESNET)
    try:
        c.wait_step(3, timeout=600)  # start-up on a loaded machine takes minutes
        c.signal("worker", "w0")
        c.wait_step(12, timeout=600)
        poll(lambda: kill_a_loader(c), 60, "a loader process killed")
        c.wait_step(22, timeout=600)
        c.signal("aggregator", "0")
        rc = c.wait(timeout=600)
    finally:
        c.close()
    assert rc == 0, c.output()
    assert "data loader died" in "".join(p.read_text() for p in (c.run_dir / "logs").glob("worker-*.log"))
    s = c.summary
    assert s["params_sha256"] == want and s["steps"] == 50 and s["stopped_early"], s
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["kind"] == "aggregator_started" for e in events) >= 2, "the aggregator was not restarted"
    assert any(e["kind"] == "died" and e["role"] == "worker" for e in events), "no worker died"
    assert s["eval_history"] == resnet_reference["eval_history"] and [e["step"] for e in s["eval_history"]] == [
        10, 20, 30, 40, 50]  # the one at 50 (when the stop is decided) is collected at the end
    weights = load_file(str(c.run_dir / "model.safetensors"))
    assert int(weights["1.num_batches_tracked"]) == 50 * 4  # one count per microbatch, as one process
    assert weights["1.running_mean"].abs().sum() > 0 and not torch.equal(weights["1.running_var"], torch.ones(16))


def loader_pids(workers: set[str]) -> list[int]:
    """Data loader processes (`python -m cmemi loader --worker-pid PID`) of these worker pids."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if argv[2:5] == [b"cmemi", b"loader", b"--worker-pid"] and argv[5].decode() in workers:
            pids.append(int(d.name))
    return pids


def kill_a_loader(c: Cluster) -> bool:
    """SIGKILL a data loader of a running worker; False (try again) if none is found or it exited meanwhile."""
    for pid in loader_pids({r["pid"] for r in c.members("worker").values()}):
        try:
            os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:  # its worker was just replaced
            continue
    return False


def test_accuracy_is_that_of_a_plain_pytorch_loop() -> None:
    """Over 3 seeds each (one seed's 360-image test set is too noisy to tell 1 point apart)."""
    torch.set_num_threads(1)
    sets = ["train.steps=60", "scheduler.kwargs.T_max=60", "optimizer.kwargs.lr=0.1"]
    ours = [train(load_config(RESNET, [*sets, f"run.seed={s}"]))[1]["eval"]["accuracy"] for s in range(3)]
    plain = [plain_loop(load_config(RESNET, sets), s)["accuracy"] for s in range(3)]
    lo, hi = min(plain), max(plain)
    assert lo - 0.02 <= statistics.mean(ours) <= hi + 0.02, (ours, plain)


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("cmemi: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def first_admission(run_dir: Path) -> float:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return min(e["t"] for e in events if e["kind"] == "worker_admitted")


def test_wrong_eval_signature_fails_at_start(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", *FAST, "eval.fn=tests.helpers.fixtures:eval_two_args", timeout=300)
    assert r.rc == 2 and not (r.run_dir / "cluster.json").exists(), "the cluster was left behind"
    events = r.run_dir / "events.jsonl"
    started = [e for e in (events.read_text().splitlines() if events.exists() else []) if '"process_started"' in e]
    assert not started, f"services were started: {started}"
    line = error_line(r.stderr)
    assert "eval.fn" in line and "eval_two_args" in line and "fixtures.py" in line


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sets, names", [
    (("model.factory=tests.helpers.fixtures:raising_model", "model.kwargs={}"), ("ValueError", "boom", "forward", "fixtures.py")),
    (("data.factory=tests.helpers.fixtures:uneven_dataset", "data.kwargs={}"), ("RuntimeError", "collate", "stack")),
    (("data.factory=tests.helpers.fixtures:uneven_dataset", "data.kwargs={}", "data.workers=1"),
     ("RuntimeError", "collate", "stack")),
], ids=["forward_raises", "collate_fails", "collate_fails_in_a_loader"])
def test_a_bug_in_user_code_stops_the_run_once(tmp_path: Path, sets: tuple[str, ...], names: tuple[str, ...]) -> None:
    r = run_up(tmp_path / "run", *FAST, *sets, "eval.fn=null", timeout=600)
    ended = time.time()
    assert r.rc == 2, r.stderr[-3000:]
    line = error_line(r.stderr)
    assert all(n in line for n in names), line
    assert ended - first_admission(r.run_dir) < 30
    kinds = [json.loads(x)["kind"] for x in (r.run_dir / "events.jsonl").read_text().splitlines()]
    assert "died" not in kinds and "restarted" not in kinds, "a user error was treated as a process fault"
