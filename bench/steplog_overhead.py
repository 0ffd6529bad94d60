"""The step log's step-time overhead alone: bench/recovery.py's step-log workload (its loopback comm-bound model,
`small`) with `checkpoint.step_log` on and off, at `cluster.shards` 1 and 2, no kills (issue 47's goal: with ≤ 1.05×
without).

bench/recovery.py --parts steplog measures the same ratio around its kills and with their restarts in the same
runs, which takes minutes a row; this runs only the calm steps, alternating on and off in each repeat so the
machine's drift falls on both alike, and prints one JSON object: per shards, each run's median step time (from
metrics.jsonl, steps past WARMUP), each repeat's on/off ratio and their median (`overhead`; lower is better,
1.0 is free).

    .venv/bin/python bench/steplog_overhead.py [--shards 1,2] [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402
from bench.recovery_log import BIG, WARMUP, WL  # noqa: E402


def one_run(work: Path, name: str, shards: int, step_log: bool, steps: int) -> float | None:
    """The median step time (s) of steps WARMUP..WARMUP + `steps` of one run (recovery_log.py's config)."""
    cfg = C.cmemi_config(name, work / name, WORKLOADS[WL], steps=BIG, microbatches=4, workers=2, spares=0,
                         ckpt_every=1000, keep_last=2, shards=shards)
    cfg["checkpoint"]["step_log"] = step_log
    cfg["train"]["log_every"] = 1
    with C.CmemiRun(cfg, work) as run:
        run.wait_step(WARMUP + steps, timeout=600)
        run.terminate()
        times = [m["step_time_s"] for m in run.metrics()
                 if "step_time_s" in m and WARMUP < m["step"] <= WARMUP + steps]
    return C.median(times)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="1,2", help="comma-separated cluster.shards values")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    C.setup()
    t_start = time.monotonic()
    work = C.workdir("steplog-overhead", args.keep)
    result: dict[str, Any] = {"bench": "steplog_overhead", **C.provenance(), "machine": C.machine(),
                              "workload": WORKLOADS[WL], "steps": args.steps, "repeats": args.repeats, "by_shards": {}}
    try:
        for k in (int(s) for s in args.shards.split(",")):
            rows: dict[str, Any] = {"on": [], "off": [], "ratios": []}
            for r in range(args.repeats):
                on = one_run(work, f"on_k{k}_r{r}", k, True, args.steps)
                off = one_run(work, f"off_k{k}_r{r}", k, False, args.steps)
                rows["on"].append(C.rnd(on))
                rows["off"].append(C.rnd(off))
                rows["ratios"].append(C.rnd(on / off) if on and off else None)
                C.log(f"K = {k} r{r}: step time with the log {on}, without {off}")
            rows["overhead"] = C.rnd(C.median(x for x in rows["ratios"] if x is not None))
            result["by_shards"][str(k)] = rows
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t_start)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
