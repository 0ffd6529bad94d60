"""Data built once per host (cmemi/launcher/zygote_data.py, shared/runtime/prebuilt.py), without `cmemi up`: the
zygote's build against a process's own in fresh interpreters, fork safety, and the cases it refuses.
The runs themselves: tests/test_zygote_data_runs.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from cmemi.shared.runtime import prebuilt

from cmemi.launcher import zygote_data
from tests.conftest import ROOT
from tests.helpers.zygote_data_models import write_config


def probe(mode: str, config: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.zygote_data_probe", mode, config], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_a_taken_object_comes_once_for_its_key_with_the_generators_as_its_build_left_them() -> None:
    before = prebuilt.states()
    torch.manual_seed(5)
    numpy.random.seed(5)
    torch.rand(3)
    after = prebuilt.moved(before)
    assert after.numpy_state is not None and after.random_state is None  # numpy moved, random did not
    value = object()
    prebuilt.keep("dataset", "k", value, after)
    assert prebuilt.take("dataset", "other") == (False, None)  # another config builds its own: and it is gone
    prebuilt.keep("dataset", "k", value, after)
    torch.manual_seed(9)
    numpy.random.seed(9)
    state_random = random.getstate()
    assert prebuilt.take("dataset", "k") == (True, value)
    assert torch.equal(torch.get_rng_state(), after.torch_cpu)
    assert numpy.array_equal(numpy.random.get_state()[1], after.numpy_state[1])
    assert random.getstate() == state_random  # untouched: the factory left it alone
    assert prebuilt.take("dataset", "k") == (False, None)  # once per process
    assert prebuilt.held() == []


def test_children_of_the_zygote_get_what_their_own_build_gives(tmp_path: Path) -> None:
    """Weights, data, augmented items and every generator's state after the builds: equal, bit for bit."""
    config = write_config(str(tmp_path / "c.yaml"), count=str(tmp_path / "count"))
    out = probe("equal", config)
    assert out["shared"] and out["error"] is None and out["put_back"], out
    zygote, fresh = out.pop("zygote"), out.pop("fresh")
    assert zygote.pop("held") == ["dataset"] and fresh.pop("held") == []
    assert zygote == fresh
    assert zygote["again"] == zygote["model"]
    assert len((tmp_path / "count").read_text().split()) == 2  # the zygote's build, then the fresh child's


def test_a_child_forked_after_a_big_torch_op_in_the_factory_runs_parallel_regions(tmp_path: Path) -> None:
    """A zygote that had run it with more than one thread leaves the child hanging (its OpenMP pool is gone)."""
    out = probe("fork", write_config(str(tmp_path / "c.yaml"), big_op=True))
    assert out["shared"] and out["grew"] <= 0, out  # no thread started (an OpenMP pool would be one)
    assert out["child"] == {"sum": float(2 << 22)}, out


def test_more_than_one_thread_per_worker_is_not_shared_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    write_config(str(config), count=str(tmp_path / "count"))
    config.write_text(config.read_text().replace("spare_workers: 0", "spare_workers: 0, threads_per_worker: 2"))
    assert zygote_data.build(str(config)) == zygote_data.Verdict()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cluster.threads_per_worker=2" in lines[0], lines
    assert not (tmp_path / "count").exists() and prebuilt.held() == []


def test_opted_out_builds_nothing_and_says_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    write_config(str(config), count=str(tmp_path / "count"))
    config.write_text(config.read_text().replace("spare_workers: 0", "spare_workers: 0, zygote_data: false"))
    assert zygote_data.build(str(config)) == zygote_data.Verdict()
    assert capsys.readouterr().err == "" and not (tmp_path / "count").exists() and prebuilt.held() == []


def test_a_dataset_factory_that_raises_is_the_users_one_line(tmp_path: Path) -> None:
    config = write_config(str(tmp_path / "c.yaml"), factory="raising_dataset", n=8)
    verdict = zygote_data.build(config)
    assert not verdict.shared and not verdict.unsafe and verdict.error is not None
    assert "\n" not in verdict.error
    assert "cannot read the dataset" in verdict.error and "raising_dataset" in verdict.error
    assert "ValueError: the corpus has 8 lines" in verdict.error and "zygote_data_models.py:" in verdict.error
    assert prebuilt.held() == []
