"""`cmemi reference CONFIG`: train the config in one process, as the cluster would, and print its params_sha256.

Same microbatch order, same per-microbatch seeding, the same microbatch computation as a worker
(services/worker/compute/microbatch.py), the same gradient codec round trip, the same collector (reduction tree,
buffer rule) and the same trainer (optimizer, scheduler, clipping, loss scaling) and early stopping as
the aggregator: its params_sha256 equals `cmemi up`'s bitwise, for any worker count and any faults.
(Codecs with error feedback keep per-worker state: there the reference is the one worker of a
`cluster.workers: 1` run, which leases and encodes a whole step's sum at once; `--codec-reset STEP:N` replays
that worker replaced by a new process during step STEP: its state is dropped, and the step is leased again in
blocks of N microbatches (1: the dead worker's lease went back split into microbatches) — the run's
`first_grad_accepted` event of the new incarnation says STEP and N = hi - lo.)

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

from cmemi.commands.configs import config_path
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.evaluation import BackgroundEval, EvalError, run_eval
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.services.worker.compute.device import make_deterministic, pick_device
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.compression.base import Codec, all_finite
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.config.schema import Config
from cmemi.shared.core.innerstate import through_wire
from cmemi.shared.core.reduction import TreeAccumulator, add_into, block_size
from cmemi.shared.errors import FaultError
from cmemi.shared.runtime.exits import Exit

HOLDER = ("reference", 0)  # the one (worker id, incarnation) that holds every lease of a reference run


class ReferenceError(FaultError, RuntimeError):
    """Training cannot go on (diverged, user code failed): the one-line reason."""


def train(cfg: Config, codec_resets: dict[int, int] | None = None) -> tuple[Trainer, dict[str, Any]]:
    """Train `cfg` in this process; returns the trainer (its model holds the result) and a summary.
    `codec_resets`: step -> lease size, where the one worker's codec state is dropped (a replacement)."""
    codec_resets = codec_resets or {}
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
    # a stateful codec's result depends on what is encoded together: one worker's whole-step leases (every codec is
    # a Codec; the GradientCodec protocol does not declare `stateful`)
    block = block_size(M, 1) if isinstance(encoder, Codec) and encoder.stateful else 1
    loss, stopped = float("nan"), False
    local = LocalRound(cfg, runner, trainer.partition) if cfg.train.local_steps else None
    try:
        while trainer.step < cfg.train.rounds and not stopped:
            step = trainer.step
            with torch.no_grad():  # what a worker holds at version `step` (compression.downlink: the mirror)
                wire = trainer.wire_state()
                for n, p in trainer.partition.views(runner.params).items():
                    p.copy_(wire[n])
                for n, b in runner.step_buffers.items():
                    b.copy_(trainer.buffers[n])
            if local is not None:
                loss = local_round(local, trainer, encoder, decoder, step, report)
                stopped = evaluate(bg, cfg, trainer)
                continue
            if step in codec_resets:  # a new worker process: no residual, no warm-start Q
                encoder.reset()
            collector = StepCollector(step, M, block=codec_resets.get(step, block))
            while (node := collector.lease(*HOLDER, now=0.0, timeout=math.inf)) is not None:  # in order
                if node[1] - node[0] > 1:
                    offer_block(cfg, runner, trainer, encoder, decoder, collector, step, node, report)
                    continue
                m = node[0]
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
            mean, loss = collector.mean()
            if mean is not None and not all_finite(mean.values()):
                raise ReferenceError(f"the summed gradient of step {step + 1} is not finite: the run diverged")
            trainer.apply(mean, collector.buffer_sum())
            stopped = evaluate(bg, cfg, trainer)
        if bg is not None:
            bg.collect(wait=True)
        evaluation = run_eval(eval_fn, trainer.model, str(cfg.eval.fn)) if eval_fn else {}
    except EvalError as exc:
        raise ReferenceError(str(exc)) from None
    finally:
        if bg is not None:
            bg.close()
    summary = {"steps": trainer.step, "final_loss": loss, "eval": evaluation, "params_sha256": trainer.params_sha256(),
               **({"mirror_sha256": trainer.mirror_sha256()} if trainer.mirror is not None else {}),
               "stopped_early": stopped, "skipped_steps": trainer.skipped, "final_lr": trainer.lr,
               "eval_history": bg.history if bg is not None else [], "wall_s": time.monotonic() - t0}
    return trainer, summary


