"""`cmemi up` end to end: real processes, a real redis-server, real ZeroMQ sockets on loopback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model, build_optimizer, build_scheduler
from cmemi.shared.core.data import fetch, microbatch_indices
from safetensors.torch import load_file

from tests.conftest import DIGITS, FAST, ROOT, cmemi_cmd, run_up

pytestmark = pytest.mark.integration


def test_run_completes_with_everything_in_the_run_dir(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", *FAST)
    assert r.rc == 0, r.stderr[-3000:]
    s = r.summary
    for key in ("steps", "final_loss", "eval", "wall_s", "samples_per_s", "workers", "bytes_sent",
                "bytes_received", "params_sha256"):
        assert key in s
    assert s["steps"] == 60 and s["workers"] == 2 and s["bytes_sent"] > 0 and s["bytes_received"] > 0
    assert s["eval"]["accuracy"] > 0.8
    assert "completed 60 steps" in r.stdout
    metrics = r.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 61))
    assert all({"loss", "lr", "samples_per_s", "bytes_in", "bytes_out"} <= m.keys() for m in metrics)
    kinds = {e["kind"] for e in r.events()}
    assert {"coordinator_started", "worker_admitted", "run_completed", "checkpoint_saved"} <= kinds
    # nothing left early and was started again: workers told the steps are done wait for the run to complete
    assert not kinds & {"exited", "restarted", "died"}, sorted(kinds)
    effective = load_config(r.run_dir / "config.yaml")
    assert effective.train.steps == 60 and effective.cluster.spare_workers == 0
    weights = load_file(str(r.run_dir / "model.safetensors"))
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"}

    # the terminal gets the progress lines and the final line; the services' logs are files in the run dir
    assert '"event"' not in r.stderr and '"event"' not in r.stdout, r.stderr[-2000:]
    logs = {p.name for p in (r.run_dir / "logs").glob("*.log")}
    assert {"coordinator.log", "aggregator.log", "checkpointer.log", "worker-w0.log", "worker-w1.log"} <= logs, logs
    shown = subprocess.run(cmemi_cmd("logs", str(r.run_dir), "aggregator"), cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "run completed" in shown.stdout and "worker-w0" not in shown.stdout, shown
    raw = subprocess.run(cmemi_cmd("logs", str(r.run_dir), "--json"), cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout.splitlines()
    services = {json.loads(line)["service"] for line in raw if line.startswith("{")}
    assert services == {"aggregator", "checkpointer", "worker"}, services  # the coordinator is quiet without faults
    stamps = [json.loads(line)["timestamp"] for line in raw if line.startswith("{")]
    assert stamps == sorted(stamps)

    # samples/s, one definition: summary = steps x global_batch / training wall time = the final line's figure,
    # and the last progress line (published at the last step, over the whole run) agrees with it; the only
    # difference is the few milliseconds between that publish and the summary's wall-clock reading
    assert s["samples_per_s"] == pytest.approx(60 * 64 / s["wall_s"], rel=1e-9)
    assert f"({s['samples_per_s']:.0f} samples/s)" in r.stdout
    # (up polls progress every 0.25 s and the aggregator lingers 1 s after its last step: the line is there)
    final = [line for line in r.stdout.splitlines() if line.startswith("step     60/60")]
    assert final, r.stdout
    shown_rate = float(final[-1].split(" samples/s")[0].split()[-1])
    assert shown_rate == pytest.approx(s["samples_per_s"], rel=0.1), (final, s)


def test_same_params_with_1_2_3_workers_and_one_gradient_per_worker_per_step(tmp_path: Path) -> None:
    """M = 8: leases are blocks of the reduction tree (8, 4 and 2 microbatches for W = 1, 2, 3), each summed by its
    worker. The result is bitwise `cmemi reference`'s, which sums microbatch by microbatch; and at W = 2 a worker
    sends one gradient per step (at most two, when an idle worker recomputes a slow one's block)."""
    sets = (*FAST, "train.microbatches=8")
    out = tmp_path / "reference.json"
    ref = subprocess.run(cmemi_cmd("reference", DIGITS, *[a for s in sets for a in ("--set", s)], "--out", str(out)),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    shas = {"reference": json.loads(out.read_text())["params_sha256"]}
    for n in (1, 2, 3):
        r = run_up(tmp_path / f"w{n}", *sets, f"cluster.workers={n}")
        assert r.rc == 0, r.stderr[-3000:]
        shas[n] = r.summary["params_sha256"]
        if n == 2:
            model = build_model(load_config(DIGITS, list(sets)))
            gradient = sum(p.numel() * p.element_size() for p in model.parameters())
            headers = 4096  # msgpack header and tensor table of one gradient message, generously
            per_step = sorted(m["bytes_in"] for m in r.metrics())
            assert per_step[-1] <= n * 2 * (gradient + headers), (per_step[-1], gradient)
            assert n * gradient <= per_step[len(per_step) // 2] <= n * (gradient + headers), (per_step, gradient)
    assert len(set(shas.values())) == 1, shas


def plain_loop(cfg_path: str, overrides: list[str]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same global batches through an ordinary single-process PyTorch loop."""
    cfg = load_config(cfg_path, overrides)
    model = build_model(cfg)
    opt = build_optimizer(cfg, model.parameters())
    sched = build_scheduler(cfg, opt)
    ds = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
    loss_fn = resolve(cfg.train.loss, "train.loss")
    lrs = []
    for s in range(cfg.train.steps):
        idx = torch.cat([microbatch_indices(cfg.run.seed, len(ds), cfg.train.global_batch, cfg.train.microbatches, s, m)
                         for m in range(cfg.train.microbatches)])
        x, y = fetch(ds, idx)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return {k: v.detach() for k, v in model.state_dict().items()}, lrs


def test_matches_a_plain_pytorch_loop(tmp_path: Path) -> None:
    overrides = [*FAST, "model.kwargs.dropout=0.0", "cluster.workers=3"]
    r = run_up(tmp_path / "run", *overrides)
    assert r.rc == 0, r.stderr[-3000:]
    expected, lrs = plain_loop(DIGITS, overrides)
    got = load_file(str(r.run_dir / "model.safetensors"))
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5)
    assert [m["lr"] for m in r.metrics()] == pytest.approx(lrs, rel=1e-12, abs=0)


def test_unreadable_data_is_one_clear_line(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", *FAST, "data.factory=tests.helpers.fixtures:file_dataset",
               f"data.kwargs={{path: {tmp_path}/missing.pt}}", timeout=120)
    assert r.rc == 2  # user-fixable: not retried
    error = [line for line in r.stderr.splitlines() if line.startswith("cmemi: error:")][-1]
    assert "cannot read the dataset" in error and "missing.pt" in error and "on host" in error
    assert "check that data.kwargs" in error
    assert "FileNotFoundError" in error and "file_dataset" in error  # the user's exception and function
    assert sum(line.startswith("cmemi: error:") for line in r.stderr.splitlines()) == 1  # said once


def test_different_data_on_a_worker_is_refused(tmp_path: Path) -> None:
    # steps enough that the run cannot end before both workers said hello (it fails at the second's hello)
    r = run_up(tmp_path / "run", *FAST, "train.steps=20000", "scheduler.kwargs.T_max=20000",
               "data.factory=tests.helpers.fixtures:worker_sees_other_data", "data.kwargs={}",
               # data built in each worker, as on separate hosts: the zygote's one build (cluster.zygote_data) would
               # give every worker of this host the same dataset, which is what it is for
               "cluster.zygote_data=false", timeout=300)  # workers must start to be refused: minutes on a loaded machine
    assert r.rc == 2
    error = [line for line in r.stderr.splitlines() if line.startswith("cmemi: error:")][-1]
    assert "has a different dataset" in error and "on host" in error and "same data on every host" in error


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA GPU")
def test_a_gpu_requested_where_there_is_none_is_one_clear_line(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", *FAST, "device=cuda", timeout=120)
    assert r.rc == 2  # user-fixable: the config asks for a GPU this host does not have
    error = [line for line in r.stderr.splitlines() if line.startswith("cmemi: error:")][-1]
    assert "'device' = 'cuda'" in error and "sees no CUDA GPU" in error and "device: cpu" in error


def test_existing_run_dir_needs_resume_or_overwrite(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({}))
    r = run_up(run_dir, *FAST, timeout=60)
    assert r.rc == 2 and "--resume" in r.stderr and "--overwrite" in r.stderr


def test_services_show_their_role_and_run_with_huge_pages(tmp_path: Path) -> None:
    """Each service's command line names its role (operators and chaos scripts find them by it), and
    glibc's malloc was told to use transparent huge pages for large buffers (see cmemi/cli.py)."""
    import os

    from tests.helpers.chaos import Cluster, poll

    c = Cluster(tmp_path / "run", "train.steps=100000", "scheduler.kwargs.T_max=100000", "checkpoint.every_steps=0",
                "cluster.spare_workers=0")
    try:
        def running() -> list[tuple[str, dict[str, str]]] | None:
            found = [(role, rec) for role in ("aggregator", "worker", "checkpointer") for rec in c.members(role).values()]
            return found if len(found) == 4 else None

        for role, rec in poll(running, 120, "aggregator, 2 workers and checkpointer running"):
            pid = int(rec["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"cmemi" in cmdline and role.encode() in cmdline, (role, cmdline)
            environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if kv)
            if os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
                assert b"glibc.malloc.hugetlb=1" in environ.get(b"GLIBC_TUNABLES", b""), (role, rec["id"])
    finally:
        c.close()
