"""The Hugging Face example (examples/hf_lm.yaml) in and out: its data and tokenizer are the same bits in every
process, it trains with 1 and 2 workers bitwise equal to `cmemi reference`, and `cmemi checkpoints export --format
hf` writes a directory `AutoModelForCausalLM.from_pretrained` opens, with the same logits bit for bit.

Real `transformers`, `tokenizers` and `datasets` (cmemi[hf], in `dev`: a missing one fails here, not skips), real
`cmemi up` clusters; HF_HUB_OFFLINE=1 everywhere (nothing may come from a hub); HOME points at a temporary
directory in the subprocesses, so a write to ~/.cache would show.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import DIGITS, ROOT, cmemi_cmd, up_args

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported (it reads it once)
import transformers  # noqa: E402  (cmemi[hf] is in dev: fails loudly when missing)
from cmemi.examples import hf_lm  # noqa: E402

HF_LM = str(ROOT / "examples" / "hf_lm.yaml")
# tens of steps, a checkpoint on the way and at the end, no spare worker
QUICK = ("train.steps=30", "scheduler.kwargs.total_steps=30", "cluster.spare_workers=0", "checkpoint.every_steps=20")

PRINT_DATA = """
import hashlib
from cmemi.examples import hf_lm
h = hashlib.sha256()
for split in ("train", "val"):
    for t in hf_lm.make_dataset(split).tensors:
        h.update(t.numpy().tobytes())
h.update(hf_lm.tokenizer().to_str().encode())
print(h.hexdigest())
"""


def offline_env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_CACHE"))}
    return {**env, "HF_HUB_OFFLINE": "1", "HOME": str(home)}


def test_data_and_tokenizer_are_the_same_in_every_process_and_nothing_lands_in_home(tmp_path: Path) -> None:
    digests = set()
    for seed in ("1", "2"):  # Python's and the tokenizer's hash seeds differ per process
        env = {**offline_env(tmp_path / "home"), "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", PRINT_DATA], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        digests.add(r.stdout.split()[-1])
    assert len(digests) == 1, digests
    assert list((tmp_path / "home").iterdir()) == []  # no ~/.cache/huggingface: datasets' cache was a temporary dir
    x, y = hf_lm.make_dataset("train").tensors
    assert x.dtype == torch.int64 and x.shape[1] == 64 and len(x) > 1000
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1:, 0], y[:-1, -1])
    assert 0 <= int(x.min()) and int(x.max()) < hf_lm.VOCAB
    text = hf_lm.split_text("train")
    assert hf_lm.tokenizer().decode(hf_lm.tokenizer().encode(text[:2000]).ids) == text[:2000]  # byte-level BPE
    assert "class ArgumentParser" in text and len(hf_lm.token_ids("train")) < len(text) / 2  # merges compress


def test_the_model_is_the_transformers_model_and_a_few_steps_lower_the_loss() -> None:
    torch.manual_seed(0)
    model = hf_lm.make_model(block=32, d_model=32)
    assert isinstance(model, transformers.PreTrainedModel)
    x, y = hf_lm.make_dataset("train", block=32, max_windows=16).tensors
    out = model(x)
    assert out.logits.shape == (16, 32, hf_lm.VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = hf_lm.loss(out, y).item()
    for _ in range(20):
        opt.zero_grad()
        hf_lm.loss(model(x), y).backward()
        opt.step()
    assert hf_lm.loss(model(x), y).item() < first - 1.0
    result = hf_lm.evaluate(model)
    assert set(result) == {"loss", "perplexity"} and model.training


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_one_and_two_workers_equal_reference_and_the_export_opens_with_from_pretrained(tmp_path: Path) -> None:
    env = offline_env(tmp_path / "home")
    out = tmp_path / "reference.json"
    ref = subprocess.run(cmemi_cmd("reference", HF_LM, *[a for s in QUICK for a in ("--set", s)], "--out", str(out)),
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    shas = {"reference": json.loads(out.read_text())["params_sha256"]}
    runs = {}
    for n in (1, 2):
        runs[n] = tmp_path / f"w{n}"
        r = subprocess.run(up_args(runs[n], *QUICK, f"cluster.workers={n}", config=HF_LM), cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        shas[n] = json.loads((runs[n] / "summary.json").read_text())["params_sha256"]
    assert len(set(shas.values())) == 1, shas
    losses = [json.loads(line)["loss"] for line in (runs[2] / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]) - 2.5  # the loss goes down

    # out: the final weights, then (model.safetensors gone) the newest checkpoint: the same weights at step 30
    run = runs[2]
    x, _ = hf_lm.make_dataset("val").tensors
    x = x[:4]
    mine = hf_lm.make_model()
    trained = load_file(str(run / "model.safetensors"))
    mine.load_state_dict(trained)
    want = logits_of(mine, x)
    for source in ("final", "checkpoint"):
        if source == "checkpoint":
            (run / "model.safetensors").unlink()
        d = tmp_path / f"hf-{source}"
        e = subprocess.run(cmemi_cmd("checkpoints", "export", str(run), "--format", "hf", "-o", str(d)), cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
        assert e.returncode == 0, e.stderr[-3000:]
        assert ("checkpoints/step-00000030" in e.stdout) == (source == "checkpoint"), e.stdout
        assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
        assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))  # tied: written once, as HF does
        loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert type(loaded) is type(mine) and loaded.config.n_embd == 64
        for name, t in trained.items():
            assert torch.equal(loaded.state_dict()[name], t), name
        assert torch.equal(logits_of(loaded, x), want)
    d = tmp_path / "hf-step-20"  # --step: that checkpoint's weights
    e = subprocess.run(cmemi_cmd("checkpoints", "export", str(run), "--format", "hf", "--step", "20", "-o", str(d)),
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert e.returncode == 0, e.stderr[-3000:]
    step20 = load_file(str(run / "checkpoints" / "step-00000020" / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in step20.items())
    assert not torch.equal(step20["transformer.wte.weight"], trained["transformer.wte.weight"])
    assert not [p for p in (tmp_path / "home").rglob("*") if "huggingface" in str(p)]


def test_export_of_a_run_whose_model_is_not_transformers_is_one_line(tmp_path: Path) -> None:
    """A digits run's files (its config.yaml, its final weights): an MLP, not a PreTrainedModel."""
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import build_model

    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(DIGITS, run / "config.yaml")
    save_file(build_model(load_config(DIGITS)).state_dict(), run / "model.safetensors")
    r = subprocess.run(cmemi_cmd("checkpoints", "export", str(run), "--format", "hf", "-o", str(tmp_path / "hf")),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a transformers PreTrainedModel" in lines[0], r.stderr
    assert "cmemi.examples.digits:make_model" in lines[0] and "--format safetensors" in lines[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("args", [("reference", HF_LM), ("up", HF_LM, "--set", "run.dir={up}"),
                                  ("checkpoints", "export", "{run}", "--format", "hf")])
def test_without_the_hf_extra_it_is_one_line_naming_it(tmp_path: Path, args: tuple[str, ...]) -> None:
    """`transformers` made unimportable (a package of that name that raises ImportError, first on the path)."""
    (tmp_path / "hide" / "transformers").mkdir(parents=True)
    (tmp_path / "hide" / "transformers" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(HF_LM, run / "config.yaml")
    env = {**offline_env(tmp_path / "home"), "PYTHONPATH": str(tmp_path / "hide")}
    argv = [a if a == HF_LM else a.format(run=run, up=tmp_path / "up") for a in args]
    r = subprocess.run(cmemi_cmd(*argv), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("pip install 'cmemi[hf]'"), r.stderr
