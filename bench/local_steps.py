"""Local steps (train.local_steps, DiLoCo) against synchronous training at equal samples: eval loss and the samples
each needs to reach the synchronous run's final eval loss.

    .venv/bin/python bench/local_steps.py [--quick] [--steps 1000] [--local 10,50,200] [--jobs 2] [--out FILE]

Every run is `cmemi reference` in this process (cmemi/commands/reference.py: the algorithm the cluster runs, bitwise — tested
in tests/test_local_steps.py), on `examples/charlm.yaml` (the char-level transformer, AdamW with a OneCycle schedule
over train.steps), train.steps inner steps of global_batch samples each: the synchronous run takes train.steps steps
of the whole batch; a local run takes train.steps / H rounds of R = 4 replicas, each inner step of global_batch / R
samples. So every run trains on the same number of samples. Each H is run with three outer steps: the paper's (SGD,
Nesterov momentum 0.9, lr 0.7: the default), a milder Nesterov one (lr 1.0, momentum 0.7: better in a run of few
rounds) and plain averaging (SGD lr 1.0, no momentum: θ ← mean θ_r). The eval loss is charlm's `evaluate` on its
held-out split, at the end and every `--every` inner steps' worth of samples (a round's boundary, so every
max(1, every / H) rounds). The target of "samples to the synchronous loss" is the synchronous run's final eval loss;
the synchronous run's own samples to it are the first evaluation at or below it (a small model on a small corpus
overfits late in a long run: its final loss is then reached before its last step).

`--reach H:OUTER:FACTOR,...` also trains local runs FACTOR times as long (the schedule over the longer run) and records
the samples each needs to reach the synchronous run's final eval loss, when the equal-samples run does not.

Prints one JSON object; `--out PATH` saves it too. The bytes each sends per sample are measured on the emulated cluster
(bench/cluster.py, system cmemi_local) and the manual's table (docs/benchmarks/local-steps.md) combines the two.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402

CONFIG = "examples/charlm.yaml"
REPLICAS = 4
OUTERS = {"paper": "{lr: 0.7, momentum: 0.9, nesterov: true}", "mild": "{lr: 1.0, momentum: 0.7, nesterov: true}",
          "average": "{lr: 1.0, momentum: 0.0}"}


def run(steps: int, local: int, outer: str | None, every: int) -> dict[str, Any]:
    C.pin_threads(1)  # (also in a --jobs process)
    from cmemi.shared.config.loading import load_config

    from cmemi.commands.reference import train

    sets = [f"train.steps={steps}", f"scheduler.kwargs.total_steps={steps}", "checkpoint.every_steps=0"]
    if local:
        sets += [f"train.local_steps={local}", f"train.replicas={REPLICAS}", f"outer_optimizer.kwargs={OUTERS[outer]}",
                 f"eval.every_steps={max(1, every // local)}"]
    else:
        sets += [f"eval.every_steps={every}"]
    cfg = load_config(str(ROOT / CONFIG), sets)
    t0 = time.monotonic()
    _, summary = train(cfg)
    per_step = cfg.train.samples_per_round  # samples per step of the servers (a round: H inner steps)
    curve = [{"samples": e["step"] * per_step, "loss": e["eval"]["loss"]} for e in summary["eval_history"]]
    curve.append({"samples": summary["steps"] * per_step, "loss": summary["eval"]["loss"]})
    return {"local_steps": local, "outer": outer, "replicas": REPLICAS if local else None, "sets": sets,
            "eval_loss": summary["eval"]["loss"], "curve": curve, "params_sha256": summary["params_sha256"],
            "wall_s": round(time.monotonic() - t0, 1)}


def samples_to(curve: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated sample count at which the eval loss is at most `target` (None: not in this run)."""
    return next((p["samples"] for p in curve if p["loss"] <= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="400 steps, H = 10 and 50 (to debug)")
    p.add_argument("--steps", type=int, default=None, help="inner steps (default 1000; --quick 400)")
    p.add_argument("--local", default=None, help="H values (default 10,50,200; --quick 10,50)")
    p.add_argument("--outers", default=",".join(OUTERS), help=f"outer steps to run, of {','.join(OUTERS)}")
    p.add_argument("--every", type=int, default=50, help="evaluate every this many inner steps' samples")
    p.add_argument("--reach", default="", help="H:OUTER:FACTOR,... longer local runs (e.g. 200:average:4)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in a process of its own (one thread "
                   "each; the losses are the same bits at any --jobs)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    steps = args.steps or (400 if args.quick else 1000)
    hs = [int(x) for x in (args.local or ("10,50" if args.quick else "10,50,200")).split(",")]
    if bad := [h for h in hs if steps % h]:
        p.error(f"--local: train.steps={steps} is not a multiple of {bad}")
    outers = args.outers.split(",")
    if unknown := [o for o in outers if o not in OUTERS]:
        p.error(f"--outers: unknown {unknown}; choose from {','.join(OUTERS)}")
    reach = [(int(h), o, int(f)) for h, o, f in (x.split(":") for x in filter(None, args.reach.split(",")))]
    C.setup(threads=1)
    result: dict[str, Any] = {"bench": "local_steps", **C.provenance(),
                              "command": " ".join(["python bench/local_steps.py", *sys.argv[1:]]),
                              "machine": C.machine(), "config": CONFIG, "steps": steps, "replicas": REPLICAS,
                              "outer_optimizers": {o: OUTERS[o] for o in outers}, "runs": []}
    t_start = time.monotonic()
    specs = [(steps, 0, None), *((steps, h, o) for h in hs for o in outers), *((steps * f, h, o) for h, o, f in reach)]
    try:
        C.log(f"{len(specs)} runs of charlm ({steps} inner steps), {args.jobs} at a time")
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(run, *zip(*specs, strict=True), [args.every] * len(specs)))
        sync, runs, longer = done[0], done[1:1 + len(hs) * len(outers)], done[1 + len(hs) * len(outers):]
        target = sync["eval_loss"]
        sync["samples_to_final"] = samples_to(sync["curve"], target)
        sync["best_loss"] = min(p["loss"] for p in sync["curve"])
        result["sync"] = sync
        for r in runs:
            r["eval_vs_sync"] = round(r["eval_loss"] / target - 1, 4)  # relative, + is worse
            r["samples_to_sync_final"] = samples_to(r["curve"], target)
        result["runs"] = runs
        result["sync_samples"] = sync["curve"][-1]["samples"]
        for r, (_, _, f) in zip(longer, reach, strict=True):
            r["factor"] = f
            r["samples_to_sync_final"] = samples_to(r["curve"], target)
        result["reach"] = longer
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