def evaluate(bg: BackgroundEval | None, cfg: Config, trainer: Trainer) -> bool:
    """After a step: an evaluation in the background at eval.every_steps, as the aggregator's; True: stop early."""
    done = trainer.step
    if bg is not None and done % cfg.eval.every_steps == 0 and done < cfg.train.rounds:
        bg.start(done, {k: v.clone() for k, v in trainer.model.state_dict().items()})
        return bg.should_stop
    return False


def local_round(local: LocalRound, trainer: Trainer, encoder: Any, decoder: Any, rnd: int, report: bool) -> float:
    """A round of local steps (train.local_steps), as the cluster runs it: each replica's round from the round's
    parameters and its inner state as the leader keeps it (through the wire), its change through the codec, the
    changes by the reduction tree, the outer step; returns the round's mean loss."""
    inner = trainer.inner
    assert inner is not None
    collector = StepCollector(rnd, inner.R, block=1)
    while (node := collector.lease(*HOLDER, now=0.0, timeout=math.inf)) is not None:
        r = node[0]
        # (streaming: a segment, the change of one fragment's pieces; its state the last one, never replayed here)
        loss, delta, contribution, state = local.lease(rnd, r, rnd, inner.start(r))
        info, frames = encoder.encode(delta, rnd)
        decoded = decoder.decode(info, {k: v.clone() for k, v in frames.items()},
                                 shapes={n: trainer.shapes[n] for n in delta})
        inner.keep(r, through_wire(state))
        collector.offer(r, decoded, loss, HOLDER, contribution if report else None)
    grads, loss = collector.mean()
    trainer.apply(grads, collector.buffer_sum())
    return loss


def offer_block(cfg: Config, runner: MicrobatchRunner, trainer: Trainer, encoder: Any, decoder: Any,
                collector: StepCollector, step: int, node: tuple[int, int], report: bool) -> None:
    """A lease of several microbatches as a worker computes it (BlockComputer.block, services/worker/compute/block.py):
    the gradients summed in the reduction tree's order, then encoded once."""
    lo, hi = node
    grads: TreeAccumulator = TreeAccumulator(hi - lo, add_into)
    buffers: TreeAccumulator = TreeAccumulator(hi - lo, add_into)
    losses, finite = [], True
    for m in range(lo, hi):
        mb_loss, g, produced = runner.run(step, m, trainer.scaler.scale)
        losses.append(mb_loss)
        if cfg.precision == "fp16" and finite and not all_finite(g.values()):
            finite = False
        grads.add(m - lo, m - lo + 1, g if finite else {})
        if report and produced is not None:
            buffers.add(m - lo, m - lo + 1, trainer.contribution(produced))
    total = trainer.partition.views(grads.result())
    if finite and not all_finite(total.values()):
        raise ReferenceError(f"the gradient of microbatches {lo}..{hi - 1} of step {step} is not finite ({losses})")
    decoded = None
    if finite:
        info, frames = encoder.encode(total, step)
        decoded = decoder.decode(info, {k: v.clone() for k, v in frames.items()}, shapes=trainer.shapes)
    collector.offer(node, decoded, losses, HOLDER, buffers.result() if buffers.complete else None)


def main(argv: list[str]) -> int:
    from cmemi.services.worker.compute.microbatch import UserCodeError
    from cmemi.shared.config.checks import ConfigError
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import check_plugins
    from cmemi.shared.config.usercode import describe

    p = argparse.ArgumentParser(prog="cmemi reference", description="Train a config in one process, as the "
                                "cluster would; prints a summary with params_sha256 (equal to `cmemi up`'s).")
    p.add_argument("config", help="run config YAML (or the name of a bundled example)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--out", default=None, help="also write the summary JSON here")
    p.add_argument("--export", default=None, metavar="FILE.safetensors", help="write the trained state_dict here")
    p.add_argument("--codec-reset", action="append", default=[], metavar="STEP:N", help="an error-feedback codec, "
                   "one worker: it was replaced by a new process during step STEP (its state dropped), which leased "
                   "that step again N microbatches at a time (repeatable)")
    args = p.parse_args(argv)
    try:
        resets = {int(a): int(b) for a, b in (r.split(":") for r in args.codec_reset)}
    except ValueError:
        p.error(f"--codec-reset takes STEP:N, two integers (got {args.codec_reset})")
    try:
        cfg = load_config(config_path(args.config), args.set)
        check_plugins(cfg)
        trainer, summary = train(cfg, resets)
    except (ConfigError, ReferenceError, FloatingPointError) as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    except UserCodeError as exc:
        print(f"cmemi: error: {describe(exc.cause).line()} during {exc.phase}", file=sys.stderr)
        return Exit.FATAL
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.export:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, args.export)
    print(text)
    return 0
