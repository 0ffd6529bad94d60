"""Small models: CMEMI's per-step floor against a plain PyTorch loop, and the start-up of `cmemi up`.

Workloads (bench/small_models.py): an MLP and a small 1-D CNN on 4,000 synthetic samples of 40 features,
10 classes; Adam (lr 1e-3), global batch 100.
  (a) plain: one process, torch's default threads (all cores), one forward/backward of the whole batch per step
  (b) `cmemi up` with 1 worker, 4 microbatches (the config's defaults: one torch thread per process)
  (c) `cmemi up` with 2 workers, 4 microbatches
and the CNN on the same samples augmented per item in `__getitem__` (torch, numpy, `random`; about 0.5 ms of
Python per microbatch), with the data read in the worker and ahead in one loader process per worker
(`data.workers: 1`): what taking the data off the critical path buys.
Variants alternate within each repeat, so drift of the machine's load hits them alike; medians over repeats.
Then `cmemi up` of the digits example as a new user runs it (defaults, a warm spare): the time from `cmemi up`
to its first step, with every process's phases (RUN_DIR/startup.json, as `cmemi up --verbose` prints them).
And the slow-import workload (bench/slow_import_model.py, a user module that takes T seconds to import and build
its dataset in a plain process): `cmemi up` with 2 workers should reach its first step within T + 3 s and
return within 2 s of its last step. Alone, in a few minutes (merged into the results file):

    .venv/bin/python bench/small.py --startup-only --repeats 3 --out bench/results/small.json

    .venv/bin/python bench/small.py [--quick] [--steps N] [--repeats R] [--out bench/results/small.json]

Every result records the commit measured ("+dirty" when the tree had changes) and the date (UTC).

Prints one JSON object: `ms_per_step` (wall-clock training time per step after the warm-up steps), `ratios`
(CMEMI / plain, lower is better), `startup` (seconds since `cmemi up` started) and `wire_us_per_message`: one
parameter message (encode, send, receive, decode on loopback) tensor by tensor against flat buffers, for the
MLP, the CNN and the `charlm` example's transformer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

WORKLOADS = {"mlp": "bench.small_models:mlp", "cnn1d": "bench.small_models:cnn1d", "cnn1d_augmented": "bench.small_models:cnn1d"}
DATA = {"mlp": "bench.small_models:dataset", "cnn1d": "bench.small_models:dataset",
        "cnn1d_augmented": "bench.small_models:augmented"}
# variant -> (workers, data.workers): the augmented workload also runs with one loader process per worker
VARIANTS = {"mlp": {"cmemi_1w": (1, 0), "cmemi_2w": (2, 0)}, "cnn1d": {"cmemi_1w": (1, 0), "cmemi_2w": (2, 0)},
            "cnn1d_augmented": {"cmemi_1w": (1, 0), "cmemi_1w_loader": (1, 1), "cmemi_2w": (2, 0),
                                "cmemi_2w_loader": (2, 1)}}
BATCH, MICROBATCHES, LR = 100, 4, 1e-3


def plain_loop(wl: str, steps: int, warmup: int) -> dict[str, Any]:
    """The loop a user writes first (in a fresh process with torch's default threads): batches in a fixed
    shuffled order, Adam, cross-entropy; samples read item by item (and collated) when the dataset augments."""
    import torch
    from cmemi.shared.config.lookup import resolve
    from torch.utils.data import default_collate

    ds = resolve(DATA[wl], "data")()
    torch.manual_seed(0)
    model = resolve(WORKLOADS[wl], "model")()
    if hasattr(ds, "tensors"):
        x, y = ds.tensors
        def batch(idx):
            return x[idx], y[idx]
    else:
        def batch(idx):
            return default_collate([ds[int(i)] for i in idx])
    n = len(ds)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    per_epoch = n // BATCH
    t0 = c0 = 0.0
    for step in range(steps):
        if step == warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        idx = order[(step % per_epoch) * BATCH:(step % per_epoch + 1) * BATCH]
        opt.zero_grad(set_to_none=True)
        xb, yb = batch(idx)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"ms_per_step": 1000 * wall / (steps - warmup), "cpu_ms_per_step": 1000 * cpu / (steps - warmup),
            "threads": torch.get_num_threads(), "final_loss": loss.item()}


def plain(work: Path, wl: str, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    out = work / f"plain-{wl}-{tag}.json"
    env = {k: v for k, v in C.env().items() if k not in C.THREAD_VARS}  # torch's default: every core
    rc = C.run_checked([C.PY, str(Path(__file__).resolve()), "--plain", wl, "--steps", str(steps), "--warmup",
                        str(warmup), "--out", str(out)], timeout=600, log_path=work / f"plain-{wl}-{tag}.log",
                       env_=env)
    if rc != 0:
        raise RuntimeError(f"plain loop failed ({rc}); see {work / f'plain-{wl}-{tag}.log'}")
    return {**json.loads(out.read_text()), "load_avg": C.load_avg()}


def cmemi(work: Path, wl: str, workers: int, loaders: int, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    name = C.safe_name(f"small_{wl}_{workers}w_{loaders}l_{tag}")
    cfg = {"run": {"name": name, "dir": str(work / name), "seed": 0},
           "model": {"factory": WORKLOADS[wl]}, "data": {"factory": DATA[wl], "workers": loaders},
           "optimizer": {"name": "Adam", "kwargs": {"lr": LR}},
           "train": {"steps": steps, "global_batch": BATCH, "microbatches": MICROBATCHES},
           "cluster": {"workers": workers, "spare_workers": 0},
           "checkpoint": {"every_steps": 0}}
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=900)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail() if run.group else ''}")
        metrics = run.metrics()
        startup = json.loads((run.run_dir / "startup.json").read_text())
    rows = [m for m in metrics if m["step"] > warmup]
    first = next(m for m in metrics if m["step"] == warmup)
    wall = rows[-1]["t"] - first["t"]
    return {"ms_per_step": 1000 * wall / len(rows),
            "step_time_median_ms": 1000 * C.median(m["step_time_s"] for m in rows),
            "final_loss": metrics[-1]["loss"], "first_step_s": startup["first_step_s"], "load_avg": C.load_avg()}


def wire(repeats: int = 1000) -> dict[str, Any]:
    """One work message (encode, send, receive, decode over loopback TCP) with a model's parameters tensor by
    tensor against flat (shared/wire/layout.py), in this process: what flat buffers save per message."""
    import torch
    import zmq
    from cmemi.examples.charlm import make_model as charlm
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.wire import protocol
    from cmemi.shared.wire.layout import Layout

    fields = {"term": 1, "step": 1, "lo": 0, "hi": 1, "version": 1, "scale": 1.0}
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    a.connect(f"tcp://127.0.0.1:{b.bind_to_random_port('tcp://127.0.0.1')}")
    out: dict[str, Any] = {}
    try:
        for name, model in (("mlp", resolve(WORKLOADS["mlp"], "model")()),
                            ("cnn1d", resolve(WORKLOADS["cnn1d"], "model")()), ("charlm", charlm())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            layout = Layout(params)
            flat = layout.pack(params)

            def once(tensors: dict[str, torch.Tensor], view: bool, layout: Layout = layout) -> None:
                protocol.send(a, protocol.encode("work", "bench", fields, tensors))
                msg = protocol.decode(b.recv_multipart(copy=False)[1:], "bench")
                if view:
                    layout.views(msg.tensors)
            row: dict[str, Any] = {"tensors": len(params), "bytes": layout.nbytes}
            for variant, tensors, view in (("per_tensor", params, False), ("flat", flat, True)):
                times = []
                for _ in range(3):
                    for _ in range(50):
                        once(tensors, view)
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        once(tensors, view)
                    times.append((time.perf_counter() - t0) / repeats * 1e6)
                row[f"{variant}_us"] = C.rnd(C.median(times), 1)
            out[name] = row
    finally:
        ctx.destroy(linger=0)
    return out


def digits_startup(work: Path, tag: str) -> dict[str, Any]:
    """`cmemi up digits` with its defaults; the start-up timeline it wrote."""
    import yaml

    cfg = yaml.safe_load((C.ROOT / "examples" / "digits.yaml").read_text())
    name = C.safe_name(f"small_digits_{tag}")
    cfg["run"] = {**cfg["run"], "name": name, "dir": str(work / name)}
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=900)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail() if run.group else ''}")
        return json.loads((run.run_dir / "startup.json").read_text())


SLOW = {"model": {"factory": "bench.small_models:cnn1d", "kwargs": {"features": 64, "classes": 8}},
        "data": {"factory": "bench.slow_import_model:dataset"}}


def slow_import_baseline() -> float:
    """T: a plain Python process that imports the slow module and builds its dataset, from its start."""
    import subprocess

    code = "import bench.slow_import_model as m; m.dataset()"
    t0 = time.time()
    subprocess.run([C.PY, "-c", code], cwd=C.ROOT, check=True, env=C.env())
    return time.time() - t0


def slow_import_startup(work: Path, tag: str) -> dict[str, Any]:
    """`cmemi up` with 2 workers (and the default warm spare) on a user module that is slow to import and to build
    its data (bench/slow_import_model.py): its first step against T, and how soon it returns after the last step."""
    name = C.safe_name(f"small_slow_{tag}")
    cfg = {"run": {"name": name, "dir": str(work / name), "seed": 0}, **SLOW,
           "optimizer": {"name": "Adam", "kwargs": {"lr": LR}},
           "train": {"steps": 50, "global_batch": BATCH, "microbatches": MICROBATCHES},
           "cluster": {"workers": 2}, "checkpoint": {"every_steps": 0}}
    t = slow_import_baseline()
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=900)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail() if run.group else ''}")
        startup = json.loads((run.run_dir / "startup.json").read_text())
        last = run.metrics()[-1]["t"]
        returned = (run.t_end or time.time()) - last
    return {"plain_import_and_dataset_s": C.rnd(t, 2), "first_step_s": startup["first_step_s"],
            "first_step_minus_plain_s": C.rnd(startup["first_step_s"] - t, 2),
            "returned_after_last_step_s": C.rnd(returned, 2), "load_avg": C.load_avg(), "startup": startup}


def startup_only(args: argparse.Namespace) -> None:
    """--startup-only: the slow-import workload alone (a few minutes), merged into --out under "slow_import"."""
    C.setup()
    t0 = time.monotonic()
    work = C.workdir("small-startup", args.keep)
    repeats = args.repeats or 3
    result: dict[str, Any] = {**C.provenance(), "command": f".venv/bin/python bench/small.py --startup-only --repeats {repeats}",
                              "machine": C.machine(), "runs": []}
    try:
        for r in range(repeats):
            result["runs"].append(slow_import_startup(work, f"r{r}"))
            C.log(f"slow import: T {result['runs'][-1]['plain_import_and_dataset_s']} s, first step "
                  f"{result['runs'][-1]['first_step_s']} s, returned {result['runs'][-1]['returned_after_last_step_s']} s "
                  "after the last step")
        for k in ("plain_import_and_dataset_s", "first_step_s", "first_step_minus_plain_s", "returned_after_last_step_s"):
            result[f"median_{k}"] = C.rnd(C.median(x[k] for x in result["runs"]), 2)
        result["targets"] = {"first_step_within_T_plus_3s": result["median_first_step_minus_plain_s"] <= 3.0,
                             "returns_within_2s_of_last_step": result["median_returned_after_last_step_s"] <= 2.0}
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t0)
    if args.out:
        out = Path(args.out)
        whole = json.loads(out.read_text()) if out.is_file() else {}
        whole["slow_import"] = result
        out.write_text(json.dumps(whole, indent=1, default=str) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="300 steps, 1 repeat")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 1000; --quick 300)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--out", default=None, help="also write the JSON here, e.g. bench/results/small.json")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--plain", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)  # one plain loop, in a child
    p.add_argument("--startup-only", action="store_true", help="only the slow-import start-up workload (minutes), "
                   "merged into --out under 'slow_import'")
    args = p.parse_args()
    if args.startup_only:
        startup_only(args)
        return
    steps = args.steps or (300 if args.quick else 1000)  # 3 repeats fit `make bench`'s 900 s per bench
    repeats = args.repeats or (1 if args.quick else 3)
    if args.plain:
        Path(args.out).write_text(json.dumps(plain_loop(args.plain, steps, args.warmup)))
        return
    C.setup()
    t0 = time.monotonic()
    work = C.workdir("small", args.keep)
    result: dict[str, Any] = {
        "bench": "small", **C.provenance(), "dataset": "4000 x 40 synthetic, 10 classes", "optimizer": f"Adam lr {LR}",
        "global_batch": BATCH, "microbatches": MICROBATCHES, "steps": steps, "warmup_skipped": args.warmup,
        "repeats": repeats, "machine": {**C.machine(), "cores_plain_loop_uses": os.cpu_count()},
        "command": " ".join([".venv/bin/python", "bench/small.py", *(a for a in sys.argv[1:] if a != "--out" and
                                                                     not a.endswith(".json"))]),
        "runs": {wl: {"plain": [], **{v: [] for v in VARIANTS[wl]}} for wl in WORKLOADS}, "digits_startup": []}
    try:
        for r in range(repeats):
            for wl in WORKLOADS:
                runs = result["runs"][wl]
                runs["plain"].append(plain(work, wl, steps, args.warmup, f"r{r}"))
                for v, (w, loaders) in VARIANTS[wl].items():
                    runs[v].append(cmemi(work, wl, w, loaders, steps, args.warmup, f"r{r}"))
                C.log(f"{wl} repeat {r}: " + ", ".join(f"{k} {v[-1]['ms_per_step']:.2f} ms/step" for k, v in runs.items()))
            result["digits_startup"].append(digits_startup(work, f"r{r}"))
            C.log(f"digits: first step after {result['digits_startup'][-1]['first_step_s']} s")
        result["ms_per_step"] = {wl: {k: C.rnd(C.median(x["ms_per_step"] for x in v), 3) for k, v in runs.items()}
                                 for wl, runs in result["runs"].items()}
        result["ratios"] = {wl: {f"{k}_vs_plain": C.ratio(v[k], v["plain"]) for k in VARIANTS[wl]}
                            for wl, v in result["ms_per_step"].items()}
        best = sorted(result["digits_startup"], key=lambda s: s["first_step_s"] or float("inf"))
        result["startup"] = best[len(best) // 2]  # the median run, whole, so its phases add up
        result["startup_first_step_s"] = result["startup"]["first_step_s"]
        result["wire_us_per_message"] = wire(300 if args.quick else 1000)
        result["slow_import"] = {"runs": [slow_import_startup(work, "r0")]}
        result["targets"] = {"cnn1d_cmemi_1w_vs_plain_le_1.5": result["ratios"]["cnn1d"]["cmemi_1w_vs_plain"] <= 1.5,
                             "cnn1d_cmemi_2w_vs_plain_le_1.0": result["ratios"]["cnn1d"]["cmemi_2w_vs_plain"] <= 1.0,
                             "digits_first_step_le_5s": result["startup_first_step_s"] <= 5.0}
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t0)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
