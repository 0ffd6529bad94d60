"""Data built once per host, end to end: `cmemi up` with real processes, a real redis-server and the zygote.

The same params_sha256 with and without cluster.zygote_data on a dataset that draws from every global generator
at build time and augments at random on every read; the dataset factory runs once per host with it (each worker
once without it); a factory that raises in the zygote is the user's one line, exit 2, before any service starts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from cmemi.shared.config.loading import load_config

from cmemi.commands.reference import train
from tests.conftest import ROOT, cmemi_cmd, run_up
from tests.helpers.zygote_data_models import write_config

pytestmark = pytest.mark.integration


def builds(count: Path) -> list[str]:
    return count.read_text().split()


def test_the_same_bits_with_the_data_built_once_or_in_every_worker(tmp_path: Path) -> None:
    results = {}
    for shared in (True, False):
        count = tmp_path / f"count-{shared}"
        config = write_config(str(tmp_path / f"c-{shared}.yaml"), steps=30, count=str(count))
        r = run_up(tmp_path / f"run-{shared}", f"cluster.zygote_data={str(shared).lower()}", config=config,
                   timeout=300)
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["steps"] == 30
        results[shared] = r.summary["params_sha256"]
        assert len(builds(count)) == (1 if shared else 2), builds(count)  # the zygote once, or each of 2 workers
        assert "data is built in every process" not in r.stderr, r.stderr[-2000:]
    assert results[True] == results[False]


def test_a_dataset_factory_that_raises_in_the_zygote_is_one_line_and_starts_no_service(tmp_path: Path) -> None:
    config = write_config(str(tmp_path / "c.yaml"), factory="raising_dataset", n=8)
    r = run_up(tmp_path / "run", config=config, timeout=240)
    assert r.rc == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cmemi: error:"), r.stderr
    assert "cannot read the dataset" in lines[0] and "raising_dataset" in lines[0], lines[0]
    assert "ValueError: the corpus has 8 lines" in lines[0] and "zygote_data_models.py:" in lines[0], lines[0]
    assert not (tmp_path / "run" / "logs" / "aggregator.log").exists(), "a service started before the verdict"
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, cwd=ROOT).stdout == b""


def test_factories_sharing_a_module_cache_read_the_data_once_and_match_the_reference(tmp_path: Path) -> None:
    """tests/helpers/usercode_models.py: the model factory reads the dataset's module-level token cache. The data is
    read once, by the zygote (after the model factory, as a worker reads it), never by a worker or the aggregator,
    and the run is bitwise `cmemi reference`'s."""
    run_dir = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "zdata-usercode", "seed": 0, "dir": str(run_dir)},
        "model": {"factory": "tests.helpers.usercode_models:model", "kwargs": {"classes": 4}},
        "data": {"factory": "tests.helpers.usercode_models:train_set", "kwargs": {"classes": 4}},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9}},
        "train": {"steps": 12, "global_batch": 32, "microbatches": 4, "loss": "torch.nn.functional:cross_entropy"},
        "cluster": {"workers": 2, "spare_workers": 0}, "checkpoint": {"every_steps": 0}}))
    data = tmp_path / "data.txt"
    proc = subprocess.run(cmemi_cmd("up", str(config)), cwd=ROOT, env={**os.environ, "CMEMI_TEST_DATA": str(data)},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[1] for line in data.read_text().splitlines()] == ["zygote"]
    _, expected = train(load_config(str(config), []))
    assert json.loads((run_dir / "summary.json").read_text())["params_sha256"] == expected["params_sha256"]
