"""The step log's step-time overhead alone: bench/recovery.py's step-log workload (its loopback comm-bound model,
`small`) with `checkpoint.step_log` on and off, at `cluster.shards` 1 and 2, no kills (issue 47's goal: with ≤ 1.05×
without).

bench/recovery.py --parts steplog measures the same ratio around its kills and with their restarts in the same
runs, which takes minutes a row; this runs only the calm steps, alternating on and off in each repeat so the
machine's drift falls on both alike, and prints one JSON object: per shards, each run's median step time (from
metrics.jsonl, steps past WARMUP) and CPU ms per step by role (the leader `aggregator`, `shard1`, `checkpointer`,
`worker`: /proc schedstat between the same steps), each repeat's on/off ratios and their medians (`overhead` of the
step time, `cpu_overhead` of the whole cluster's CPU per step; lower is better, 1.0 is free). With `--tree NAME=PATH` (a checkout with its own .venv, repeatable) each tree's code runs in turn
within each repeat, so a change's before and after are measured in the same invocation.

    .venv/bin/python bench/steplog_overhead.py [--shards 1,2] [--steps 200] [--repeats 3] \\
        [--tree before=PATH_TO_A_CHECKOUT --tree head=.] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402
from bench.recovery_log import BIG, WARMUP, WL  # noqa: E402
from bench.step_cpu import per_step, thread_cpu  # noqa: E402


def labels(pgid: int) -> dict[int, str]:
    """The group's processes by role, a shard k > 0 apart from the leader (`shard1`), workers as one role."""
    out = {}
    for pid, label in C.group_pids(pgid).items():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if label == "aggregator" and b"--shard" in argv and argv.index(b"--shard") + 1 < len(argv):
            label = f"shard{argv[argv.index(b'--shard') + 1].decode()}"
        out[pid] = "worker" if label.startswith("worker") else label
    return out


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


def one_run(work: Path, name: str, shards: int, step_log: bool, steps: int, root: Path) -> dict[str, Any]:
    """One run of recovery_log.py's config: the median step time (s) of steps WARMUP..WARMUP + `steps`, and the CPU
    ms each role (and each thread) spent per step between them (/proc schedstat, as bench/step_cpu.py): CPU moves
    far less with the machine's other load than the step time does."""
    cfg = C.cmemi_config(name, work / name, WORKLOADS[WL], steps=BIG, microbatches=4, workers=2, spares=0,
                         ckpt_every=1000, keep_last=2, shards=shards)
    cfg["checkpoint"]["step_log"] = step_log
    cfg["train"]["log_every"] = 1
    with TreeRun(cfg, work, root) as run:
        s0 = run.wait_step(WARMUP, timeout=600)
        assert run.group is not None
        roles = labels(run.group.pgid)
        first = {pid: thread_cpu(pid) for pid in roles}
        s1 = run.wait_step(WARMUP + steps, timeout=600)
        last = {pid: thread_cpu(pid) for pid in roles}
        run.terminate()
        times = [m["step_time_s"] for m in run.metrics()
                 if "step_time_s" in m and WARMUP < m["step"] <= WARMUP + steps]
    by_role, by_thread = per_step(first, last, roles, s1 - s0)
    return {"step_time_s": C.median(times), "cpu_ms_per_step": by_role,
            "cpu_ms_per_step_total": round(sum(by_role.values()), 3), "cpu_ms_per_step_by_thread": by_thread}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="1,2", help="comma-separated cluster.shards values")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree", action="append", default=None, help="NAME=PATH, repeatable (default: head=.)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = p.parse_args(argv)
    C.setup()
    t_start = time.monotonic()
    work = C.workdir("steplog-overhead", args.keep)
    result: dict[str, Any] = {"bench": "steplog_overhead", **C.provenance(), "machine": C.machine(),
                              "command": " ".join([".venv/bin/python bench/steplog_overhead.py", *argv]),
                              "workload": WORKLOADS[WL], "steps": args.steps, "repeats": args.repeats, "by_shards": {}}
    try:
        trees = [tree(t) for t in (args.tree or ["head=."])]
        for k in (int(s) for s in args.shards.split(",")):
            rows: dict[str, Any] = {name: {"on": [], "off": [], "ratios": [], "cpu_ratios": []} for name, _ in trees}
            for r in range(args.repeats):
                for name, root in trees:  # alternating: the machine's drift falls on every tree alike
                    row = rows[name]
                    on = one_run(work, f"{name}_on_k{k}_r{r}", k, True, args.steps, root)
                    off = one_run(work, f"{name}_off_k{k}_r{r}", k, False, args.steps, root)
                    row["on"].append(C.rnd(on))
                    row["off"].append(C.rnd(off))
                    a, b = on["step_time_s"], off["step_time_s"]
                    row["ratios"].append(C.rnd(a / b) if a and b else None)
                    row["cpu_ratios"].append(C.ratio(on["cpu_ms_per_step_total"], off["cpu_ms_per_step_total"]))
                    C.log(f"{name} K = {k} r{r}: with the log {a} s a step, {on['cpu_ms_per_step']} CPU ms a step; "
                          f"without {b} s, {off['cpu_ms_per_step']}")
            for row in rows.values():
                row["overhead"] = C.rnd(C.median(x for x in row["ratios"] if x is not None))
                row["cpu_overhead"] = C.rnd(C.median(x for x in row["cpu_ratios"] if x is not None))
                for side in ("on", "off"):
                    roles = sorted({n for run in row[side] for n in run["cpu_ms_per_step"]})
                    row[f"median_cpu_ms_per_step_{side}"] = {
                        n: C.rnd(C.median(run["cpu_ms_per_step"].get(n, 0.0) for run in row[side]), 3) for n in roles}
            result["by_shards"][str(k)] = rows
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t_start)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
