"""User code runs as in a plain PyTorch script (tests/helpers/usercode_models.py): factories that cache tensors, read the
data and torch.load pretrained weights start and agree bitwise with `cmemi reference`; a run fine-tunes another
run's model on a new head (model.init_from); the user's module is imported once per host (by the zygote) and the
aggregator never reads the data."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from cmemi.shared.config.loading import load_config
from safetensors.torch import save_file

from cmemi.commands.reference import train
from tests.conftest import ROOT, cmemi_cmd
from tests.helpers.usercode_models import tokens


def write_config(path: Path, run_dir: Path, classes: int, **model: object) -> Path:
    path.write_text(yaml.safe_dump({
        "run": {"name": f"u{abs(hash(str(run_dir))) % 10**8}", "seed": 0, "dir": str(run_dir)},
        "model": {"factory": "tests.helpers.usercode_models:model", "kwargs": {"classes": classes}, **model},
        "data": {"factory": "tests.helpers.usercode_models:train_set", "kwargs": {"classes": classes}},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9}},
        "train": {"steps": 12, "global_batch": 32, "microbatches": 4, "loss": "torch.nn.functional:cross_entropy"},
        "cluster": {"workers": 2, "spare_workers": 0},
        "checkpoint": {"every_steps": 0},
    }))
    return path


@pytest.mark.integration
def test_factories_with_side_effects_fine_tune_a_new_head_and_match_the_reference(tmp_path: Path) -> None:
    # pretrained embeddings, torch.save'd: the factory torch.loads them into a module-level cache
    emb = tmp_path / "emb.pt"
    torch.save(torch.linspace(-1, 1, (int(tokens().max()) + 1) * 8).reshape(-1, 8), emb)
    # a model trained on 4 classes, saved as a run directory holds it (RUN_DIR/model.safetensors)
    base = load_config(str(write_config(tmp_path / "base.yaml", tmp_path / "base", 4, kwargs={"classes": 4,
                                                                                                "embedding": str(emb)})), [])
    trainer, _ = train(base)
    (tmp_path / "base").mkdir()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, tmp_path / "base" / "model.safetensors")
    # fine-tune it on 3 classes: the head and the class prior keep the factory's values, the rest is loaded
    cfg_path = write_config(tmp_path / "tune.yaml", tmp_path / "tune", 3, kwargs={"classes": 3, "embedding": str(emb)},
                            init_from=str(tmp_path / "base"), init_strict=False)
    imports, data = tmp_path / "imports.txt", tmp_path / "data.txt"
    env = {**os.environ, "CMEMI_TEST_IMPORTS": str(imports), "CMEMI_TEST_DATA": str(data)}
    # each worker builds its own dataset here (the zygote's one build: tests/test_zygote_data_runs.py)
    proc = subprocess.run(cmemi_cmd("up", str(cfg_path), "--set", "cluster.zygote_data=false"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "tune" / "summary.json").read_text())
    _, expected = train(load_config(str(cfg_path), []))
    assert summary["params_sha256"] == expected["params_sha256"]  # the same weights loaded, the same bits trained
    assert "kept the factory's values for 3 names" in proc.stderr and "wrong shape: head.weight is [4, 16]" in proc.stderr
    # imported once, by the zygote, before it forked every service (zygote_imports: true)
    assert [line.split()[1] for line in imports.read_text().splitlines()] == ["zygote"]
    # the data were read by the two workers only: the aggregator takes the first worker's fingerprint
    assert sorted(line.split()[1] for line in data.read_text().splitlines()) == ["worker", "worker"]


@pytest.mark.integration
def test_a_missing_init_from_is_one_line_and_exit_2_before_any_service(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path / "c.yaml", tmp_path / "run", 4, init_from=str(tmp_path / "nowhere"))
    t0 = time.monotonic()
    proc = subprocess.run(cmemi_cmd("up", str(cfg_path)), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("cmemi: error:")]
    assert len(errors) == 1 and "model.init_from" in errors[0] and "no such file or directory" in errors[0]
    assert "cmemi: run" not in proc.stdout  # said before Redis, the zygote's check or any service started
    assert time.monotonic() - t0 < 60
