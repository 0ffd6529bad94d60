"""Config schema: every field validated, errors name the field, the value and the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import config_from_dict, dump_config, env_overrides, load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_optimizer, build_scheduler, check_plugins
from cmemi.shared.config.schema import Config

from tests.conftest import DIGITS, ROOT, cmemi_cmd

BASE = {"model": {"factory": "cmemi.examples.digits:make_model"}, "data": {"factory": "cmemi.examples.digits:make_dataset"}}


def cfg_with(**sections: dict) -> Config:
    raw = {**BASE, **sections}
    return config_from_dict(raw)


def test_example_config_loads_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(DIGITS)
    assert cfg.cluster.workers == 2 and cfg.train.microbatches == 4
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("section, value, expected", [
    ({"cluster": {"workers": 0}}, None, "cluster.workers' = 0: must be >= 1"),
    ({"cluster": {"workers": "two"}}, None, "cluster.workers' = 'two': expected int"),
    ({"cluster": {"wrokers": 2}}, None, "unknown key 'cluster.wrokers'"),
    ({"train": {"global_batch": 30, "microbatches": 4}}, None, "must be divisible by train.microbatches=4"),
    ({"train": {"steps": -1}}, None, "train.steps' = -1: must be > 0"),
    ({"cluster": {"dead_after": 0.1}}, None, "cluster.dead_after"),
    ({"cluster": {"redis": "localhost:6379"}}, None, "must be a redis:// or rediss:// URL"),
    ({"precision": "fp8"}, None, "precision"),
    ({"device": "gpu"}, None, "config field 'device' = 'gpu': must be auto, cpu, cuda or cuda:N"),
    ({"checkpoint": {"keep_last": 0}}, None, "checkpoint.keep_last"),
    ({"data": {"factory": "m:f", "workers": -1}}, None, "data.workers' = -1: must be between 0 and 32"),
])
def test_bad_values_name_field_and_fix(section: dict, value: None, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg_with(**section)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match="valid keys are: .*workers"):
        cfg_with(cluster={"wrokers": 2})
    with pytest.raises(ConfigError, match="unknown key 'bogus' in the top level"):
        config_from_dict({**BASE, "bogus": 1})


def test_set_overrides_any_field_and_env() -> None:
    cfg = config_from_dict(BASE, ["cluster.workers=3", "optimizer.kwargs.lr=0.5", "eval.fn=null"])
    assert cfg.cluster.workers == 3 and cfg.optimizer.kwargs["lr"] == 0.5 and cfg.eval.fn is None
    assert env_overrides({"CMEMI__CLUSTER__REDIS": "redis://h:1/0", "OTHER": "x"}) == ["cluster.redis=redis://h:1/0"]
    cfg = load_config(DIGITS, environ={"CMEMI__CLUSTER__WORKERS": "5"})
    assert cfg.cluster.workers == 5
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config_from_dict(BASE, ["cluster.workers"])


def test_missing_factory_lists_what_module_has() -> None:
    cfg = cfg_with(model={"factory": "cmemi.examples.digits:make_modle"})
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg)
    msg = str(err.value)
    assert "model.factory" in msg and "Did you mean 'make_model'" in msg and "make_dataset" in msg
    with pytest.raises(ConfigError, match="cannot import module 'cmemi.examples.nope'"):
        resolve("cmemi.examples.nope:x", "model.factory")


def test_any_torch_optimizer_and_scheduler_by_name() -> None:
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    for name, kwargs in [("SGD", {"lr": 0.1}), ("AdamW", {"lr": 1e-3}), ("RMSprop", {"lr": 1e-3}),
                         ("Adagrad", {"lr": 0.1}), ("NAdam", {"lr": 1e-3})]:
        cfg = cfg_with(optimizer={"name": name, "kwargs": kwargs})
        opt = build_optimizer(cfg, params)
        assert type(opt).__name__ == name
    cfg = cfg_with(optimizer={"name": "SGD", "kwargs": {"lr": 0.1}},
                   scheduler={"name": "OneCycleLR", "kwargs": {"max_lr": 0.1, "total_steps": 10}})
    assert type(build_scheduler(cfg, build_optimizer(cfg, params))).__name__ == "OneCycleLR"
    with pytest.raises(ConfigError, match="available: .*AdamW"):
        build_optimizer(cfg_with(optimizer={"name": "Adamm"}), params)
    with pytest.raises(ConfigError, match="rejected by SGD"):
        build_optimizer(cfg_with(optimizer={"name": "SGD", "kwargs": {"lr": 0.1, "betas": 1}}), params)
    # a custom class by import path
    cfg = cfg_with(optimizer={"name": "torch.optim:Adam", "kwargs": {"lr": 0.01}})
    assert type(build_optimizer(cfg, params)).__name__ == "Adam"


def test_optimizers_take_the_fused_kernel_where_torch_has_one_else_foreach_and_explicit_choices_stand() -> None:
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = build_optimizer(cfg_with(optimizer={"name": "Adam", "kwargs": {"lr": 1e-3}}), params)
    assert opt.defaults["fused"] is True
    opt = build_optimizer(cfg_with(optimizer={"name": "NAdam", "kwargs": {"lr": 1e-3}}), params)  # no fused kernel
    assert opt.defaults["foreach"] is True
    opt = build_optimizer(cfg_with(optimizer={"name": "Adam", "kwargs": {"lr": 1e-3, "foreach": False}}), params)
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is False
    with pytest.raises(ConfigError, match="rejected by Adam"):  # a bad value still names the field
        build_optimizer(cfg_with(optimizer={"name": "Adam", "kwargs": {"lr": -1}}), params)


@pytest.mark.parametrize("args, expected", [
    (["--set", "cluster.workers=0"], "cluster.workers' = 0: must be >= 1"),
    (["--set", "model.factory=cmemi.examples.digits:nothing"], "has no attribute 'nothing'"),
    (["--set", "cluster.wrokers=2"], "unknown key 'cluster.wrokers'"),
])
def test_cli_bad_config_is_one_line_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    proc = subprocess.run(cmemi_cmd("up", DIGITS, "--set", f"run.dir={tmp_path}", *args), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cmemi: error: ") and expected in lines[0], proc.stderr


def test_cli_missing_config_file() -> None:
    proc = subprocess.run(cmemi_cmd("up", "nope.yaml"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_yaml_exponent_floats_are_numbers(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("model: {factory: 'cmemi.examples.digits:make_model'}\n"
                                     "data: {factory: 'cmemi.examples.digits:make_dataset'}\n"
                                     "optimizer: {name: AdamW, kwargs: {lr: 3e-3}}\n")
    assert load_config(tmp_path / "c.yaml").optimizer.kwargs["lr"] == 0.003
    assert config_from_dict(BASE, ["optimizer.kwargs.lr=1e-4"]).optimizer.kwargs["lr"] == 1e-4


def test_schedule_shorter_than_the_run_fails_before_start() -> None:
    cfg = cfg_with(train={"steps": 20}, optimizer={"name": "SGD", "kwargs": {"lr": 0.1}},
                   scheduler={"name": "OneCycleLR", "kwargs": {"max_lr": 0.1, "total_steps": 10}})
    with pytest.raises(ConfigError, match="fails at step 1[12] of train.steps=20.*total_steps >= train.steps"):
        check_plugins(cfg)
