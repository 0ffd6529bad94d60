"""`cmemi reference CONFIG`: train the config in one process, as the cluster would, and print its params_sha256.

Same microbatch order, same per-microbatch seeding, the same microbatch computation as a worker
(services/worker/compute.py), the same gradient codec round trip, the same collector (reduction tree,
buffer rule) and the same trainer (optimizer, scheduler, clipping, loss scaling) and early stopping as
the aggregator: its params_sha256 equals `cmemi up`'s bitwise, for any worker count and any faults.
(Codecs with error feedback keep per-worker state: there the reference is one worker doing everything.)

Because it shares that code with the system, tests also compare the cluster with an independent plain
PyTorch loop, within a tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cmemi.configs import config_path
from cmemi.services.aggregator.collector import StepCollector
from cmemi.services.aggregator.evaluation import BackgroundEval, EvalError, run_eval
from cmemi.services.aggregator.trainer import Trainer
from cmemi.services.worker.compute import MicrobatchRunner
from cmemi.services.worker.device import make_deterministic, pick_device
from cmemi.shared.codecs import all_finite, make_codec
from cmemi.shared.config import Config
from cmemi.shared.plugins import build_model, resolve

HOLDER = ("reference", 0)  # the one (worker id, incarnation) that holds every lease of a reference run


class ReferenceError(RuntimeError):
    """Training cannot go on (diverged, user code failed): the one-line reason."""


def train(cfg: Config) -> tuple[Trainer, dict[str, Any]]:
    """Train `cfg` in this process; returns the trainer (its model holds the result) and a summary."""
    t0 = time.monotonic()
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    trainer = Trainer(cfg, shards=1)  # the whole grid in one process: the same pieces as any cluster.shards
    eval_fn = resolve(cfg.eval.fn, "eval.fn") if cfg.eval.fn else None
    bg = BackgroundEval(cfg, eval_fn) if eval_fn and cfg.eval.every_steps else None
    runner = MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                              resolve(cfg.train.loss, "train.loss"))
    device = pick_device(cfg.device, "w0")
    if device.type != "cpu":
        make_deterministic(device)
        runner.to(device)
    encoder, decoder = make_codec(cfg.compression), make_codec(cfg.compression, check_finite=False)
    M, report = cfg.train.microbatches, bool(trainer.buffers) and cfg.model.buffers == "mean"
    loss, stopped = float("nan"), False
    try:
        while trainer.step < cfg.train.steps and not stopped:
            step = trainer.step
            with torch.no_grad():  # what a worker receives with version `step`
                for n, p in runner.params.items():
                    p.copy_(trainer.params[n])
                for n, b in runner.step_buffers.items():
                    b.copy_(trainer.buffers[n])
            collector = StepCollector(step, M)
            for m in range(M):
                collector.lease(*HOLDER, now=0.0, timeout=math.inf)  # m, in order: the reference holds every lease
                mb_loss, grads, produced = runner.run(step, m, trainer.scaler.scale)
                grads = trainer.partition.views(grads)  # by piece of the chunk grid, as workers send them
                finite = all_finite(grads.values())
                if not finite and cfg.precision != "fp16":
                    raise ReferenceError(f"the gradient of microbatch {m} of step {step} is not finite (loss {mb_loss})")
                decoded = None
                if finite:
                    info, frames = encoder.encode(grads, step)
                    decoded = decoder.decode(info, {k: v.clone() for k, v in frames.items()}, shapes=trainer.shapes)
                contribution = trainer.contribution(produced) if report and produced is not None else None
                collector.offer(m, decoded, mb_loss, HOLDER, contribution)
            grads, loss = collector.mean()
            if grads is not None and not all_finite(grads.values()):
                raise ReferenceError(f"the summed gradient of step {step + 1} is not finite: the run diverged")
            trainer.apply(grads, collector.buffer_sum())
            done = trainer.step
            if bg is not None and done % cfg.eval.every_steps == 0 and done < cfg.train.steps:
                bg.start(done, {k: v.clone() for k, v in trainer.model.state_dict().items()})
                stopped = bg.should_stop
        if bg is not None:
            bg.collect(wait=True)
        evaluation = run_eval(eval_fn, trainer.model, str(cfg.eval.fn)) if eval_fn else {}
    except EvalError as exc:
        raise ReferenceError(str(exc)) from None
    finally:
        if bg is not None:
            bg.close()
    summary = {"steps": trainer.step, "final_loss": loss, "eval": evaluation, "params_sha256": trainer.params_sha256(),
               "stopped_early": stopped, "skipped_steps": trainer.skipped, "final_lr": trainer.lr,
               "eval_history": bg.history if bg is not None else [], "wall_s": time.monotonic() - t0}
    return trainer, summary


def main(argv: list[str]) -> int:
    from cmemi.services.worker.compute import UserCodeError
    from cmemi.shared.config import ConfigError, load_config
    from cmemi.shared.plugins import check_plugins
    from cmemi.shared.usercode import describe

    p = argparse.ArgumentParser(prog="cmemi reference", description="Train a config in one process, as the "
                                "cluster would; prints a summary with params_sha256 (equal to `cmemi up`'s).")
    p.add_argument("config", help="run config YAML (or the name of a bundled example)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--out", default=None, help="also write the summary JSON here")
    p.add_argument("--export", default=None, metavar="FILE.safetensors", help="write the trained state_dict here")
    args = p.parse_args(argv)
    try:
        cfg = load_config(config_path(args.config), args.set)
        check_plugins(cfg)
        trainer, summary = train(cfg)
    except (ConfigError, ReferenceError) as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return 2
    except UserCodeError as exc:
        print(f"cmemi: error: {describe(exc.cause).line()} during {exc.phase}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.export:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, args.export)
    print(text)
    return 0
