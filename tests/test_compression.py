"""Codecs and mixed precision inside a real run: determinism, overflow handling, error-feedback state."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model, build_optimizer, build_scheduler
from cmemi.shared.core.data import fetch, microbatch_indices
from safetensors.torch import load_file

from tests.conftest import DIGITS, FAST, ROOT, cmemi_cmd, run_up
from tests.helpers.chaos import Cluster

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_stateless_codecs_keep_worker_count_determinism(tmp_path: Path, codec: str) -> None:
    shas = {}
    for n in (1, 2, 3):
        r = run_up(tmp_path / f"w{n}", *FAST, f"compression.codec={codec}", "compression.min_compress_numel=0",
                   f"cluster.workers={n}")
        assert r.rc == 0, r.stderr[-3000:]
        shas[n] = r.summary["params_sha256"]
        assert r.summary["codec"] == codec
    assert len(set(shas.values())) == 1, shas


def test_a_codec_ships_10x_fewer_bytes_within_one_point_of_accuracy(tmp_path: Path) -> None:
    """The issue's claim: at least one codec sends >= 10x fewer bytes than `none` at test accuracy within
    1 point. Both sparse codecs are held to the byte ratio; the accuracy claim needs one of them (the test
    set has 360 images: 1 point is under 4 of them). One worker: the error-feedback residual is per worker,
    so with several workers it depends on which worker got which microbatch (timing), and a sparse codec's
    result varies by an image or two from run to run; with one worker every run is the same."""
    one = ("cluster.workers=1", "cluster.spare_workers=0")
    dense = run_up(tmp_path / "none", *one)
    assert dense.rc == 0, dense.stderr[-3000:]
    accuracy = {}
    for codec, option in (("topk", "compression.topk_ratio=0.02"), ("powersgd", "compression.powersgd_rank=2")):
        r = run_up(tmp_path / codec, *one, f"compression.codec={codec}", option)
        assert r.rc == 0, r.stderr[-3000:]
        ratio = dense.summary["bytes_sent"] / r.summary["bytes_sent"]
        assert ratio >= 10, (codec, ratio)
        assert all("codec_s" in m for m in r.metrics())
        accuracy[codec] = r.summary["eval"]["accuracy"]
    assert max(accuracy.values()) >= dense.summary["eval"]["accuracy"] - 0.01, (dense.summary["eval"], accuracy)


@pytest.mark.timeout(400)
def test_a_model_whose_parameters_are_named_inner_trains_with_every_codec_like_the_reference(tmp_path: Path) -> None:
    """Parameters named "inner.…" (a wrapper's submodule `inner`) are sent per tensor by a compressing codec, beside
    the wire's own tensors: every frame stays the gradient's (they were once taken for a replica's inner state, and
    the run hung re-sending a gradient the leader dropped). One worker: the result is `cmemi reference`'s, bitwise."""
    sets = (*FAST, "train.steps=6", "scheduler.kwargs.T_max=6", "cluster.workers=1",
            "model.factory=tests.helpers.fixtures:wrapped_digits")
    for codec in ("powersgd", "int8"):
        run = (*sets, f"compression.codec={codec}", "compression.downlink=int8")
        r = run_up(tmp_path / codec, *run)
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["steps"] == 6
        ref = subprocess.run(cmemi_cmd("reference", DIGITS, *(a for s in run for a in ("--set", s))),
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert ref.returncode == 0, ref.stderr[-3000:]
        assert json.loads(ref.stdout)["params_sha256"] == r.summary["params_sha256"], codec


def test_error_feedback_state_dies_with_its_worker_and_the_run_still_converges(tmp_path: Path) -> None:
    """topk's residual belongs to the worker: a killed worker's residual is lost (bounded: < one step of
    its gradients), its replacement starts with none, and training still reaches the target accuracy.
    One worker, so the result is exact: it is `cmemi reference` with the codec state dropped at the step each
    replacement took over, leased as it was to the replacement (its `first_grad_accepted`), bitwise."""
    sets = ("train.steps=600", "scheduler.kwargs.T_max=600", "compression.codec=topk", "cluster.workers=1",
            "cluster.spare_workers=0")
    c = Cluster(tmp_path / "run", *sets)
    incarnations = []
    try:
        for target in (150, 350):
            c.wait_step(target)
            incarnations.append(c.signal("worker", "w0"))
            c.replaced("worker", "w0", incarnations[-1])
    finally:
        rc = c.wait()
    assert rc == 0, c.output()
    assert c.summary["steps"] == 600 and c.summary["eval"]["accuracy"] >= 0.95
    events = [json.loads(line) for line in (c.run_dir / "events.jsonl").read_text().splitlines()]
    firsts = {e["incarnation"]: (e["step"], e["hi"] - e["lo"]) for e in events
              if e["kind"] == "first_grad_accepted" and e["worker"] == "w0"}
    replacements = sorted(inc for inc in firsts if inc > incarnations[0])
    assert len(replacements) == 2, firsts  # each kill hit a worker that had trained, and a new one took over
    resets = [f"{firsts[inc][0]}:{firsts[inc][1]}" for inc in replacements]
    ref = subprocess.run(cmemi_cmd("reference", DIGITS, *(a for s in sets for a in ("--set", s)),
                                   *(a for r in resets for a in ("--codec-reset", r))),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert json.loads(ref.stdout)["params_sha256"] == c.summary["params_sha256"], (resets, firsts)


def grad_scaler_reference(overrides: list[str]) -> tuple[list[float], list[bool], dict[str, torch.Tensor]]:
    """torch.amp.GradScaler in one process over the same global batches."""
    cfg = load_config(DIGITS, overrides)
    model = build_model(cfg)
    opt = build_optimizer(cfg, model.parameters())
    sched = build_scheduler(cfg, opt)
    scaler = torch.amp.GradScaler("cpu")
    ds = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
    loss_fn = resolve(cfg.train.loss, "train.loss")
    scales, skipped = [], []
    for s in range(cfg.train.steps):
        idx = torch.cat([microbatch_indices(cfg.run.seed, len(ds), cfg.train.global_batch, cfg.train.microbatches, s, m)
                         for m in range(cfg.train.microbatches)])
        x, y = fetch(ds, idx)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        with warnings.catch_warnings():  # a skipped first optimizer.step() makes torch warn about the order
            warnings.simplefilter("ignore")
            sched.step()
        skipped.append(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return scales, skipped, {k: v.detach() for k, v in model.state_dict().items()}


def test_fp16_overflow_skips_the_step_everywhere_like_grad_scaler(tmp_path: Path) -> None:
    overrides = [*FAST, "precision=fp16", "model.kwargs.dropout=0.0", "data.factory=tests.helpers.fixtures:poisoned_digits",
                 "data.kwargs={index: 5}", "cluster.workers=2"]
    r = run_up(tmp_path / "run", *overrides)
    assert r.rc == 0, r.stderr[-3000:]
    metrics = r.metrics()
    scales, skipped, expected = grad_scaler_reference(overrides)
    assert any(skipped), "the poisoned sample should overflow at least one step"
    assert [m["skipped"] for m in metrics] == skipped
    assert [m["loss_scale"] for m in metrics] == scales
    assert r.summary["skipped_steps"] == sum(skipped)
    got = load_file(str(r.run_dir / "model.safetensors"))
    for name, t in expected.items():  # fp16 products summed per microbatch vs per global batch: fp16 tolerance
        torch.testing.assert_close(got[name], t, rtol=1e-2, atol=5e-3)
