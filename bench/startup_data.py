"""Start-up with a dataset built in its factory: `cmemi up` with 2 workers, the data built once per host or in
every worker (cluster.zygote_data), against a plain script (issue 46 part 5).

The user module is bench/startup_data_model.py (MNIST-1D-like, a few seconds of CPU, deterministic). Measured in
one run, alternately:
  T           a plain `python -c "import torch; build the dataset"`, from its start to its end;
  shared      `cmemi up` (2 workers, no spare), cluster.zygote_data: true: seconds from the command's start to the
              first step (RUN_DIR/startup.json first_step_s: the first line of metrics.jsonl);
  per_worker  the same with cluster.zygote_data: false (each worker builds its own, as before).
The goal: shared first step <= T + 3 s. Both runs' params_sha256 are printed, and must be equal.

    .venv/bin/python bench/startup_data.py [--repeats N] [--samples N] [--keep]

One JSON object on stdout. The figures depend on the machine's load (it prints the load average): on a busy
machine both runs' times grow, the per-worker one most (its two builds share the cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/startup_data.py`: the repository root makes `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

MODEL = {"factory": "bench.startup_data_model:make_model", "kwargs": {"hidden": 100}}
STEPS, BATCH, MICROBATCHES = 30, 128, 4


def plain(samples: int) -> dict[str, float]:
    """T: a fresh interpreter that imports torch and builds the dataset, wall and CPU seconds."""
    code = f"import torch\nimport bench.startup_data_model as m\nm.make_dataset({samples})"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    subprocess.run([C.PY, "-c", code], cwd=C.ROOT, check=True, env=C.env(), timeout=900)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": C.rnd(wall, 2), "cpu_s": C.rnd(cpu, 2)}


def up(work: Path, samples: int, shared: bool, tag: str) -> dict[str, Any]:
    """`cmemi up` with 2 workers; its first step in seconds since the command started, and its params_sha256."""
    name = C.safe_name(f"startup_data_{'shared' if shared else 'per_worker'}_{tag}")
    workload = {"model": MODEL, "data": {"factory": "bench.startup_data_model:make_dataset",
                                         "kwargs": {"samples": samples}}, "global_batch": BATCH, "lr": 0.05}
    cfg = C.cmemi_config(name, work / name, workload, steps=STEPS, microbatches=MICROBATCHES, workers=2,
                         zygote_data=shared)
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=900)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail() if run.group else ''}")
        startup = json.loads((run.run_dir / "startup.json").read_text())
        summary = json.loads((run.run_dir / "summary.json").read_text())
    return {"first_step_s": startup["first_step_s"], "params_sha256": summary["params_sha256"],
            "load_avg": C.load_avg(), "startup": startup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of T, shared, per-worker")
    ap.add_argument("--samples", type=int, default=120_000, help="dataset size (bench/startup_data_model.py)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    C.setup()
    t0 = time.monotonic()
    work = C.workdir("startup-data", args.keep)
    result: dict[str, Any] = {**C.provenance(), "command": "bench/startup_data.py " + " ".join(sys.argv[1:]),
                              "machine": C.machine(), "samples": args.samples, "rounds": []}
    try:
        for r in range(args.repeats):
            one: dict[str, Any] = {"T": plain(args.samples)}
            C.log(f"round {r}: T {one['T']['wall_s']} s")
            for shared in ((True, False) if r % 2 == 0 else (False, True)):  # alternate which goes first
                key = "shared" if shared else "per_worker"
                one[key] = up(work, args.samples, shared, f"r{r}")
                C.log(f"round {r}: {key} first step {one[key]['first_step_s']} s")
            result["rounds"].append(one)
        rounds = result["rounds"]
        t = C.median(x["T"]["wall_s"] for x in rounds)
        shared_s = C.median(x["shared"]["first_step_s"] for x in rounds)
        per_worker_s = C.median(x["per_worker"]["first_step_s"] for x in rounds)
        result["median"] = {"T_s": t, "shared_first_step_s": shared_s, "per_worker_first_step_s": per_worker_s,
                            "shared_minus_T_s": C.rnd(shared_s - t, 2) if None not in (shared_s, t) else None,
                            "per_worker_minus_T_s": C.rnd(per_worker_s - t, 2) if None not in (per_worker_s, t)
                            else None}
        result["goal_first_step_within_T_plus_3s"] = (result["median"]["shared_minus_T_s"] is not None
                                                      and result["median"]["shared_minus_T_s"] <= 3.0)
        result["params_sha256_same"] = len({x[k]["params_sha256"] for x in rounds
                                            for k in ("shared", "per_worker")}) == 1
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t0)


if __name__ == "__main__":
    main()
