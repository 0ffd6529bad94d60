"""Training features on the aggregator: clipping, param groups, periodic eval, early stop, /metrics."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch
from cmemi.shared.config.loading import config_from_dict
from cmemi.shared.config.plugins import build_optimizer
from safetensors.torch import load_file

from tests.conftest import DIGITS, FAST, run_up
from tests.helpers.chaos import Cluster, poll
from tests.test_up import plain_loop

pytestmark = pytest.mark.integration


def test_clipping_matches_clip_grad_norm_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [*FAST, "model.kwargs.dropout=0.0", "train.clip_grad_norm=0.05", "cluster.workers=2"]
    r = run_up(tmp_path / "run", *overrides)
    assert r.rc == 0, r.stderr[-3000:]
    real_step = torch.optim.SGD.step
    norms = []

    def clipped_step(self, *a, **k):  # clip exactly where the aggregator does: right before optimizer.step()
        params = [p for g in self.param_groups for p in g["params"]]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", clipped_step)
    expected, _ = plain_loop(DIGITS, overrides)
    assert max(norms) > 0.05, "the test must actually clip"
    got = load_file(str(r.run_dir / "model.safetensors"))
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5)
    unclipped = run_up(tmp_path / "free", *overrides[:-2], "cluster.workers=2")
    assert unclipped.summary["params_sha256"] != r.summary["params_sha256"]


def test_param_groups_by_regex() -> None:
    cfg = config_from_dict({"model": {"factory": "cmemi.examples.digits:make_model"},
                            "data": {"factory": "cmemi.examples.digits:make_dataset"},
                            "optimizer": {"name": "AdamW", "kwargs": {"lr": 0.01, "weight_decay": 0.1},
                                          "param_groups": [{"match": "bias$", "weight_decay": 0.0}]}})
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = build_optimizer(cfg, dict(model.named_parameters()))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and len(decay["params"]) == 2
    assert no_decay["weight_decay"] == 0.0 and {id(p) for p in no_decay["params"]} == {
        id(model[0].bias), id(model[1].bias)}


def test_eval_cadence_and_deterministic_early_stop(tmp_path: Path) -> None:
    r = run_up(tmp_path / "run", *FAST, "eval.every_steps=20")
    assert r.rc == 0, r.stderr[-3000:]
    evals = [m for m in r.metrics() if "eval" in m]
    assert [e["step"] for e in evals] == [20, 40]
    assert [e["step"] for e in r.summary["eval_history"]] == [20, 40]
    assert all("accuracy" in e["eval"] for e in evals) and not r.summary["stopped_early"]
    # a metric that never improves: best at step 10, no better at 20 -> decided at the 30 boundary
    stop = ("eval.fn=tests.helpers.fixtures:constant_eval", "eval.every_steps=10", "eval.early_stop_metric=score",
            "eval.patience=1")
    shas = set()
    for n in (1, 2):
        r = run_up(tmp_path / f"stop{n}", *FAST, *stop, f"cluster.workers={n}")
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["stopped_early"] and r.summary["steps"] == 30
        shas.add(r.summary["params_sha256"])
    assert len(shas) == 1


def test_prometheus_metrics_endpoint(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "run", "train.steps=1200", "scheduler.kwargs.T_max=1200", "metrics.enabled=true",
                "cluster.spare_workers=0")
    try:
        c.wait_step(50)
        url = poll(lambda: c.redis.hget(c.keys.member("aggregator", "0"), "metrics_url"), 30, "metrics_url")
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        for name in ("cmemi_steps_total", "cmemi_step_seconds_bucket", "cmemi_bytes_in_total", "cmemi_live_workers"):
            assert name in body, name
        steps = float(next(line.split()[1] for line in body.splitlines() if line.startswith("cmemi_steps_total")))
        assert steps >= 50
        coord = c.redis.hget(c.keys.member("coordinator", "0"), "metrics_url")
        assert "cmemi_deaths" in urllib.request.urlopen(coord, timeout=10).read().decode()
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
