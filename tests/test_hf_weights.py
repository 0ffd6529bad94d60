"""model.init_from on a Hugging Face `save_pretrained` directory (shared/config/pretrained.py): sharded safetensors
read through their index, tied weights (GPT-2's lm_head.weight, absent from the files) accepted, a real mismatch
still named. A real `transformers` model and its own save_pretrained; needs cmemi[hf] (in `dev`: fails if missing).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.config import initweights
from cmemi.shared.config.loading import load_config

from tests.conftest import ROOT, cmemi_cmd

os.environ["HF_HUB_OFFLINE"] = "1"  # before the example imports transformers: nothing may come from a hub
from cmemi.examples import hf_lm  # noqa: E402  (cmemi[hf] is in dev: a missing package fails here, loudly)

HF_LM = str(ROOT / "examples" / "hf_lm.yaml")
SMALL = {"vocab": 512, "block": 32, "d_model": 32, "n_layer": 2, "n_head": 4}


def tiny(seed: int, **kwargs: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return hf_lm.make_model(**{**SMALL, **kwargs})


def saved(model: torch.nn.Module, out: Path, shard: str | None = None) -> Path:
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


def test_a_sharded_save_pretrained_directory_with_tied_weights_loads_every_tensor(tmp_path: Path) -> None:
    source = tiny(1)
    d = saved(source, tmp_path / "hf", shard="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2, "not sharded: lower max_shard_size"
    assert not (d / "model.safetensors").exists() and (d / "config.json").is_file()
    assert "lm_head.weight" not in index and "transformer.wte.weight" in index  # tied: written once
    assert initweights.weights_file(str(d)).name == "model.safetensors.index.json"
    target = tiny(2)
    assert not torch.equal(target.state_dict()["transformer.wte.weight"], source.state_dict()["transformer.wte.weight"])
    assert initweights.load_into(target, str(d), strict=True) == []
    want, got = source.state_dict(), target.state_dict()
    assert list(want) == list(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()  # still tied


def test_a_single_file_save_pretrained_directory_loads(tmp_path: Path) -> None:
    source = tiny(3)
    d = saved(source, tmp_path / "hf")
    assert (d / "model.safetensors").is_file()
    target = tiny(4)
    initweights.load_into(target, str(d), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(),
                                                   strict=True))


def test_a_real_mismatch_still_fails_naming_it(tmp_path: Path) -> None:
    d = saved(tiny(1, n_layer=1), tmp_path / "hf", shard="20KB")
    with pytest.raises(initweights.InitError) as err:
        initweights.load_into(tiny(2), str(d), strict=True)
    text = str(err.value)
    assert "missing: transformer.h.1.attn.c_attn.weight [32, 96]" in text
    assert "lm_head.weight" not in text  # tied to a name the file has: not missing
    wider = saved(tiny(1, d_model=64), tmp_path / "wide")
    with pytest.raises(initweights.InitError, match=r"wrong shape: transformer.wte.weight is \[512, 64\]"):
        initweights.load_into(tiny(2), str(wider), strict=True)


def test_a_lost_shard_is_named(tmp_path: Path) -> None:
    d = saved(tiny(1), tmp_path / "hf", shard="20KB")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(initweights.InitError, match=f"shard {shard.name} named by model.safetensors.index.json"):
        initweights.load_into(tiny(2), str(d), strict=True)


def test_the_servers_and_cmemi_reference_start_from_a_save_pretrained_directory(tmp_path: Path) -> None:
    sets = ["model.kwargs.block=32", "data.kwargs.block=32", "model.kwargs.d_model=32"]
    source = tiny(5)
    d = saved(source, tmp_path / "hf", shard="20KB")
    trainer = Trainer(load_config(HF_LM, [*sets, f"model.init_from={d}"]))
    for name, t in source.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], t), name
    out = tmp_path / "ref.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [a for s in [*sets, f"model.init_from={d}", "train.steps=2", "scheduler.kwargs.total_steps=2"]
            for a in ("--set", s)]
    r = subprocess.run(cmemi_cmd("reference", HF_LM, *args, "--out", str(out)), cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["steps"] == 2
