"""model.init_from (shared/config/initweights.py) and user code run as in a plain script (shared/wire/limits.py,
shared/config/plugins.py, shared/core/data.py): fast, in-process."""

from __future__ import annotations

import pytest
import torch
from cmemi.services.aggregator.common import dataprint
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.config import initweights
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.plugins import FactoryError, build_model, user_modules
from cmemi.shared.core.data import data_error
from cmemi.shared.wire import limits
from safetensors.torch import save_file

from tests.conftest import DIGITS


def digits(*sets: str):
    return load_config(DIGITS, list(sets))


def test_init_from_finds_the_weights_of_a_file_a_checkpoint_or_a_run(tmp_path) -> None:
    (tmp_path / "run" / "checkpoints" / "step-00000010").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000020").mkdir()
    for step in ("00000010", "00000020"):
        save_file({"w": torch.zeros(1)}, tmp_path / "run" / "checkpoints" / f"step-{step}" / "model.safetensors")
    assert initweights.weights_file(str(tmp_path / "run")).parent.name == "step-00000020"  # the newest checkpoint
    save_file({"w": torch.zeros(1)}, tmp_path / "run" / "model.safetensors")
    assert initweights.weights_file(str(tmp_path / "run")) == tmp_path / "run" / "model.safetensors"  # final weights
    with pytest.raises(initweights.InitError, match="no such file or directory"):
        initweights.weights_file(str(tmp_path / "missing.safetensors"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(initweights.InitError, match="no model.safetensors and no checkpoint"):
        initweights.weights_file(str(tmp_path / "empty"))


def test_strict_lists_every_mismatch_and_non_strict_loads_what_fits(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    other = {"0.weight": torch.full((4, 3), 7.0), "0.bias": torch.full((4,), 7.0), "1.weight": torch.ones(5, 4),
             "extra": torch.zeros(1)}
    torch.save(other, tmp_path / "w.pt")
    before = model[1].weight.detach().clone()
    with pytest.raises(initweights.InitError) as err:
        initweights.load_into(model, str(tmp_path / "w.pt"), strict=True)
    lines = str(err.value).splitlines()
    assert "3 names or shapes" in lines[0] and "init_strict: false" in lines[0]
    assert sorted(line.strip().split(":")[0] for line in lines[1:]) == ["missing", "unexpected", "wrong shape"]
    assert "1.weight is [5, 4] in the file, [2, 4] in the model" in str(err.value)
    assert not torch.equal(model[0].weight, other["0.weight"])  # strict: nothing loaded
    skipped = initweights.load_into(model, str(tmp_path / "w.pt"), strict=False)
    assert len(skipped) == 3 and torch.equal(model[0].weight, other["0.weight"])
    assert torch.equal(model[1].weight, before)  # the new head keeps the factory's values


def test_the_parameter_servers_start_from_init_from(tmp_path) -> None:
    weights = {k: torch.full_like(v, 0.5) for k, v in build_model(digits()).state_dict().items()}
    save_file(weights, tmp_path / "model.safetensors")
    trainer = Trainer(digits(f"model.init_from={tmp_path}"))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in weights.items())


def test_messages_are_sized_from_the_model_built_and_a_factory_cache_holds_real_tensors() -> None:
    from tests.helpers import usercode_models

    cfg = load_config(DIGITS, ["model.factory=tests.helpers.usercode_models:model", "model.kwargs={}",
                               "data.factory=tests.helpers.usercode_models:train_set", "data.kwargs={}"])
    usercode_models.token_cache = None
    measured = limits.model_bytes(cfg)  # nothing built here yet: measured in a forked child, its cache thrown away
    assert usercode_models.token_cache is None
    model = build_model(cfg)
    assert measured == limits.tensor_bytes(model) > 0
    assert not usercode_models.token_cache.is_meta and len(usercode_models.train_set()) > 0  # the dataset reads the cache


def test_a_failing_factory_names_itself_the_exception_and_where() -> None:
    with pytest.raises(FactoryError) as err:
        build_model(digits("model.factory=tests.helpers.usercode_models:model", "model.kwargs={embedding: /nowhere.pt}"))
    text = str(err.value)
    assert "model.factory" in text and "tests.helpers.usercode_models:model" in text and "FileNotFoundError" in text
    assert "usercode_models.py:" in text and "\n" not in text


def test_the_paths_hint_only_when_a_file_could_not_be_opened() -> None:
    cfg = digits()
    assert "check that data.kwargs (paths)" in data_error("worker w0", cfg, FileNotFoundError("x.pt"))
    assert "check that data.kwargs" not in data_error("worker w0", cfg, NotImplementedError("meta"))


def test_the_run_fingerprint_is_the_checkpoints_else_the_first_workers() -> None:
    run: dict = {}
    assert dataprint.agrees(run, {"length": 3, "sha256": "a"}) and run == {"length": 3, "sha256": "a"}
    assert not dataprint.agrees(run, {"length": 3, "sha256": "b"})
    restored: dict = {}
    assert dataprint.adopt(restored, {"length": 3, "sha256": "c"}) and not dataprint.agrees(restored, run)


def test_the_zygote_imports_the_modules_the_config_names() -> None:
    cfg = digits("optimizer.name=mypkg.opt:Lion")
    assert user_modules(cfg) == ["cmemi.examples.digits", "torch.nn.functional", "mypkg.opt"]


def test_a_model_is_measured_on_the_meta_device_when_its_factory_allows_it() -> None:
    """The checkpointer's child measures shapes only (it stays small whatever the model); a factory that reads
    data values cannot build there and is measured for real in a fresh child: the same size either way."""
    devices = []

    def build(cfg):
        model = build_model(cfg)
        devices.append(next(model.parameters()).device.type)
        return model

    plain = digits()
    assert limits.measure(plain, build, meta=True) == limits.tensor_bytes(build_model(plain)) and devices[0] == "meta"
    assert limits.model_bytes(plain) == limits.tensor_bytes(build_model(plain))
