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

`--codecs` instead writes issue 48's quality table: on the Python standard library's sources (bench/stdlib_corpus.py, 8 MB:
no overfitting within the run), synchronous training, whole rounds and streaming (F = 5 fragments) at H = 50 and 200
with fp32, int4 and sparse2 outer changes (`compression.codec`, sparse2 with its per-replica error feedback, at the
default top-k fraction of 1 % and at 10 %: CODECS says why), the mild outer step, eval loss at equal samples; `--quick`
runs 400 inner steps of a global batch of 16 (a check that it works, not a measurement: about 11 minutes at --jobs 2
on 2 cores shared with other work), the default 4000 of 32 (about 20 times the work of --quick); `--steps` and
`--batch` size a shorter run, and `--note` says why in the results file:

    .venv/bin/python bench/local_steps.py --codecs [--quick] [--steps N] [--batch B] [--jobs 2] [--note TEXT] \
        --out bench/results/outer_codecs.json

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
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402

CONFIG = "examples/charlm.yaml"
REPLICAS = 4
OUTERS = {"paper": "{lr: 0.7, momentum: 0.9, nesterov: true}", "mild": "{lr: 1.0, momentum: 0.7, nesterov: true}",
          "average": "{lr: 1.0, momentum: 0.0}"}


# (row name, compression.codec, its extra settings): fp32, 4-bit and sparse 2-bit outer changes; sparse2 also at a
# top-k fraction of 10 %: at the default 1 % a replica sends at most 1 % of each chunk per sync, so a run of R syncs
# moves at most R % of a replica's coordinates, and this short run's R (5 to 20 rounds) leaves most of the model where
# it started (the --quick pass: +17 % to +61 % against fp32 changes). SparseLoCo's 1-3 % is meant for thousands of syncs.
CODECS = (("none", "none", ()), ("int4", "int4", ()), ("sparse2", "sparse2", ()),
          ("sparse2_10pct", "sparse2", ("compression.topk_ratio=0.1",)))
WIDE = ["data.factory=bench.stdlib_corpus:make_dataset", "eval.fn=bench.stdlib_corpus:evaluate"]


def run(steps: int, local: int, outer: str | None, every: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    C.pin_threads(1)  # (also in a --jobs process)
    from cmemi.shared.config.loading import load_config

    from cmemi.commands.reference import train

    sets = [f"train.steps={steps}", f"scheduler.kwargs.total_steps={steps}", "checkpoint.every_steps=0", *extra]
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
    out = {"local_steps": local, "outer": outer, "replicas": REPLICAS if local else None, "sets": sets,
            "eval_loss": summary["eval"]["loss"], "curve": curve, "params_sha256": summary["params_sha256"],
            "wall_s": round(time.monotonic() - t0, 1)}
    C.log(f"done: H={local} {' '.join(extra[2:])}: eval loss {out['eval_loss']:.4f} in {out['wall_s']} s")
    return out


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
    p.add_argument("--codecs", action="store_true", help="the outer-codec quality table on the stdlib corpus instead")
    p.add_argument("--batch", type=int, default=None, help="--codecs: train.global_batch (default 32; --quick 16)")
    p.add_argument("--note", default="", help="--codecs: a note saved in the results file (why these steps)")
    args = p.parse_args()
    if args.codecs:
        return codec_table(args)
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


def codec_table(args: argparse.Namespace) -> None:
    """`--codecs`: rows {system, local_steps, fragments, codec, eval_loss, vs_sync, vs_fp32} (relative, + is worse)."""
    steps = args.steps or (400 if args.quick else 4000)
    batch = args.batch or (16 if args.quick else 32)
    hs = [int(x) for x in (args.local or ("50,200")).split(",")]
    if bad := [h for h in hs if steps % h or h % 5]:
        p_error(f"--local: {bad} must divide train.steps={steps} and be multiples of the 5 fragments")
    C.setup(threads=1)
    base = (*WIDE, f"train.global_batch={batch}")
    specs: list[tuple[str, int, int, str]] = [("sync", 0, 1, "none")]
    specs += [(system, h, f, row) for h in hs for system, f in (("whole", 1), ("streaming", 5)) for row, _, _ in CODECS]
    codecs = {row: (codec, sets) for row, codec, sets in CODECS}
    result: dict[str, Any] = {"bench": "outer_codecs", **C.provenance(),
                              "command": " ".join(["python bench/local_steps.py", *sys.argv[1:]]),
                              "machine": C.machine(), "config": CONFIG, "corpus": "bench/stdlib_corpus.py",
                              "steps": steps, "global_batch": batch, "replicas": REPLICAS, "outer": "mild",
                              **({"note": args.note} if args.note else {}), "codecs": []}
    t_start = time.monotonic()
    extras = [(*base, *([f"compression.codec={codecs[c][0]}", *codecs[c][1]] if c != "none" else []),
               *([f"train.fragments={f}"] if f > 1 else [])) for _, _, f, c in specs]
    # The synchronous run first, then every fp32 row, then each codec's: a run cut short (a deadline, a signal) has
    # saved the rows the others are compared with.
    order = sorted(range(len(specs)), key=lambda i: (i > 0, [row for row, _, _ in CODECS].index(specs[i][3]), i))
    done: dict[int, dict[str, Any]] = {}
    try:
        C.log(f"{len(specs)} runs of charlm on the stdlib corpus ({steps} inner steps), {args.jobs} at a time")
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run, steps, specs[i][1], "mild" if specs[i][1] else None, args.every, extras[i]): i
                       for i in order}
            for fut in as_completed(futures):
                done[futures[fut]] = fut.result()
                result["codecs"] = codec_rows(specs, codecs, done)
                save(result, t_start, args.out)
        result.pop("missing", None)
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        result["codecs"] = codec_rows(specs, codecs, done)
        if missing := [f"{s} H={h} {c}" for i, (s, h, _, c) in enumerate(specs) if i not in done]:
            result["missing"] = missing
        print(save(result, t_start, args.out))


def codec_rows(specs: list[tuple[str, int, int, str]], codecs: dict[str, tuple[str, tuple[str, ...]]],
               done: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the finished runs that can be compared (the synchronous run's and their fp32 row's done), in the
    order of `specs`."""
    if 0 not in done:
        return []
    sync = done[0]["eval_loss"]
    fp32 = {(s, h): done[i]["eval_loss"] for i, (s, h, _, c) in enumerate(specs) if c == "none" and i in done}
    rows = []
    for i, (system, h, f, codec) in enumerate(specs):
        if i not in done or (system, h) not in fp32:
            continue
        r = done[i]
        rows.append({"system": system, "local_steps": h, "fragments": f, "codec": codecs[codec][0], "row": codec,
                     "codec_sets": list(codecs[codec][1]), "eval_loss": r["eval_loss"],
                     "vs_sync": round(r["eval_loss"] / sync - 1, 4),
                     "vs_fp32": round(r["eval_loss"] / fp32[(system, h)] - 1, 4), "curve": r["curve"],
                     "params_sha256": r["params_sha256"], "wall_s": r["wall_s"]})
    return rows


def save(result: dict[str, Any], t_start: float, out: str | None) -> str:
    """The result so far as JSON, written to `out` (rewritten as each run finishes)."""
    result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    return text


def p_error(message: str) -> None:
    raise SystemExit(f"bench/local_steps.py: {message}")


if __name__ == "__main__":
    main()
