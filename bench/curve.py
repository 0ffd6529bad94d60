"""The cost of CurveZMQ (the default) on a communication-bound step: the same run with security.curve on and off.

The comm_bound workload of bench/models.py (a wide MLP on tiny batches: the step is mostly moving parameters
and gradients), 2 workers, M = 2. Runs alternate on / off so that drift of the shared machine's load hits both
alike; the median step time over `--repeats` runs of each is reported, with the load average at the time.

    .venv/bin/python bench/curve.py [--steps 100] [--repeats 3] [--out bench/results/curve.json]

Prints one JSON object; `ratio_on_vs_off` = median step time with Curve / without (lower is better).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

WORKLOAD = "comm_bound"


def one_run(work: Path, curve: bool, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    name = C.safe_name(f"curve_{'on' if curve else 'off'}_{tag}")
    cfg = C.cmemi_config(name, work / name, WORKLOADS[WORKLOAD], steps=steps, microbatches=2, workers=2)
    cfg["security"] = {"curve": curve}
    with C.CmemiRun(cfg, work) as run:
        rc = run.wait(timeout=600)
        if rc != 0:
            raise RuntimeError(f"cmemi up failed ({rc}); see {run.log_path}:\n{run.group.tail() if run.group else ''}")
        stats = C.step_stats(run.metrics(), warmup)
        summ = run.summary() or {}
    return {**stats, "bytes_per_step": (summ.get("bytes_sent", 0) + summ.get("bytes_received", 0)) / max(1, steps),
            "load_avg": C.load_avg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here, e.g. bench/results/curve.json")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    C.setup()
    t0 = time.monotonic()
    work = C.workdir("curve", args.keep)
    result: dict[str, Any] = {"bench": "curve", **C.provenance(), "workload": WORKLOAD, "spec": WORKLOADS[WORKLOAD], "workers": 2,
                              "microbatches": 2, "steps": args.steps, "warmup_skipped": args.warmup,
                              "repeats": args.repeats, "machine": C.machine(), "runs": {"on": [], "off": []}}
    try:
        for r in range(args.repeats):
            for curve in (True, False):
                res = one_run(work, curve, args.steps, args.warmup, f"r{r}")
                result["runs"]["on" if curve else "off"].append(res)
                C.log(f"curve {'on ' if curve else 'off'} repeat {r}: {res.get('step_time_median_s')} s/step, "
                      f"load {res['load_avg']}")
        med = {k: C.median(x["step_time_median_s"] for x in v if x.get("step_time_median_s") is not None)
               for k, v in result["runs"].items()}
        result["step_time_median_s"] = {k: C.rnd(v, 5) for k, v in med.items()}
        result["ratio_on_vs_off"] = C.rnd(C.ratio(med["on"], med["off"]), 3)
    except BaseException as exc:
        C.record_error(result, exc)
    result["load_avg_end"] = C.load_avg()
    C.finish(result, work, args.keep, t0)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
