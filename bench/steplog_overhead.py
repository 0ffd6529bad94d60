"""The step log's step-time overhead alone: bench/recovery.py's step-log workload (its loopback comm-bound model,
`small`) with `checkpoint.step_log` on and off, at `cluster.shards` 1 and 2, no kills (issue 47's goal: with ≤ 1.05×
without).

bench/recovery.py --parts steplog measures the same ratio around its kills and with their restarts in the same
runs, which takes minutes a row; this runs only the calm steps, alternating on and off in each repeat so the
machine's drift falls on both alike, and prints one JSON object: per shards, each run's median step time (from
metrics.jsonl, steps past WARMUP), each repeat's on/off ratio and their median (`overhead`; lower is better,
1.0 is free). With `--tree NAME=PATH` (a checkout with its own .venv, repeatable) each tree's code runs in turn
within each repeat, so a change's before and after are measured in the same invocation.

    .venv/bin/python bench/steplog_overhead.py [--shards 1,2] [--steps 200] [--repeats 3] \\
        [--tree before=PATH_TO_A_CHECKOUT --tree head=.]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402
from bench.recovery_log import BIG, WARMUP, WL  # noqa: E402


class TreeRun(C.CmemiRun):
    """`cmemi up` of the checkout at `root`, with its own .venv (its code is what runs)."""

    def __init__(self, cfg: dict[str, Any], base: Path, root: Path) -> None:
        super().__init__(cfg, base)
        self.root = root

    def __enter__(self) -> TreeRun:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.t_start = time.time()
        self.group = C.ProcGroup([str(self.root / ".venv" / "bin" / "python"), "-m", "cmemi", "up",
                                  str(self.config_path), "--overwrite"], self.log_path,
                                 env_=C.env(PYTHONPATH=str(self.root)), cwd=self.root)
        return self


def tree(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    root = Path(path).resolve()
    if not sep or not name or not (root / ".venv" / "bin" / "python").exists():
        raise SystemExit(f"--tree {spec!r}: expected NAME=PATH, a checkout with its .venv, e.g. head=.")
    return name, root


def one_run(work: Path, name: str, shards: int, step_log: bool, steps: int, root: Path) -> float | None:
    """The median step time (s) of steps WARMUP..WARMUP + `steps` of one run (recovery_log.py's config)."""
    cfg = C.cmemi_config(name, work / name, WORKLOADS[WL], steps=BIG, microbatches=4, workers=2, spares=0,
                         ckpt_every=1000, keep_last=2, shards=shards)
    cfg["checkpoint"]["step_log"] = step_log
    cfg["train"]["log_every"] = 1
    with TreeRun(cfg, work, root) as run:
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
    p.add_argument("--tree", action="append", default=None, help="NAME=PATH, repeatable (default: head=.)")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    C.setup()
    t_start = time.monotonic()
    work = C.workdir("steplog-overhead", args.keep)
    result: dict[str, Any] = {"bench": "steplog_overhead", **C.provenance(), "machine": C.machine(),
                              "workload": WORKLOADS[WL], "steps": args.steps, "repeats": args.repeats, "by_shards": {}}
    try:
        trees = [tree(t) for t in (args.tree or ["head=."])]
        for k in (int(s) for s in args.shards.split(",")):
            rows: dict[str, Any] = {name: {"on": [], "off": [], "ratios": []} for name, _ in trees}
            for r in range(args.repeats):
                for name, root in trees:  # alternating: the machine's drift falls on every tree alike
                    row = rows[name]
                    on = one_run(work, f"{name}_on_k{k}_r{r}", k, True, args.steps, root)
                    off = one_run(work, f"{name}_off_k{k}_r{r}", k, False, args.steps, root)
                    row["on"].append(C.rnd(on))
                    row["off"].append(C.rnd(off))
                    row["ratios"].append(C.rnd(on / off) if on and off else None)
                    C.log(f"{name} K = {k} r{r}: step time with the log {on}, without {off}")
            for row in rows.values():
                row["overhead"] = C.rnd(C.median(x for x in row["ratios"] if x is not None))
            result["by_shards"][str(k)] = rows
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t_start)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
